"""The warm start trains in a spawned child (rsearch_verl/toy/warm_start.py); a driver killed meanwhile takes the child
with it (PR_SET_PDEATHSIG), where an orphan used to keep both cores busy.

Run: .venv/bin/python -m pytest -q tests/toy/test_warm_start_child.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

DRIVER = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from rsearch_verl.toy.warm_start import _die_with_parent

    def work(path):
        open(path, "w").write(str(os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn, initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            pool.submit(work, sys.argv[1]).result()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split()[2] != "Z"


def test_a_killed_driver_takes_its_warm_start_child(tmp_path):
    script, marker = tmp_path / "driver.py", tmp_path / "child.pid"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not (marker.exists() and marker.read_text()):
            assert driver.poll() is None and time.monotonic() < deadline, "the child never started"
            time.sleep(0.2)
        child = int(marker.read_text())
        assert _alive(child)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), "the warm start's child outlived its killed driver"
    finally:
        driver.kill()
