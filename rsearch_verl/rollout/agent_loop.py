"""Search-aware multi-turn rollout: one asynchronous agent loop per trajectory, token-in / token-out.

Each trajectory runs on its own: generate until a protocol stop string or EOS, decode ONLY the new turn's tokens
to parse the action, run the search, append the observation's token ids with response_mask 0, continue — up to
`rollout.max_turns` turns and `rollout.max_response_length` response tokens (observations included). Trajectories
never wait for each other: while one searches, the engine batches the others' generation. The sampled token ids
are exactly the ones trained (nothing is re-tokenised), so a `<information>` block the policy forges itself is
sampled text with mask 1.

    traj = await run_trajectory(engine, tokenizer, protocol, search, prompt_ids, cfg, sampling)
    batch = generate_batch(engine, tokenizer, prompts, cfg, protocol=protocol)  # every rollout key of batch.py
    # `protocol`: the run's (rsearch_verl.rollout.protocols.protocol_for(cfg)), built once by the caller's process

`generate_batch` repeats each prompt `rollout.n` times (`val_n` / `val_temperature` when
`prompts.meta_info["validate"]`), seeds each trajectory from `meta_info["seed"]`, the prompt's uid and the row
index (a rerun reproduces), and searches through the process's one `SearchClient` for `cfg.retriever`
(rsearch_verl/search/process.py) behind its circuit breaker (`retriever.breaker`, rsearch_verl/search/breaker.py:
searches pause while the retriever is down) unless `search` is given; their metrics windows are reset per batch
(`search/*` in `meta_info["metrics"]`, next to `timing/rollout_s` and `timing/search_s`; the per-trajectory `rollout/*`
statistics are computed once by the driver from the batch: rsearch_verl/trainer/phases.py `rollout_metrics`).
A trajectory with a search that failed for an outage reason (timeout, connection, 5xx) is marked `search_failed`
(the trainer drops it from the update).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from verl import DataProto

from rsearch_verl.batch import sequence_keys
from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.engines.base import RolloutEngine, SamplingParams
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.client import SearchError
from rsearch_verl.search.process import process_breaker, process_search_client
from rsearch_verl.search.types import SearchFn

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "...[truncated]"


@dataclass
class Trajectory:
    response_ids: list[int] = field(default_factory=list)  # policy tokens and observation tokens, in order
    response_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = inserted observation
    logprobs: list[float] = field(default_factory=list)  # rollout log-prob per token (0.0 on observations)
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token (-1 on observations)
    segments: list[tuple[str, str]] = field(default_factory=list)  # ("policy" | "observation", text)
    n_searches: int = 0
    n_search_errors: int = 0  # searches that failed for good (after retries); each became an error observation
    n_search_outages: int = 0  # of those, failures of the backend (timeout, connection, 5xx): not the policy's doing
    n_turns: int = 0
    finish_reason: str = "max_turns"  # one of rsearch_verl.batch.FINISH_REASONS
    turn_timing: list[dict[str, float]] = field(default_factory=list)  # per turn {"gen_s", "search_s"}

    @property
    def response_text(self) -> str:
        return "".join(text for _, text in self.segments)

    def add(self, ids: list[int], mask: int, logprobs: list[float] | None, role: str, text: str,
            versions: list[int] | None = None) -> None:  # fmt: skip
        self.response_ids.extend(ids)
        self.response_mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [-1] * len(ids))
        self.segments.append((role, text))


class _CountingSearch:
    """Wraps a SearchFn to count failures and time calls (the protocol turns failures into observations)."""

    def __init__(self, search: SearchFn):
        self.search = search
        self.errors = 0
        self.outages = 0
        self.seconds = 0.0

    async def __call__(self, queries: list[str], topk: int, source: str = "local"):
        start = time.perf_counter()
        try:
            return await self.search(queries, topk, source)
        except SearchError as err:
            self.errors += 1
            self.outages += int(err.outage)
            raise
        finally:
            self.seconds += time.perf_counter() - start


def observation_ids(tokenizer, text: str, limit: int, close_tag: str) -> tuple[list[int], str]:
    """Token ids (and their text) of an observation, cut to `limit` tokens with a marker; the closing tag is kept
    so the policy still sees a well-formed block."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= limit:
        return ids, text
    cut = text.rfind(close_tag) if close_tag else -1
    tail_text = TRUNCATION_MARKER + (text[cut:] if cut >= 0 else "")
    tail = tokenizer.encode(tail_text, add_special_tokens=False)
    if len(tail) >= limit:  # a tiny limit: the marker alone
        tail = tail[:limit]
        return tail, tokenizer.decode(tail, skip_special_tokens=False)
    head = ids[: limit - len(tail)]
    return head + tail, tokenizer.decode(head + tail, skip_special_tokens=False)


def hidden_token_ids(tokenizer, protocol: SearchProtocol) -> frozenset[int]:
    """Special tokens left out of response text (EOS, pad, BOS, chat markers): all of the tokenizer's special ids
    except the protocol's own tags (R1-Searcher's `<|begin_of_query|>` is special yet is what the policy said)."""
    keep = set(tokenizer.convert_tokens_to_ids(list(protocol.special_tokens))) if protocol.special_tokens else set()
    return frozenset(int(i) for i in tokenizer.all_special_ids) - keep


def _decode_turn(tokenizer, token_ids: list[int], hidden: frozenset[int]) -> str:
    # EOS / pad are trained (mask 1) when sampled, but their text is not part of what the policy "said"
    return tokenizer.decode([t for t in token_ids if t not in hidden], skip_special_tokens=False)


def turn_until_stop(text: str, out) -> str:
    """The turn's text up to the end of the stop string that ended it. With a BPE vocabulary the token completing
    a stop string can carry more text (`>.` after `</search`, `>\n\n`): that text stays in the trajectory (it was
    sampled and is trained) but is not part of the action the parser reads."""
    if out.finish_reason != "stop" or not out.stop_string:
        return text
    at = text.rfind(out.stop_string)
    return text[: at + len(out.stop_string)] if at >= 0 else text


async def run_trajectory(
    engine: RolloutEngine,
    tokenizer,
    protocol: SearchProtocol,
    search: SearchFn,
    prompt_ids: list[int],
    cfg: RSearchConfig,
    sampling: SamplingParams,
) -> Trajectory:
    """One trajectory: turns of generation and search until an answer, EOS, max_turns or the token budget."""
    rc = cfg.rollout
    traj = Trajectory()
    counted = _CountingSearch(search)  # this trajectory's own failures (a shared counter also sees the others')
    hidden = hidden_token_ids(tokenizer, protocol)
    for turn in range(rc.max_turns):
        remaining = rc.max_response_length - len(traj.response_ids)
        if remaining <= 0:
            traj.finish_reason = "length"
            break
        seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + turn) % (2**63)
        params = dataclasses.replace(sampling, max_tokens=min(rc.max_tokens_per_turn, remaining), seed=seed)
        start = time.perf_counter()
        out = await engine.generate(prompt_ids + traj.response_ids, params, protocol.stop_strings)
        timing = {"gen_s": time.perf_counter() - start, "search_s": 0.0}
        traj.turn_timing.append(timing)
        traj.n_turns += 1
        text = _decode_turn(tokenizer, out.token_ids, hidden)
        versions = list(out.versions) or [engine.version] * len(out.token_ids)
        traj.add(list(out.token_ids), 1, list(out.logprobs), "policy", text, versions)
        action = protocol.parse_turn(turn_until_stop(text, out))
        if action.kind == "answer":
            traj.finish_reason = "answer"
            break
        if action.kind not in ("search", "invalid") or out.finish_reason != "stop":
            traj.finish_reason = {"eos": "eos", "length": "length"}.get(out.finish_reason, "stop")
            break
        if turn == rc.max_turns - 1:  # no turn left to read the results: do not search for nothing
            traj.finish_reason = "max_turns"
            break
        start = time.perf_counter()
        obs = await protocol.observe(action, counted, cfg.retriever.topk)
        timing["search_s"] = time.perf_counter() - start
        traj.n_searches += int(action.kind == "search")
        room = rc.max_response_length - len(traj.response_ids)
        obs_ids, obs_text = observation_ids(tokenizer, obs, min(rc.max_obs_length, room), protocol.observation_close)
        traj.add(obs_ids, 0, None, "observation", obs_text)
        if len(traj.response_ids) >= rc.max_response_length:
            traj.finish_reason = "length"
            break
    traj.n_search_errors, traj.n_search_outages = counted.errors, counted.outages
    return traj


def trajectory_seed(base_seed: int, uid: str, row: int) -> int:
    """A stable per-trajectory seed (crc32, not hash(): Python salts str hashes per process)."""
    return zlib.crc32(f"{base_seed}:{uid}:{row}".encode()) * 1_000 + row % 1_000


def _object_array(values: list) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: numpy would turn equal-length lists into a 2-D array
        arr[i] = v
    return arr


def _pad_tensors(prompts: list[list[int]], trajs: list[Trajectory], pad_id: int, pad_prompt_to: int | None,
                 pad_response_to: int | None) -> dict[str, torch.Tensor]:  # fmt: skip
    width_p = max([len(p) for p in prompts] + [pad_prompt_to or 0])
    width_r = max([len(t.response_ids) for t in trajs] + [pad_response_to or 0, 1])
    b = len(trajs)
    prompt_t = torch.full((b, width_p), pad_id, dtype=torch.long)
    prompt_m = torch.zeros((b, width_p), dtype=torch.long)
    resp_t = torch.full((b, width_r), pad_id, dtype=torch.long)
    resp_attn = torch.zeros((b, width_r), dtype=torch.long)
    resp_mask = torch.zeros((b, width_r), dtype=torch.long)
    logp = torch.zeros((b, width_r), dtype=torch.float32)
    versions = torch.full((b, width_r), -1, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompts, trajs, strict=True)):
        prompt_t[i, width_p - len(p) :] = torch.tensor(p, dtype=torch.long)
        prompt_m[i, width_p - len(p) :] = 1
        n = len(t.response_ids)
        if n:
            resp_t[i, :n] = torch.tensor(t.response_ids, dtype=torch.long)
            resp_attn[i, :n] = 1
            resp_mask[i, :n] = torch.tensor(t.response_mask, dtype=torch.long)
            logp[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32) * resp_mask[i, :n]
            versions[i, :n] = torch.tensor(t.versions, dtype=torch.long)
    attn = torch.cat([prompt_m, resp_attn], dim=1)
    return {**sequence_keys(prompt_t, resp_t, attn, resp_mask), "rollout_log_probs": logp, "rollout_versions": versions}


def search_metrics(search, counted: _CountingSearch, wall_s: float, breaker: CircuitBreaker | None = None):
    """What only the rollout measures: its wall time, time in search, the search client's and breaker's windows.
    (Per-trajectory statistics, `rollout/*`, come from the batch: rsearch_verl/trainer/phases.py `rollout_metrics`.)"""
    out = {"timing/rollout_s": wall_s, "timing/search_s": counted.seconds}
    if hasattr(search, "metrics"):
        out.update(search.metrics(reset=True))  # one window per batch (per training step)
    if breaker is not None:
        out.update(breaker.metrics(reset=True))
    out["search/errors"] = float(counted.errors)  # failures the trajectories saw (after the client's retries)
    return out


async def generate_batch_async(
    engine: RolloutEngine,
    tokenizer,
    prompts: DataProto,
    cfg: RSearchConfig,
    search: SearchFn | None = None,
    *,
    protocol: SearchProtocol,
    pad_prompt_to: int | None = None,
    pad_response_to: int | None = None,
) -> DataProto:
    """The async body of `generate_batch` (call it directly from code that already runs an event loop)."""
    rc = cfg.rollout
    validate = bool(prompts.meta_info.get("validate", False))
    n, temperature = (rc.val_n, rc.val_temperature) if validate else (rc.n, rc.temperature)
    batch = prompts.repeat(repeat_times=n, interleave=True)
    nt = batch.non_tensor_batch
    protocol.bind_tokenizer(tokenizer, chat=cfg.prompt_variant == "instruct")  # tool-call observation framing
    own_client = search is None
    breaker = None
    if own_client:
        search = process_search_client(cfg.retriever)
        breaker = process_breaker(cfg.retriever) if cfg.retriever.breaker.enable else None
    counted = _CountingSearch(breaker or search)
    base_seed = int(prompts.meta_info.get("seed", cfg.seed))
    sem = asyncio.Semaphore(max(1, rc.max_concurrent_trajectories))

    async def one(row: int) -> Trajectory:
        sampling = SamplingParams(temperature, rc.top_p, rc.top_k, rc.max_tokens_per_turn)
        sampling.seed = trajectory_seed(base_seed, str(nt["uid"][row]), row)
        async with sem:
            prompt_ids = list(nt["prompt_ids"][row])
            return await run_trajectory(engine, tokenizer, protocol, counted, prompt_ids, cfg, sampling)

    start = time.perf_counter()
    try:
        trajs = await asyncio.gather(*(one(i) for i in range(len(batch))))
    finally:
        if own_client:
            await search.aclose()
    metrics = search_metrics(search, counted, time.perf_counter() - start, breaker)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tensors = _pad_tensors([list(p) for p in nt["prompt_ids"]], trajs, pad_id, pad_prompt_to, pad_response_to)
    non_tensors = {key: nt[key] for key in nt}
    non_tensors.update(
        response_text=_object_array([t.response_text for t in trajs]),
        segments=_object_array([t.segments for t in trajs]),
        n_searches=_object_array([t.n_searches for t in trajs]),
        n_turns=_object_array([t.n_turns for t in trajs]),
        finish_reason=_object_array([t.finish_reason for t in trajs]),
        search_failed=_object_array([t.n_search_outages > 0 for t in trajs]),
        turn_timing=_object_array([t.turn_timing for t in trajs]),
    )
    meta = {**prompts.meta_info, "metrics": metrics}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def generate_batch(*args, **kwargs) -> DataProto:
    """Roll out every prompt (rollout.n samples each) and return the batch with all rollout keys of batch.py;
    the arguments are those of `generate_batch_async` (engine, tokenizer, prompts, cfg, search, protocol=...)."""
    coro = generate_batch_async(*args, **kwargs)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # called from inside a running loop (e.g. an async Ray actor): run on a private loop in a helper thread
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()
