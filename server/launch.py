"""Start the SGLang server the settings describe, once the plan accepts it, and wait until it answers.

The server runs in its own process group with its output in FLEET_SERVER_LOG and keeps running after this
command returns; `python -m server supervise` is the one that keeps it up.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from common.settings import Settings, get_settings
from server.plan import MachineOverrides, PlanError, add_machine_arguments, build_plan, machine_overrides, render
from server.process import start_logged, stop_group

# SGLang's own health check gives a generation this long (SGLANG_HEALTH_CHECK_TIMEOUT).
HEALTH_TIMEOUT = 20.0
PROGRESS_EVERY = 15.0
MASK = "***"


def server_url(settings: Settings) -> str:
    """Where this machine reaches the server (a wildcard bind is reached on loopback)."""
    host = "127.0.0.1" if settings.server_host in ("", "0.0.0.0", "::") else settings.server_host
    return f"http://{host}:{settings.server_port}"


def server_command(settings: Settings) -> list[str]:
    """The SGLang command line, or FLEET_SERVER_COMMAND with its placeholders filled in."""
    fraction = f"{settings.mem_fraction_static:g}"
    if settings.server_command:
        fill = {"{host}": settings.server_host, "{port}": str(settings.server_port), "{mem_fraction_static}": fraction}
        parts = shlex.split(settings.server_command)
        for placeholder, value in fill.items():
            parts = [part.replace(placeholder, value) for part in parts]
        return parts
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", settings.model_path]
    command += ["--tp-size", str(settings.tp), "--mem-fraction-static", fraction]
    command += ["--kv-cache-dtype", settings.kv_cache_dtype, "--host", settings.server_host]
    command += ["--port", str(settings.server_port), "--enable-metrics"]
    if settings.hicache_size:
        command += ["--enable-hierarchical-cache", "--hicache-size", str(settings.hicache_size)]
    elif settings.hicache_ratio:
        command += ["--enable-hierarchical-cache", "--hicache-ratio", f"{settings.hicache_ratio:g}"]
    if settings.server_context_length:
        command += ["--context-length", str(settings.server_context_length)]
    if settings.sglang_api_key:
        command += ["--api-key", settings.sglang_api_key.get_secret_value()]
    return command + shlex.split(settings.server_args)


def masked(command: list[str], settings: Settings) -> str:
    """The command as a shell line, fit to print: the API key replaced."""
    key = settings.sglang_api_key.get_secret_value() if settings.sglang_api_key else ""
    return shlex.join(part.replace(key, MASK) if key else part for part in command)


def check_plan(settings: Settings, say: Callable[[str], None], machine: MachineOverrides | None = None) -> bool:
    """Print the plan of the configured server; False when it is refused. A stand-in command is not planned."""
    if settings.server_command:
        say("plan skipped: FLEET_SERVER_COMMAND replaces SGLang")
        return True
    try:
        plan = build_plan(settings, machine=machine)
    except PlanError as error:
        say(f"refused: cannot plan: {error}")
        return False
    say(render(plan))
    return plan.ok


def healthy(url: str, timeout: float = HEALTH_TIMEOUT) -> bool:
    try:
        return httpx.get(f"{url}/health_generate", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def last_line(settings: Settings) -> str:
    """The log's last line, to show what the server is doing while it loads."""
    try:
        with open(settings.server_log, "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - 4096))
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def wait_until_healthy(
    settings: Settings, process: subprocess.Popen[bytes], say: Callable[[str], None], interval: float = 1.0
) -> str | None:
    """None once /health_generate answers; otherwise why the server never got there."""
    url = server_url(settings)
    started = time.monotonic()
    next_progress = started + PROGRESS_EVERY
    while True:
        if process.poll() is not None:
            return f"the server exited with code {process.returncode} before it was healthy"
        if healthy(url):
            return None
        now = time.monotonic()
        if now - started > settings.startup_timeout:
            return f"the server was not healthy after {settings.startup_timeout:.0f} s"
        if now >= next_progress:
            say(f"waiting for {url}/health_generate: {now - started:.0f} s; log: {last_line(settings)}")
            next_progress = now + PROGRESS_EVERY
        time.sleep(interval)


def say(message: str) -> None:
    print(message, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the command, start nothing")
    add_machine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    accepted = check_plan(settings, say, machine_overrides(args))
    command = server_command(settings)
    if args.dry_run:
        say(masked(command, settings))
        return 0 if accepted else 1
    if not accepted:
        return 1
    say(f"starting: {masked(command, settings)}")
    process = start_logged(command, settings.server_log, masked(command, settings))
    say(f"server process group {process.pid}, log {settings.server_log}")
    problem = wait_until_healthy(settings, process, say)
    if problem:
        say(f"launch failed: {problem}; stopping the process group; see {settings.server_log}")
        stop_group(process)
        return 1
    say(f"healthy at {server_url(settings)} (process group {process.pid})")
    return 0
