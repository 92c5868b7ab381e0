"""Logging setup for the command-line entry points (training, SFT, warm start, eval): one format, one level.

It imports nothing from the package, so any module can call it without creating an import cycle.

    from rsearch_verl.log_setup import setup_logging
    setup_logging()            # level from RSEARCH_LOG_LEVEL (default INFO), to stderr
"""

from __future__ import annotations

import logging
import os
import sys

QUIET = ("httpx", "httpcore", "urllib3", "filelock")  # per-request INFO lines that drown the run's own


def setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("RSEARCH_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
