"""Placements other than the default: 2 FSDP ranks with stand-alone rollout workers (`trainer.placement=split`),
so weights travel actor -> driver -> rollout workers after every update. Two steps end to end through Ray."""

import pytest
from e2e_helpers import hf_weights, read_metrics, run_main


@pytest.mark.slow
def test_split_placement_two_ranks(tmp_path, toy_cache):
    run_dir = tmp_path / "run"
    run_main(
        "search_r1_grpo",
        run_dir,
        toy_cache,
        "rollout.n=2",
        "trainer.n_workers=2",
        "trainer.placement=split",
        "trainer.ray_num_cpus=4",  # 2 actor + 2 rollout bundles (logical CPUs; the machine may have 2 cores)
        "actor.entropy_coeff=0.01",
        "actor.optim.lr=1e-3",  # big enough that stale rollout weights would show in the log-prob gap
        "rollout.temperature=0.7",  # the actor's log-probs are taken at the same temperature
        "rollout.top_p=1.0",
    )
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["actor/grad_norm"] > 0
    # step 2 samples with the weights synced after step 1's update: engine and actor log-probs agree (both at T=0.7)
    assert rows[2]["rollout/logprob_abs_diff_max"] < 1e-3, rows[2]
    weights = hf_weights(str(run_dir / "checkpoints" / "step_000002"))
    assert weights and all(v.isfinite().all() for v in weights.values())
