"""The toy world's warm start: an SFT curriculum that gives the tiny policy the skills RL needs, checked by probes.

RL can only reinforce what the policy already does now and then. On the toy world that is: search the fact a
question needs, read the retrieved passage and copy the answer out of it. The warm start teaches those skills on
practice sub-worlds (rsearch_verl/toy/demos.py: no fact to memorise) and leaves the *decision* to search weak,
so that the greedy warm start answers from "memory" and RL has something to learn. See docs/toy_world_learning.md
for why it is built this way and what was measured.

Phases (the `warm_start` config group, rsearch_verl/config/schema.py `WarmStartConfig`; e.g. warm_start.copy_epochs=30):
  1. copy: demonstrations that mostly search, until a probe shows the skill -- sampled at temperature 1 on questions
     of a practice world none of the demonstrations came from, the trajectories that search answer correctly at
     least `until_em` of the time. Copying the answer appears suddenly and after a number of epochs that depends on
     float summation order (machine, thread count), so the phase ends on the measured skill, not on a loss value or a
     fixed epoch count; if it never appears, the run stops with `WarmStartError` instead of starting RL from a policy
     that cannot learn.
  2. mix: the imperfect mix (`p_no_search` of the demonstrations answer at once from "memory"), which shifts the
     search / no-search prior so that the greedy warm start answers from memory.
The probes' numbers are logged and written next to the checkpoint (`warm_start.json`). The copy phase keeps its state
after every epoch in `<key>.partial/` (rsearch_verl/sft.py `EpochCheckpoint`): a build that is stopped (a session that
ends, a crash) resumes at its next epoch when the same warm start is asked for again.

    path = warm_start(cfg)  # cached under <toy world cache>/warm_start/<hash>; what model.sft_checkpoint=auto resolves
                            # to; built in a child process. Its seed is model.warm_start_seed, not the RL seed
    python -m rsearch_verl.toy.warm_start --out outputs/warm_start +recipe=search_r1_ppo   # the same, to a directory
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from rsearch_verl.batch import last_rows
from rsearch_verl.config import ModelConfig, RSearchConfig, WarmStartConfig, load_config
from rsearch_verl.data.dataset import PromptDataset, render_prompt
from rsearch_verl.log_setup import setup_logging
from rsearch_verl.rewards.qa import exact_match
from rsearch_verl.rollout.agent_loop import generate_batch
from rsearch_verl.rollout.context import FOLD_REVISION
from rsearch_verl.rollout.engines.hf import HFEngine
from rsearch_verl.rollout.protocols import SearchProtocol, protocol_for
from rsearch_verl.run_context import RunContext
from rsearch_verl.sft import EpochCheckpoint, load_policy, save_hf, train_sft
from rsearch_verl.toy.demos import NOTE_FORM, demonstrations, practice_search, practice_sides
from rsearch_verl.toy.fold_demos import fold_demos
from rsearch_verl.toy.world import build_toy_world, world_fields
from rsearch_verl.toy.world_data import toy_world_data
from rsearch_verl.workers.fsdp import cast_floating

logger = logging.getLogger(__name__)

PROBE_SEED = 7_919  # the practice world the probes ask about: no demonstration comes from it
REPORT_FILE = "warm_start.json"


@dataclasses.dataclass
class Skills:
    """What a probe measured: `search_rate` = share of trajectories with a search, `searched_em` = EM of those."""

    search_rate: float
    searched_em: float
    no_search_em: float
    temperature: float
    n: int  # trajectories
    answered: float = 0.0  # share of trajectories that gave an answer (a policy that keeps searching does not)
    searches_mean: float = 0.0
    searched_em_by_hops: dict[int, float] = dataclasses.field(default_factory=dict)  # EM of searching ones, per hops

    def as_dict(self) -> dict[str, float]:
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}
        out["searched_em_by_hops"] = {h: round(v, 4) for h, v in self.searched_em_by_hops.items()}
        return out


class SkillProbe:
    """Runs the policy through the real agent loop (HF engine, the protocol's own parser and observation format)
    on questions of a held-out practice world, searching its passages (toy_demos.practice_search). `protocol`: the
    run's (`protocol_for(cfg)` once per process)."""

    def __init__(self, cfg: RSearchConfig, model, tokenizer, n_questions: int, protocol: SearchProtocol, engine=None):
        side = practice_sides(build_toy_world(cfg.data.toy_world), 1, seed=PROBE_SEED)[0]
        rng = random.Random(PROBE_SEED)
        tw = cfg.data.toy_world  # the world's mix of hops (the default world: half 2-hop; the deep one: 70 % 4-6 hop)
        n_three = min(len(side.three_hop), int(n_questions * tw.three_hop_share))
        n_two = min(len(side.two_hop), int(n_questions * tw.two_hop_share))
        n_deep = min(len(side.deep), int(n_questions * tw.deep_share))
        questions = rng.sample(side.one_hop, n_questions - n_two - n_three - n_deep) + rng.sample(side.two_hop, n_two)
        questions += rng.sample(side.three_hop, n_three)
        if n_deep:
            questions += rng.sample(side.deep, n_deep)
        self.questions = questions
        self.protocol = protocol
        rows = [
            {
                "id": f"probe-{i}",
                "prompt": self.protocol.build_prompt(q["question"], cfg.prompt_variant),
                "question": q["question"],
                "golden_answers": q["golden_answers"],
                "data_source": f"toy_world_{q['hops']}hop",
            }
            for i, q in enumerate(questions)
        ]
        self.cfg, self.tokenizer, self.model = cfg, tokenizer, model
        self.data = PromptDataset(rows, tokenizer, cfg.data.max_prompt_length, name="probe", protocol=self.protocol)
        self.search = practice_search(side, random.Random(PROBE_SEED))
        # the engine generates as the run's rollouts will: in the compute dtype (model.dtype). In the training dtype it
        # shares the model being trained (each probe sees its current weights); in another one (bfloat16 on float32
        # masters) it holds a copy that each probe first loads the current weights into, as the RL weight sync does
        self.dtype = getattr(torch, cfg.model.dtype)
        self.copied = engine is None and next(model.parameters()).dtype != self.dtype
        if engine is None:
            engine = HFEngine(copy.deepcopy(model).to(self.dtype) if self.copied else model, tokenizer)
        self.engine, self.version = engine, 0

    def __call__(self, temperature: float) -> Skills:
        if self.copied:
            self.version += 1
            self.engine.load_weights(cast_floating(dict(self.model.state_dict()), self.dtype), version=self.version)
        rollout = dataclasses.replace(self.cfg.rollout, val_temperature=temperature, val_n=1)
        cfg = dataclasses.replace(self.cfg, rollout=rollout)
        prompts = self.data.to_batch(list(range(len(self.data))), uids=[f"probe-{i}" for i in range(len(self.data))])
        prompts.meta_info.update(validate=True, seed=PROBE_SEED)
        nt = generate_batch(
            self.engine, self.tokenizer, prompts, cfg, search=self.search, protocol=self.protocol
        ).non_tensor_batch
        last = last_rows(nt)  # one row per trajectory (a folded one has several)
        segments, golds = nt["segments"][last], nt["ground_truth"][last]
        answers = [self.protocol.extract_answer([tuple(s) for s in segs]) for segs in segments]
        em = np.array([exact_match(a or "", list(g)) for a, g in zip(answers, golds, strict=True)])
        searches = nt["n_searches"][last].astype(int)
        searched = searches > 0
        hops = np.array([self.questions[int(str(uid).rsplit("-", 1)[1])]["hops"] for uid in nt["uid"][last]])
        by_hops = {int(h): float(em[searched & (hops == h)].mean()) for h in np.unique(hops[searched])}
        return Skills(
            search_rate=float(searched.mean()),
            searched_em=float(em[searched].mean()) if searched.any() else 0.0,
            no_search_em=float(em[~searched].mean()) if (~searched).any() else 0.0,
            temperature=temperature,
            n=len(em),
            answered=float(np.mean([a is not None for a in answers])),
            searches_mean=float(searches.mean()),
            searched_em_by_hops=by_hops,
        )

    def close(self) -> None:
        self.engine.close()


class WarmStartError(RuntimeError):
    """The curriculum ended without the skill RL needs; RL from such a policy would not learn to search. `report`:
    the curriculum's losses and probes so far."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report or {}


def toy_demos(
    cfg: RSearchConfig, n: int, p_no_search: float, seed: int, tokenizer=None, protocol: SearchProtocol | None = None
) -> list[dict]:
    """`n` toy world demonstrations in the recipe's protocol, observations formatted as the rollouts' (top-k), and
    prompts as the rollouts see them: a chat model's (`cfg.prompt_variant == "instruct"`) rendered through its
    `tokenizer`'s chat template with the run's `protocol`'s tools; a base prompt as it is."""
    world = build_toy_world(cfg.data.toy_world)
    chat = cfg.prompt_variant == "instruct"
    demos = demonstrations(
        world, cfg.rollout.protocol, n, seed=seed, p_no_search=p_no_search, variant=cfg.prompt_variant,
        topk=cfg.retriever.topk, tokenizer=tokenizer if chat else None,
    )  # fmt: skip
    if chat:
        for demo in demos:
            demo["prompt"] = render_prompt(demo["prompt"], tokenizer, protocol.tools, protocol.chat_template_kwargs)
    return fold_demos(demos, cfg, tokenizer, protocol)  # long-horizon recipes: rows as the rollout folds them


def train_toy(
    model, tokenizer, cfg: RSearchConfig, protocol: SearchProtocol, opts: WarmStartConfig, seed: int,
    progress: str | None = None,
) -> dict:  # fmt: skip
    """Run both phases on `model` in place; returns the report (losses, every probe's skills, the copy epochs).
    `progress`: a directory where the copy phase keeps its state after every epoch (and resumes from it)."""
    report: dict = {"seed": seed, "loss": [], "probes": []}
    dtype = getattr(torch, cfg.model.dtype)  # the compute dtype: float32 masters, bfloat16 autocast where asked
    probe = SkillProbe(cfg, model, tokenizer, opts.probe_questions, protocol=protocol)

    def measured(phase: str, epoch: int, loss: float) -> dict:
        row = {"phase": phase, "epoch": epoch, "loss": round(loss, 4), **probe(1.0).as_dict()}
        report["probes"].append(row)
        logger.info("warm start %s epoch %d: loss %.4f, probe at T=1 %s", phase, epoch, loss, row)
        return row

    def skilled(row: dict, least_em: float) -> bool:
        return row["searched_em"] >= least_em and row["search_rate"] * row["n"] >= opts.min_searched

    try:
        demos = toy_demos(cfg, opts.n_demos, opts.copy_p_no_search, seed + 1, tokenizer, protocol)
        phase = dataclasses.replace(opts.sft, epochs=opts.copy_epochs, lr=opts.copy_lr, seed=seed, schedule="constant")
        copied = lambda epoch, loss: skilled(measured("copy", epoch, loss), opts.until_em)  # noqa: E731
        keep = None
        if progress is not None:  # the probes so far are part of the state: a resumed report misses none
            keep = EpochCheckpoint(os.path.join(progress, "copy.pt"), lambda: {"probes": list(report["probes"])},
                                   lambda extra: report["probes"].extend(extra["probes"]))  # fmt: skip
        report["loss"] = train_sft(model, tokenizer, demos, phase, until=copied, dtype=dtype, checkpoint=keep)
        report["epochs"] = len(report["loss"])
        if not skilled(report["probes"][-1], opts.until_em):
            raise WarmStartError(
                f"warm start: after {opts.copy_epochs} epochs the policy still does not copy answers out of what it "
                f"retrieved (probe: {report['probes'][-1]}; wanted searched_em >= {opts.until_em} over >= "
                f"{opts.min_searched} searching trajectories); RL from it would not learn. Try another "
                "model.warm_start_seed.",
                report,
            )
        demos = toy_demos(cfg, opts.n_demos, opts.p_no_search, seed, tokenizer, protocol)
        mix = dataclasses.replace(opts.sft, epochs=opts.mix_epochs, lr=opts.mix_lr, seed=seed)
        report["loss"] += train_sft(model, tokenizer, demos, mix, dtype=dtype)
        last = measured("mix", opts.mix_epochs, report["loss"][-1])
        if last["searched_em"] < opts.mix_keeps_em:
            message = f"warm start: the mix phase undid the copying (probe: {last}); RL would not learn"
            raise WarmStartError(message, report)
        report["greedy"] = probe(0.0).as_dict()
        logger.info("warm start greedy probe: %s", report["greedy"])
    finally:
        probe.close()
    return report


def warm_start(cfg: RSearchConfig) -> str:
    """The toy world's warm start for `cfg` (built once, then reused from the cache); returns its HF directory.

    Cached under `cache_key(cfg)`; a build from an empty cache takes minutes on CPU and logs each epoch. It runs in a
    child process (`build`): training SmolLM2-135M peaks at ~10 GB, and a process that did it keeps most of that
    (measured: a driver that built it in-process held 9.8 GB to the end of its run, next to the workers)."""
    opts = cfg.warm_start
    out = warm_start_dir(cfg)
    if os.path.isfile(os.path.join(out, "config.json")):
        logger.info("warm start: cached at %s", out)
        return out
    logger.info(
        "warm start: building %s (SFT on %d toy demonstrations per epoch, up to %d copy + %d mix epochs, each "
        "followed by a %d-question probe; ~10 min on 2 CPU cores, once per world and model: later runs reuse it)",
        out,
        opts.n_demos,
        opts.copy_epochs,
        opts.mix_epochs,
        opts.probe_questions,
    )
    spawn = multiprocessing.get_context("spawn")
    child = {"initializer": _die_with_parent, "initargs": (os.getpid(),)}  # ends with this process
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn, **child) as pool:
        report = pool.submit(build, cfg, out).result()  # WarmStartError and others re-raised here
    logger.info("warm start trained (loss %s) -> %s", [round(x, 3) for x in report["loss"]], out)
    return out


def warm_start_dir(cfg: RSearchConfig) -> str:
    """Where the warm start for `cfg` is (or will be) cached: <toy world cache>/warm_start/<cache_key(cfg)>."""
    return os.path.join(os.path.expanduser(cfg.data.toy_world.cache_dir), "warm_start", cache_key(cfg))


def _die_with_parent(parent: int) -> None:
    """The child is ended with its driver (Linux PR_SET_PDEATHSIG): a killed driver leaves no warm start training on
    behind it (seen: an orphaned child kept both cores busy after its driver was stopped). A driver that died before
    the child got here has already handed it to another parent: the child exits. Elsewhere: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def build(cfg: RSearchConfig, out: str) -> dict:
    """Train the warm start for `cfg` and save it to `out` (with its report); the child process's work."""

    setup_logging()  # a spawned process starts without the parent's logging
    seed = cfg.model.warm_start_seed
    model, tokenizer = load_policy(cfg, seed=seed)
    # the probes roll out with the run's protocol, rebuilt here from the same config (one per process)
    progress = out.rstrip("/") + ".partial"  # the copy phase's state after each epoch: a stopped build resumes there
    try:
        report = train_toy(model, tokenizer, cfg, protocol_for(cfg), cfg.warm_start, seed, progress=progress)
    except WarmStartError as err:  # kept for inspection (never reused: the cache looks for `out` only)
        failed = out.rstrip("/") + ".failed"
        save_hf(model, tokenizer, failed, extra_files={REPORT_FILE: json.dumps(err.report, indent=1)})
        shutil.rmtree(progress, ignore_errors=True)
        logger.error("warm start: the policy it ended with and its probes are kept at %s", failed)
        raise
    save_hf(model, tokenizer, out, extra_files={REPORT_FILE: json.dumps(report, indent=1)})
    shutil.rmtree(progress, ignore_errors=True)
    return report


# Model fields the warm start does not read: load_policy drops sft_checkpoint (it is what this resolves), the SFT trains
# the full model without adapters (LoRA wraps the actor and critic only, in the workers) and with the model's default
# attention. They are put at their defaults in the key, so turning LoRA on reuses the cached warm start (the same
# bytes) and keys of runs that never set them stay what they were.
NOT_IN_KEY = ("lora_rank", "lora_alpha", "lora_target_modules", "attn_implementation")


# Model fields added after warm starts were first cached: in the key only when set, so the warm starts of runs that
# never set them keep their keys (and their caches)
KEYED_WHEN_SET = ("family", "thinking")


# warm_start.sft fields each phase sets itself (train_toy: copy_* / mix_* and model.warm_start_seed): never read as
# given, so they stay out of the key
SFT_OVERWRITTEN = ("epochs", "lr", "seed", "schedule")


def cache_key(cfg: RSearchConfig) -> str:
    """The warm start's cache key: everything that shapes it -- the model and tokenizer (minus NOT_IN_KEY), the
    protocol, the world (not where its cache lies), the retriever's top-k, the options (the `warm_start` group, minus
    SFT_OVERWRITTEN), model.warm_start_seed and, when the recipe folds, how it folds (rollout.context, the turn,
    observation and row budgets, the fold's FOLD_REVISION and the summary notes' NOTE_FORM) -- and not the RL seed: RL
    seeds share one warm start."""
    defaults = ModelConfig()
    model = dataclasses.replace(cfg.model, **{name: getattr(defaults, name) for name in NOT_IN_KEY})
    model_fields = {k: v for k, v in dataclasses.asdict(model).items()
                    if not (k in KEYED_WHEN_SET and v == getattr(defaults, k))}  # fmt: skip
    options = dataclasses.asdict(cfg.warm_start)
    options["sft"] = {k: v for k, v in options["sft"].items() if k not in SFT_OVERWRITTEN}
    key = [model_fields, cfg.rollout.protocol, world_fields(cfg.data.toy_world)]
    key += [cfg.retriever.topk, options]
    if cfg.rollout.context.strategy != "none":  # folded demonstrations (fold_demos): the rows depend on how it folds
        rc = cfg.rollout
        key += [dataclasses.asdict(rc.context), rc.max_tokens_per_turn, rc.max_obs_length, rc.max_response_length]
        key.append(FOLD_REVISION)
        if cfg.rollout.context.strategy == "summary":  # the demonstrations' notes (demos.py hop_notes)
            key.append(NOTE_FORM)
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]


def read_report(checkpoint: str) -> dict | None:
    """The curriculum's report saved with a warm start (None for other checkpoints)."""
    path = os.path.join(checkpoint, REPORT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> str:
    """`python -m rsearch_verl.toy.warm_start --out DIR [hydra overrides]`: build the warm start and copy it to DIR."""

    parser = argparse.ArgumentParser(prog="python -m rsearch_verl.toy.warm_start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to copy the warm start (an HF model directory)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(overrides)
    protocol = protocol_for(cfg)
    if cfg.model.path == "tiny":  # the toy world's own tokenizer, as in training (unless the recipe names one)
        cfg = RunContext(tokenizer_path=toy_world_data(cfg, protocol).tokenizer_path).apply(cfg)
    shutil.copytree(warm_start(cfg), args.out, dirs_exist_ok=True)
    return args.out


if __name__ == "__main__":
    from rsearch_verl.log_setup import setup_logging

    setup_logging()
    main()
