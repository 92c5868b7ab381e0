"""Logging setup for the command-line entry points (training, SFT, warm start, eval): one format, one level.

It imports nothing from the package, so any module can call it without creating an import cycle.

    from rsearch_verl.log_setup import setup_logging
    setup_logging()            # level from RSEARCH_LOG_LEVEL (default INFO), to stderr
    quiet_expected_warnings(cpu=True)   # before Ray / verl print warnings that every CPU run would show
"""

from __future__ import annotations

import logging
import os
import sys

QUIET = ("httpx", "httpcore", "urllib3", "filelock")  # per-request INFO lines that drown the run's own
# Warnings every run prints that say nothing about it (logger -> message starts; see quiet_expected_warnings)
RAY_TOKEN_AUTH = ("ray._private.authentication.authentication_token_setup", ("Token authentication is enabled",))
VERL_NO_ACCELERATOR = (
    "verl.plugin.platform.platform_manager",
    ("No supported accelerator detected", "Platform 'nvidia' (PlatformCUDA) is registered but not available"),
)


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("RSEARCH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_expected_warnings(cpu: bool) -> None:
    """Drop two warnings that are expected, not news, at the loggers that emit them (the driver before ray.init, each
    worker before verl looks for an accelerator): Ray's "token authentication is enabled" for the local cluster a run
    starts (the secure default; its "disabled" warning stays), and, with `cpu` (trainer.device=cpu), verl's "no
    accelerator, falling back to 'nvidia'" pair (our CPU workers use no verl platform). Idempotent."""
    quiet = [RAY_TOKEN_AUTH, VERL_NO_ACCELERATOR] if cpu else [RAY_TOKEN_AUTH]
    for name, starts in quiet:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.starts == starts for f in log.filters):
            log.addFilter(_DropMessages(starts))
