"""Processes a test started: wait for one to answer HTTP, find one below another by its command line."""

from __future__ import annotations

import subprocess
import time

import httpx
import psutil


def wait_http_ok(url: str, timeout_s: float, interval_s: float = 0.5, proc: subprocess.Popen | None = None) -> bool:
    """Poll GET `url` until it answers 200 (True), `timeout_s` passes or `proc` exits (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


def descendants(pid: int, marker: str) -> list[psutil.Process]:
    """The processes below `pid` whose command line contains `marker` (never someone else's)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found
