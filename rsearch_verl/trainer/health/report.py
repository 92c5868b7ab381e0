"""The health record of a run: what went wrong and what the driver did about it, for `summary.json`.

It sums the health metrics of every executed step (circuit breaker trips and paused time, search errors, dropped
trajectories, skipped updates), and keeps the retriever outages the driver saw (each with its down time and restarts;
the summary's `retriever_down_s` / `retriever_restarts` are their sums), the watchdog's rollbacks and a stop, if any.
It is saved in every checkpoint (`trainer_state.json`), so a resumed run reports the whole run.

    health = RunHealth()
    health.add_step(metrics)                      # after every step (tripped ones too: what happened, happened)
    health.record_rollback(step=7, restored=6, trips={"nonfinite": nan}, lr_scale=0.5)
    summary["health"] = health.summary()          # {"status": "ok" | "degraded" | "stopped", "reasons": [...], ...}
    summary["search_cost"] = health.cost.summary()  # {"search_cost_s": ..., "search_calls": {"local": ...}, ...}

`search_cost` sums the search client's cost metrics (`search/cost_s`, `search/calls/<source>`, the same of `documents/`)
over every executed step and validation, like the health counters (a rolled-back step's searches were paid for too).

`status`: "ok" when nothing happened; "degraded" when the run completed but something did (each in `reasons`);
"stopped" when the run ended early on an outage, a dead worker or exhausted rollbacks (exit code 3).
"""

from __future__ import annotations

import math

from rsearch_verl import signals as sig

# step metric -> counter in the record
COUNTED = {
    sig.BREAKER_TRIPS: "breaker_trips",
    sig.BREAKER_WAIT_S: "breaker_wait_s",
    sig.SEARCH_ERRORS: "search_errors",
    sig.DROPPED: "dropped_trajectories",
    sig.UPDATE_SKIPPED: "skipped_updates",
    sig.STREAM_LOST: "lost_trajectories",
    sig.STREAM_DROPPED_STALE: "stale_trajectories",
    sig.STREAM_WORKERS_LOST: "rollout_workers_lost",
}


class SearchCost:
    """The run's search cost: seconds inside the search client's calls and calls per source, summed over the rows."""

    def __init__(self):
        self.seconds: dict[str, float] = dict.fromkeys(sig.COST_KINDS, 0.0)
        self.calls: dict[str, dict[str, float]] = {kind: {} for kind in sig.COST_KINDS}
        self.requests = 0.0  # HTTP requests that reached a source (replayed and cached calls make none)

    def add_step(self, metrics: dict[str, float]) -> None:
        for kind in sig.COST_KINDS:
            self.seconds[kind] += _finite(metrics.get(sig.cost_s(kind)))
            self.requests += _finite(metrics.get(sig.requests_of(kind)))
            prefix = sig.calls_of(kind)
            for key, value in metrics.items():
                if key.startswith(prefix):
                    source = key[len(prefix) :]
                    self.calls[kind][source] = self.calls[kind].get(source, 0.0) + _finite(value)

    def summary(self) -> dict:
        out: dict = {"search_cost_s": round(self.seconds["search"], 3)}
        out["search_calls"] = {s: int(round(n)) for s, n in sorted(self.calls["search"].items())}
        out["documents_cost_s"] = round(self.seconds["documents"], 3)
        out["documents_calls"] = {s: int(round(n)) for s, n in sorted(self.calls["documents"].items())}
        out["requests"] = int(round(self.requests))
        return out

    def state_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": {k: dict(v) for k, v in self.calls.items()},
                "requests": self.requests}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.seconds.update(state["seconds"])
        self.calls.update({k: dict(v) for k, v in state["calls"].items()})
        self.requests = float(state["requests"])


def _finite(value) -> float:
    return float(value) if value is not None and math.isfinite(float(value)) else 0.0


class RunHealth:
    def __init__(self):
        self.counts: dict[str, float] = dict.fromkeys(COUNTED.values(), 0.0)
        self.outages: list[dict] = []  # retriever outages seen by the driver: {"step", "down_s", "restarts", ...}
        self.rollbacks: list[dict] = []  # {"step", "restored_step", "trips", "lr_scale"}
        self.stop: dict | None = None  # {"step", "reason"} when this process stopped the run early
        self.interruptions: list[dict] = []  # earlier stops this run was resumed from (read from the checkpoint)
        self.lr_scale = 1.0  # product of the rollbacks' lr factors
        self.cost = SearchCost()  # not health, but summed over the same rows and saved with it

    def add_step(self, metrics: dict[str, float]) -> None:
        self.cost.add_step(metrics)
        for key, name in COUNTED.items():
            value = metrics.get(key)
            if value is not None and math.isfinite(float(value)):
                self.counts[name] += float(value)

    def add_outages(self, outages: list[dict], step: int) -> None:
        self.outages.extend({"step": step, **o} for o in outages)

    def record_rollback(self, step: int, restored: int, trips: dict[str, float], lr_scale: float) -> None:
        self.lr_scale = lr_scale
        trips = {k: (v if math.isfinite(v) else str(v)) for k, v in trips.items()}  # JSON has no NaN
        self.rollbacks.append({"step": step, "restored_step": restored, "trips": trips, "lr_scale": lr_scale})

    def record_stop(self, step: int, reason: str) -> None:
        self.stop = {"step": step, "reason": reason}

    def summary(self) -> dict:
        counts = {
            "retriever_restarts": sum(o.get("restarts", 0) for o in self.outages),
            "retriever_down_s": sum((o.get("down_s", 0.0) for o in self.outages), 0.0),
            **self.counts,
        }
        counts = {k: (round(v, 3) if k.endswith("_s") else int(v)) for k, v in counts.items()}
        reasons = self._reasons(counts)
        status = "stopped" if self.stop else ("degraded" if reasons else "ok")
        out = {"status": status, "reasons": reasons, **counts, "outages": self.outages, "rollbacks": self.rollbacks}
        out["lr_scale"] = self.lr_scale
        out["interruptions"] = self.interruptions
        if self.stop:
            out["stop"] = self.stop
        return out

    def _reasons(self, c: dict) -> list[str]:
        reasons = []
        if self.outages:
            reasons.append(
                f"retriever down {c['retriever_down_s']:.1f} s in {len(self.outages)} outage(s), "
                f"{c['retriever_restarts']} restart(s)"
            )
        if c["breaker_trips"]:
            reasons.append(f"search circuit breaker tripped {c['breaker_trips']} time(s)")
        if c["search_errors"]:
            reasons.append(f"{c['search_errors']} failed search(es)")
        if c["dropped_trajectories"]:
            reasons.append(f"{c['dropped_trajectories']} trajectory(ies) with failed searches dropped from the update")
        if c["rollout_workers_lost"]:
            reasons.append(f"{c['rollout_workers_lost']} rollout worker(s) died mid-stream; the run went on without")
        if c["lost_trajectories"]:
            reasons.append(f"{c['lost_trajectories']} trajectory(ies) in flight lost (dead worker or rollback), "
                           "their prompts generated again")  # fmt: skip
        if c["stale_trajectories"]:
            reasons.append(f"{c['stale_trajectories']} trajectory(ies) over the staleness bound, generated again")
        if c["skipped_updates"]:
            reasons.append(f"{c['skipped_updates']} update(s) skipped (every trajectory dropped)")
        for rb in self.rollbacks:
            reasons.append(
                f"watchdog tripped at step {rb['step']} ({', '.join(rb['trips'])}): rolled back to step "
                f"{rb['restored_step']}, lr x{rb['lr_scale']:g}"
            )
        for past in self.interruptions:
            reasons.append(f"resumed after a stop at step {past['step']}: {past['reason']}")
        if self.stop:
            reasons.append(f"stopped at step {self.stop['step']}: {self.stop['reason']}")
        return reasons

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "outages": list(self.outages), "rollbacks": list(self.rollbacks),
                "stop": self.stop, "interruptions": list(self.interruptions), "lr_scale": self.lr_scale,
                "cost": self.cost.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict | None) -> None:
        """Restore from a checkpoint (None: one written before health was recorded). A stop saved with it becomes an
        interruption: the run stopped there, then was resumed."""
        if not state:
            return
        self.counts.update(state["counts"])
        self.outages, self.rollbacks = list(state["outages"]), list(state["rollbacks"])
        self.lr_scale = float(state["lr_scale"])
        self.interruptions = list(state["interruptions"]) + ([state["stop"]] if state["stop"] else [])
        if "cost" in state:  # checkpoints written before the cost accounting have none
            self.cost.load_state_dict(state["cost"])
