"""Keep the SGLang server up: restart it when it exits or stops answering, safely and with backoff.

Each (re)launch waits until no process holds GPU memory (a crashed server's ranks can linger), runs the
plan, and starts the server in its own process group. The server is restarted when it exits, or when
/health_generate has failed for FLEET_UNHEALTHY_AFTER seconds; the whole group (every TP rank) is killed
first. After an out-of-memory crash mem_fraction_static drops by FLEET_OOM_STEP, down to
FLEET_MEM_FRACTION_FLOOR. Decode statistics from the log go to Redis (server/metrics.py).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import redis

from common.settings import Settings, get_settings
from server.gpu import GpuProbe, GpuProbeError, gpu_probe, wait_for_free_gpus
from server.launch import HEALTH_TIMEOUT, check_plan, healthy, masked, server_command, server_url
from server.metrics import LogFollower, MetricsHash, is_out_of_memory, parse_decode
from server.process import start_logged, stop_group

# How often the log is read and the process looked at, between health checks.
TICK = 0.2


@dataclass(frozen=True)
class Outcome:
    """How one run of the server ended."""

    reason: str
    was_healthy: bool
    out_of_memory: bool


class Supervisor:
    def __init__(self, settings: Settings, probe: GpuProbe, metrics: MetricsHash, say: Callable[[str], None]) -> None:
        self.settings = settings
        self.probe = probe
        self.metrics = metrics
        self.say = say
        self.fraction = settings.mem_fraction_static
        self.restarts = 0
        self.stopping = threading.Event()

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> int:
        """Serve until stopped (0) or until relaunching is refused (1)."""
        failures = 0
        while True:
            refusal = self._prepare()
            if refusal:
                return self._refuse(refusal)
            outcome = self._serve()
            if self.stopping.is_set():
                self.metrics.state("stopped")
                return 0
            self.say(f"server {outcome.reason}")
            if outcome.out_of_memory:
                refusal = self._step_down()
                if refusal:
                    return self._refuse(refusal)
            # A server that became healthy resets the backoff: it is a new failure, not a crash loop.
            failures = 1 if outcome.was_healthy else failures + 1
            delay = min(self.settings.restart_backoff_max, self.settings.restart_backoff * 2 ** (failures - 1))
            self.say(f"restarting in {delay:.1f} s")
            self.metrics.state("restarting", reason=outcome.reason)
            if self.stopping.wait(delay):
                self.metrics.state("stopped")
                return 0
            self.restarts += 1

    def _refuse(self, reason: str) -> int:
        self.say(f"refusing to launch: {reason}")
        self.metrics.state("refused", reason=reason)
        return 1

    def _current(self) -> Settings:
        return self.settings.model_copy(update={"mem_fraction_static": self.fraction})

    def _prepare(self) -> str | None:
        """Why the server must not be (re)launched now, if it must not."""
        timeout = self.settings.gpu_free_timeout
        try:
            left = wait_for_free_gpus(self.probe, timeout, self.say)
        except GpuProbeError as error:
            return f"cannot tell whether the GPUs are free: {error}"
        if left:
            names = ", ".join(process.describe() for process in left)
            return f"GPU memory still held by {names} after {timeout:.0f} s; stop them and start again"
        if not check_plan(self._current(), self.say):
            return f"the plan refuses mem_fraction_static {self.fraction:g} (see above)"
        return None

    def _step_down(self) -> str | None:
        floor, step = self.settings.mem_fraction_floor, self.settings.oom_step
        if self.fraction <= floor:
            return f"out of memory at mem_fraction_static {self.fraction:g}, already at the floor {floor:g}"
        lowered = max(floor, round(self.fraction - step, 3))
        self.say(f"out of memory: lowering mem_fraction_static {self.fraction:g} -> {lowered:g}")
        self.fraction = lowered
        return None

    def _serve(self) -> Outcome:
        settings = self._current()
        command = server_command(settings)
        follower = LogFollower(settings.server_log)
        process = start_logged(command, settings.server_log, masked(command, settings))
        self.say(f"started process group {process.pid}: {masked(command, settings)}")
        self.metrics.state(
            "starting", pid=process.pid, mem_fraction_static=self.fraction, restarts=self.restarts, reason=""
        )
        try:
            outcome = self._watch(process, follower)
        finally:
            stop_group(process)
        # The last words (the out-of-memory traceback) may land after the exit was seen.
        out_of_memory = self._read_log(follower) or outcome.out_of_memory
        return Outcome(outcome.reason, outcome.was_healthy, out_of_memory)

    def _watch(self, process: subprocess.Popen[bytes], follower: LogFollower) -> Outcome:
        settings = self.settings
        url = server_url(settings)
        started = last_ok = time.monotonic()
        was_healthy = unhealthy = out_of_memory = False
        next_check = started
        while not self.stopping.is_set():
            out_of_memory = self._read_log(follower) or out_of_memory
            if process.poll() is not None:
                return Outcome(f"exited with code {process.returncode}", was_healthy, out_of_memory)
            if time.monotonic() >= next_check:
                # No use waiting for an answer longer than the server may go without one.
                ok = healthy(url, min(HEALTH_TIMEOUT, settings.unhealthy_after))
                now = time.monotonic()
                if ok:
                    if not was_healthy or unhealthy:
                        self.say(f"healthy at {url}")
                        self.metrics.state("healthy")
                    was_healthy, unhealthy, last_ok = True, False, now
                elif was_healthy:
                    if not unhealthy:
                        self.metrics.state("unhealthy")
                        unhealthy = True
                    if now - last_ok > settings.unhealthy_after:
                        reason = f"failed /health_generate for {now - last_ok:.0f} s"
                        return Outcome(reason, True, out_of_memory)
                elif now - started > settings.startup_timeout:
                    reason = f"was not healthy {settings.startup_timeout:.0f} s after it started"
                    return Outcome(reason, False, out_of_memory)
                next_check = now + settings.health_interval
            self.stopping.wait(TICK)
        return Outcome("stopped", was_healthy, out_of_memory)

    def _read_log(self, follower: LogFollower) -> bool:
        """Store the decode statistics of the new log lines; whether one of them is an out-of-memory crash."""
        out_of_memory = False
        for line in follower.lines():
            fields = parse_decode(line)
            if fields:
                self.metrics.decode(fields)
            elif is_out_of_memory(line) and not out_of_memory:
                self.say(f"out of memory in the log: {line.strip()[:200]}")
                out_of_memory = True
        return out_of_memory


def say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervise: {message}", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help="the server's URL as workers reach it, naming its metrics in Redis (default: its host and port)",
    )


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    metrics = MetricsHash(client, args.url or server_url(settings), say)
    supervisor = Supervisor(settings, gpu_probe(settings.gpu_probe_file), metrics, say)

    def stop(signum: int, frame: FrameType | None) -> None:
        say(f"{signal.Signals(signum).name}: stopping the server")
        supervisor.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return supervisor.run()
