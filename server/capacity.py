"""What one SGLang server configuration holds, by SGLang's own memory arithmetic: pure functions, no I/O.

Formulas follow SGLang 0.5.23 (`pip download sglang`):
- mem_cache/kv_cache_configurator.py `_profile_available_bytes`: the KV pool gets what is free after the
  weights load minus `pre_load_free * (1 - mem_fraction_static)`, where `pre_load_free` is the GPU memory
  free before the weights load. So the static pool (weights + KV) is `pre_load_free * mem_fraction_static`
  and everything else (CUDA graphs, request tables, activations) lives in the rest.
- model_executor/pool_configurator.py `_compute_cell_size`: KV bytes per token per rank. MLA keeps one
  latent of `kv_lora_rank + qk_rope_head_dim` per token and layer on EVERY rank (it is not split by TP);
  MHA/GQA keeps K and V for `max(1, kv_heads // tp)` heads per rank.
- mem_cache/pool_host/base.py `HostKVCache`: `--hicache-size` is GB (10^9 bytes) PER TP RANK, the same
  bytes per token as the GPU pool, and SGLang keeps 10 GiB of host memory free; but each rank checks only
  its own pool against the memory free at that moment, so TP ranks together can overcommit the host.
- arg_groups/memory_hook.py `handle_gpu_memory_settings`: its automatic mem_fraction_static leaves at
  least 10 GiB per GPU outside the static pool on GPUs over 60 GiB.

All memory figures here are GiB (2^30 bytes), like SGLang's GPU log lines, nvidia-smi and `free -g`; the one
exception is `--hicache-size`, which SGLang defines in 10^9 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
HICACHE_GB = 10**9
# HICACHE_HOST_MEMORY_RESERVE_BYTES in mem_cache/pool_host/base.py.
HICACHE_HOST_RESERVE_BYTES = 10 * GIB
# The floor of SGLang's automatic reserve outside the static pool, and the GPU size it applies from.
SGLANG_MIN_RESERVE_GIB = 10.0
SGLANG_MIN_RESERVE_FROM_GIB = 60.0

KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2")
_KV_DTYPE_BYTES = {"bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
# SGLang serves a float32 checkpoint in float16 (configs/model_config.py), so its KV cache is 2 bytes too.
_MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 2}


@dataclass(frozen=True)
class ModelShape:
    """The parts of a Hugging Face config.json that decide KV cache size and per-rank weights."""

    num_layers: int
    # Bytes per parameter of the unquantized model (what `--kv-cache-dtype auto` uses for the KV cache).
    dtype_bytes: int
    # MLA (DeepSeek-V3, Kimi-K2): kv_lora_rank is set.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    # MHA/GQA.
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    # Weights every TP rank holds whole instead of a 1/TP share (see replicated_weight_bytes).
    replicated_weight_bytes: int = 0
    # The checkpoint's quantization config asks for an FP8 KV cache, which `--kv-cache-dtype auto` then uses.
    fp8_kv_cache: bool = False

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Read a config.json; a multimodal model's language model is under `text_config`, as SGLang reads it."""
        text = {**config, **config.get("text_config", {})}
        dtype_bytes = _MODEL_DTYPE_BYTES.get(str(text.get("torch_dtype") or text.get("dtype")), 2)
        layers = int(text["num_hidden_layers"])
        quant = text.get("quantization_config") or {}
        fp8_kv = str(quant.get("kv_cache_quant_algo") or "").upper() == "FP8"
        if text.get("kv_lora_rank"):
            return cls(
                num_layers=layers,
                dtype_bytes=dtype_bytes,
                fp8_kv_cache=fp8_kv,
                kv_lora_rank=int(text["kv_lora_rank"]),
                qk_rope_head_dim=int(text["qk_rope_head_dim"]),
                replicated_weight_bytes=_mla_replicated_bytes(text, dtype_bytes),
            )
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        return cls(
            num_layers=layers,
            dtype_bytes=dtype_bytes,
            fp8_kv_cache=fp8_kv,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            v_head_dim=int(text.get("v_head_dim") or head_dim),
        )


def _mla_replicated_bytes(text: dict[str, Any], dtype_bytes: int) -> int:
    """SGLang's DeepSeek-V2/V3 model keeps two kinds of weights whole on every rank: the fused MLA
    down-projection `fused_qkv_a_proj_with_mqa` (a ReplicatedLinear of hidden x (q_lora_rank + kv_lora_rank
    + qk_rope_head_dim)) and the MoE router (n_routed_experts x hidden per MoE layer). For Kimi-K2 at TP 8
    that is 1.8 GiB per GPU more than total/TP. A vision tower (Kimi-K2.5) is also replicated; it is
    not counted here."""
    quant = text.get("quantization_config") or {}
    # An FP8 checkpoint (DeepSeek-V3) stores the projections in one byte; INT4 ones (Kimi) keep them in bf16.
    projection_bytes = 1 if quant.get("quant_method") == "fp8" else dtype_bytes
    layers = int(text["num_hidden_layers"])
    hidden = int(text["hidden_size"])
    width = (text.get("q_lora_rank") or 0) + int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])
    projections = layers * hidden * width * projection_bytes
    moe_layers = layers - int(text.get("first_k_dense_replace") or 0) if text.get("n_routed_experts") else 0
    routers = moe_layers * int(text.get("n_routed_experts") or 0) * hidden * dtype_bytes
    return projections + routers


def kv_dtype_bytes(shape: ModelShape, kv_cache_dtype: str) -> int:
    """As SGLang resolves it (mem_cache/kv_cache_dtype.py): `auto` is FP8 when the checkpoint's quantization
    config says `kv_cache_quant_algo: FP8`, else the model's dtype."""
    if kv_cache_dtype == "auto":
        return 1 if shape.fp8_kv_cache else shape.dtype_bytes
    return _KV_DTYPE_BYTES[kv_cache_dtype]


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_cache_dtype: str) -> int:
    """KV cache bytes one token takes on each TP rank (SGLang's `cell_size`)."""
    element = kv_dtype_bytes(shape, kv_cache_dtype)
    if shape.is_mla:
        assert shape.kv_lora_rank is not None
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * shape.num_layers * element
    heads_per_rank = max(1, shape.num_kv_heads // tp)
    return heads_per_rank * (shape.head_dim + shape.v_head_dim) * shape.num_layers * element


@dataclass(frozen=True)
class ServerConfig:
    """The SGLang flags that decide memory."""

    tp: int
    mem_fraction_static: float
    kv_cache_dtype: str = "auto"
    # GB (10^9 bytes) per TP rank; 0 sizes the host cache by hicache_ratio instead.
    hicache_size: int = 0
    # Host cache tokens per GPU KV token, when hicache_size is 0; both 0 = no hierarchical cache.
    hicache_ratio: float = 0.0


@dataclass(frozen=True)
class Machine:
    gpu_mem_gib: float
    host_available_gib: float
    host_total_gib: float | None = None


@dataclass(frozen=True)
class Assumptions:
    """Per-GPU figures SGLang only learns at run time, measured on the Kimi-K2.5 TP8 run on 96 GiB GPUs:
    0.82 GiB left after CUDA graph capture at mem_fraction_static 0.93, 5.5 GiB at 0.88. Those two points
    give 93.6 GiB free before the weights load (so 2.4 GiB of CUDA context and NCCL buffers) and 5.7 GiB
    taken outside the static pool before serving (CUDA graphs, the request-to-token table, buffers)."""

    cuda_context_gib: float = 2.4
    runtime_overhead_gib: float = 5.7
    # The first big prefill crashed with 0.82 GiB left; 5.5 GiB held.
    min_headroom_gib: float = 4.0


@dataclass(frozen=True)
class Workload:
    short_concurrency: int
    long_concurrency: int
    avg_short_tokens: int
    avg_long_tokens: int
    # The longest request the fleet sends (prompt + max_new_tokens); one must fit in the GPU KV cache.
    max_request_tokens: int


@dataclass
class Plan:
    server: ServerConfig
    machine: Machine
    assumptions: Assumptions
    workload: Workload
    is_mla: bool
    kv_bytes_per_token: int
    weights_bytes: int
    weights_per_rank_gib: float
    replicated_gib: float
    static_pool_gib: float
    kv_pool_gib: float
    kv_tokens_gpu: int
    reserve_gib: float
    headroom_gib: float
    max_mem_fraction_static: float
    host_cache_tokens: int
    host_cache_gib_per_rank: float
    host_cache_gib_total: float
    host_needed_gib: float
    recommended_concurrency: dict[str, int]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def hicache_enabled(self) -> bool:
        return self.host_cache_tokens > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "warnings": self.warnings,
            "tp": self.server.tp,
            "mem_fraction_static": self.server.mem_fraction_static,
            "kv_cache_dtype": self.server.kv_cache_dtype,
            "hicache_size": self.server.hicache_size,
            "hicache_ratio": self.server.hicache_ratio,
            "gpu_mem_gib": self.machine.gpu_mem_gib,
            "weights_gb": round(self.weights_bytes / 1e9, 3),
            "weights_per_rank_gib": round(self.weights_per_rank_gib, 3),
            "static_pool_gib": round(self.static_pool_gib, 3),
            "kv_pool_gib": round(self.kv_pool_gib, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_tokens_gpu": self.kv_tokens_gpu,
            "headroom_gib": round(self.headroom_gib, 3),
            "max_mem_fraction_static": self.max_mem_fraction_static,
            "host_cache_tokens": self.host_cache_tokens,
            "host_cache_gib_per_rank": round(self.host_cache_gib_per_rank, 3),
            "host_cache_gib_total": round(self.host_cache_gib_total, 3),
            "host_needed_gib": round(self.host_needed_gib, 3),
            "host_available_gib": round(self.machine.host_available_gib, 3),
            "recommended_concurrency": self.recommended_concurrency,
        }


def make_plan(
    shape: ModelShape,
    weights_bytes: int,
    server: ServerConfig,
    machine: Machine,
    workload: Workload,
    assumptions: Assumptions | None = None,
) -> Plan:
    """Size the GPU and host KV caches of one configuration and list what would make it fail."""
    assumptions = assumptions or Assumptions()
    tp, fraction = server.tp, server.mem_fraction_static
    cell = kv_bytes_per_token(shape, tp, server.kv_cache_dtype)

    replicated_gib = shape.replicated_weight_bytes * (1 - 1 / tp) / GIB
    weights_gib = weights_bytes / tp / GIB + replicated_gib
    pre_load_free_gib = machine.gpu_mem_gib - assumptions.cuda_context_gib
    static_gib = pre_load_free_gib * fraction
    kv_pool_gib = static_gib - weights_gib
    kv_tokens = max(0, int(kv_pool_gib * GIB) // cell)
    reserve_gib = pre_load_free_gib * (1 - fraction)
    headroom_gib = reserve_gib - assumptions.runtime_overhead_gib
    needed_outside = assumptions.runtime_overhead_gib + assumptions.min_headroom_gib
    max_fraction = math.floor((1 - needed_outside / pre_load_free_gib) * 100) / 100

    host_tokens = _host_cache_tokens(server, cell, kv_tokens)
    host_per_rank_gib = host_tokens * cell / GIB
    host_total_gib = host_per_rank_gib * tp
    host_needed_gib = host_total_gib + HICACHE_HOST_RESERVE_BYTES / GIB if host_tokens else 0.0

    plan = Plan(
        server=server,
        machine=machine,
        assumptions=assumptions,
        workload=workload,
        is_mla=shape.is_mla,
        kv_bytes_per_token=cell,
        weights_bytes=weights_bytes,
        weights_per_rank_gib=weights_gib,
        replicated_gib=replicated_gib,
        static_pool_gib=static_gib,
        kv_pool_gib=kv_pool_gib,
        kv_tokens_gpu=kv_tokens,
        reserve_gib=reserve_gib,
        headroom_gib=headroom_gib,
        max_mem_fraction_static=max_fraction,
        host_cache_tokens=host_tokens,
        host_cache_gib_per_rank=host_per_rank_gib,
        host_cache_gib_total=host_total_gib,
        host_needed_gib=host_needed_gib,
        recommended_concurrency=_concurrency(workload, kv_tokens),
    )
    _check_gpu(plan, weights_gib)
    _check_host(plan, cell)
    return plan


def _host_cache_tokens(server: ServerConfig, cell: int, kv_tokens: int) -> int:
    """HostKVCache's size: `hicache_size * 1e9 // bytes_per_token` or the device pool times the ratio,
    then one page more (page size 1)."""
    if server.hicache_size > 0:
        return server.hicache_size * HICACHE_GB // cell + 1
    if server.hicache_ratio > 0:
        return int(kv_tokens * server.hicache_ratio) + 1
    return 0


def _concurrency(workload: Workload, kv_tokens: int) -> dict[str, int]:
    """Scale the configured short:long mix to what the GPU KV cache holds at the average request sizes.
    Running requests must have their KV on the GPU; the host cache only keeps evicted prefixes."""
    demand = (
        workload.short_concurrency * workload.avg_short_tokens + workload.long_concurrency * workload.avg_long_tokens
    )
    scale = kv_tokens / demand
    return {
        "short": int(workload.short_concurrency * scale),
        "long": int(workload.long_concurrency * scale),
    }


def _check_gpu(plan: Plan, weights_gib: float) -> None:
    server, machine, assumptions = plan.server, plan.machine, plan.assumptions
    fraction = server.mem_fraction_static
    if plan.kv_pool_gib <= 0:
        plan.problems.append(
            f"weights take {weights_gib:.1f} GiB per GPU but the static pool at mem_fraction_static "
            f"{fraction} is only {plan.static_pool_gib:.1f} GiB: use a larger --tp or GPUs with more memory"
        )
        return
    if plan.headroom_gib < assumptions.min_headroom_gib:
        plan.problems.append(
            f"mem_fraction_static {fraction} leaves {plan.headroom_gib:.2f} GiB per GPU for activations "
            f"after CUDA graphs (needs {assumptions.min_headroom_gib:.1f}; the first big prefill runs out "
            f"of memory): lower --mem-fraction-static to at most {plan.max_mem_fraction_static:.2f}"
        )
    if plan.kv_tokens_gpu < plan.workload.max_request_tokens:
        plan.problems.append(
            f"the GPU KV cache holds {plan.kv_tokens_gpu:,} tokens, less than one request of "
            f"{plan.workload.max_request_tokens:,} tokens: raise --mem-fraction-static or --tp, use "
            f"--kv-cache-dtype fp8_e4m3, or lower FLEET_CONTEXT_LENGTH"
        )
    reserve_total_gib = machine.gpu_mem_gib * (1 - fraction)
    if machine.gpu_mem_gib > SGLANG_MIN_RESERVE_FROM_GIB and reserve_total_gib < SGLANG_MIN_RESERVE_GIB:
        plan.warnings.append(
            f"mem_fraction_static {fraction} leaves {reserve_total_gib:.1f} GiB per GPU outside the static "
            f"pool; SGLang's automatic setting never leaves less than {SGLANG_MIN_RESERVE_GIB:.0f} GiB"
        )
    supported = plan.recommended_concurrency
    workload = plan.workload
    if workload.short_concurrency > supported["short"] or workload.long_concurrency > supported["long"]:
        plan.warnings.append(
            f"FLEET_SHORT_CONCURRENCY={workload.short_concurrency} and FLEET_LONG_CONCURRENCY="
            f"{workload.long_concurrency} need more KV cache than the GPUs hold at the average request "
            f"sizes; SGLang will queue or retract requests beyond about {supported['short']} short + "
            f"{supported['long']} long"
        )


def _check_host(plan: Plan, cell: int) -> None:
    if not plan.hicache_enabled:
        return
    server, machine = plan.server, plan.machine
    available_for_cache = machine.host_available_gib * GIB - HICACHE_HOST_RESERVE_BYTES
    if plan.host_needed_gib > machine.host_available_gib:
        if server.hicache_size > 0:
            most = max(0, int(available_for_cache / server.tp // HICACHE_GB))
            change = f"lower --hicache-size to at most {most} (GB per rank)"
            asked = f"--hicache-size {server.hicache_size} GB per rank"
        else:
            most_ratio = math.floor(available_for_cache / server.tp / cell / max(plan.kv_tokens_gpu, 1) * 100) / 100
            change = f"lower --hicache-ratio to at most {most_ratio}"
            asked = f"--hicache-ratio {server.hicache_ratio}"
        plan.problems.append(
            f"the hierarchical cache needs {plan.host_needed_gib:.1f} GiB of host memory ({asked} x "
            f"{server.tp} ranks = {plan.host_cache_gib_total:.1f} GiB + SGLang's 10 GiB reserve) but "
            f"{machine.host_available_gib:.1f} GiB is available: {change}"
        )
    if plan.host_cache_tokens <= plan.kv_tokens_gpu:
        plan.warnings.append(
            f"the host cache ({plan.host_cache_tokens:,} tokens per rank) is no larger than the GPU KV cache "
            f"({plan.kv_tokens_gpu:,}); SGLang warns that it then adds little"
        )
