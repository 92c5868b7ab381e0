"""GPU smoke test: what one GPU must show before a real job is submitted (at most ~10 minutes on one GPU).

    bash launch/gpu_smoke.sh                       # every check; exit 1 if any fails
    bash launch/gpu_smoke.sh --only env,ppo_e2e    # a subset
    bash launch/gpu_smoke.sh --allow-missing vllm,faiss_gpu,flash_attn --big   # a bare image; + a 3B-shaped run

Checks (one table row each: status, numbers, seconds; `--json PATH` writes the rows):
    env          CUDA device with bf16; vLLM importable at the pinned version; faiss with GPUs; flash-attn
    actor_bf16   one actor update at lr 1e-6 with model.dtype=bfloat16 on this GPU (the real ActorWorker: FSDP2 over
                 NCCL, fp32 master weights, bf16 compute): share of the fp32 master weights that changed (>= 0.5)
    ppo_e2e      two PPO steps of `python -m rsearch_verl.main` on this GPU (bf16, colocated actor + critic + rollout
                 engine: vLLM when installed, else Hugging Face); finite losses; the engine's log-probs of the sampled
                 tokens after a weight sync within 0.02 (mean) of the actor's; peak GPU memory (nvidia-smi) < 90 %
    deep_e2e     two GRPO steps of `+recipe=deep_search_grpo` (up to 8 turns, drop_observations) on this GPU in bf16;
                 with `--deep-policy DIR` (the deep world's warm start, `python -m rsearch_verl.toy.warm_start --out
                 DIR +recipe=deep_search_grpo`, built on this machine: a toy tokenizer trained by another
                 `tokenizers` version differs, and the run refuses the checkpoint) its trajectories must search and fold
    hybrid_e2e   two PPO steps of `python -m rsearch_verl.main` with a random Qwen3.5 (Qwen3_5ForCausalLM: 3 Gated
                 DeltaNet : 1 gated attention) of Qwen3.5-0.8B's depth, width and 248k vocabulary, built on this GPU,
                 bf16, the Hugging Face engine, padded micro-batches (hybrids never pack); finite losses, the
                 engine-vs-actor log-prob gap after the weight sync within 0.02 (mean), peak memory < 90 %
    logprob_mem  benchmarks/logprob_memory.py on this GPU: peak memory of chunked vs unchunked log-probs (152k vocab)
    faiss_gpu    recall@10 of a flat inner-product index on the GPU equals the CPU index's
    model_3b     (--big) two GRPO steps of a random model with Qwen2.5-3B's shape (toy vocabulary) on one GPU:
                 peak memory and step time

A check whose package is missing (vLLM, faiss with GPUs, flash-attn) fails unless `--allow-missing` names it; it is
then reported as SKIP. The numbers measured on a lent H100 are in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

logger = logging.getLogger("gpu_smoke")

PINNED_VLLM = "0.31.0"  # pyproject.toml's gpu extra
MAX_MEMORY_SHARE = 0.90
MAX_LOGPROB_GAP = 0.02

# the main job, small: a random tiny policy on a small toy world, one GPU, 2 steps (a weight sync between them)
E2E = [
    "trainer.device=cuda",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=1",
    "trainer.placement=colocate",
    "trainer.total_steps=2",
    "trainer.save_freq=2",
    "trainer.test_freq=2",
    "trainer.loggers=[console,jsonl]",
    "model.sft_checkpoint=null",
    "model.dtype=bfloat16",
    "data.train_batch_size=8",
    "data.val_batch_size=8",
    "data.val_max_samples=8",
    "data.toy_world.n_entities=48",
    "data.toy_world.n_train=64",
    "data.toy_world.n_val=8",
    "rollout.n=1",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=32",
    "rollout.max_response_length=192",
    "rollout.max_obs_length=64",
    "rollout.gpu_memory_utilization=0.3",
    "actor.ppo_mini_batch_size=8",
    "actor.micro_batch_size=4",
    "critic.ppo_mini_batch_size=8",
    "critic.micro_batch_size=4",
    "actor.use_remove_padding=true",  # padding-free, as the GPU trainer groups (varlen SDPA without flash-attn)
    "critic.use_remove_padding=true",
]
QWEN25_3B_SHAPE = [
    "model.tiny.hidden_size=2048",
    "model.tiny.intermediate_size=11008",
    "model.tiny.num_hidden_layers=36",
    "model.tiny.num_attention_heads=16",
    "model.tiny.num_key_value_heads=2",
    "model.tiny.max_position_embeddings=4096",
    "model.gradient_checkpointing=true",
]

# Qwen3.5-0.8B's layer count, width, MLP width, GQA ratio and vocabulary (the real tokenizer: model=tiny_qwen3_5);
# the tiny builder derives the heads (attention head_dim 1024 / 8 = 128, not the published 256; linear attention
# 8 key / 16 value heads of 64), so it has 0.62B parameters (tied embeddings 0.25B), a little under the real text model
QWEN3_5_0_8B_SHAPE = [
    "model.tiny.hidden_size=1024",
    "model.tiny.intermediate_size=3584",
    "model.tiny.num_hidden_layers=24",  # 18 Gated DeltaNet, 6 full attention
    "model.tiny.num_attention_heads=8",
    "model.tiny.num_key_value_heads=2",
    "model.gradient_checkpointing=true",
]


class Skip(Exception):
    """A check that cannot run here because an allowed-missing package is absent."""


class GpuMemoryPoller:
    """Peak used / total GPU memory of device 0 from nvidia-smi, polled in a thread (covers every process)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s, self.peak_mib, self.total_mib = interval_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        used, total = (int(x) for x in out.strip().split(","))
        self.peak_mib, self.total_mib = max(self.peak_mib, used), total

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMemoryPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    @property
    def share(self) -> float:
        return self.peak_mib / self.total_mib if self.total_mib else float("nan")


def _need(module: str, key: str, allow_missing: set[str]):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if key in allow_missing:
            raise Skip(f"{module} is not installed") from exc
        raise AssertionError(f"{module} is not installed ({exc}); bash launch/install.sh gpu") from exc


def check_env(allow_missing: set[str]) -> dict:
    import torch

    assert torch.cuda.is_available(), "torch sees no CUDA device"
    assert torch.cuda.is_bf16_supported(), "this GPU has no bfloat16"
    props = torch.cuda.get_device_properties(0)
    row = {"gpu": props.name, "gpu_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__}
    row["cuda"] = torch.version.cuda
    missing = []
    for module, key in (("vllm", "vllm"), ("flash_attn", "flash_attn")):
        try:
            mod = importlib.import_module(module)
            row[module] = getattr(mod, "__version__", "?")
        except ImportError:
            missing.append(key)
    if "vllm" in row:
        assert row["vllm"] == PINNED_VLLM, f"vLLM {row['vllm']} is not the tested {PINNED_VLLM}"
    import faiss

    row["faiss_gpus"] = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if not row["faiss_gpus"]:
        missing.append("faiss_gpu")
    row["missing"] = ",".join(missing) or "-"
    blocking = [m for m in missing if m not in allow_missing]
    assert not blocking, f"missing: {blocking} (bash launch/install.sh gpu, or --allow-missing {','.join(blocking)})"
    return row


def _run_main(recipe: str, run_dir: str, overrides: list[str], timeout_s: int) -> tuple[list[dict], float, float]:
    """The main job as a subprocess; (metrics rows, peak GPU memory share, wall seconds)."""
    cmd = [sys.executable, "-m", "rsearch_verl.main", f"+recipe={recipe}", f"trainer.run_dir={run_dir}", *overrides]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    start = time.perf_counter()
    with GpuMemoryPoller() as mem, open(os.path.join(run_dir + ".log"), "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        with open(run_dir + ".log") as f:
            tail = f.read()[-3000:]
        raise AssertionError(f"main exited {done.returncode}:\n{tail}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, mem.share, wall


def _finite(rows: list[dict], keys: tuple[str, ...]) -> dict:
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert len(steps) == 2, f"expected 2 training steps in metrics.jsonl, got {len(steps)}"
    out = {}
    for key in keys:
        values = [r[key] for r in steps if key in r]
        assert values and all(math.isfinite(v) for v in values), f"{key} not finite: {values}"
        out[key] = max(abs(v) for v in values)
    return out


def check_ppo_e2e(allow_missing: set[str], workdir: str) -> dict:
    engine = "vllm"
    try:
        _need("vllm", "vllm", allow_missing)
    except Skip:
        engine = "hf"  # the same colocated path with the Hugging Face engine
    overrides = [*E2E, f"rollout.engine={engine}", f"data.toy_world.cache_dir={workdir}/toy"]
    rows, share, wall = _run_main("search_r1_ppo", f"{workdir}/ppo", overrides, timeout_s=240)
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
    row = {"engine": engine, **_finite(rows, keys), "mem_peak_share": round(share, 3), "wall_s": round(wall, 1)}
    last = [r for r in rows if "rollout/logprob_abs_diff_mean" in r][-1]  # step 2: after the first weight sync
    row["logprob_gap_mean"] = last["rollout/logprob_abs_diff_mean"]
    row["logprob_gap_max"] = last["rollout/logprob_abs_diff_max"]
    row["step_s"] = last.get("timing/step_s")
    assert row["logprob_gap_mean"] < MAX_LOGPROB_GAP, f"engine vs actor log-prob gap {row['logprob_gap_mean']:.4f}"
    assert share < MAX_MEMORY_SHARE, f"peak GPU memory {share:.0%} >= {MAX_MEMORY_SHARE:.0%}"
    return row


def hybrid_overrides(workdir: str) -> list[str]:
    """check_hybrid_e2e's run: the main job's small PPO run with the random 0.8B-shaped Qwen3.5 on the HF engine
    (vLLM's qwen3_5 path is not what this checks), padded micro-batches (config validation refuses packing)."""
    padded = ("actor.use_remove_padding=", "critic.use_remove_padding=")
    return [
        *[o for o in E2E if not o.startswith(padded)],
        "model=tiny_qwen3_5",
        *QWEN3_5_0_8B_SHAPE,
        "rollout.engine=hf",
        f"data.toy_world.cache_dir={workdir}/toy",
    ]


def check_hybrid_e2e(allow_missing: set[str], workdir: str) -> dict:
    rows, share, wall = _run_main("search_r1_ppo", f"{workdir}/hybrid", hybrid_overrides(workdir), timeout_s=330)
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
    row = {**_finite(rows, keys), "mem_peak_share": round(share, 3), "wall_s": round(wall, 1)}
    last = [r for r in rows if "rollout/logprob_abs_diff_mean" in r][-1]  # step 2: after the first weight sync
    row["logprob_gap_mean"] = last["rollout/logprob_abs_diff_mean"]
    row["logprob_gap_max"] = last["rollout/logprob_abs_diff_max"]
    row.update({k: last.get(k) for k in ("timing/step_s", "actor/total_params", "off_policy/capped_frac")})
    assert row["logprob_gap_mean"] < MAX_LOGPROB_GAP, f"engine vs actor log-prob gap {row['logprob_gap_mean']:.4f}"
    assert share < MAX_MEMORY_SHARE, f"peak GPU memory {share:.0%} >= {MAX_MEMORY_SHARE:.0%}"
    return row


def check_model_3b(allow_missing: set[str], workdir: str) -> dict:
    overrides = [
        *E2E,
        *QWEN25_3B_SHAPE,
        "rollout.engine=hf",
        "rollout.n=2",
        "data.train_batch_size=4",
        "actor.micro_batch_size=2",
        f"data.toy_world.cache_dir={workdir}/toy",
    ]
    rows, share, wall = _run_main("search_r1_grpo", f"{workdir}/grpo3b", overrides, timeout_s=330)
    row = {**_finite(rows, ("actor/pg_loss", "actor/grad_norm")), "mem_peak_share": round(share, 3)}
    steps = [r for r in rows if "timing/step_s" in r]
    row.update({"params": steps[-1].get("actor/total_params"), "step_s": steps[-1]["timing/step_s"]})
    row["wall_s"] = round(wall, 1)
    assert share < MAX_MEMORY_SHARE, f"peak GPU memory {share:.0%} >= {MAX_MEMORY_SHARE:.0%}"
    return row


def deep_overrides(workdir: str, policy: str | None) -> list[str]:
    """check_deep_e2e's run: without a policy, the random tiny one in a 448-token context (it hardly searches, so
    nothing folds); with `policy` (the deep world's warm start, built on this machine: a carried one was trained with
    another machine's toy tokenizer), the recipe's own world and budgets at temperature 1, where searching trajectories
    fold."""
    common = ["rollout.engine=hf", "rollout.n=4", "data.train_batch_size=4", "rollout.max_turns=8"]
    if policy:
        own = ("data.toy_world.", "rollout.max_", "model.sft_checkpoint=")  # the recipe's world and budgets
        return [o for o in E2E if not o.startswith(own)] + common + [f"model.sft_checkpoint={policy}"]
    return [
        *E2E,
        *common,
        "data.max_prompt_length=256",
        "rollout.context.max_tokens=448",
        "data.toy_world.n_entities=480",  # the deep world's own size: its twins and chains need the entities
        f"data.toy_world.cache_dir={workdir}/toy",
    ]


def check_deep_e2e(allow_missing: set[str], workdir: str, policy: str | None = None) -> dict:
    """The long-horizon recipe (docs/long_horizon.md) in bfloat16 on the GPU: 2 GRPO steps of up to 8 turns
    (drop_observations), rows padded for the update (phases.fit_rows). With `--deep-policy` (a warm start of the deep
    world) its trajectories search and fold, and the check fails unless some do."""
    rows, share, wall = _run_main("deep_search_grpo", f"{workdir}/deep", deep_overrides(workdir, policy), 300)
    row = {**_finite(rows, ("actor/pg_loss", "actor/grad_norm")), "mem_peak_share": round(share, 3)}
    steps = [r for r in rows if "timing/step_s" in r]
    row.update({k: steps[-1].get(k) for k in ("timing/step_s", "rollout/rows_per_trajectory")})
    row["folds_max"] = max(r.get("rollout/folds_max", 0.0) for r in steps)
    row["searches_mean"] = max(r.get("rollout/searches_mean", 0.0) for r in steps)
    row["wall_s"] = round(wall, 1)
    assert share < MAX_MEMORY_SHARE, f"peak GPU memory {share:.0%} >= {MAX_MEMORY_SHARE:.0%}"
    folded = row["searches_mean"] > 0 and row["folds_max"] >= 1
    assert not policy or folded, f"the deep policy's trajectories must search and fold: {row}"
    return row


def check_actor_bf16(allow_missing: set[str], workdir: str) -> dict:
    """The CPU test's real ActorWorker update (tests/workers/test_workers_mixed_precision.py) on this GPU over NCCL:
    lr 1e-6, model.dtype=bfloat16; the share of float32 masters that changed, and the same with bf16 masters."""
    import pathlib

    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    test = importlib.import_module("test_workers_mixed_precision")
    row = {}
    for master in ("float32", "bfloat16"):
        res = test.run_update(master, pathlib.Path(workdir), device="cuda", ranks=1)
        row[f"changed_{master}_masters"] = round(res["fraction"], 4)
        row[f"grad_norm_{master}"] = res["actor/grad_norm"]
    row["compute_dtype"] = res["compute"]
    assert math.isfinite(row["grad_norm_float32"]) and row["grad_norm_float32"] > 0
    assert row["changed_float32_masters"] >= 0.5, f"only {row['changed_float32_masters']:.1%} of the masters moved"
    return row


def check_logprob_mem(allow_missing: set[str], workdir: str) -> dict:
    cmd = [sys.executable, "benchmarks/logprob_memory.py", "--device", "cuda", "--tokens", "16384", "--hidden", "3584"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, f"benchmark exited {done.returncode}:\n{out[-2500:]}"
    _out(out)
    return {"last_line": out.splitlines()[-1]}


def check_faiss_gpu(allow_missing: set[str], workdir: str) -> dict:
    import faiss
    import numpy as np

    if not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() == 0:
        if "faiss_gpu" in allow_missing:
            raise Skip("this faiss build has no GPUs")
        raise AssertionError("this faiss build has no GPUs (bash launch/install.sh gpu)")
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((20000, 384)).astype("float32")
    queries = rng.standard_normal((200, 384)).astype("float32")
    cpu = faiss.IndexFlatIP(384)
    cpu.add(docs)
    gpu = faiss.index_cpu_to_all_gpus(cpu)
    _, want = cpu.search(queries, 10)
    _, got = gpu.search(queries, 10)
    recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(want, got, strict=True)]))
    assert recall >= 0.999, f"GPU recall@10 vs CPU {recall:.4f}"
    return {"recall_at_10_vs_cpu": recall, "gpus": faiss.get_num_gpus()}


CHECKS = {
    "env": lambda allow, work: check_env(allow),
    "actor_bf16": check_actor_bf16,
    "ppo_e2e": check_ppo_e2e,
    "deep_e2e": check_deep_e2e,
    "hybrid_e2e": check_hybrid_e2e,
    "logprob_mem": check_logprob_mem,
    "faiss_gpu": check_faiss_gpu,
    "model_3b": check_model_3b,
}


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated checks (default: all but model_3b)")
    p.add_argument("--allow-missing", default="", help="vllm,faiss_gpu,flash_attn: report SKIP instead of FAIL")
    p.add_argument("--big", action="store_true", help="also run model_3b (a 3B-shaped model, ~3 minutes)")
    p.add_argument("--json", default=None, help="write the result rows here")
    p.add_argument("--deep-policy", default=None, help="deep_e2e: the deep world's warm start built here (HF dir)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    names = [n for n in CHECKS if n != "model_3b" or args.big]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    allow = {m.strip() for m in args.allow_missing.split(",") if m.strip()}
    results, workdir = [], tempfile.mkdtemp(prefix="gpu_smoke_")
    checks = {**CHECKS, "deep_e2e": functools.partial(check_deep_e2e, policy=args.deep_policy)}
    for name in names:
        start = time.perf_counter()
        try:
            row, status = checks[name](allow, workdir), "PASS"
        except Skip as exc:
            row, status = {"why": str(exc)}, "SKIP"
        except Exception as exc:  # noqa: BLE001 - every check runs and reports; the exit code sums them up
            row, status = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}, "FAIL"
        results.append({"check": name, "status": status, "s": round(time.perf_counter() - start, 1), **row})
        logger.info("%-12s %s %s", name, status, json.dumps(row))
    _out(f"\n{'check':<12} {'status':<6} {'s':>6}  numbers")
    for r in results:
        nums = {k: v for k, v in r.items() if k not in ("check", "status", "s")}
        _out(f"{r['check']:<12} {r['status']:<6} {r['s']:>6}  {json.dumps(nums)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    failed = [r["check"] for r in results if r["status"] == "FAIL"]
    _out(f"gpu smoke: {len(results) - len(failed)}/{len(results)} passed or skipped; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
