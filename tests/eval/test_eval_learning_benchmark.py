"""benchmarks/learning.py's table: per-variant spread of the EM gain, the share of runs reaching the target, the
masking effect paired by (seed, world) beside the seed-to-seed spread, the worst default-recipe run on the last line;
a finished grid resumes."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("learning_bench", os.path.join(ROOT, "benchmarks", "learning.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(variant, seed, world, before, after, searches=(0.0, 1.5)):
    return {"variant": variant, "seed": seed, "world": world, "em_before": before, "em_after": after,
            "searches_before": searches[0], "searches_after": searches[1], "wall_s": 1.0}  # fmt: skip


def test_report_spread_share_masking_effect_and_worst_run():
    bench = _bench()
    rows = [
        _row("ppo", 1, 0, 0.0, 0.9),
        _row("ppo", 2, 0, 0.0, 0.2),  # below the target
        _row("ppo", 1, 1, 0.1, 0.8),
        _row("ppo_nomask", 1, 0, 0.0, 0.5),
        _row("ppo_nomask", 2, 0, 0.0, 0.4),
        _row("ppo_nomask", 1, 1, 0.1, 0.9),
    ]
    lines = bench.report(rows, ["ppo", "ppo_nomask"])
    ppo = next(line for line in lines if line.startswith("ppo "))
    assert "+0.200 / +0.700 / +0.900" in ppo and "67%" in ppo and "0.00 -> 1.50" in ppo
    assert "+0.400 / +0.500 / +0.800" in next(line for line in lines if line.startswith("ppo_nomask"))
    effect = next(line for line in lines if line.startswith("masking effect"))
    assert "3 pairs" in effect and "-0.200 / -0.100 / +0.400" in effect
    # what an effect is judged against: two seeds of ppo in the same world (world 1 has one seed: no pair)
    seeds = next(line for line in lines if line.startswith("seed effect"))
    assert "2 pairs" in seeds and "-0.700 / +0.000 / +0.700; p10 / p90 -0.560 / +0.560" in seeds
    assert lines[-1].startswith("worst run of ppo: EM gain +0.200 (seed 2, world 0")


def test_a_stopped_run_is_a_failure_outside_the_spreads():
    bench = _bench()
    rows = [_row("ppo", 1, 0, 0.0, 0.9), _row("ppo", 2, 0, 0.0, 0.8), _row("ppo_async1", 1, 0, 0.0, 0.7)]
    rows.append({"variant": "ppo_async1", "seed": 2, "world": 0, "stopped": "watchdog tripped", "wall_s": 1.0})
    lines = bench.report(rows, ["ppo", "ppo_async1"])
    async1 = next(line for line in lines if line.startswith("ppo_async1"))
    assert "   1 " in async1 and "+0.700 / +0.700 / +0.700" in async1 and "50%" in async1
    assert "1 pairs): -0.200 / -0.200 / -0.200" in next(line for line in lines if line.startswith("asynchronous"))
    assert "stopped: ppo_async1 seed 2 world 0: watchdog tripped" in lines
    assert lines[-1].startswith("worst run of ppo: EM gain +0.800 (seed 2, world 0")
    rows.append({"variant": "ppo", "seed": 3, "world": 0, "stopped": "retriever gone", "wall_s": 1.0})
    assert bench.report(rows, ["ppo", "ppo_async1"])[-1].startswith("worst run of ppo: stopped (seed 3, world 0")
    assert bench.report(rows[-2:], ["ppo", "ppo_async1"])[-1] == "no run finished"


def test_finished_cells_are_read_back(tmp_path):
    bench = _bench()
    path = tmp_path / "results.jsonl"
    rows = [_row("grpo", 3, 2, 0.0, 1.0), _row("ppo", 1, 0, 0.0, 0.5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = bench.load_done(str(path))
    assert set(done) == {("grpo", 3, 2), ("ppo", 1, 0)} and done[("ppo", 1, 0)]["em_after"] == 0.5


def test_effects_carry_a_paired_bootstrap_interval_of_their_mean():
    bench = _bench()
    rows = [_row("ppo", s, w, 0.0, 0.5) for s in (1, 2, 3) for w in (0, 1)]
    rows += [_row("grpo", s, w, 0.0, 0.5 + 0.1 * s) for s in (1, 2, 3) for w in (0, 1)]  # +0.1 / +0.2 / +0.3
    effect = next(line for line in bench.report(rows, ["ppo", "grpo"]) if line.startswith("GRPO vs PPO"))
    assert "6 pairs" in effect and "+0.100 / +0.200 / +0.300" in effect and "mean +0.200" in effect
    low, high = bench.bootstrap_ci([0.1, 0.2, 0.3] * 2)
    assert 0.1 <= low < 0.2 < high <= 0.3  # inside the range of the differences, around their mean
    assert bench.bootstrap_ci([0.25] * 4) == (0.25, 0.25)  # no spread, no interval
    wide, narrow = bench.bootstrap_ci([-0.5, 0.5, -0.4, 0.6]), bench.bootstrap_ci([0.04, 0.06, 0.05, 0.05])
    assert wide[1] - wide[0] > 10 * (narrow[1] - narrow[0])
    assert bench.WORLDS["hard"] == ["data=toy_world_hard"] and "ppo_async1" in bench.DEFAULT_VARIANTS["hard"]


def test_a_worlds_runs_wait_for_its_first_while_other_worlds_run(monkeypatch):
    """The grid's scheduler (the main job itself is tests/e2e/test_e2e_learning.py): a world's first run builds its
    warm start alone; the world's other runs start only after it, while another world's runs go on."""
    import threading
    import time
    import types

    bench, events, lock = _bench(), [], threading.Lock()

    def run_cell(variant, seed, world, args):
        with lock:
            events.append(("start", variant, seed, world))
        time.sleep(0.3 if (variant, seed) == ("ppo", 1) and world == 1 else 0.02)  # world 1's warm start is slow
        with lock:
            events.append(("end", variant, seed, world))
        return _row(variant, seed, world, 0.0, 0.5)

    monkeypatch.setattr(bench, "run_cell", run_cell)
    monkeypatch.setattr(bench, "_built", lambda variant, world, args: False)  # no warm start cached yet
    cells = [(v, s, w) for w in (0, 1) for s in (1, 2) for v in ("ppo", "grpo")]
    rows = list(bench.run_cells(cells, types.SimpleNamespace(jobs=2)))
    assert sorted((r["variant"], r["seed"], r["world"]) for r in rows) == sorted(cells)
    for world in (0, 1):
        first_end = events.index(("end", "ppo", 1, world))
        others = [i for i, e in enumerate(events) if e[0] == "start" and e[3] == world and e[1:3] != ("ppo", 1)]
        assert min(others) > first_end, events
    # world 0's runs went on while world 1's first was still building: they did not wait for it
    world0_done = max(i for i, e in enumerate(events) if e[0] == "end" and e[3] == 0)
    assert world0_done < events.index(("end", "ppo", 1, 1)), events


def test_a_world_whose_warm_starts_are_built_runs_its_cells_at_once(monkeypatch):
    """A world whose warm starts are cached already (e.g. built by an earlier grid) has nothing to wait for: its
    cells start together, up to the jobs; a world still to build runs its first cell alone."""
    import threading
    import time
    import types

    bench, events, lock = _bench(), [], threading.Lock()

    def run_cell(variant, seed, world, args):
        with lock:
            events.append(("start", variant, seed, world))
        time.sleep(0.3 if (variant, seed) == ("ppo", 1) else 0.02)
        with lock:
            events.append(("end", variant, seed, world))
        return _row(variant, seed, world, 0.0, 0.5)

    monkeypatch.setattr(bench, "run_cell", run_cell)
    monkeypatch.setattr(bench, "_built", lambda variant, world, args: world == 0)  # world 0 cached, 1 not
    cells = [(v, s, w) for w in (0, 1) for s in (1, 2) for v in ("ppo", "grpo")]
    rows = list(bench.run_cells(cells, types.SimpleNamespace(jobs=8)))
    assert sorted((r["variant"], r["seed"], r["world"]) for r in rows) == sorted(cells)
    ready_first_end = events.index(("end", "ppo", 1, 0))
    assert all(events.index(("start", *c)) < ready_first_end for c in cells if c[2] == 0), events
    building_first_end = events.index(("end", "ppo", 1, 1))
    assert all(events.index(("start", *c)) > building_first_end for c in cells if c[2] == 1 and c[:2] != ("ppo", 1))


def test_a_grid_given_its_policy_builds_no_warm_start():
    import types

    bench = _bench()
    given = types.SimpleNamespace(extra=["model.sft_checkpoint=/some/policy"], world="deep")
    assert bench._built("deep_summary", 0, given)  # nothing to build, nothing looked up: all cells start at once


def test_em_after_by_question_type_is_the_spread_over_runs():
    bench = _bench()
    rows = [_row("ppo", s, 0, 0.0, 0.5) for s in (1, 2, 3)]
    for row, (one, two) in zip(rows, [(0.9, 0.1), (0.7, 0.3), (0.8, 0.6)], strict=True):
        row["em_after_by_type"] = {"toy_world_1hop": one, "toy_world_2hop": two}
    lines = bench.report(rows, ["ppo"])
    want = "  ppo: EM after by question type (min / median / max): toy_world_1hop 0.70 / 0.80 / 0.90, toy_world_2hop"
    assert want + " 0.10 / 0.30 / 0.60" in lines, lines


def test_smollm2_runs_are_judged_by_their_own_targets():
    """SmolLM2's target: gain >= +0.15 and, after RL, 2-hop EM >= 0.25 with >= 1.5 searches per 2-hop question."""
    bench = _bench()

    def smol(seed, after, two_em, two_searches):
        row = _row("smollm2_grpo", seed, 0, 0.3, after)
        row["em_after_by_type"] = {"toy_world_1hop": 0.9, "toy_world_2hop": two_em}
        row["searches_after_by_type"] = {"toy_world_1hop": 1.0, "toy_world_2hop": two_searches}
        return row

    rows = [smol(1, 0.5, 0.3, 1.9), smol(2, 0.5, 0.2, 1.9), smol(3, 0.5, 0.3, 1.2), smol(4, 0.4, 0.3, 1.9)]
    assert [bench.reached(r) for r in rows] == [True, False, False, False]  # 2-hop EM, 2-hop searches, gain +0.10
    lines = bench.report(rows, ["smollm2_grpo"])
    assert "25%" in next(line for line in lines if line.startswith("smollm2_grpo"))
    assert any(
        "searches after by question type" in line and "toy_world_2hop 1.20 / 1.90 / 1.90" in line for line in lines
    )
    assert lines[-1].startswith("worst run of smollm2_grpo: EM gain +0.100 (seed 4, world 0; target >= +0.15)")
    assert bench.reached(_row("ppo", 1, 0, 0.0, 0.25)) and not bench.reached(_row("ppo", 1, 0, 0.0, 0.2))
