"""Every feature on at once: context strategy {none, drop_observations, summary} x rollout mode {batch, streaming} x
generation workers {1, 2} x protocol {search_r1 tags, tool_call} x tools {search, search + open}, as real main jobs
(local Ray, FSDP over gloo, the recipe's BM25 server) whose policy always searches (the plug-in engine
`SearchingEngine`, rsearch_verl/testing/scripted_engines.py: a question's own number of searches, so contexts fold and
rows differ in width between workers and groups; with `open`, each search is followed by opening its first result's
document). Each cell trains 2 steps with a checkpoint after step 1, then resumes from it for step 2 again, and
checks:

  * it ran: folding cells folded (`rollout/folds_mean` > 0), `open` cells opened documents (`rollout/opens_mean` > 0);
    rows of different widths were joined;
  * masks: in every dumped row, mask-0 tokens are exactly the observation blocks (they decode to the protocol's
    observation tags, and no observation tag is in the policy's tokens): opened pages never enter the loss;
  * every drawn prompt trained exactly once, across the resume too: the trained uids equal the loader's uids before the
    final checkpoint's resume point plus the ones it records as trained after it, none twice.

CI runs a pairwise subset (every pair of values of any two factors appears in some cell: 6 cells); the whole matrix
(48 cells, about an hour on 2 cores) is `-m matrix`.

Run: .venv/bin/python -m pytest -q tests/e2e/test_e2e_matrix.py            (pairwise)
     .venv/bin/python -m pytest -q -m matrix tests/e2e/test_e2e_matrix.py   (all 48)
"""

from __future__ import annotations

import collections
import itertools
import json
import os

import pytest
from e2e_helpers import read_metrics, run_main

STRATEGIES = ("none", "drop_observations", "summary")
MODES = ("batch", "streaming")
WORKERS = (1, 2)
PROTOCOLS = ("search_r1", "tool_call")
TOOLS = ("search", "search+open")
# a pairwise covering array: each pair of values of any two factors appears in at least one cell
PAIRWISE = [
    ("none", "batch", 2, "search_r1", "search"),
    ("none", "streaming", 1, "tool_call", "search+open"),
    ("drop_observations", "batch", 1, "search_r1", "search+open"),
    ("drop_observations", "streaming", 2, "tool_call", "search"),
    ("summary", "batch", 2, "tool_call", "search+open"),
    ("summary", "streaming", 1, "search_r1", "search"),
]
CELLS = [
    pytest.param(*cell, marks=[] if cell in PAIRWISE else [pytest.mark.matrix])
    for cell in itertools.product(STRATEGIES, MODES, WORKERS, PROTOCOLS, TOOLS)
]
ENGINE = "rollout.engine=rsearch_verl.testing.scripted_engines:SearchingEngine"


# the prompt budget each protocol's prompts need (tool_call declares its tools in the prompt; open adds its
# instruction), and a context of the prompt plus room for a turn, its observation and a note after a fold
def _prompt(protocol: str, tools: str) -> list[str]:
    tool_call, opens = protocol == "tool_call", "open" in tools
    length = 192 + 128 * tool_call + 64 * opens + 256 * (tool_call and opens)  # both tools' schemas: 567 tokens
    return [f"data.max_prompt_length={length}", f"rollout.context.max_tokens={length + 200}"]


SIZES = ["rollout.max_response_length=192", "rollout.max_obs_length=48", "rollout.max_tokens_per_turn=40",
         "rollout.context.summary_max_tokens=16", "rollout.context.keep_recent_turns=1",
         "rollout.max_turns=8", "rollout.n=2", "retriever.topk=1", "trainer.test_freq=0",
         "trainer.val_before_train=false", "actor.loss_agg_mode=token-mean",
         "trainer.prefetch_log_probs=check"]  # fmt: skip


def _overrides(strategy: str, mode: str, workers: int, protocol: str, tools: str) -> list[str]:
    out = [ENGINE, *SIZES, *_prompt(protocol, tools), f"rollout.context.strategy={strategy}",
           f"trainer.n_workers={workers}", f"rollout.tools=[{tools.replace('+', ',')}]"]  # fmt: skip
    if mode == "streaming":
        out += [
            "trainer.placement=split",
            "trainer.max_staleness=1",
            "trainer.rollout_mode=streaming",
            f"trainer.ray_num_cpus={2 * workers}",
        ]  # a 1-CPU bundle per actor rank and per rollout worker
    return out


def _dump(run_dir, step: int) -> list[dict]:
    with open(os.path.join(run_dir, "rollouts", f"step_{step}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _drawn_before(loader: dict, batch_size: int, n_train: int) -> set[str]:
    per_epoch = (n_train // batch_size) * batch_size
    return {f"e{e}-p{p}" for e in range(loader["epoch"] + 1) for p in range(per_epoch)
            if (e, p) < (loader["epoch"], loader["pos"])}  # fmt: skip


def _check_masks(rows: list[dict], tokenizer, observation_open: str) -> None:
    for row in rows:
        ids, mask = row["response_ids"], row["response_mask"]
        assert len(ids) == len(mask) and set(mask) <= {0, 1}
        policy = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        runs = [list(g) for k, g in itertools.groupby(zip(ids, mask, strict=True), key=lambda x: x[1]) if k == 0]
        assert observation_open not in policy  # observations are never the policy's tokens
        for run in runs:  # each mask-0 run: an observation block, a dropped-observation marker or a note's opening
            text = tokenizer.decode([t for t, _ in run], skip_special_tokens=False)
            assert observation_open in text or "<note>" in text, text[:200]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("strategy", "mode", "workers", "protocol", "tools"), CELLS)
def test_composed_features_train_every_prompt_once(tmp_path, toy_cache, strategy, mode, workers, protocol, tools):
    from rsearch_verl.config import from_omegaconf
    from rsearch_verl.models import policy_tokenizer
    from rsearch_verl.rollout.protocols import protocol_for

    recipe = "search_r1_toolcall_grpo" if protocol == "tool_call" else "search_r1_grpo"
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    overrides = [*_overrides(strategy, mode, workers, protocol, tools), "trainer.total_steps=2", "trainer.save_freq=1"]
    run_main(recipe, first, toy_cache, *overrides, timeout=600)
    ckpt = first / "checkpoints" / "step_000001"
    run_main(recipe, resumed, toy_cache, *overrides, f"trainer.resume={ckpt}", timeout=600)
    metrics = [r for r in read_metrics(first) if "reward/mean" in r]
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(r["rollout/searches_mean"] > 0 for r in metrics)  # every trajectory searched (the scripted policy)
    if strategy != "none":
        assert max(r["rollout/folds_mean"] for r in metrics) > 0  # contexts folded: trajectories of several rows
    if tools == "search+open":  # documents were opened (their pages are observations: the mask check below)
        assert max(r["rollout/opens_mean"] for r in metrics) > 0
    if mode == "streaming":  # the log-probs prefetched while a step waited equal the step's own (prefetch=check)
        assert all(r["stream/prefetched_old_frac"] <= r["stream/prefetched_ref_frac"] for r in metrics)
        assert all(r["stream/lost_trajectories"] == 0 for r in metrics)
    import yaml

    with open(first / "config.yaml") as f:
        cfg = from_omegaconf(yaml.safe_load(f))
    tokenizer = policy_tokenizer(cfg)
    rows = {1: _dump(first, 1), 2: _dump(resumed, 2)}
    for step_rows in rows.values():
        _check_masks(step_rows, tokenizer, protocol_for(cfg).observation_open)
    assert len({len(r["response_ids"]) for rs in rows.values() for r in rs}) > 1  # rows of different widths
    trained = collections.Counter()
    for step_rows in rows.values():
        uids = {r["uid"].split("#")[0] for r in step_rows}
        assert len(uids) == cfg.data.train_batch_size  # whole groups of train_batch_size prompts
        trained.update(uids)
    assert max(trained.values()) == 1  # none twice, across the resume
    final = json.loads((resumed / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["loader"]
    expected = _drawn_before(final, cfg.data.train_batch_size, cfg.data.toy_world.n_train)
    assert set(trained) == expected | set(final.get("trained_uids", []))  # none skipped


def test_the_pairwise_cells_cover_every_pair_of_values():
    factors = (STRATEGIES, MODES, WORKERS, PROTOCOLS, TOOLS)
    pairs = itertools.combinations(range(len(factors)), 2)
    need = {(i, a, j, b) for i, j in pairs for a in factors[i] for b in factors[j]}
    got = {(i, c[i], j, c[j]) for c in PAIRWISE for i, j in itertools.combinations(range(len(factors)), 2)}
    assert need <= got, sorted(need - got)
