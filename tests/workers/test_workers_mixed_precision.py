"""bfloat16 training with float32 masters (rsearch_verl/workers/fsdp.py): one real `ActorWorker.update_actor` at
lr 1e-6 over 2 FSDP2 ranks (gloo, one process per rank, the worker's methods called as its Ray actor would).

With model.dtype=bfloat16 the sharded parameters and AdamW state are float32 and the forward runs in bf16; one Adam
step of ~lr per weight changes nearly every master weight. The old behaviour (bf16 parameters, bf16 Adam state, no
mixed-precision policy; reproduced by making bf16 the master dtype) rounds almost every update away: an Adam step
of 1e-6 is far below bf16's spacing (~1.2e-4 at |w| ~ 0.02), so only weights within ~2.5e-4 of zero move.
Measured on the tiny Qwen2 (2 layers, hidden 64): 99.98% of the float32 masters change vs 2.1% of pure-bf16
parameters (the zero-initialised biases and a few near-zero weights).

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_mixed_precision.py
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.config import load_config, to_dict
from rsearch_verl.testing.batches import sequence_tensors

P, R, B = 6, 10, 4


def make_cfg(device: str = "cpu", ranks: int = 2):
    """`device=cuda`: the same update on `ranks` GPUs over NCCL (launch/gpu_smoke.py runs it on a lent GPU)."""
    where = ["trainer.device=cuda", f"trainer.n_gpus_per_node={ranks}"] if device == "cuda" else []
    return load_config(
        [
            "model=tiny",
            "model.sft_checkpoint=null",
            "model.dtype=bfloat16",
            "trainer=cpu",
            f"trainer.n_workers={ranks}",
            *where,
            "data.train_batch_size=4",
            "rollout.n=1",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size=1",
            "actor.optim.lr=1e-6",
            "actor.optim.warmup_steps=0",
            "actor.entropy_coeff=0.01",  # the entropy's backward through the chunked log-probs too
        ]
    )


def make_batch(vocab: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    attention = torch.ones_like(ids)
    attention[1, :2] = 0  # left padding
    mask = attention[:, P:].clone()
    advantages = torch.randn(B, R, generator=g)
    return DataProto.from_dict(
        tensors={**sequence_tensors(ids[:, :P], ids[:, P:], attention, mask), "advantages": advantages}
    )


def _rank_main(rank: int, port: int, master_dtype: str, out_path: str, device: str, ranks: int) -> None:
    """One FSDP rank: build the actor, one update on this rank's share of the batch, report what changed."""
    local = str(rank) if device == "cuda" else "0"  # one GPU per rank
    env = {"WORLD_SIZE": str(ranks), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "LOCAL_WORLD_SIZE": str(ranks), "LOCAL_RANK": local, "REDIS_STORE_SERVER_HOST": "127.0.0.1"}  # fmt: skip
    os.environ.update(env)
    torch.set_num_threads(1)
    from rsearch_verl.workers import fsdp
    from rsearch_verl.workers.actor import ActorWorker

    fsdp.MASTER_DTYPE = getattr(torch, master_dtype)  # bfloat16: the behaviour before mixed precision
    worker = ActorWorker(to_dict(make_cfg(device, ranks)), with_rollout=False)
    worker.init_model()
    compute = []
    worker.model.model.layers[0].register_forward_pre_hook(lambda _m, args: compute.append(args[0].dtype))
    before = fsdp.full_state_dict(worker.model)
    data = make_batch(len(worker.tokenizer)).chunk(ranks)[rank]  # what DP_COMPUTE_PROTO hands this rank
    data = data.union(worker.compute_log_prob(data))  # on policy: ratios start at 1
    metrics = worker.update_actor(data).meta_info["metrics"]
    after = fsdp.full_state_dict(worker.model)
    if rank == 0:
        changed = sum(int((after[k] != before[k]).sum()) for k in before)
        total = sum(v.numel() for v in before.values())
        dtypes = {str(p.dtype) for p in worker.model.parameters()}
        torch.save({"fraction": changed / total, "dtypes": dtypes, "compute": str(compute[0]), **metrics}, out_path)
    torch.distributed.destroy_process_group()


def run_update(master_dtype: str, tmp_path, device: str = "cpu", ranks: int = 2) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / f"{master_dtype}.pt")
    args = (port, master_dtype, out, device, ranks)
    mp.start_processes(_rank_main, args=args, nprocs=ranks, start_method="spawn")
    return torch.load(out, weights_only=False)


def test_bf16_update_at_lr_1e6_moves_the_float32_masters(tmp_path):
    res = run_update("float32", tmp_path)
    assert res["dtypes"] == {"torch.float32"}  # masters (and so AdamW's state) in float32
    assert res["compute"] == "torch.bfloat16"  # FSDP's mixed precision: the layers run in bf16
    assert {sig.PG_LOSS, sig.ACTOR_GRAD_NORM, sig.ACTOR_ENTROPY} <= res.keys()  # what the health watchdog reads
    assert torch.isfinite(torch.tensor([res[sig.PG_LOSS], res[sig.ACTOR_GRAD_NORM]])).all()
    assert res["actor/grad_norm"] > 0
    assert res["fraction"] >= 0.5, f"only {res['fraction']:.1%} of the float32 masters moved"


@pytest.mark.slow
def test_pure_bf16_parameters_lose_the_same_update(tmp_path):
    """The check above can fail: with bf16 parameters (the old behaviour) the same step changes almost nothing."""
    res = run_update("bfloat16", tmp_path)
    assert res["dtypes"] == {"torch.bfloat16"}
    assert res["fraction"] < 0.05, f"{res['fraction']:.1%} of the bf16 parameters moved"
