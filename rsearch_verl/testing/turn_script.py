"""A scripted heavy-tailed policy for benchmarks: the rollout workers' engine searches a number of times drawn from a
heavy tail per question (1 turn for most, 16+ for a few), installed from outside the product code.

Streaming rollouts pay off when trajectories are long-tailed (benchmarks/streaming.py); a tiny policy does not
produce such a tail by itself. This installs, through Ray's extension points, a `ScriptedHFEngine`
(rsearch_verl/testing/scripted_engines.py: the real HF engine whose turns start with forced text, through its own
decode, stop-string and log-prob path) in every rollout worker: `RAY_RUNTIME_ENV_HOOK` names `runtime_env_hook`,
which adds `install` as the job's `worker_process_setup_hook` (the way rsearch_verl/testing/faults.py injects a NaN).

The number of searches of a question is a Pareto draw from the crc32 of its text: P(searches >= s) = 1 / (s + 1),
cut at `max_searches`; every sample of a question (a GRPO group) searches as often. Search k asks the question's
text followed by k (distinct queries: a search client's cache does not shorten the tail); after the last one the
policy answers. The script counts the searches in the context it is shown, so it
needs the whole trajectory there: rollout.context.strategy=none (a folded context forgets older turns).

    env = {**os.environ, **heavy_tail_env(max_searches=16)}
    subprocess.run([sys.executable, "-m", "rsearch_verl.main", ..., "model.sft_checkpoint=null"], env=env)
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Callable

TAIL_ENV = "RSEARCH_SCRIPTED_TAIL_MAX_SEARCHES"


def heavy_tail_env(max_searches: int = 16) -> dict[str, str]:
    """The env vars that make the main job's rollout workers follow the heavy-tailed script."""
    return {"RAY_RUNTIME_ENV_HOOK": f"{__name__}.runtime_env_hook", TAIL_ENV: str(max_searches)}


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's RAY_RUNTIME_ENV_HOOK: the job's runtime env plus `install` as the worker setup hook."""
    env = dict(runtime_env or {})
    env["env_vars"] = {**env.get("env_vars", {}), TAIL_ENV: os.environ[TAIL_ENV]}
    env["worker_process_setup_hook"] = f"{__name__}.install"
    return env


def searches_for(question: str, max_searches: int) -> int:
    """A heavy-tailed number of searches for `question` (module docstring), deterministic in its text."""
    u = (zlib.crc32(question.encode()) % 1_000_003 + 1) / 1_000_004  # uniform in (0, 1)
    return min(max_searches, int(1 / u) - 1)


def heavy_tail_script(max_searches: int) -> Callable[[str], str]:
    """The script: search the question's text until its number of searches is reached, then answer."""

    def script(ctx: str) -> str:
        found = list(re.finditer(r"Question: (.*)", ctx))
        question = found[-1].group(1).strip() if found else ""
        response = ctx[found[-1].end() :] if found else ctx  # the instruction itself shows a search tag
        done = response.count("</search>")
        if done < searches_for(question, max_searches):  # each query its own: no search cache hit shortens the tail
            return f"<search> {question} {done + 1} </search>"
        return "<answer> unknown </answer>"

    return script


def install() -> None:
    """Ray's worker_process_setup_hook: this process's rollout engines follow the heavy-tailed script (HF only)."""
    # heavy: the generation worker (torch, verl) only when the script is installed
    from rsearch_verl.testing.scripted_engines import ScriptedHFEngine
    from rsearch_verl.workers import generation

    script = heavy_tail_script(int(os.environ[TAIL_ENV]))

    def make_engine(rollout_cfg, model, tokenizer, device: str = "cpu", dtype=None):
        if rollout_cfg.engine != "hf":
            raise ValueError("the heavy-tailed script drives the HF engine only")
        return ScriptedHFEngine(model if dtype is None else model.to(dtype), tokenizer, script, device=device,
                                max_batch=max(1, rollout_cfg.max_concurrent_trajectories),
                                bucket_mb=rollout_cfg.update_weights_bucket_mb)  # fmt: skip

    generation.make_engine = make_engine
