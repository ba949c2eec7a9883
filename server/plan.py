"""Check an SGLang configuration against this machine (or another) before launching it.

Reads the model's config.json and weight index, the GPUs (NVML) and the host memory (/proc/meminfo),
prints what SGLang will make of them (server/capacity.py) and exits non-zero, one line per problem, when
the configuration would not hold.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import redis

from common.protocol.keys import partition_key
from common.settings import Settings, get_settings
from server.capacity import (
    GIB,
    KV_CACHE_DTYPES,
    Assumptions,
    Machine,
    ModelShape,
    Plan,
    ServerConfig,
    Workload,
    make_plan,
)
from server.gpu import GpuProbeError, gpu_probe, holders

MEMINFO = Path("/proc/meminfo")
# Request sizes when nothing better is known: the old run held about 50 requests of 4K tokens at once.
DEFAULT_PROMPT_TOKENS = 2000
DEFAULT_OUTPUT_TOKENS = 2000
# SGLang flags that change memory in ways the plan does not model: a draft model and its KV cache, data
# parallel attention, and the sizes of CUDA graphs, prefill chunks and request tables.
UNMODELED_FLAGS = {
    "--speculative-algorithm": "a draft model's weights and KV cache",
    "--speculative-draft-model-path": "a draft model's weights and KV cache",
    "--enable-dp-attention": "data-parallel attention",
    "--dp-size": "data parallelism",
    "--dp": "data parallelism",
    "--cuda-graph-max-bs": "the CUDA graphs' memory",
    "--chunked-prefill-size": "the prefill activations",
    "--max-running-requests": "the request tables",
    "--max-total-tokens": "the KV cache size itself",
}


class PlanError(Exception):
    """An input the plan cannot do without is missing or unreadable; the message says which."""


@dataclass(frozen=True)
class MachineOverrides:
    """Plan for another machine: any figure given here (in GiB) is not read from this one."""

    gpu_mem_gib: float | None = None
    host_mem_gib: float | None = None


def read_model(model_dir: Path | None, config_file: Path | None, weights_bytes: int | None) -> tuple[ModelShape, int]:
    """The model's shape and its total weight bytes."""
    config_path = config_file or (model_dir / "config.json" if model_dir else None)
    if config_path is None:
        raise PlanError("no model: pass --model DIR, or --model-config FILE with --weights-gb, or set FLEET_MODEL_PATH")
    try:
        shape = ModelShape.from_config(json.loads(config_path.read_text()))
    except (OSError, ValueError, KeyError) as error:
        raise PlanError(f"cannot read the model config {config_path}: {error!r}") from error
    if weights_bytes is not None:
        return shape, weights_bytes
    if model_dir is None:
        raise PlanError(
            "--model-config needs --weights-gb (GB of 10^9 bytes, as checkpoints are published) or --weights-gib"
        )
    return shape, _weights_bytes(model_dir)


def _weights_bytes(model_dir: Path) -> int:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            return int(json.loads(index.read_text())["metadata"]["total_size"])
        except (OSError, ValueError, KeyError) as error:
            raise PlanError(f"cannot read metadata.total_size from {index}: {error!r}") from error
    # A single-file checkpoint has no index; its file size is the tensors plus a small header.
    files = list(model_dir.glob("*.safetensors"))
    if not files:
        raise PlanError(f"no model.safetensors.index.json or *.safetensors in {model_dir}: pass --weights-gb")
    return sum(path.stat().st_size for path in files)


def read_meminfo(path: Path = MEMINFO) -> tuple[float, float]:
    """(MemAvailable, MemTotal) in GiB."""
    fields = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = int(value.split()[0]) * 1024
    return fields["MemAvailable"] / GIB, fields["MemTotal"] / GIB


def read_machine(settings: Settings, overrides: MachineOverrides) -> tuple[Machine, list[str]]:
    """This machine's memory (or the overrides), and what on its first FLEET_TP GPUs would stop a launch."""
    tp = settings.tp
    problems: list[str] = []
    if overrides.gpu_mem_gib is not None:
        gpu_mem_gib = overrides.gpu_mem_gib
    else:
        try:
            gpus = gpu_probe(settings.gpu_probe_file).gpus()
        except GpuProbeError as error:
            raise PlanError(f"cannot read the GPUs ({error}): pass --gpu-mem-gib to plan without them") from error
        if not gpus:
            raise PlanError("no GPU visible: pass --gpu-mem-gib (or --gpu-mem-gb) to plan for a machine with GPUs")
        if len(gpus) < tp:
            problems.append(f"--tp {tp} needs {tp} GPUs but {len(gpus)} are visible: lower --tp")
        used = gpus[:tp]
        gpu_mem_gib = min(gpu.total_bytes for gpu in used) / GIB
        busy = holders(used)
        if busy:
            names = ", ".join(process.describe() for process in busy)
            problems.append(f"GPU memory is held by {names}: stop them first (SGLang would size its pools around them)")
    if overrides.host_mem_gib is not None:
        machine = Machine(gpu_mem_gib=gpu_mem_gib, host_available_gib=overrides.host_mem_gib)
    else:
        available, total = read_meminfo()
        machine = Machine(gpu_mem_gib=gpu_mem_gib, host_available_gib=available, host_total_gib=total)
    return machine, problems


def server_config(settings: Settings) -> ServerConfig:
    return ServerConfig(
        tp=settings.tp,
        mem_fraction_static=settings.mem_fraction_static,
        kv_cache_dtype=settings.kv_cache_dtype,
        hicache_size=settings.hicache_size,
        hicache_ratio=settings.hicache_ratio,
    )


def workload(
    settings: Settings,
    avg_prompt_tokens: int,
    avg_output_tokens: int,
    avg_short_tokens: int | None = None,
    avg_long_tokens: int | None = None,
) -> Workload:
    """A request of each queue holds its prompt and output in the KV cache, unless a queue's size is given."""
    longest = settings.context_length
    if settings.server_context_length:
        longest = min(longest, settings.server_context_length)
    request = avg_prompt_tokens + avg_output_tokens
    return Workload(
        short_concurrency=settings.short_concurrency,
        long_concurrency=settings.long_concurrency,
        avg_short_tokens=avg_short_tokens or request,
        avg_long_tokens=avg_long_tokens or request,
        max_request_tokens=longest,
    )


def measured_prompt_tokens(settings: Settings) -> int | None:
    """The mean prompt length the producer recorded at enqueue (over partitions, by their totals), if Redis
    has it and answers: the plan runs on a GPU host, where Redis may be out of reach."""
    try:
        connection = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=2)
        keys = list(connection.scan_iter(match=partition_key("*"), count=1000))
        records = [connection.hmget(key, "mean_prompt_tokens", "total") for key in keys]
    except redis.RedisError:
        return None
    sizes = [(int(mean), int(total or 1)) for mean, total in records if mean]
    if not sizes:
        return None
    return sum(mean * total for mean, total in sizes) // sum(total for _, total in sizes)


def assumptions(settings: Settings) -> Assumptions:
    return Assumptions(
        cuda_context_gib=settings.cuda_context_gib,
        runtime_overhead_gib=settings.runtime_overhead_gib,
        min_headroom_gib=settings.min_headroom_gib,
    )


def build_plan(
    settings: Settings,
    *,
    model_dir: Path | None = None,
    model_config: Path | None = None,
    weights_bytes: int | None = None,
    machine: MachineOverrides | None = None,
    avg_prompt_tokens: int | None = None,
    avg_output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    avg_short_tokens: int | None = None,
    avg_long_tokens: int | None = None,
) -> Plan:
    """Plan the server these settings describe; the model defaults to FLEET_MODEL_PATH."""
    if model_dir is None and model_config is None and settings.model_path:
        model_dir = Path(settings.model_path)
    shape, weights = read_model(model_dir, model_config, weights_bytes)
    found, machine_problems = read_machine(settings, machine or MachineOverrides())
    plan = make_plan(
        shape,
        weights,
        server_config(settings),
        found,
        workload(
            settings,
            avg_prompt_tokens or measured_prompt_tokens(settings) or DEFAULT_PROMPT_TOKENS,
            avg_output_tokens,
            avg_short_tokens,
            avg_long_tokens,
        ),
        assumptions(settings),
    )
    plan.problems[:0] = machine_problems
    plan.warnings += unmodeled(settings.server_args)
    return plan


def unmodeled(server_args: str) -> list[str]:
    """A warning for each flag in FLEET_SERVER_ARGS whose memory the plan does not count."""
    given = {argument.split("=", 1)[0] for argument in shlex.split(server_args) if argument.startswith("--")}
    return [
        f"FLEET_SERVER_ARGS has {flag}, which changes {what}; the plan does not model it"
        for flag, what in UNMODELED_FLAGS.items()
        if flag in given
    ]


def render(plan: Plan) -> str:
    """The plan as a table a person reads top to bottom, then its verdict."""
    server, machine, assumed = plan.server, plan.machine, plan.assumptions
    gib = "{:,.1f} GiB".format
    rows: list[tuple[str, str, str]] = [
        ("model weights", gib(plan.weights_bytes / GIB), f"= {plan.weights_bytes / 1e9:,.1f} GB of 10^9 bytes"),
        ("GPU memory per GPU", gib(machine.gpu_mem_gib), f"= {machine.gpu_mem_gib * GIB / 1e9:,.1f} GB"),
        ("  in use before weights load", gib(assumed.cuda_context_gib), "assumed: CUDA context, NCCL"),
        (
            "  static pool",
            gib(plan.static_pool_gib),
            f"x {server.mem_fraction_static} of the {machine.gpu_mem_gib - assumed.cuda_context_gib:.1f} free",
        ),
        (
            "    weights per rank",
            gib(plan.weights_per_rank_gib),
            f"1/{server.tp} of the weights + {plan.replicated_gib:.1f} GiB every rank holds whole",
        ),
        ("    KV cache", gib(plan.kv_pool_gib), ""),
        ("  outside the static pool", gib(plan.reserve_gib), ""),
        ("    runtime buffers", gib(assumed.runtime_overhead_gib), "assumed: CUDA graphs, request tables"),
        ("    headroom", gib(plan.headroom_gib), f"for activations; needs {assumed.min_headroom_gib:.1f}"),
        (
            "KV bytes per token per rank",
            f"{plan.kv_bytes_per_token:,}",
            "MLA latent, on every rank" if plan.is_mla else f"K+V heads split over {server.tp} ranks",
        ),
        ("GPU KV capacity", f"{plan.kv_tokens_gpu:,} tokens", f"KV cache {server.kv_cache_dtype}"),
    ]
    if plan.hicache_enabled:
        asked = (
            f"--hicache-size {server.hicache_size} (GB of 10^9 bytes)"
            if server.hicache_size
            else f"--hicache-ratio {server.hicache_ratio} x the GPU KV cache"
        )
        rows += [
            ("host cache per rank", gib(plan.host_cache_gib_per_rank), f"{plan.host_cache_tokens:,} tokens; {asked}"),
            ("host cache needed", gib(plan.host_needed_gib), f"x {server.tp} ranks + SGLang's 10 GiB reserve"),
        ]
    else:
        rows.append(("host cache", "off", "--hicache-size 0 and --hicache-ratio 0"))
    total = f" of {machine.host_total_gib:,.1f}" if machine.host_total_gib else ""
    host_gb = machine.host_available_gib * GIB / 1e9
    rows.append(("host memory available", gib(machine.host_available_gib), f"= {host_gb:,.1f} GB; MemAvailable{total}"))
    workload, supported = plan.workload, plan.recommended_concurrency
    rows.append(
        (
            "concurrency short / long",
            f"{supported['short']} / {supported['long']}",
            f"what the KV cache holds at {workload.avg_short_tokens:,} / {workload.avg_long_tokens:,} tokens a "
            f"request; configured {workload.short_concurrency} / {workload.long_concurrency}",
        )
    )
    hicache = "off" if not plan.hicache_enabled else "on"
    lines = [
        f"SGLang plan: TP {server.tp}, mem_fraction_static {server.mem_fraction_static}, "
        f"KV cache {server.kv_cache_dtype}, hierarchical cache {hicache}"
    ]
    lines += [f"  {label:<30}{value:>18}   {note}".rstrip() for label, value, note in rows]
    lines += [f"warning: {warning}" for warning in plan.warnings]
    lines += [f"refused: {problem}" for problem in plan.problems]
    lines.append("OK" if plan.ok else f"REFUSED ({len(plan.problems)} problem{'s' * (len(plan.problems) > 1)})")
    return "\n".join(lines)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def add_sizes(parser: argparse.ArgumentParser, name: str, what: str) -> None:
    """`--NAME-gb` (10^9 bytes, as sizes are published) and `--NAME-gib` (2^30, as nvidia-smi and free show)."""
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(f"--{name}-gb", type=float, help=f"{what} in GB (10^9 bytes)")
    sizes.add_argument(f"--{name}-gib", type=float, help=f"{what} in GiB (2^30 bytes)")


def in_gib(args: argparse.Namespace, name: str) -> float | None:
    """A size given as `--NAME-gb` or `--NAME-gib`, in GiB."""
    gb, gib = getattr(args, f"{name}_gb"), getattr(args, f"{name}_gib")
    return gib if gib is not None else None if gb is None else gb * 1e9 / GIB


def add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    add_sizes(parser, "gpu-mem", "memory per GPU (default: read through NVML)")
    add_sizes(parser, "host-mem", "host memory available (default: MemAvailable in /proc/meminfo)")


def machine_overrides(args: argparse.Namespace) -> MachineOverrides:
    return MachineOverrides(in_gib(args, "gpu_mem"), in_gib(args, "host_mem"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (default: FLEET_MODEL_PATH)")
    model.add_argument("--model", type=Path, help="a model directory: config.json and model.safetensors.index.json")
    model.add_argument("--model-config", type=Path, help="a config.json, with --weights-gb or --weights-gib")
    add_sizes(model, "weights", "total weight size (default: the index's total_size)")
    server = parser.add_argument_group("SGLang flags (default: the FLEET_ settings of the same names)")
    server.add_argument("--tp", type=positive_int)
    server.add_argument("--mem-fraction-static", type=fraction)
    server.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES)
    server.add_argument("--hicache-size", type=int, help="GB (10^9 bytes) of host cache PER TP RANK; 0 = off")
    server.add_argument("--hicache-ratio", type=float, help="host cache / GPU KV cache, when --hicache-size is 0")
    machine = parser.add_argument_group("machine")
    add_machine_arguments(machine)
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--avg-prompt-tokens",
        type=positive_int,
        help="average prompt length (default: what enqueue measured, else 2,000)",
    )
    load.add_argument(
        "--avg-output-tokens",
        type=positive_int,
        default=DEFAULT_OUTPUT_TOKENS,
        help=f"average generation length (default: {DEFAULT_OUTPUT_TOKENS:,}, an assumption: about the old run's)",
    )
    load.add_argument("--avg-short-tokens", type=positive_int, help="prompt + output of a short request (overrides)")
    load.add_argument("--avg-long-tokens", type=positive_int, help="prompt + output of a long request (overrides)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    flags = ("tp", "mem_fraction_static", "kv_cache_dtype", "hicache_size", "hicache_ratio")
    overrides = {name: value for name in flags if (value := getattr(args, name)) is not None}
    settings = get_settings().model_copy(update=overrides)
    try:
        plan = build_plan(
            settings,
            model_dir=args.model,
            model_config=args.model_config,
            weights_bytes=None if (weights := in_gib(args, "weights")) is None else int(weights * GIB),
            machine=machine_overrides(args),
            avg_prompt_tokens=args.avg_prompt_tokens,
            avg_output_tokens=args.avg_output_tokens,
            avg_short_tokens=args.avg_short_tokens,
            avg_long_tokens=args.avg_long_tokens,
        )
    except PlanError as error:
        print(f"plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json()) if args.json else render(plan))
    return 0 if plan.ok else 1
