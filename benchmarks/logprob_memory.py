"""Peak memory of response log-probs + entropy + backward through a 152k-vocabulary LM head: the unchunked float32
computation the actor used before (`log_softmax(logits.float())`, verl's `entropy_from_logits`) against
`rsearch_verl.workers.logprobs.chunked_log_probs` (float32 a chunk of positions at a time, recomputing in backward).

Both variants run the same head: hidden [N, H] (compute dtype) @ W[V, H]^T -> logits [N, V] (compute dtype), then
log-probs and entropy in float32, a weighted sum as the loss, and its backward into hidden and W. Memory is the peak
above what hidden, W and the targets hold before the head runs:
  - CUDA: torch.cuda.max_memory_allocated (one process, stats reset per variant);
  - CPU: the RSS high-water mark (VmHWM, reset through /proc/self/clear_refs just before the head) of a fresh
    subprocess per variant, minus its RSS at that point.

Run (CPU, ~1 min on 2 cores):   .venv/bin/python benchmarks/logprob_memory.py
GPU (e.g. an H100):              python benchmarks/logprob_memory.py --tokens 16384 --hidden 3584
Prints a table and, last, the ratio unchunked / chunked peak memory.

Measured (bf16 head, vocabulary 151936, chunk 1024 = actor.logprob_chunk_size):
  CPU, 2048 tokens x hidden 1024:   unchunked 9.27 GiB, chunked 2.32 GiB (4.0x); 28 s vs 12 s
  H100, 16384 tokens x hidden 3584: unchunked 64.9 GiB, chunked 10.4 GiB (6.2x); 0.26 s vs 0.20 s
  H100, chunk 512 / 2048 / 4096:    9.9 / 11.6 / 13.9 GiB, 0.20 s each (the unchunked peak is 14x the bf16 logits)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

VARIANTS = ("unchunked", "chunked")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS (so set-up allocations do not count)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(args, device: torch.device):
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(args.tokens, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    weights = torch.randn(args.tokens, generator=g).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, weights


def _entropy_before(z: torch.Tensor) -> torch.Tensor:
    """The entropy the actor computed before chunking: verl's `entropy_from_logits` (its formula where verl is not
    installed, e.g. a bare GPU box: logsumexp(z) - sum(softmax(z) * z), with the same temporaries)."""
    try:
        from verl.utils.torch_functional import entropy_from_logits
    except ImportError:
        return torch.logsumexp(z, dim=-1) - torch.sum(torch.softmax(z, dim=-1) * z, dim=-1)
    return entropy_from_logits(z)


def _step(variant: str, args, hidden, weight, targets, weights) -> float:
    """Forward + backward of one variant; returns a checksum (so nothing is optimised away)."""
    from rsearch_verl.workers.logprobs import chunked_log_probs

    logits = hidden @ weight.T  # [N, V], compute dtype: what the model's LM head returns
    if variant == "unchunked":
        z = logits.float()  # the code before chunking, verbatim
        z = z / args.temperature if args.temperature != 1.0 else z
        log_probs = torch.log_softmax(z, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = _entropy_before(z)
    else:
        log_probs, entropy = chunked_log_probs(logits, targets, args.temperature, args.chunk_size, True)
    del logits
    loss = (log_probs * weights).sum() / args.tokens - 0.01 * entropy.mean()
    loss.backward()
    return float(loss.detach()) + float(hidden.grad.float().sum())


def run_variant(variant: str, args) -> dict:
    """Measure one variant in this process."""
    device = torch.device(args.device)
    hidden, weight, targets, weights = _inputs(args, device)
    _step(variant, args, *_warmup_inputs(args, device))  # first-call allocations (kernels, pools) off the books
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_peak_rss()
        base = _rss_bytes()
    start = time.perf_counter()
    checksum = _step(variant, args, hidden, weight, targets, weights)
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes() - base
    return {"variant": variant, "peak_bytes": peak, "seconds": time.perf_counter() - start, "checksum": checksum}


def _warmup_inputs(args, device: torch.device):
    small = argparse.Namespace(**{**vars(args), "tokens": 4, "vocab": min(args.vocab, 1024)})
    return _inputs(small, device)


def measure(variant: str, args) -> dict:
    """CUDA: in process. CPU: a fresh subprocess, so the RSS high-water mark is this variant's alone."""
    if args.device == "cuda":
        torch.cuda.empty_cache()
        return run_variant(variant, args)
    cmd = [sys.executable, __file__, "--child", variant, *_forward_args(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forward_args(args) -> list[str]:
    keys = ("tokens", "hidden", "vocab", "chunk_size", "dtype", "temperature", "device", "threads")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


def parse_args(argv=None):
    from rsearch_verl.workers.logprobs import DEFAULT_CHUNK

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="response positions in the micro-batch (batch x length)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's vocabulary")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="actor.logprob_chunk_size")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of the head (model.dtype)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return
    gib = 1024**3
    logits_gib = args.tokens * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits / 8 / gib
    print(
        f"device={args.device} tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} dtype={args.dtype} "
        f"chunk={args.chunk_size}; logits alone: {logits_gib:.2f} GiB ({args.dtype}), "
        f"{args.tokens * args.vocab * 4 / gib:.2f} GiB as float32"
    )
    rows = [measure(v, args) for v in VARIANTS]
    print(f"{'variant':<10} {'peak GiB':>9} {'x logits':>9} {'seconds':>8}")
    for r in rows:
        print(
            f"{r['variant']:<10} {r['peak_bytes'] / gib:>9.2f} {r['peak_bytes'] / gib / logits_gib:>9.2f} "
            f"{r['seconds']:>8.2f}"
        )
    before, after = rows[0]["peak_bytes"], rows[1]["peak_bytes"]
    print(f"peak memory unchunked / chunked: {before / after:.2f}x ({before / gib:.2f} -> {after / gib:.2f} GiB)")


if __name__ == "__main__":
    main()
