"""Actor update throughput with sequence packing + a token budget per micro-batch, against the padded micro-batches,
on a long-tailed batch (a few long multi-turn trajectories among many short ones, as search rollouts are).

Both modes run the real `ActorWorker.update_actor` (FSDP2, one rank over gloo; in-process, no Ray) on the same batch,
model and seed, each in a fresh subprocess so that its peak memory is its own, alternating over `--rounds`:
    padded   actor.micro_batch_size=M rows per micro-batch, each padded to the batch's width (today's default path)
    packed   actor.use_remove_padding + actor.use_dynamic_bsz with ppo_max_token_len_per_gpu = M x the batch's width
             (the same number of token slots per micro-batch as the padded path, now filled with real tokens)
Per subprocess: one untimed warm-up update, then `--repeats` timed updates; each mode reports the median over all its
timed updates. Tokens/s counts the batch's real tokens (prompt and response) per update, by wall clock and by the
process's CPU time (the CPU-time figure is the robust one on a shared, loaded machine; `--threads` torch threads, 1 by
default so that CPU time is not inflated by OpenMP spin-waits). Peak memory: the process's peak RSS during the timed
updates minus its RSS just before them, with glibc's mmap threshold fixed so that freed tensors leave the RSS (CPU), or
torch's peak allocated memory (CUDA). The last line prints the tokens/s ratio packed / padded.

Measured (defaults, 2-core CPU under heavy load from other jobs): padded 678 tokens per CPU-second, packed 1653; peak
185 MB vs 166 MB; last line "2.43x wall-clock, 2.44x per CPU-second" (docs/lora_and_packing.md has the table).

    .venv/bin/python benchmarks/packing.py                          # 32 trajectories, 2-layer 256-d Qwen2, CPU
    .venv/bin/python benchmarks/packing.py --rows 64 --layers 4 --rounds 3 --micro 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("benchmarks.packing")


def lengths(rows: int, max_prompt: int, max_response: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts 40-100 % of max_prompt; responses long-tailed (lognormal, ~1/8 of the rows
    near max_response, most a few turns long)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(int(0.4 * max_prompt), max_prompt + 1, rows)
    responses = np.clip(rng.lognormal(np.log(max_response / 8), 0.9, rows), 8, max_response).astype(int)
    return [(int(p), int(r)) for p, r in zip(prompts, responses, strict=True)]


def make_batch(vocab: int, lens: list[tuple[int, int]], max_prompt: int, max_response: int, seed: int):
    """A batch in the layout of rsearch_verl/batch.py, trimmed to its longest prompt and response like a real one."""
    import torch
    from verl import DataProto

    from rsearch_verl.batch import trim_padding

    g = torch.Generator().manual_seed(seed)
    b, width = len(lens), max_prompt + max_response
    attention = torch.zeros(b, width, dtype=torch.long)
    for i, (p, r) in enumerate(lens):
        attention[i, max_prompt - p : max_prompt + r] = 1
    ids = torch.randint(3, vocab, (b, width), generator=g) * attention
    mask = attention[:, max_prompt:].clone()
    tensors = {
        "prompts": ids[:, :max_prompt],
        "responses": ids[:, max_prompt:],
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask,
        "loss_mask": mask.clone(),
        "advantages": torch.randn(b, max_response, generator=g) * mask,
        "old_log_probs": -torch.rand(b, max_response, generator=g) * mask,
    }
    trim_padding(tensors)
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


class PeakRSS:
    """Samples this process's resident set size every 2 ms in a thread; `peak` is the highest seen."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def run_mode(args) -> dict:
    """One mode in this process: build the worker, warm up, time `repeats` updates."""
    import torch

    from rsearch_verl.config import load_config, to_dict
    from rsearch_verl.workers.actor import ActorWorker

    torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    packed = args.mode == "packed"
    lens = lengths(args.rows, args.max_prompt, args.max_response, args.seed)
    width = max(p for p, _ in lens) + max(r for _, r in lens)
    overrides = [
        "model=tiny",
        "model.sft_checkpoint=null",
        f"model.tiny.hidden_size={args.hidden}",
        f"model.tiny.intermediate_size={4 * args.hidden}",
        f"model.tiny.num_hidden_layers={args.layers}",
        f"model.tiny.num_attention_heads={args.hidden // 64}",
        f"model.tiny.num_key_value_heads={max(1, args.hidden // 128)}",
        f"trainer.device={args.device}",
        f"data.max_prompt_length={args.max_prompt}",
        f"rollout.max_response_length={args.max_response}",
        f"data.train_batch_size={args.rows}",
        "rollout.n=1",
        "algorithm.adv_estimator=reinforce_plus_plus",
        f"actor.ppo_mini_batch_size={args.rows}",
        f"actor.micro_batch_size={args.micro}",
        f"actor.use_remove_padding={str(packed).lower()}",
        f"actor.use_dynamic_bsz={str(packed).lower()}",
        f"actor.ppo_max_token_len_per_gpu={max(args.micro * width, args.max_prompt + args.max_response)}",
    ]
    cfg = load_config(overrides)
    worker = ActorWorker(to_dict(cfg), with_rollout=False)
    worker.init_model()
    batch = make_batch(len(worker.tokenizer), lens, args.max_prompt, args.max_response, args.seed)
    real_tokens = int(batch.batch["attention_mask"].sum())
    cuda = args.device == "cuda"
    worker.update_actor(batch)  # warm-up (allocator, kernels, optimizer state)
    wall, cpu = [], []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = PeakRSS.rss()
    with PeakRSS() as mem:
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            worker.update_actor(batch)
            if cuda:
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    peak = torch.cuda.max_memory_allocated() if cuda else mem.peak - before
    return {
        "mode": args.mode,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_mem_mb": peak / 2**20,
        "real_tokens": real_tokens,
        "padded_tokens": int(batch.batch["attention_mask"].numel()),
        "budget": cfg.actor.ppo_max_token_len_per_gpu if packed else None,
    }


def child(mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--port", str(29600 + (mode == "packed"))]
    keys = ("rows", "micro", "max_prompt", "max_response", "hidden", "layers", "repeats", "seed", "device", "threads")
    for key in keys:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # large tensors mmapped and unmapped on free: RSS follows live memory
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """Medians over every timed update of every subprocess of one mode; the highest peak memory."""
    out = dict(runs[0])
    out["wall_s"] = statistics.median([t for r in runs for t in r["wall_s"]])
    out["cpu_s"] = statistics.median([t for r in runs for t in r["cpu_s"]])
    out["peak_mem_mb"] = max(r["peak_mem_mb"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["padded", "packed"], help="internal: run one mode and print its JSON")
    ap.add_argument("--rows", type=int, default=32, help="trajectories in the batch (one mini-batch)")
    ap.add_argument("--micro", type=int, default=4, help="rows per padded micro-batch")
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-response", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (head_dim 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per subprocess")
    ap.add_argument("--rounds", type=int, default=2, help="subprocesses per mode, alternating padded / packed")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--port", type=int, default=29600)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    runs = {"padded": [], "packed": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(child(mode, args))
    pad, pk = (summarise(runs[mode]) for mode in runs)
    lens = lengths(args.rows, args.max_prompt, args.max_response, args.seed)
    resp = sorted(r for _, r in lens)
    print(
        f"batch: {args.rows} trajectories, response lengths min/median/max {resp[0]}/{resp[len(resp) // 2]}/{resp[-1]}"
        f" tokens; {pad['real_tokens']} real tokens of {pad['padded_tokens']} padded slots"
        f" ({100 * (1 - pad['real_tokens'] / pad['padded_tokens']):.0f}% padding)"
    )
    print(f"model: Qwen2 {args.layers} layers x {args.hidden}, {args.device}; packed budget {pk['budget']} tokens")
    print(f"{'mode':8} {'wall s':>8} {'tokens/s':>9} {'CPU s':>8} {'tokens/CPU-s':>13} {'peak MB':>8}")
    for r in (pad, pk):
        tok = r["real_tokens"]
        row = f"{r['mode']:8} {r['wall_s']:8.2f} {tok / r['wall_s']:9.0f} {r['cpu_s']:8.2f} {tok / r['cpu_s']:13.0f}"
        print(f"{row} {r['peak_mem_mb']:8.0f}")
    wall_ratio, cpu_ratio = pad["wall_s"] / pk["wall_s"], pad["cpu_s"] / pk["cpu_s"]
    print(f"packed/padded actor update tokens/s: {wall_ratio:.2f}x wall-clock, {cpu_ratio:.2f}x per CPU-second")


if __name__ == "__main__":
    main()
