"""The secret environment variables a run forwards to its Ray workers, and nothing else about them.

Ray workers do not inherit the driver's environment on a cluster, so a token exported in the submitting shell never
reaches the rollout workers that search with it. The session (rsearch_verl/trainer/session.py) puts these variables
into the local Ray runtime env, placement code (rsearch_verl/workers/) adds them to a worker actor's env_vars, and
launch/submit.sh forwards them into the job's runtime env. The values are never logged nor written to config.yaml:
log the names (`secret_names`) only. It sits on the bottom floor (imports nothing above it), so the trainer and the
workers both read it without importing each other.

    from rsearch_verl.secrets import worker_secrets
    env_vars = {**other_vars, **worker_secrets(cfg)}   # {"RETRIEVER_TOKEN": "...", ...}: only those that are set

    # launch/submit.sh: the job's runtime env plus the secrets set in this shell, in a file only its owner can read
    python -m rsearch_verl.secrets launch/runtime_env.yaml OUT.yaml [MORE_VAR ...]
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

import yaml

logger = logging.getLogger(__name__)

# the retrieval server's bearer token, the Serper web-search key, the metrics logger's key
SECRET_ENV = ("RETRIEVER_TOKEN", "SERPER_API_KEY", "WANDB_API_KEY")
DEFAULT_JUDGE_ENV = "OPENAI_API_KEY"  # reward.judge.api_key_env's default (submit.sh cannot read the run's config)


def secret_names(cfg=None) -> tuple[str, ...]:
    """SECRET_ENV plus the judge's `reward.judge.api_key_env` variable when `cfg` (an RSearchConfig) names one."""
    names = list(SECRET_ENV)
    judge_env = cfg.reward.judge.api_key_env if cfg is not None else None
    if judge_env and judge_env not in names:
        names.append(judge_env)
    return tuple(names)


def worker_secrets(cfg=None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret env vars to forward to workers: those of `secret_names(cfg)` set (non-empty) in `environ`
    (default: this process's environment), with `cfg.retriever.token`, when set, as RETRIEVER_TOKEN."""
    environ = os.environ if environ is None else environ
    out = {name: environ[name] for name in secret_names(cfg) if environ.get(name)}
    if cfg is not None and cfg.retriever.token:  # retriever.token wins over the variable it defaults to
        out["RETRIEVER_TOKEN"] = cfg.retriever.token
    return out


def write_runtime_env(src: str, dst: str, extra: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> list:
    """Write the runtime env `src` plus the set secrets (SECRET_ENV, the judge's default, `extra`) to `dst`, readable
    by its owner only; return the names forwarded. A secret `src` already sets is left as it is."""

    environ = os.environ if environ is None else environ
    with open(src) as f:
        env = yaml.safe_load(f) or {}
    env_vars = dict(env.get("env_vars") or {})
    names = [*SECRET_ENV, DEFAULT_JUDGE_ENV, *extra]
    forwarded = [n for n in dict.fromkeys(names) if environ.get(n) and n not in env_vars]
    env_vars.update({n: environ[n] for n in forwarded})
    env["env_vars"] = env_vars
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(env, f, sort_keys=False)
    return forwarded


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        logger.error("usage: python -m rsearch_verl.secrets SRC.yaml DST.yaml [MORE_VAR ...]")
        return 2
    forwarded = write_runtime_env(argv[0], argv[1], argv[2:])
    # names only: the values stay out of every log
    logger.warning("runtime env %s: forwarding %s", argv[1], ", ".join(forwarded) or "no secrets")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main(sys.argv[1:]))
