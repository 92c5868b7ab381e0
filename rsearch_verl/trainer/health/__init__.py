"""Run health: the driver keeps a long run from degrading silently (docs/health.md).

    supervisor.py  the retrieval server is watched, restarted with backoff (own server) or waited for (retriever.url)
    watchdog.py    after every step: NaN / inf, log-prob gap, answer-rate collapse, entropy collapse or explosion,
                   response-length blow-up; a trip rolls back to the last complete checkpoint at a lower lr
    report.py      what happened, for summary.json (status ok | degraded | stopped, with reasons)
The circuit breaker that pauses searches while the retriever is down runs in the rollout processes:
rsearch_verl/search/breaker.py.

`RunStopped` is how the step loop ends a run it cannot continue safely; `python -m rsearch_verl.main` turns it into
exit code 3 with its message (which says what to do, usually: fix the cause, rerun with trainer.resume=auto).
"""

from __future__ import annotations

import os

STOP_EXIT_CODE = 3
FAULT_NAN_ENV = "RSEARCH_FAULT_NAN_LOSS_STEP"


class RunStopped(RuntimeError):
    """The run stopped early for a reason the message names (exit code 3)."""


def fault_nan_step() -> int | None:
    """Test-only fault injection: `RSEARCH_FAULT_NAN_LOSS_STEP=k` makes the actor's loss NaN in the first attempt at
    step k (the watchdog must catch it and roll back). Unset in every real run."""
    value = os.environ.get(FAULT_NAN_ENV)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{FAULT_NAN_ENV}={value!r}: expected a step number >= 1")
    return int(value)
