"""Run health: the driver keeps a long run from degrading silently (docs/health.md).

    watchdog.py    after every step: NaN / inf, log-prob gap, answer-rate collapse, entropy collapse or explosion,
                   response-length blow-up; a trip rolls back to the last complete checkpoint at a lower lr
    report.py      what happened, for summary.json (status ok | degraded | stopped, with reasons)
    __init__.py    `RunStopped` and its exit code, `STOP_EXIT_CODE`

`RunStopped` is how the step loop ends a run it cannot continue safely; `python -m rsearch_verl.main` turns it into
exit code 3 with its message (which says what to do, usually: fix the cause, rerun with trainer.resume=auto).

Elsewhere: the metric names these read, shared with the code that writes them, are rsearch_verl/signals.py; the run
control that acts on them between steps (rollback, stop) is rsearch_verl/trainer/run_control.py; the retrieval
server's supervision (restarted with backoff, or waited for with retriever.url) is rsearch_verl/search/supervisor.py,
and the circuit breaker that pauses searches while it is down, in the rollout processes, rsearch_verl/search/breaker.py.
"""

from __future__ import annotations

STOP_EXIT_CODE = 3


class RunStopped(RuntimeError):
    """The run stopped early for a reason the message names (exit code 3)."""
