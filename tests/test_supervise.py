"""`python -m server launch` and `supervise` as real processes, with a stand-in server and a stand-in NVML.

The stand-in server (STAND_IN, below) answers /health and /health_generate, logs one decode line, records
each start with the mem_fraction_static it was given, runs out of memory above a chosen fraction and turns
unhealthy while a chosen file exists. The stand-in NVML is a JSON file (server/gpu.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import redis

from common.protocol.keys import server_metrics_key
from common.records import ServerMetrics
from server.capacity import GIB
from server.gpu import GpuProbeError, GpuProcess, NvmlProbe, holders
from server.metrics import is_out_of_memory, parse_decode
from tests.harness import ROOT, ManagedProcess, RedisServer, free_port, wait_until
from tests.test_plan import KIMI_K25, KIMI_WEIGHTS

STAND_IN = """
import argparse, http.server, json, os, sys

parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--mem-fraction-static", type=float, required=True)
parser.add_argument("--record", required=True)
parser.add_argument("--oom-above", type=float, default=1.0)
parser.add_argument("--unhealthy-while", default="")
args = parser.parse_args()
with open(args.record, "a") as record:
    record.write(json.dumps({"pid": os.getpid(), "fraction": args.mem_fraction_static}) + "\\n")
if args.mem_fraction_static > args.oom_above:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
    sys.exit(1)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        sick = args.unhealthy_while and os.path.exists(args.unhealthy_while)
        self.send_response(503 if sick else 200 if self.path in ("/health", "/health_generate") else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
print(
    "[2026-01-01 12:00:00 TP0] Decode batch, #running-req: 7, #token: 5120, token usage: 0.03, "
    "cuda graph: True, gen throughput (token/s): 931.52, #queue-req: 2",
    flush=True,
)
server.serve_forever()
"""

DECODE_NEW = (
    "[2026-01-01 12:00:00 TP0] Decode batch, #running-req: 150, #token: 158000, token usage: 0.99, "
    "cuda graph: True, gen throughput (token/s): 1350.12, #queue-req: 12"
)
DECODE_OLD = (
    "[2025-03-01 08:00:00 TP0] Decode batch. #running-req: 3, #token: 900, token usage: 0.01, "
    "gen throughput (token/s): 600.00, #queue-req: 0, "
)


def test_parses_both_decode_line_formats() -> None:
    assert parse_decode(DECODE_NEW) == {
        "running_req": "150",
        "token": "158000",
        "token_usage": "0.99",
        "cuda_graph": "True",
        "gen_throughput": "1350.12",
        "queue_req": "12",
    }
    assert parse_decode(DECODE_OLD) == {
        "running_req": "3",
        "token": "900",
        "token_usage": "0.01",
        "gen_throughput": "600.00",
        "queue_req": "0",
    }
    with_iteration = DECODE_NEW.replace("Decode batch,", "Decode batch [4711],")
    assert parse_decode(with_iteration) == parse_decode(DECODE_NEW)
    assert parse_decode("[2026-01-01 12:00:00 TP0] Prefill batch, #new-seq: 1, #new-token: 512") is None
    # A hybrid model's pools (scheduler_components/pool_stats_observer.py): the full pool's count, the fullest usage.
    hybrid = DECODE_NEW.replace(
        "#token: 158000, token usage: 0.99",
        "#full token: 158000, full token usage: 0.62, #swa token: 900, swa token usage: 0.97",
    )
    assert parse_decode(hybrid) == parse_decode(DECODE_NEW) | {"token_usage": "0.97"}


def test_recognises_out_of_memory_crashes_only() -> None:
    assert is_out_of_memory("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB")
    assert is_out_of_memory("RuntimeError: CUDA error: out of memory")
    host = "ValueError: Not enough host memory available. Requesting 51.54 GB but only have 12.30 GB free."
    assert is_out_of_memory(host)
    # SGLang's own complaint asks for a larger fraction, not a smaller one.
    assert not is_out_of_memory("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")


def test_nvml_probe_lists_gpus_and_the_processes_holding_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML itself needs a GPU; its answers are stood in for here to check what the probe makes of them."""
    calls: list[str] = []
    process = SimpleNamespace(pid=4242, usedGpuMemory=30 * GIB)
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda handle: "NVIDIA H200")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: SimpleNamespace(total=140 * GIB))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda handle: [process] if handle else [])
    gpus = NvmlProbe().gpus()
    assert [(gpu.index, gpu.name, gpu.total_bytes) for gpu in gpus] == [
        (0, "NVIDIA H200", 140 * GIB),
        (1, "NVIDIA H200", 140 * GIB),
    ]
    assert holders(gpus) == [GpuProcess(pid=4242, gpu=1, used_bytes=30 * GIB)]
    assert calls == ["init", "shutdown"]

    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    with pytest.raises(GpuProbeError, match="NVML"):
        NvmlProbe().gpus()


class Fleet:
    """Runs `python -m server ...` with FLEET_ settings pointing at this test's files, Redis and stand-ins."""

    def __init__(self, tmp_path: Path, redis_url: str) -> None:
        self.tmp_path = tmp_path
        self.record = tmp_path / "starts.jsonl"
        self.log = tmp_path / "sglang.log"
        self.probe = tmp_path / "gpus.json"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.free_gpus()
        stand_in = tmp_path / "stand_in.py"
        stand_in.write_text(STAND_IN)
        command = [sys.executable, str(stand_in), "--port", "{port}"]
        command += ["--mem-fraction-static", "{mem_fraction_static}", "--record", str(self.record)]
        self.settings: dict[str, object] = {
            "redis_url": redis_url,
            "server_command": shlex.join(command),
            "server_port": self.port,
            "server_log": self.log,
            "gpu_probe_file": self.probe,
            "health_interval": 0.1,
            "unhealthy_after": 1.0,
            "startup_timeout": 20,
            "restart_backoff": 0.05,
            "gpu_free_timeout": 10,
        }
        self.processes: list[ManagedProcess] = []

    def free_gpus(self, held_by: tuple[int, ...] = ()) -> None:
        processes = [{"pid": pid, "used_gib": 30} for pid in held_by]
        self.probe.write_text(json.dumps({"gpus": [{"total_gib": 96, "processes": processes}]}))

    def env(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if not name.startswith("FLEET_")}
        env.update({f"FLEET_{name.upper()}": str(value) for name, value in self.settings.items()})
        return env

    def start(self, *args: str) -> ManagedProcess:
        log = self.tmp_path / f"{args[0]}-{len(self.processes)}.out"
        process = ManagedProcess([sys.executable, "-m", "server", *args], log, self.env()).start()
        self.processes.append(process)
        return process

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "server", *args]
        return subprocess.run(command, cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=60)

    def starts(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def stop_stand_ins(self) -> None:
        """Whatever a failed test left running: the stand-ins lead process groups of their own."""
        for start in self.starts():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(start["pid"]), signal.SIGKILL)


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path, redis_server.url)
    yield fleet
    for process in fleet.processes:
        process.signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
    fleet.stop_stand_ins()


def metrics(client: redis.Redis, url: str) -> dict[str, str]:
    """The server's hash as `status` reads it, its values as text."""
    found = ServerMetrics.from_hash(client.hgetall(server_metrics_key(url)))
    return {key: str(value) for key, value in found.model_dump(exclude_none=True).items()}


def state_is(client: redis.Redis, url: str, state: str, **fields: str) -> Callable[[], bool]:
    def check() -> bool:
        found = metrics(client, url)
        return found.get("state") == state and all(found.get(name) == value for name, value in fields.items())

    return check


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_restarts_the_server_after_it_is_killed_and_stores_decode_metrics(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    supervisor = fleet.start("supervise")
    wait_until(state_is(redis_client, fleet.url, "healthy"), timeout=30, what="the first start to be healthy")
    found = wait_until(lambda: metrics(redis_client, fleet.url).get("updated_at") and metrics(redis_client, fleet.url))
    assert found["running_req"] == "7.0" and found["gen_throughput"] == "931.52" and found["queue_req"] == "2.0"

    [first] = fleet.starts()
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: len(fleet.starts()) == 2, timeout=30, what="a second start")
    wait_until(state_is(redis_client, fleet.url, "healthy", restarts="1"), timeout=30, what="healthy again")
    assert "server exited with code 137" in supervisor.output()

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 0
    assert pid_gone(fleet.starts()[1]["pid"]), "stopping the supervisor stops the server's process group"
    assert metrics(redis_client, fleet.url)["state"] == "stopped"


def test_restarts_a_server_that_stops_answering(fleet: Fleet, redis_client: redis.Redis) -> None:
    sick = fleet.tmp_path / "sick"
    fleet.settings["server_command"] = f"{fleet.settings['server_command']} --unhealthy-while {sick}"
    supervisor = fleet.start("supervise")
    wait_until(state_is(redis_client, fleet.url, "healthy"), timeout=30, what="healthy")
    sick.touch()
    wait_until(lambda: len(fleet.starts()) == 2, timeout=30, what="a restart of the unhealthy server")
    [first, _] = fleet.starts()
    assert pid_gone(first["pid"]), "the unhealthy server's process group is killed before the restart"
    sick.unlink()
    wait_until(state_is(redis_client, fleet.url, "healthy", restarts="1"), timeout=30, what="healthy again")
    assert "failed /health_generate for" in supervisor.output()


def test_lowers_mem_fraction_static_after_out_of_memory_crashes(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.settings.update(mem_fraction_static=0.88, oom_step=0.02, mem_fraction_floor=0.80)
    fleet.settings["server_command"] = f"{fleet.settings['server_command']} --oom-above 0.85"
    supervisor = fleet.start("supervise")
    wait_until(state_is(redis_client, fleet.url, "healthy"), timeout=30, what="a start that does not run out")
    assert [start["fraction"] for start in fleet.starts()] == [0.88, 0.86, 0.84]
    assert "lowering mem_fraction_static 0.88 -> 0.86" in supervisor.output()
    assert "lowering mem_fraction_static 0.86 -> 0.84" in supervisor.output()
    assert metrics(redis_client, fleet.url)["mem_fraction_static"] == "0.84"


def test_refuses_to_relaunch_out_of_memory_at_the_floor(fleet: Fleet) -> None:
    fleet.settings.update(mem_fraction_static=0.88, oom_step=0.02, mem_fraction_floor=0.86)
    fleet.settings["server_command"] = f"{fleet.settings['server_command']} --oom-above 0.85"
    supervisor = fleet.start("supervise")
    assert supervisor.wait(timeout=30) == 1
    assert [start["fraction"] for start in fleet.starts()] == [0.88, 0.86]
    assert "out of memory at mem_fraction_static 0.86, already at the floor 0.86" in supervisor.output()


def test_refuses_to_launch_while_gpu_memory_is_held(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.free_gpus(held_by=(4242,))
    fleet.settings["gpu_free_timeout"] = 1
    supervisor = fleet.start("supervise")
    assert supervisor.wait(timeout=30) == 1
    assert "GPU memory still held by PID 4242 (GPU 0, 30.0 GiB) after 1 s" in supervisor.output()
    assert fleet.starts() == [], "nothing is started beside the leftover process"
    assert metrics(redis_client, fleet.url)["state"] == "refused"


def test_waits_for_leftover_processes_to_release_gpu_memory(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.free_gpus(held_by=(4242,))
    supervisor = fleet.start("supervise")
    wait_until(lambda: "waiting up to 10 s" in supervisor.output(), timeout=30, what="the supervisor to wait")
    assert fleet.starts() == []
    fleet.free_gpus()
    wait_until(state_is(redis_client, fleet.url, "healthy"), timeout=30, what="a start once the memory is free")


def test_launch_starts_the_server_and_returns_once_it_is_healthy(fleet: Fleet) -> None:
    result = fleet.run("launch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"healthy at {fleet.url}" in result.stdout
    [start] = fleet.starts()
    assert not pid_gone(start["pid"]), "the server outlives launch"
    assert "Decode batch" in wait_until(lambda: "Decode batch" in fleet.log.read_text() and fleet.log.read_text())


@pytest.fixture
def kimi_settings(fleet: Fleet) -> Fleet:
    """The real SGLang command for Kimi-K2.5 on the old machine's 8 x 96 GiB GPUs, with an API key."""
    model = fleet.tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_K25))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": KIMI_WEIGHTS}}))
    fleet.probe.write_text(json.dumps({"gpus": [{"total_gib": 96}] * 8}))
    del fleet.settings["server_command"]
    fleet.settings.update(
        model_path=model, tp=8, kv_cache_dtype="bf16", hicache_size=48, sglang_api_key="sk-very-secret"
    )
    return fleet


def test_launch_dry_run_prints_the_command_with_the_api_key_masked(kimi_settings: Fleet) -> None:
    result = kimi_settings.run("launch", "--dry-run", "--host-mem-gib", "449")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sk-very-secret" not in result.stdout + result.stderr
    [command] = [line for line in result.stdout.splitlines() if "sglang.launch_server" in line]
    assert "--api-key '***'" in command
    for flags in ("--tp-size 8", "--mem-fraction-static 0.88", "--kv-cache-dtype bf16", "--enable-metrics"):
        assert flags in command
    assert "--enable-hierarchical-cache --hicache-size 48" in command
    assert "GPU KV capacity" in result.stdout


def test_launch_refuses_what_the_plan_refuses(kimi_settings: Fleet) -> None:
    kimi_settings.settings.update(mem_fraction_static=0.93, hicache_size=300)
    result = kimi_settings.run("launch", "--host-mem-gib", "449")
    assert result.returncode == 1
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused: ")]
    assert len(refusals) == 2
    assert not kimi_settings.log.exists(), "nothing was started"


def test_the_log_never_holds_the_api_key(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    env = {name: value for name, value in os.environ.items() if not name.startswith("FLEET_")}
    env["FLEET_SGLANG_API_KEY"] = "sk-very-secret"
    speaker = [sys.executable, "-c", "print(\"server_args=ServerArgs(api_key='sk-very-secret', port=30000)\")"]
    command = [sys.executable, "-m", "server.logpipe", str(log), "--", *speaker]
    assert subprocess.run(command, cwd=ROOT, env=env, timeout=30).returncode == 0
    assert log.read_text() == "server_args=ServerArgs(api_key='***', port=30000)\n"
