"""The peak RSS of a child process, from the kernel's high-water mark of its own memory (VmHWM).

Not wait4's ru_maxrss: exec carries the forking process's high-water mark over to the child, so for a
child of a benchmark that holds a few hundred MB, ru_maxrss reports the benchmark's size, not the child's.
"""

from __future__ import annotations

import threading
from pathlib import Path


class PeakRss(threading.Thread):
    """Polls `pid`'s VmHWM until stopped; `stop()` returns the highest value seen, in MB."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_mb = 0.0
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.interval):
            self.peak_mb = max(self.peak_mb, _high_water_mb(self.pid))

    def stop(self) -> float:
        self._stopped.set()
        self.join()
        return self.peak_mb


def _high_water_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0.0
    # A process that has exited but is not yet reaped has no memory left, and no VmHWM line.
    kilobytes = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), "0")
    return int(kilobytes) / 1024
