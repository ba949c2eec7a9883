"""What the GPUs hold: NVML on a real machine, or a JSON file standing in for it (tests, other machines).

The stand-in file (FLEET_GPU_PROBE_FILE) is read again on every look, so a test can change it while the
supervisor waits:

    {"gpus": [{"name": "fake", "total_gib": 96, "processes": [{"pid": 4242, "used_gib": 30}]}]} (GiB)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pynvml

from server.capacity import GIB


class GpuProbeError(Exception):
    """The GPUs cannot be read (no driver, no GPU, a bad stand-in file)."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu: int
    # NVML cannot always tell (e.g. without the rights to see other users' processes).
    used_bytes: int | None

    def describe(self) -> str:
        used = "" if self.used_bytes is None else f", {self.used_bytes / GIB:.1f} GiB"
        return f"PID {self.pid} (GPU {self.gpu}{used})"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_bytes: int
    processes: tuple[GpuProcess, ...]


class GpuProbe(Protocol):
    def gpus(self) -> list[Gpu]: ...


class NvmlProbe:
    def gpus(self) -> list[Gpu]:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            raise GpuProbeError(f"NVML: {error}") from error
        try:
            return [self._gpu(index) for index in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as error:
            raise GpuProbeError(f"NVML: {error}") from error
        finally:
            pynvml.nvmlShutdown()

    @staticmethod
    def _gpu(index: int) -> Gpu:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        processes = tuple(
            GpuProcess(pid=process.pid, gpu=index, used_bytes=process.usedGpuMemory)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )
        name = pynvml.nvmlDeviceGetName(handle)
        return Gpu(
            index=index,
            name=name.decode() if isinstance(name, bytes) else name,
            total_bytes=pynvml.nvmlDeviceGetMemoryInfo(handle).total,
            processes=processes,
        )


class FileProbe:
    def __init__(self, path: Path) -> None:
        self.path = path

    def gpus(self) -> list[Gpu]:
        try:
            described = json.loads(self.path.read_text())["gpus"]
            return [
                Gpu(
                    index=index,
                    name=gpu.get("name", "stand-in"),
                    total_bytes=int(gpu["total_gib"] * GIB),
                    processes=tuple(
                        GpuProcess(pid=int(p["pid"]), gpu=index, used_bytes=int(p.get("used_gib", 0) * GIB))
                        for p in gpu.get("processes", [])
                    ),
                )
                for index, gpu in enumerate(described)
            ]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise GpuProbeError(f"GPU stand-in file {self.path}: {error!r}") from error


def gpu_probe(stand_in: Path | None) -> GpuProbe:
    return FileProbe(stand_in) if stand_in else NvmlProbe()


def holders(gpus: list[Gpu]) -> list[GpuProcess]:
    """Processes that hold GPU memory: a server cannot start cleanly beside them."""
    return [process for gpu in gpus for process in gpu.processes]


def wait_for_free_gpus(
    probe: GpuProbe, timeout: float, say: Callable[[str], None], interval: float = 1.0
) -> list[GpuProcess]:
    """Wait until no process holds GPU memory; return those still holding it at the deadline.

    After a crash the TP ranks can take a while to exit and release their memory, so look again until
    the deadline before giving up.
    """
    deadline = time.monotonic() + timeout
    reported = False
    while True:
        remaining = holders(probe.gpus())
        if not remaining or time.monotonic() >= deadline:
            return remaining
        if not reported:
            names = ", ".join(process.describe() for process in remaining)
            say(f"GPU memory still held by {names}; waiting up to {timeout:.0f} s")
            reported = True
        time.sleep(interval)
