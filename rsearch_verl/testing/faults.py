"""Fault injection for tests, installed from outside the product code: a NaN in the actor's loss at a chosen step
(the health watchdog must catch it and roll back, docs/health.md).

The main job runs as a subprocess, so the fault goes in through Ray's own extension points. Ray calls the function
that `RAY_RUNTIME_ENV_HOOK` names on the job's runtime env in the driver's `ray.init`: `runtime_env_hook` adds `install`
as the job's `worker_process_setup_hook`, which Ray runs in every worker process before an actor starts there. It
wraps `ActorWorker.update_actor`: the process's first update of step k (the driver's `meta_info["step"]`) multiplies the
policy loss by NaN; the redo of step k after the rollback trains normally.

    env = {**os.environ, **nan_loss_env(step=7)}
    subprocess.run([sys.executable, "-m", "rsearch_verl.main", ...], env=env)
"""

from __future__ import annotations

import contextlib
import functools
import os

from rsearch_verl import signals as sig

NAN_LOSS_STEP_ENV = "RSEARCH_FAULT_NAN_LOSS_STEP"


def nan_loss_env(step: int) -> dict[str, str]:
    """The env vars that make the main job's actor loss NaN in its first attempt at `step`."""
    if step < 1:
        raise ValueError(f"nan_loss_env: step {step} is not a training step (>= 1)")
    return {"RAY_RUNTIME_ENV_HOOK": f"{__name__}.runtime_env_hook", NAN_LOSS_STEP_ENV: str(step)}


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's RAY_RUNTIME_ENV_HOOK: the job's runtime env, plus `install` as the worker setup hook and the fault's step
    for the workers (on a cluster they do not inherit the driver's environment)."""
    env = dict(runtime_env or {})
    env["env_vars"] = {**env.get("env_vars", {}), NAN_LOSS_STEP_ENV: os.environ[NAN_LOSS_STEP_ENV]}
    env["worker_process_setup_hook"] = f"{__name__}.install"
    return env


def install() -> None:
    """Ray's worker_process_setup_hook: in this process, the actor's first update at step k has a NaN loss."""
    # heavy: the actor worker (torch, verl) only when a fault is installed
    from rsearch_verl.workers import actor

    step, fired = int(os.environ[NAN_LOSS_STEP_ENV]), []
    update = actor.ActorWorker.update_actor

    @functools.wraps(update)  # keeps verl's dispatch registration
    def update_actor(self, data):
        if data.meta_info.get("step") != step or fired:
            return update(self, data)
        fired.append(step)
        with _nan_policy_loss(actor):
            return update(self, data)

    actor.ActorWorker.update_actor = update_actor


@contextlib.contextmanager
def _nan_policy_loss(module):
    """`module.policy_loss` returns a NaN loss (and reports it) while the block runs."""
    loss_fn = module.policy_loss

    def nan_loss(**kwargs):
        loss, metrics = loss_fn(**kwargs)
        return loss * float("nan"), {**metrics, sig.PG_LOSS: float("nan")}

    module.policy_loss = nan_loss
    try:
        yield
    finally:
        module.policy_loss = loss_fn
