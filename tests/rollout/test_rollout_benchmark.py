"""Smoke test of benchmarks/rollout_async.py on a small long-tailed workload (real engine, real uvicorn retriever):
both loops keep exactly the scripted policy tokens (the script asserts it), the turn-synchronous loop decodes exactly
its step bound, the async loop never fewer than its own, nothing is discarded with stop strings, and the headline is
the last line. With the HF engine and (vllm lane) the continuous vLLM engine.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_benchmark.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_benchmark_small_workload(engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "rollout_async.py"), "--n", "8", "--short-max", "12",
           "--long-min", "30", "--long-max", "40", "--max-tokens-per-turn", "100", "--latency-ms", "5",
           "--jitter-ms", "2", "--engine", engine]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    bound = re.search(r"turn-sync sum_t max_i steps = (\d+), async max_i sum_t steps = (\d+)", proc.stdout)
    sync_bound, async_bound = int(bound.group(1)), int(bound.group(2))
    rows = {}
    for line in lines:
        match = re.match(r"(async \(ours\)|turn-sync \+ stop|turn-sync \(S-R1\))\s+(.*)", line)
        if match:
            rows[match.group(1)] = [float(x) for x in match.group(2).split()]
    # columns after the name: draw, wall, traj/s, searches, policy, generated, discarded, retok!=, steps, kv Mcol
    ours, sync, sr1 = rows["async (ours)"], rows["turn-sync + stop"], rows["turn-sync (S-R1)"]
    assert ours[3] == sync[3] == sr1[3] == 12  # 0+1+2+3 searches, twice
    assert ours[6] == sync[6] == 0 and sr1[6] > 0  # discarded tokens
    # HF counts decode forwards only (a turn's first token comes from its prefill); vLLM counts every engine step,
    # the 4 turns' prefill steps included
    assert sync[8] == sync_bound + (4 if engine == "vllm" else 0) and ours[8] >= async_bound
    assert lines[-1].startswith("speed-up async vs turn-sync + stop (fair baseline): ")
