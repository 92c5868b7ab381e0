"""Search-aware multi-turn rollout: one asynchronous agent loop per trajectory, token-in / token-out.

Each trajectory runs on its own: generate until a protocol stop string or EOS, decode ONLY the new turn's tokens
to parse the action, run the search (or another tool of `rollout.tools`: rsearch_verl/rollout/tools/), append the
observation's token ids with response_mask 0, continue — up to `rollout.max_turns` turns and
`rollout.max_response_length` response tokens (observations included). Trajectories
never wait for each other: while one searches, the engine batches the others' generation. The sampled token ids
are exactly the ones trained (nothing is re-tokenised), so a `<information>` block the policy forges itself is
sampled text with mask 1. Where the engine is called and returns, and where an observation's ids are made, the
trajectory's `record` takes its own copy (rsearch_verl/rollout/round_trip.py: what the round-trip check compares the
batch tensors with).

    traj = await run_trajectory(engine, tokenizer, protocol, search, prompt_ids, cfg, sampling)
    batch = generate_batch(engine, tokenizer, prompts, cfg, protocol=protocol)  # every rollout key of batch.py
    # `protocol`: the run's (rsearch_verl.rollout.protocols.protocol_for(cfg)), built once by the caller's process

`generate_batch` repeats each prompt `rollout.n` times (`val_n` / `val_temperature` when
`prompts.meta_info["validate"]`), seeds each trajectory from `meta_info["seed"]`, the prompt's uid and the row
index (a rerun reproduces), and searches through the process's one `SearchClient` for `cfg.retriever`
(rsearch_verl/search/process.py) behind its circuit breaker (`retriever.breaker`, rsearch_verl/search/breaker.py:
searches pause while the retriever is down) unless `search` is given; their metrics windows are reset per batch
(`search/*` in `meta_info["metrics"]`, next to `timing/rollout_s` and `timing/search_s`; the per-trajectory `rollout/*`
statistics are computed once by the driver from the batch: rsearch_verl/trainer/phases.py `rollout_metrics`). On a
sample of each batch the token-in / token-out round trip is checked on the batch `trajectories_batch` built
(`rollout.round_trip_check`: the trained ids are the recorded sampled ones, the observations what the chat template
renders; rsearch_verl/rollout/round_trip.py): a mismatch raises; the checked rows carry their record to the driver,
which checks them again before the update.
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

from verl import DataProto

from rsearch_verl import signals as sig
from rsearch_verl.config import RSearchConfig
from rsearch_verl.config.context import context_budget
from rsearch_verl.rollout.context import ContextWindow, Turn
from rsearch_verl.rollout.engines.base import RolloutEngine, SamplingParams
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.rollout.round_trip import check_round_trip, round_trip_enabled
from rsearch_verl.rollout.trajectory import Trajectory, rows_to_batch
from rsearch_verl.search.breaker import CircuitBreaker
from rsearch_verl.search.client import SearchError
from rsearch_verl.search.process import process_breaker, process_search_client
from rsearch_verl.search.types import SearchFn

logger = logging.getLogger(__name__)

TRUNCATION_MARKER = "...[truncated]"


class CountingSearch:
    """Wraps a SearchFn to count failures and time calls (the protocol turns failures into observations); its
    `documents` (the `open` tool's whole-document pages, rsearch_verl/rollout/tools/open.py) go to the wrapped
    function's `documents`, counted the same way, and count the pages read."""

    def __init__(self, search: SearchFn):
        self.search = search
        self.errors = 0
        self.outages = 0
        self.seconds = 0.0
        self.pages = 0  # document pages `documents` returned

    async def __call__(self, queries: list[str], topk: int, source: str = "local"):
        return await self._counted(self.search(queries, topk, source))

    async def documents(self, ids: list[str], page: int = 0, source: str = "local"):
        """Page `page` (0-based) of each document (SearchClient.documents, behind the circuit breaker when there is
        one); SearchError("config") when the wrapped search serves no documents (a plain SearchFn)."""
        fn = getattr(self.search, "documents", None)
        if fn is None:
            self.errors += 1
            raise SearchError("config", "this search backend serves no documents")
        pages = await self._counted(fn(ids, page, source))
        self.pages += len(pages)
        return pages

    async def _counted(self, call):
        start = time.perf_counter()
        try:
            return await call
        except SearchError as err:
            self.errors += 1
            self.outages += int(err.outage)
            raise
        finally:
            self.seconds += time.perf_counter() - start

    def reset(self) -> None:
        """A new window (the trajectory stream's, one per training step)."""
        self.errors, self.outages, self.seconds, self.pages = 0, 0, 0.0, 0


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
    window: ContextWindow | None = None,
) -> Trajectory:
    """One trajectory: turns of generation and search until an answer, EOS, max_turns or the token budget; its
    context kept within budget by `window` (rollout.context; built from `cfg` when not given)."""
    rc = cfg.rollout
    window = window or ContextWindow(cfg, tokenizer, protocol, context_budget(cfg))
    traj = Trajectory(list(prompt_ids))
    counted = CountingSearch(search)  # this trajectory's own failures (a shared counter also sees the others')
    hidden = hidden_token_ids(tokenizer, protocol)
    for turn in range(rc.max_turns):
        seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + turn) % (2**63)
        turn_sampling = dataclasses.replace(sampling, seed=seed)
        if window.must_fold(traj) and not await window.fold(traj, engine, turn_sampling):
            traj.finish_reason = "context"
            break
        room, by_context = window.turn_room(traj), window.context_binds(traj)
        if room <= 0:
            traj.finish_reason = "context" if by_context else "length"
            break
        out = await _generate_turn(engine, traj, turn_sampling, room, protocol.stop_strings)
        traj.n_turns += 1
        text = _decode_turn(tokenizer, out.token_ids, hidden)
        versions = list(out.versions) or [engine.version] * len(out.token_ids)
        traj.add(list(out.token_ids), 1, list(out.logprobs), "policy", text, versions)
        traj.turns.append(Turn(list(out.token_ids)))
        action = protocol.parse_turn(turn_until_stop(text, out))
        if action.kind == "answer":
            traj.finish_reason = "answer"
            break
        ends_call = out.finish_reason == "stop" or (out.finish_reason == "eos" and protocol.eos_ends_call)
        if action.kind not in ("search", "tool", "invalid") or not ends_call:
            traj.finish_reason = _engine_finish(out, by_context)
            break
        if turn == rc.max_turns - 1:  # no turn left to read the results: do not search for nothing
            traj.finish_reason = "max_turns"
            break
        start = time.perf_counter()
        obs = await protocol.observe(action, counted, cfg.retriever.topk)
        traj.turn_timing[-1]["search_s"] = time.perf_counter() - start
        traj.n_searches += int(action.kind == "search")
        traj.n_opens += int(action.kind == "tool" and action.tool == "open")
        obs_room = window.obs_room(traj)
        obs_ids, obs_text = observation_ids(
            tokenizer, obs, min(rc.max_obs_length, obs_room), protocol.observation_close
        )
        traj.record.inserted(traj.row_index, obs_ids)  # the environment's ids, as made (rollout/round_trip.py)
        traj.add(obs_ids, 0, None, "observation", obs_text)
        traj.turns[-1].obs_ids, traj.turns[-1].obs_cut = list(obs_ids), obs_text != obs
        if window.strategy == "none" and len(traj.row.response_ids) >= rc.max_response_length:
            traj.finish_reason = "length"
            break
    traj.n_search_errors, traj.n_search_outages = counted.errors, counted.outages
    traj.n_pages_read = counted.pages
    return traj


async def _generate_turn(engine: RolloutEngine, traj: Trajectory, sampling: SamplingParams, room: int, stop):
    start = time.perf_counter()
    context = traj.row.context_ids
    traj.record.context(traj.row_index, context)  # the engine boundary, both ways (rollout/round_trip.py): what it
    out = await engine.generate(context, dataclasses.replace(sampling, max_tokens=room), stop)
    traj.record.sampled(traj.row_index, out.token_ids)  # was handed, and a copy of what it returned, before any use
    traj.turn_timing.append({"gen_s": time.perf_counter() - start, "search_s": 0.0})
    traj.count_generation(traj.row.context_len, len(out.token_ids))
    return out


def _engine_finish(out, by_context: bool) -> str:
    """Why a turn that neither answered nor searched ended the trajectory: EOS, the turn's or row's length, or the
    context budget (`by_context`: the turn was cut below its own budget by the context's)."""
    if out.finish_reason == "length" and by_context:
        return "context"
    return {"eos": "eos", "length": "length"}.get(out.finish_reason, "stop")


def trajectory_seed(base_seed: int, uid: str, row: int) -> int:
    """A stable per-trajectory seed (crc32, not hash(): Python salts str hashes per process)."""
    return zlib.crc32(f"{base_seed}:{uid}:{row}".encode()) * 1_000 + row % 1_000


def search_metrics(search, counted: CountingSearch, wall_s: float, breaker: CircuitBreaker | None = None):
    """What only the rollout measures: its wall time, time in search, the search client's and breaker's windows.
    (Per-trajectory statistics, `rollout/*`, come from the batch: rsearch_verl/trainer/phases.py `rollout_metrics`.)"""
    out = {"timing/rollout_s": wall_s, "timing/search_s": counted.seconds}
    if hasattr(search, "metrics"):
        out.update(search.metrics(reset=True))  # one window per batch (per training step)
    if breaker is not None:
        out.update(breaker.metrics(reset=True))
    out[sig.SEARCH_ERRORS] = float(counted.errors)  # failures the trajectories saw (after the client's retries)
    return out


async def generate_batch_async(
    engine: RolloutEngine,
    tokenizer,
    prompts: DataProto,
    cfg: RSearchConfig,
    search: SearchFn | None = None,
    *,
    protocol: SearchProtocol,
) -> DataProto:
    """The async body of `generate_batch` (call it directly from code that already runs an event loop)."""
    rc = cfg.rollout
    validate = bool(prompts.meta_info.get("validate", False))
    batch = prompts.repeat(repeat_times=rc.val_n if validate else rc.n, interleave=True)
    nt = batch.non_tensor_batch
    protocol.bind_tokenizer(tokenizer, chat=cfg.prompt_variant == "instruct")  # tool-call observation framing
    own_client = search is None
    breaker = None
    if own_client:
        search = process_search_client(cfg.retriever)
        breaker = process_breaker(cfg.retriever) if cfg.retriever.breaker.enable else None
    counted = CountingSearch(breaker or search)
    window = ContextWindow(cfg, tokenizer, protocol, context_budget(cfg))
    base_seed = int(prompts.meta_info.get("seed", cfg.seed))
    sem = asyncio.Semaphore(max(1, rc.max_concurrent_trajectories))

    async def one(row: int) -> Trajectory:
        sampling = trajectory_sampling(cfg, validate, trajectory_seed(base_seed, str(nt["uid"][row]), row))
        async with sem:
            prompt_ids = list(nt["prompt_ids"][row])
            return await run_trajectory(engine, tokenizer, protocol, counted, prompt_ids, cfg, sampling, window)

    start = time.perf_counter()
    try:
        trajs = await asyncio.gather(*(one(i) for i in range(len(batch))))
    finally:
        if own_client:
            await search.aclose()
    metrics = search_metrics(search, counted, time.perf_counter() - start, breaker)
    out = trajectories_batch(trajs, batch, tokenizer, {**prompts.meta_info, "metrics": metrics})
    if round_trip_enabled(cfg):  # the trained ids are the sampled ones, observations the template's (raises if not)
        metrics.update(check_round_trip(trajs, out, tokenizer, protocol, rc.round_trip_sample))
    return out


def trajectory_sampling(cfg: RSearchConfig, validate: bool, seed: int) -> SamplingParams:
    """One trajectory's sampling parameters: training's temperature, or validation's (`rollout.val_temperature`)."""
    rc = cfg.rollout
    temperature = rc.val_temperature if validate else rc.temperature
    return SamplingParams(temperature, rc.top_p, rc.top_k, rc.max_tokens_per_turn, seed=seed)


def trajectories_batch(trajs: list[Trajectory], prompts: DataProto, tokenizer, meta: dict) -> DataProto:
    """The batch of finished trajectories (one per row of `prompts`, whose non-tensors they carry): one row per
    segment, a trajectory whose context folded is several rows (rollout/context.py), every rollout key of batch.py;
    padded to its own widest row (batches of different widths are joined by `rsearch_verl.batch.join_rows`)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    nt = prompts.non_tensor_batch
    tensors, non_tensors = rows_to_batch(trajs, {key: nt[key] for key in nt}, pad_id)
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
