"""Peak extra memory of one colocated weight sync (actor -> rollout engine in the same process), per rank: the old
sync (`fsdp.full_state_dict`: every rank gathers the whole model, then the engine copies it in) against the
streamed one (`ActorWorker._rollout_weights`: one FSDP parameter gathered at a time, loaded into the engine in
buckets of rollout.update_weights_bucket_mb).

Two gloo ranks on CPU, FSDP2-sharded Qwen2 built from a config (~110M parameters, float32, ~440 MB), each rank with
an HF engine holding its own copy (the engine the CPU path uses). Memory is each rank's RSS high-water mark
(VmHWM, reset through /proc/self/clear_refs just before the sync) minus its RSS at that point, in a fresh pair of
processes per variant (MALLOC_MMAP_THRESHOLD_ fixed so freed tensors go back to the OS instead of hiding in the
heap); the table shows the larger of the two ranks. Each variant checks the engine ends up with the actor's weights.

Run (CPU, ~2 min on 2 cores):   .venv/bin/python benchmarks/weight_sync_memory.py
Smaller / other buckets:        .venv/bin/python benchmarks/weight_sync_memory.py --layers 4 --buckets 8,64
Prints a table and, last, the ratio full-state-dict / streamed peak memory (at the middle bucket size).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import tempfile
import time
import types

import torch

logger = logging.getLogger("weight_sync_memory")
MB = 1 << 20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS (so set-up allocations do not count)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _rank(rank: int, variant: str, bucket_mb: int, port: int, args, out_dir: str) -> None:
    import copy

    import torch.distributed as dist

    from rsearch_verl.rollout.engines.hf import HFEngine
    from rsearch_verl.workers import fsdp
    from rsearch_verl.workers.actor import ActorWorker

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _build(args)
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)  # the engine only needs these two ids
    engine = HFEngine(copy.deepcopy(model), tok, bucket_mb=bucket_mb)
    sharded = fsdp.shard_model(model, torch.device("cpu"))
    with torch.no_grad():  # an "update": the engine must end up with the actor's weights, not its starting copy
        for p in sharded.parameters():
            p.to_local().add_(0.01)
    dist.barrier()
    base_kb = _status_kb("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if variant == "full_state_dict":  # the old sync: every rank gathers everything, then the engine copies it
        engine.load_weights(fsdp.full_state_dict(sharded), version=1)
    else:  # the actor's stream; the method only reads `model` and `use_lora`
        engine.load_weights(ActorWorker._rollout_weights(types.SimpleNamespace(model=sharded, use_lora=False)), 1)
    seconds = time.perf_counter() - start
    peak_mb = (_status_kb("VmHWM") - base_kb) / 1024
    name, param = next(iter(sharded.named_parameters()))
    ok = torch.equal(engine.model.state_dict()[name], param.full_tensor())
    engine.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_mb": peak_mb, "seconds": seconds, "ok": ok}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(variant: str, bucket_mb: int, args) -> dict:
    """A fresh pair of gloo processes for one variant; the larger rank's peak."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(variant, bucket_mb, _free_port(), args, out_dir), nprocs=2, join=True)
        ranks = []
        for r in range(2):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    if not all(r["ok"] for r in ranks):
        raise RuntimeError(f"{variant}: the engine does not hold the actor's weights after the sync")
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--buckets", default="16,64,512", help="bucket sizes (MiB) of the streamed variant")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # the spawned ranks inherit it (see module docstring)
    n_params = sum(p.numel() for p in _build(args).parameters())
    model_mb = n_params * 4 / MB
    buckets = [int(b) for b in args.buckets.split(",")]
    rows = [("full_state_dict", "-", run_variant("full_state_dict", buckets[0], args))]
    rows += [("streamed", str(b), run_variant("streamed", b, args)) for b in buckets]
    logger.info("model: %.1fM parameters, %.0f MB float32, 2 FSDP ranks (gloo, CPU)", n_params / 1e6, model_mb)
    logger.info("%-16s %10s %18s %10s", "sync", "bucket MiB", "peak extra MB/rank", "seconds")
    for name, bucket, r in rows:
        logger.info("%-16s %10s %18.0f %10.2f", name, bucket, r["peak_mb"], r["seconds"])
    mid = rows[1 + len(buckets) // 2]
    ratio = rows[0][2]["peak_mb"] / max(mid[2]["peak_mb"], 1e-9)
    logger.info("ratio full_state_dict / streamed (bucket %s MiB) peak extra memory: %.1fx", mid[1], ratio)


if __name__ == "__main__":
    main()
