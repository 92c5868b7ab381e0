"""Every recipe (PPO, GRPO and REINFORCE++ among them) trains 2 steps end to end on CPU through Ray: the main job as a
subprocess with a tiny Qwen2 built from a config, the toy world and the recipe's own retrieval server (real uvicorn).
Checks the run directory contract of docs/architecture.md and that the policy's parameters really moved."""

import json
import os

import pytest
import torch
from e2e_helpers import hf_weights, read_metrics, run_main

RECIPES = {
    "search_r1_ppo": [],  # GAE + critic, KL in the reward
    "search_r1_grpo": ["rollout.n=2"],  # group advantages, KL as a loss
    "r1_searcher_rpp": ["rollout.n=2"],  # REINFORCE++
    "research_grpo": ["rollout.n=2"],  # <result> observations, \\boxed{} answers, F1 reward
    # the R-Search rewards call a judge model; offline runs use the documented F1 stand-in
    "r_search_grpo": ["rollout.n=2", "+reward.kwargs.judge=f1"],
    "r_search_ppo": ["+reward.kwargs.judge=f1"],
    "r_search_dag_grpo": ["rollout.n=2", "+reward.kwargs.judge=f1"],  # NL-DAG plans; β annealed 0.1 -> 0.01
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_steps_end_to_end(recipe, tmp_path, toy_cache):
    run_dir = tmp_path / "run"
    # a random policy earns no reward (all advantages 0): a small entropy bonus gives every update a gradient
    run_main(recipe, run_dir, toy_cache, *RECIPES[recipe], "trainer.save_freq=1", "actor.entropy_coeff=0.01")
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/em" in rows[0] and "val/em" in rows[-1]
    for key in ("reward/mean", "rollout/searches_mean", "rollout/response_len_mean", "timing/step_s"):
        assert key in rows[1] and key in rows[2], key
    if recipe.endswith("_ppo"):
        assert "critic/vf_loss" in rows[1]
    assert "actor/pg_loss" in rows[1] and rows[2]["actor/grad_norm"] > 0
    # rollout dump: one line per trajectory, masks cover exactly the response tokens
    with open(run_dir / "rollouts" / "step_1.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines and all(len(rec["response_ids"]) == len(rec["response_mask"]) for rec in lines)
    assert {"uid", "prompt", "response", "reward", "n_searches", "ground_truth", "data_source"} <= set(lines[0])
    # atomic checkpoints of both steps; the policy moved between them
    ckpts = run_dir / "checkpoints"
    assert sorted(os.listdir(ckpts))[-2:] == ["step_000001", "step_000002"]
    first, second = hf_weights(str(ckpts / "step_000001")), hf_weights(str(ckpts / "step_000002"))
    assert any(not torch.equal(first[k], second[k]) for k in first), "parameters did not change"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and "val/em_after" in summary
