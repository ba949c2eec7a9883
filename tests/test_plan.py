"""`python -m server plan`: SGLang's memory arithmetic against hand computations and the old run's failures.

The old run: Kimi-K2.5 at TP 8 on 96 GiB GPUs with ~449 GiB of host memory. It crashed at
mem_fraction_static 0.93 (0.82 GiB left per GPU after CUDA graphs), hung with --hicache-size 300 (GB per
rank, 2.4 TB in all), and held at 0.88 with a bf16 KV cache and --hicache-size 48: ~116K GPU KV tokens at
0.85, ~159K at 0.88, ~5.5 GiB left per GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.protocol.keys import partition_key
from common.settings import Settings
from server.capacity import GIB, Machine, ModelShape, Plan, ServerConfig, Workload, kv_bytes_per_token, make_plan
from server.plan import measured_prompt_tokens, unmodeled, workload
from tests.harness import ROOT, RedisServer, free_port

# Kimi-K2.5's config.json: a DeepSeek-V3 language model under text_config, experts in INT4.
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {
        "model_type": "kimi_k2",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "n_routed_experts": 384,
        "first_k_dense_replace": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors"},
    },
}
# The old run's checkpoint size is not at hand; Kimi-K2.5 is published as about 595-630 GB, and 603 GB
# (10^9 bytes) is the size at which this arithmetic meets the run's measured 116K / 159K tokens.
KIMI_WEIGHTS = 603 * 10**9

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
LLAMA_70B_WEIGHTS = 141_107_412_992

WORKLOAD = Workload(
    short_concurrency=150, long_concurrency=32, avg_short_tokens=3000, avg_long_tokens=12000, max_request_tokens=32768
)
OLD_MACHINE = Machine(gpu_mem_gib=96, host_available_gib=449)


def kimi_plan(fraction: float, hicache_size: int = 48, kv_cache_dtype: str = "bf16") -> Plan:
    server = ServerConfig(tp=8, mem_fraction_static=fraction, kv_cache_dtype=kv_cache_dtype, hicache_size=hicache_size)
    return make_plan(ModelShape.from_config(KIMI_K25), KIMI_WEIGHTS, server, OLD_MACHINE, WORKLOAD)


def test_mla_figures_match_a_hand_computation() -> None:
    plan = kimi_plan(0.88)
    # MLA keeps one latent per token and layer, on every rank: (kv_lora_rank + qk_rope_head_dim) x layers x bf16.
    assert plan.kv_bytes_per_token == (512 + 64) * 61 * 2 == 70_272
    # Every rank holds two kinds of weights whole, of which 1/8 is in its share of the total anyway:
    # the MLA down-projection, 61 layers x 7168 x (1536 + 512 + 64) x 2 bytes, and the routers,
    # 60 MoE layers x 384 experts x 7168 x 2 bytes: 1.774 GiB more than 603 GB / 8 = 70.199 GiB.
    replicated = (61 * 7168 * (1536 + 512 + 64) * 2 + 60 * 384 * 7168 * 2) * 7 / 8
    weights_per_rank = KIMI_WEIGHTS / 8 + replicated
    assert plan.weights_per_rank_gib == pytest.approx(71.973, abs=0.001)
    # The static pool is mem_fraction_static of what is free before loading: (96 - 2.4) x 0.88 = 82.368 GiB,
    # which leaves 82.368 - 71.973 = 10.395 GiB of KV cache: 10.395 GiB / 70,272 bytes = 158,838 tokens.
    kv_pool = (96 - 2.4) * 0.88 * GIB - weights_per_rank
    assert plan.kv_tokens_gpu == pytest.approx(kv_pool // 70_272, abs=1)
    assert plan.kv_tokens_gpu == 158_838
    # The rest of the free memory, (96 - 2.4) x 0.12 = 11.232 GiB, less 5.7 GiB of CUDA graphs and buffers.
    assert plan.headroom_gib == pytest.approx(93.6 * 0.12 - 5.7) == pytest.approx(5.532)
    # --hicache-size 48 is 48e9 bytes per rank: 48e9 // 70,272 + 1 = 683,061 tokens; 8 ranks x 44.70 GiB.
    assert plan.host_cache_tokens == 48 * 10**9 // 70_272 + 1 == 683_061
    assert plan.host_cache_gib_total == pytest.approx(683_061 * 70_272 * 8 / GIB) == pytest.approx(357.63, abs=0.01)
    # Short:long at 150:32 with 3,000 and 12,000 tokens a request need 834,000 tokens; 158,838 hold 19%.
    assert plan.recommended_concurrency == {"short": int(150 * 158_838 / 834_000), "long": int(32 * 158_838 / 834_000)}
    assert plan.recommended_concurrency == {"short": 28, "long": 6}


def test_mla_matches_the_old_runs_capacity() -> None:
    """~116K tokens at 0.85 and ~159K at 0.88; fp8 halves the cell and doubles the tokens."""
    assert 115_000 < kimi_plan(0.85).kv_tokens_gpu < 117_000
    assert 158_000 < kimi_plan(0.88).kv_tokens_gpu < 160_000
    fp8 = kimi_plan(0.88, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes_per_token == (512 + 64) * 61 * 1
    assert fp8.kv_tokens_gpu == pytest.approx(2 * 158_838, abs=2)


def test_gqa_figures_match_a_hand_computation() -> None:
    shape = ModelShape.from_config(LLAMA_70B)
    server = ServerConfig(tp=4, mem_fraction_static=0.85, kv_cache_dtype="bf16")
    plan = make_plan(shape, LLAMA_70B_WEIGHTS, server, Machine(gpu_mem_gib=80, host_available_gib=500), WORKLOAD)
    # GQA splits the 8 KV heads over the ranks: 8 // 4 heads x (K 128 + V 128) x 80 layers x bf16.
    assert plan.kv_bytes_per_token == (8 // 4) * (128 + 128) * 80 * 2 == 81_920
    # Nothing is replicated: 141.1 GB / 4 = 32.854 GiB per rank; (80 - 2.4) x 0.85 = 65.96 GiB static pool,
    # 33.106 GiB of KV cache / 81,920 bytes = 433,925 tokens.
    assert plan.weights_per_rank_gib == pytest.approx(LLAMA_70B_WEIGHTS / 4 / GIB) == pytest.approx(32.854, abs=0.001)
    assert plan.kv_tokens_gpu == pytest.approx(((80 - 2.4) * 0.85 * GIB - LLAMA_70B_WEIGHTS / 4) // 81_920, abs=1)
    assert plan.kv_tokens_gpu == 433_925
    assert plan.headroom_gib == pytest.approx(77.6 * 0.15 - 5.7)
    assert plan.ok and not plan.hicache_enabled
    # With more ranks than KV heads each rank keeps one head (SGLang's max(1, heads // tp)).
    assert kv_bytes_per_token(shape, 16, "auto") == 1 * (128 + 128) * 80 * 2


def test_refuses_mem_fraction_static_093_for_lack_of_headroom() -> None:
    plan = kimi_plan(0.93)
    # (96 - 2.4) x 0.07 - 5.7 = 0.852 GiB: the old run measured 0.82 GiB and crashed on the first big prefill.
    assert plan.headroom_gib == pytest.approx(93.6 * 0.07 - 5.7) == pytest.approx(0.852)
    assert not plan.ok
    [problem] = plan.problems
    assert "0.85 GiB per GPU" in problem
    # 1 - (5.7 + 4.0) / 93.6 = 0.896: the highest fraction that keeps 4 GiB of headroom.
    assert "lower --mem-fraction-static to at most 0.89" in problem


def test_refuses_hicache_size_300_per_rank_at_tp8() -> None:
    plan = kimi_plan(0.88, hicache_size=300)
    # 300 GB per rank x 8 ranks = 2,235 GiB + SGLang's 10 GiB reserve, against 449 GiB.
    assert plan.host_needed_gib == pytest.approx((300 * 10**9 // 70_272 + 1) * 70_272 * 8 / GIB + 10)
    assert plan.host_needed_gib > 2245
    [problem] = plan.problems
    assert "2245.2 GiB" in problem and "449.0 GiB" in problem
    # (449 - 10) GiB / 8 ranks = 58.9 GB per rank.
    assert "lower --hicache-size to at most 58 (GB per rank)" in problem


def test_accepts_the_working_configuration() -> None:
    plan = kimi_plan(0.88, hicache_size=48)
    assert plan.ok, plan.problems
    # 357.6 GiB of host cache + the 10 GiB reserve fits in 449.
    assert plan.host_needed_gib == pytest.approx(367.63, abs=0.01)
    assert plan.to_json()["recommended_concurrency"] == {"short": 28, "long": 6}


def test_refuses_a_kv_cache_smaller_than_one_request() -> None:
    # (96 - 2.4) x 0.80 = 74.88 GiB static - 71.973 GiB of weights = 2.907 GiB: 44,423 tokens, enough for
    # one 32,768-token request; at 0.78, 1.035 GiB holds 15,819 tokens, not enough.
    assert kimi_plan(0.80, hicache_size=0).kv_tokens_gpu == 44_423
    assert kimi_plan(0.80, hicache_size=0).ok
    lower = kimi_plan(0.78, hicache_size=0)
    assert lower.kv_tokens_gpu == 15_819
    [problem] = lower.problems
    assert "holds 15,819 tokens, less than one request of 32,768 tokens" in problem


# The command line, as a real process.


@pytest.fixture
def kimi_dir(tmp_path: Path) -> Path:
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(KIMI_K25))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": KIMI_WEIGHTS}}))
    return model


def plan_cli(*flags: str, **settings: object) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FLEET_")}
    env.update({f"FLEET_{name.upper()}": str(value) for name, value in settings.items()})
    return subprocess.run(
        [sys.executable, "-m", "server", "plan", *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


KIMI_FLAGS = ("--tp", "8", "--kv-cache-dtype", "bf16", "--gpu-mem-gib", "96", "--host-mem-gib", "449")
AVERAGES = ("--avg-short-tokens", "3000", "--avg-long-tokens", "12000")


@pytest.mark.e2e
def test_cli_json_of_the_working_configuration(kimi_dir: Path) -> None:
    result = plan_cli("--model", str(kimi_dir), *KIMI_FLAGS, "--hicache-size", "48", *AVERAGES, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["kv_bytes_per_token"] == 70_272
    assert report["kv_tokens_gpu"] == 158_838
    assert report["headroom_gib"] == pytest.approx(5.532)
    assert report["host_cache_gib_total"] == pytest.approx(357.63, abs=0.01)
    assert report["host_available_gib"] == 449 and report["weights_gb"] == 603
    assert report["recommended_concurrency"] == {"short": 28, "long": 6}


@pytest.mark.e2e
def test_cli_refuses_both_old_failures_one_line_each(kimi_dir: Path) -> None:
    flags = ("--model", str(kimi_dir), *KIMI_FLAGS, "--mem-fraction-static", "0.93", "--hicache-size", "300")
    result = plan_cli(*flags)
    assert result.returncode == 1
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused: ")]
    assert len(refusals) == 2
    assert "0.85 GiB per GPU" in refusals[0] and "at most 0.89" in refusals[0]
    assert "at most 58 (GB per rank)" in refusals[1]
    assert "GPU KV capacity" in result.stdout


@pytest.mark.e2e
def test_cli_reads_weights_from_a_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    weights_gib = str(LLAMA_70B_WEIGHTS / GIB)
    flags = ("--model-config", str(config), "--weights-gib", weights_gib, "--tp", "4", "--mem-fraction-static", "0.85")
    result = plan_cli(*flags, "--gpu-mem-gib", "80", "--host-mem-gib", "500", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["kv_tokens_gpu"] == pytest.approx(433_925, abs=1)
    # The same weights in GB of 10^9 bytes, as checkpoints are published, give the same plan.
    flags = (*flags[:2], "--weights-gb", str(LLAMA_70B_WEIGHTS / 1e9), *flags[4:])
    result = plan_cli(*flags, "--gpu-mem-gib", "80", "--host-mem-gib", "500", "--json")
    assert json.loads(result.stdout)["kv_tokens_gpu"] == pytest.approx(433_925, abs=1)


@pytest.mark.e2e
def test_cli_with_the_old_runs_published_sizes_predicts_its_capacity(tmp_path: Path) -> None:
    """Kimi-K2.5 published as 595 GB, 96 GiB GPUs, 445 GB of host memory: the old run measured about 116K GPU
    KV tokens at 0.85 and 159K at 0.88, crashed at 0.93, and hung with --hicache-size 300."""
    config = tmp_path / "kimi.json"
    config.write_text(json.dumps(KIMI_K25))
    machine = ("--model-config", str(config), "--weights-gb", "595", "--tp", "8", "--kv-cache-dtype", "bf16")
    machine += ("--gpu-mem-gib", "96", "--host-mem-gb", "445", "--hicache-size", "48", "--json")
    for fraction, measured in (("0.85", 116_000), ("0.88", 159_000)):
        report = json.loads(plan_cli(*machine, "--mem-fraction-static", fraction).stdout)
        assert report["kv_tokens_gpu"] == pytest.approx(measured, rel=0.15)
    assert json.loads(plan_cli(*machine, "--mem-fraction-static", "0.93").stdout)["ok"] is False
    refused = json.loads(plan_cli(*machine, "--mem-fraction-static", "0.88", "--hicache-size", "300").stdout)
    assert refused["ok"] is False and "--hicache-size" in refused["problems"][0]


@pytest.mark.e2e
def test_cli_without_gpus_needs_gpu_mem_gb(kimi_dir: Path, tmp_path: Path) -> None:
    probe = tmp_path / "gpus.json"
    probe.write_text(json.dumps({"gpus": []}))
    result = plan_cli("--model", str(kimi_dir), "--tp", "8", gpu_probe_file=probe)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "no GPU visible" in line and "--gpu-mem-gib" in line


@pytest.mark.e2e
def test_cli_refuses_gpus_held_by_other_processes(kimi_dir: Path, tmp_path: Path) -> None:
    probe = tmp_path / "gpus.json"
    gpus = [{"total_gib": 96, "processes": [{"pid": 4242, "used_gib": 80}] if index == 3 else []} for index in range(8)]
    probe.write_text(json.dumps({"gpus": gpus}))
    result = plan_cli("--model", str(kimi_dir), "--tp", "8", "--host-mem-gib", "449", "--json", gpu_probe_file=probe)
    assert result.returncode == 1
    [problem] = json.loads(result.stdout)["problems"]
    assert "PID 4242 (GPU 3, 80.0 GiB)" in problem


def test_kv_dtype_auto_resolves_as_sglang_does() -> None:
    fp8_kv = {**LLAMA_70B, "quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}}
    bf16, fp8 = ModelShape.from_config(LLAMA_70B), ModelShape.from_config(fp8_kv)
    assert kv_bytes_per_token(fp8, 4, "auto") * 2 == kv_bytes_per_token(bf16, 4, "auto")
    assert kv_bytes_per_token(fp8, 4, "bf16") == kv_bytes_per_token(bf16, 4, "auto")
    # A float32 checkpoint is served in float16.
    float32 = ModelShape.from_config({**LLAMA_70B, "torch_dtype": "float32"})
    assert kv_bytes_per_token(float32, 4, "auto") == kv_bytes_per_token(bf16, 4, "auto")


def test_flags_whose_memory_the_plan_does_not_model_are_named() -> None:
    warnings = unmodeled("--trust-remote-code --speculative-algorithm EAGLE3 --cuda-graph-max-bs=64")
    assert len(warnings) == 2 and "--speculative-algorithm" in warnings[0] and "--cuda-graph-max-bs" in warnings[1]
    assert unmodeled("--trust-remote-code --reasoning-parser kimi_k2") == []


def test_concurrency_is_recommended_for_prompt_and_output_sizes() -> None:
    settings = Settings(short_concurrency=150, long_concurrency=32)
    sized = workload(settings, avg_prompt_tokens=2000, avg_output_tokens=2000)
    assert (sized.avg_short_tokens, sized.avg_long_tokens) == (4000, 4000)
    plan = make_plan(
        ModelShape.from_config(KIMI_K25),
        KIMI_WEIGHTS,
        ServerConfig(tp=8, mem_fraction_static=0.88, kv_cache_dtype="bf16", hicache_size=48),
        OLD_MACHINE,
        sized,
    )
    # The old run held about 50 requests of 4K tokens at once in 159K tokens.
    assert plan.recommended_concurrency == {"short": 32, "long": 6}


def test_the_mean_prompt_length_enqueue_recorded_sizes_the_plan(redis_server: RedisServer, redis_client) -> None:
    redis_client.hset(partition_key("a"), mapping={"total": 300, "mean_prompt_tokens": 1000})
    redis_client.hset(partition_key("b"), mapping={"total": 100, "mean_prompt_tokens": 3000})
    redis_client.hset(partition_key("c"), mapping={"total": 50})
    assert measured_prompt_tokens(Settings(redis_url=redis_server.url)) == 1500
    assert measured_prompt_tokens(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")) is None
