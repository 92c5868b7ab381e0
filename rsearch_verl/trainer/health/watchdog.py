"""The health watchdog: after every training step, look for the signs of a run that is falling apart.

Signals (`SIGNALS`, thresholds in `trainer.watchdog`):
    nonfinite         NaN or inf in a loss or a gradient norm (actor/pg_loss, actor/kl_loss, actor/grad_norm,
                      critic/vf_loss, critic/grad_norm, actor/entropy)
    logprob_gap       rollout/logprob_abs_diff_mean above `max_logprob_gap`: rollout engine and actor disagree on the
                      tokens just sampled (a broken weight sync, numerics gone wrong)
    answer_collapse   rollout/finish_answer (the share of trajectories that end in a well-formed answer: the
                      format-valid rate) below `answer_collapse` x its baseline
    entropy_collapse  policy entropy below `entropy_collapse` x baseline while the mean reward is below its baseline
                      too (entropy that falls while the reward rises is a policy converging on right answers: a
                      pretrained LM warm-started on templated demonstrations goes from 0.06 to 0.001 nats a token
                      within a few steps as it learns to search); entropy_explode: above `entropy_explode` x it
                      and above `entropy_explode_min` nats a token (a converged policy's baseline is so small that
                      3x it is still a sharply peaked policy: SmolLM2 at 0.047 over a 0.01 baseline)
                      The entropy is actor/entropy when the actor computes it (actor.entropy_coeff != 0), else
                      rollout/entropy_mc (the mean -log p of the sampled tokens under the policy that sampled them)
    length_blowup     rollout/response_len_mean above `length_blowup` x baseline

The absolute signals (nonfinite, logprob_gap) trip from the first step. A baseline is the median over the last
`history` healthy steps, and relative signals wait for `min_history` of them (GRPO-style collapses build up over steps;
one noisy early step is no baseline). A tripped step never enters the baseline.

    dog = Watchdog(cfg.trainer.watchdog)
    trips = dog.check(step, metrics)      # {} or {"nonfinite": nan, ...}: signal -> the value that tripped
    dog.forget_after(restored_step)       # after a rollback: the redone steps are new history
"""

from __future__ import annotations

import math
import statistics

from rsearch_verl import signals as sig
from rsearch_verl.config import WatchdogConfig

SIGNALS = ("nonfinite", "logprob_gap", "answer_collapse", "entropy_collapse", "entropy_explode", "length_blowup")
MIN_ANSWER_BASELINE = 0.2  # below this share there is no format-valid rate to collapse from


def tracked_values(metrics: dict[str, float]) -> dict[str, float]:
    """The values the relative signals watch, from one step's metrics (missing ones are left out)."""
    entropy = metrics.get(sig.ACTOR_ENTROPY, metrics.get(sig.ENTROPY_MC))
    values = {
        "answer": metrics.get(sig.FINISH_ANSWER),
        "entropy": entropy,
        "length": metrics.get(sig.RESPONSE_LEN),
        "reward": metrics.get(sig.REWARD),
    }
    return {k: float(v) for k, v in values.items() if v is not None}


def _improving(values: dict[str, float], base: dict[str, float]) -> bool:
    """Whether the step's mean reward is at or above its baseline (False when either is unknown)."""
    return "reward" in values and "reward" in base and values["reward"] >= base["reward"]


class Watchdog:
    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.history: list[tuple[int, dict[str, float]]] = []  # (step, tracked values) of healthy steps

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The signals this step trips (signal -> value); a healthy step joins the baseline."""
        if not self.cfg.enable:
            return {}
        trips = self._absolute(metrics)
        values = tracked_values(metrics)
        trips.update(self._relative(values))
        if not trips:
            self.history.append((step, values))
            del self.history[: -self.cfg.history]
        return trips

    def forget_after(self, step: int) -> None:
        self.history = [(s, v) for s, v in self.history if s <= step]

    def _absolute(self, metrics: dict[str, float]) -> dict[str, float]:
        trips = {}
        bad = [float(metrics[k]) for k in sig.FINITE if k in metrics and not math.isfinite(float(metrics[k]))]
        if bad:
            trips["nonfinite"] = bad[0]
        gap = metrics.get(sig.LOGPROB_GAP)
        if gap is not None and not float(gap) <= self.cfg.max_logprob_gap:  # NaN trips too
            trips["logprob_gap"] = float(gap)
        return trips

    def _relative(self, values: dict[str, float]) -> dict[str, float]:
        if len(self.history) < self.cfg.min_history:
            return {}
        base = {}
        for key in values:
            past = [v[key] for _, v in self.history if key in v]
            if len(past) >= self.cfg.min_history:
                base[key] = statistics.median(past)
        cfg, trips = self.cfg, {}
        answer, entropy, length = values.get("answer"), values.get("entropy"), values.get("length")
        answer_base = base.get("answer", 0.0)
        if answer is not None and answer_base >= MIN_ANSWER_BASELINE and answer < cfg.answer_collapse * answer_base:
            trips["answer_collapse"] = answer
        if entropy is not None and base.get("entropy", 0.0) > 0:
            if entropy < cfg.entropy_collapse * base["entropy"] and not _improving(values, base):
                trips["entropy_collapse"] = entropy
            elif not entropy <= max(cfg.entropy_explode * base["entropy"], cfg.entropy_explode_min):
                trips["entropy_explode"] = entropy
        if length is not None and base.get("length", 0.0) > 0 and not length <= cfg.length_blowup * base["length"]:
            trips["length_blowup"] = length
        return trips
