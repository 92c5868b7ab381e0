"""Shared set-up for end-to-end runs: the main job as a real subprocess (`python -m rsearch_verl.main`) on a small
toy world, a local Ray and the recipe's own retrieval server, with sizes small enough for 2 CPU cores."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Small everything: 2 prompts per step, short turns, a small world; one FSDP rank, bm25 retriever.
TINY = [
    "trainer.total_steps=2",
    "trainer.save_freq=2",
    "trainer.test_freq=2",
    "trainer.ray_num_cpus=2",
    "model.sft_checkpoint=null",  # a random tiny policy: these tests check plumbing, not learning
    "data.train_batch_size=2",
    "data.val_batch_size=4",
    "data.val_max_samples=4",
    "data.toy_world.n_entities=24",
    "data.toy_world.n_train=32",
    "data.toy_world.n_val=8",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=24",
    "rollout.max_response_length=128",
    "rollout.max_obs_length=64",
    "actor.ppo_mini_batch_size=2",
    "actor.micro_batch_size=1",
    "critic.ppo_mini_batch_size=2",
    "critic.micro_batch_size=1",
]

# runs with `searching_policy` (conftest.py): 2 prompts x 2 samples per step, a checkpoint every step, no validation
FAST = [
    "rollout.n=2",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "rollout.max_tokens_per_turn=40",
    "rollout.temperature=0.5",  # the short-trained policy below searches in every trajectory at 0.5
    "retriever.supervisor.check_interval_s=0.5",
]


def main_cmd(recipe: str, run_dir, toy_cache: str, *overrides: str) -> list[str]:
    args = [f"+recipe={recipe}", *TINY, f"trainer.run_dir={run_dir}", f"data.toy_world.cache_dir={toy_cache}"]
    return [sys.executable, "-m", "rsearch_verl.main", *args, *overrides]


def child_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return {**env, **(extra or {})}


def run_main(
    recipe: str, run_dir, toy_cache: str, *overrides: str, timeout: int = 420, env: dict | None = None
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        main_cmd(recipe, run_dir, toy_cache, *overrides),
        cwd=ROOT,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"main failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def hf_weights(ckpt_dir: str) -> dict[str, torch.Tensor]:
    path = os.path.join(ckpt_dir, "actor", "hf")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert files, f"no HF export in {path}"
    out = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out
