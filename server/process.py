"""Start a server in a process group of its own with its output logged, and stop the whole group.

SGLang runs one process per TP rank besides its HTTP server; killing only the process we started leaves
ranks that hold GPU memory. Everything the server starts stays in its group, so a signal to the group
reaches every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# How long the group gets to exit on SIGTERM before SIGKILL.
STOP_GRACE = 30.0
KILL_WAIT = 10.0


def start_logged(command: list[str], log: Path, banner: str) -> subprocess.Popen[bytes]:
    """Start `command` through server/logpipe.py, which leads the new process group and masks the API key.

    `banner` (the command, masked) goes in the log first, so that each start can be told apart there.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as errors:
        errors.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {banner}\n".encode())
        errors.flush()
        return subprocess.Popen(
            [sys.executable, "-m", "server.logpipe", str(log), "--", *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,
        )


def group_alive(process: subprocess.Popen[bytes]) -> bool:
    """Whether any process of the group is left; reaping the leader first so its zombie does not count."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(process: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """SIGTERM the group, SIGKILL what is left after `grace` seconds, and wait until it is gone."""
    for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while group_alive(process) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not group_alive(process):
            break
    process.poll()
