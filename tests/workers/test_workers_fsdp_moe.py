"""FSDP2 on the hybrid MoE stand-in (model=tiny_qwen3_6_moe's layers: 3 Gated DeltaNet : 1 gated attention, 4 routed
experts, 2 a token, plus a shared expert), 2 ranks over gloo, one process per rank (rsearch_verl/workers/fsdp.py).

- `shard_model` makes one FSDP unit per `Qwen3_5MoeDecoderLayer` (transformers' `_no_split_modules`), the sparse
  MoE block and the Gated DeltaNet inside it, not units of their own;
- the routed experts' fused 3-D parameters (`mlp.experts.gate_up_proj` [4, 256, 128], `down_proj` [4, 128, 128])
  are DTensors sharded on dim 0: each rank holds 2 of the 4 experts;
- two AdamW steps, each rank on its half of the batch (tokens route to different experts on the two ranks): the
  loss stays finite, every parameter changes, and the gathered full state dict has the unsharded shapes and equals
  the same two steps of the unsharded model on the whole batch (the reduced gradients are the full batch's).

The vocabulary is 512 (not the 248k of model=tiny_qwen3_5's tokenizer): the embedding is the root unit, the same for
every family, and a 248k one would cost the 2-core machine most of a minute. ~25 s.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_fsdp_moe.py
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from rsearch_verl.config import load_config
from rsearch_verl.models import build_tiny_model

VOCAB, B, S, STEPS, RANKS = 512, 4, 24, 2, 2
OPTIM = SimpleNamespace(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01, warmup_steps=0, lr_scheduler="constant",
                        min_lr_ratio=0.0)  # fmt: skip
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _tiny():
    """model=tiny_qwen3_6_moe's shape (read once, in the test process)."""
    return load_config(["+recipe=search_r1_grpo", "model=tiny_qwen3_6_moe"]).model.tiny


def _model(tiny):
    return build_tiny_model("qwen3_5_moe", tiny, VOCAB, seed=0)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))


def _steps(model, optim, ids: torch.Tensor) -> list[float]:
    """STEPS AdamW steps of the next-token loss on `ids` (no padding: every rank's mean is over the same count)."""
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _rank_main(rank: int, port: int, out_path: str, tiny) -> None:
    env = {"WORLD_SIZE": str(RANKS), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(RANKS)}  # fmt: skip
    os.environ.update(env)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    from rsearch_verl.workers import fsdp

    device = fsdp.init_distributed("cpu")
    model = _model(tiny)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    units = [type(m).__name__ for m in fsdp._decoder_layers(model)]
    model = fsdp.shard_model(model, device)
    expert = model.model.layers[0].mlp.experts.gate_up_proj
    local = {"dtensor": isinstance(expert, DTensor), "placements": str(expert.placements),
             "local_shape": tuple(expert.to_local().shape)}  # fmt: skip
    optim, _ = fsdp.build_optimizer(model, OPTIM, total_steps=STEPS)
    losses = _steps(model, optim, _batch().chunk(RANKS)[rank])
    state = fsdp.full_state_dict(model)
    if rank == 0:
        torch.save({"shapes": shapes, "units": units, "local": local, "losses": losses, "state": state}, out_path)
    torch.distributed.destroy_process_group()


def test_moe_hybrid_trains_sharded_over_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, tiny = str(tmp_path / "rank0.pt"), _tiny()
    mp.start_processes(_rank_main, args=(port, out, tiny), nprocs=RANKS, start_method="spawn")
    res = torch.load(out, weights_only=False)
    assert res["units"] == ["Qwen3_5MoeDecoderLayer"] * 4  # one unit per decoder layer, the MoE block inside it
    assert res["local"] == {"dtensor": True, "placements": "(Shard(dim=0),)", "local_shape": (2, 256, 128)}
    assert all(torch.isfinite(torch.tensor(res["losses"])))

    init = _model(tiny)
    before = {k: v.detach().clone() for k, v in init.state_dict().items()}
    state = res["state"]
    assert {k: tuple(v.shape) for k, v in state.items()} == res["shapes"]
    unchanged = [k for k in state if torch.equal(state[k], before[k])]
    assert not unchanged, f"parameters the sharded steps did not move: {unchanged}"
    assert all(k.endswith(EXPERTS) for k in state if state[k].dim() == 3 and "experts" in k)

    optim = torch.optim.AdamW(init.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay)
    _steps(init, optim, _batch())  # the same two steps, unsharded, on the whole batch
    # An Adam step moves a weight by ~lr = 1e-2; a sharding or reduction bug is off by that much. Summation order
    # alone, amplified by Adam's normalisation where a gradient is near 0, moved 1 of 16384 weights by 1.4e-4.
    for k, v in init.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-3, msg=lambda m, k=k: f"{k} differs: {m}")
        assert float((state[k] - v).abs().gt(5e-5).float().mean()) < 1e-3, f"{k}: many weights differ"
