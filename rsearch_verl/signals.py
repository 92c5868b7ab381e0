"""The metric names run health reads: the watchdog's signals and the health record's counters, shared with the code
that writes them. A name read here and written nowhere would silently switch a safety signal off (`.get` returns
None), so tests run the writers and check that every name read here comes out (tests/trainer/test_health_signals.py:
the driver's and the rollout's; tests/workers/test_workers_fsdp.py: the workers' updates).

It sits on the bottom floor (imports nothing above it), so every writer uses these constants: the trainer, the
workers, the pure losses of rsearch_verl/algos, search/ and the agent loop; trainer/health/ reads them.

    from rsearch_verl import signals as sig
    metrics[sig.SEARCH_ERRORS] = float(n_errors)
"""

from __future__ import annotations

# ---- the actor's and critic's update metrics (workers/actor.py, workers/critic.py); the watchdog's `nonfinite`
PG_LOSS = "actor/pg_loss"
KL_LOSS = "actor/kl_loss"  # actor.use_kl_loss only
ACTOR_GRAD_NORM = "actor/grad_norm"
ACTOR_ENTROPY = "actor/entropy"  # actor.entropy_coeff != 0 only
VF_LOSS = "critic/vf_loss"  # critic only (PPO)
CRITIC_GRAD_NORM = "critic/grad_norm"
FINITE = (PG_LOSS, KL_LOSS, ACTOR_GRAD_NORM, ACTOR_ENTROPY, VF_LOSS, CRITIC_GRAD_NORM)

# ---- the driver's per-step rollout statistics and reward (trainer/phases.py)
REWARD = "reward/mean"  # the step's mean reward: a policy converging on right answers is not collapsing
LOGPROB_GAP = "rollout/logprob_abs_diff_mean"  # rollout engine vs actor on the tokens just sampled
FINISH_ANSWER = "rollout/finish_answer"  # the share of trajectories that end in a well-formed answer
ENTROPY_MC = "rollout/entropy_mc"  # -log p of the sampled tokens under the policy that sampled them
RESPONSE_LEN = "rollout/response_len_mean"
DROPPED = "rollout/dropped_trajectories"  # failed searches dropped from the update

# ---- the rollout's search counters (search/breaker.py, rollout/agent_loop.py)
BREAKER_TRIPS = "search/breaker_trips"
BREAKER_WAIT_S = "search/breaker_wait_s"
SEARCH_ERRORS = "search/errors"

# ---- the search client's cost (search/client.py), summed into summary.json's `search_cost` (trainer/health/report.py)
COST_KINDS = ("search", "documents")  # each kind's metric prefix: searches, and documents() (the open tool)


def cost_s(kind: str) -> str:
    """Seconds inside the client's calls of `kind` in the window (summed over concurrent calls)."""
    return f"{kind}/cost_s"


def calls_of(kind: str, source: str = "") -> str:
    """The client's calls of `kind` to `source` in the window (`source=""`: the prefix of them all)."""
    return f"{kind}/calls/{source}"


def requests_of(kind: str) -> str:
    """HTTP requests of `kind` that reached a source (replayed and cached calls make none)."""
    return f"{kind}/requests"


# ---- the streaming pipeline's (trainer/stream_pipeline.py, trainer.rollout_mode=streaming)
STREAM_LOST = "stream/lost_trajectories"  # in flight on a rollout worker that died, or cancelled by a rollback
STREAM_DROPPED_STALE = "stream/dropped_stale"  # finished over the staleness bound: generated again
STREAM_WORKERS_LOST = "stream/rollout_workers_lost"

# ---- the driver's own (trainer/loop.py, trainer/run_control.py; retriever/* from search/supervisor.py)
UPDATE_SKIPPED = "health/update_skipped"  # every trajectory was dropped: no update
ROLLBACKS = "health/rollbacks"
ROLLED_BACK_FROM = "health/rolled_back_from"
RETRIEVER_RESTARTS = "retriever/restarts"
RETRIEVER_DOWN_S = "retriever/down_s"
CARRIED_OVER_ROLLBACK = (RETRIEVER_RESTARTS, RETRIEVER_DOWN_S)  # a rolled-back step's counts, added to the next row


def trip(signal: str) -> str:
    """The metric that marks a watchdog trip of `signal` in the row after a rollback."""
    return f"health/trip_{signal}"
