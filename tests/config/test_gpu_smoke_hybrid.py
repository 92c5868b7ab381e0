"""launch/gpu_smoke.py's hybrid_e2e check composes and validates here (it runs only on a GPU): the main job's small PPO
run with a random Qwen3.5 of Qwen3.5-0.8B's depth and width, bf16, the HF engine, padded micro-batches.

Run: .venv/bin/python -m pytest -q tests/config/test_gpu_smoke_hybrid.py
"""

from __future__ import annotations

import importlib.util
import os

from rsearch_verl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", os.path.join(ROOT, "launch", "gpu_smoke.py"))
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    return smoke


def test_gpu_smoke_hybrid_run_composes():
    smoke = _smoke()
    assert "hybrid_e2e" in smoke.CHECKS
    cfg = load_config(["+recipe=search_r1_ppo", *smoke.hybrid_overrides("/tmp/w")])  # validated: packing is refused
    assert cfg.trainer.device == "cuda" and cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "hf"
    assert cfg.model.family == "qwen3_5" and cfg.model.path == "tiny"
    assert not cfg.actor.use_remove_padding and not cfg.critic.use_remove_padding
    tiny = cfg.model.tiny
    shape = (tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers, tiny.num_attention_heads)
    assert shape == (1024, 3584, 24, 8) and tiny.num_key_value_heads == 2
    assert cfg.trainer.total_steps == 2 and cfg.off_policy_mode == "tis"  # bf16: the default correction is on
