"""model.dtype=bfloat16 end to end on CPU (`python -m rsearch_verl.main`, PPO with its critic and GRPO): the float32
FSDP2 masters with bf16 compute (rsearch_verl/workers/fsdp.py) train the actor and the critic (whose float32 value
head once broke a bf16 FSDP group), losses and gradient norms are finite, and the HF export is in bf16.

One update per recipe, smallest sizes (each run ~30-60 s on 2 cores).

Run: .venv/bin/python -m pytest -q -m slow tests/e2e/test_e2e_bf16.py
"""

import math

import pytest
import torch
from e2e_helpers import hf_weights, read_metrics, run_main

RECIPES = {"search_r1_ppo": [], "search_r1_grpo": ["rollout.n=2", "actor.ppo_mini_batch_size=4"]}
SHORT = [
    "model.dtype=bfloat16",
    "trainer.total_steps=1",
    "trainer.val_before_train=false",
    "trainer.dump_rollouts=false",
    "data.val_max_samples=2",
    "data.val_batch_size=2",
    "actor.entropy_coeff=0.01",  # a random policy earns no reward: the entropy bonus gives the update a gradient
]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_bf16_trains_end_to_end(recipe, tmp_path, toy_cache):
    run_dir = tmp_path / "run"
    run_main(recipe, run_dir, toy_cache, *SHORT, *RECIPES[recipe], timeout=300)
    row = next(r for r in read_metrics(run_dir) if r["step"] == 1)
    keys = ["actor/pg_loss", "actor/grad_norm"]
    if recipe.endswith("_ppo"):
        keys += ["critic/vf_loss", "critic/grad_norm"]
    for key in keys:
        assert key in row and math.isfinite(row[key]), f"{key}: {row.get(key)}"
    assert row["actor/grad_norm"] > 0
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    weights = hf_weights(str(ckpts[-1]))
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}  # the export is in model.dtype
