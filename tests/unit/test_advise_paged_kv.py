"""copt advise models copt serve's paged KV cache: the pool it sizes, the concurrency it predicts at a context length
(block rounding, --max-batch-size, fp8 blocks, a shared prefix stored once) and the prefill prefix caching saves —
checked against the engine itself on the CPU fixture model."""

from __future__ import annotations

import random

import pytest

from clusteropt_cli.core.advise.api import advise, resolve_target
from clusteropt_cli.core.advise.memory import serving_capacity
from clusteropt_cli.core.advise.plan import InferPlan, Target
from clusteropt_cli.core.serve.kv_blocks import cacheable_blocks, max_concurrent_sequences
from clusteropt_cli.modelspec import load_model_spec

GIB = 0.001  # --kv-cache-memory of the engine tests: 524 fp32 tokens of the fixture teacher, 32 blocks of 16
CPU = Target(None, budget_bytes=8 * 2**30)


def _plan(prompt_len: int, gen_len: int = 1, **kw) -> InferPlan:
    settings = dict(batch=64, prompt_len=prompt_len, gen_len=gen_len, continuous_batching=True,
                    kv_cache_memory_gib=GIB, max_batch_size=16, max_model_len=128)
    settings.update(kw)
    return InferPlan(**settings)


def _predicted(spec, plan: InferPlan) -> int:
    return advise(spec, CPU, plan)["time"]["max_concurrent_seqs"]


def _engine(fixtures, **kw):
    from clusteropt_cli.core.serve.engine import Engine, EngineConfig

    settings = dict(model=str(fixtures.teacher), device="cpu", kv_cache_memory_gib=GIB, max_model_len=128,
                    max_batch_size=16, compile=False)
    settings.update(kw)
    return Engine(EngineConfig(**settings))


def _prompts(n: int, length: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = list(prefix or [])
    return [head + [rng.randrange(10, 1000) for _ in range(length - len(head))] for _ in range(n)]


# ---- the rules (no engine) ------------------------------------------------------------------------------------
def test_block_rules():
    # ceil(L / 16) blocks per sequence; the batch cap; a pool smaller than one sequence holds none
    assert max_concurrent_sequences(100, 16, 16, 1000) == 100
    assert max_concurrent_sequences(100, 16, 17, 1000) == 50
    assert max_concurrent_sequences(100, 16, 17, 64) == 50 and max_concurrent_sequences(100, 16, 1, 64) == 64
    assert max_concurrent_sequences(3, 16, 64, 8) == 0
    # a shared prefix: its full blocks once, at most (prompt - 1) // 16 of them (the last prompt token is computed)
    assert cacheable_blocks(2128, 2000, 16) == 125 and cacheable_blocks(64, 64, 16) == 3
    assert max_concurrent_sequences(1000, 16, 2255, 10**6, 2128, 2000) == (1000 - 125) // (141 - 125)


def test_paged_capacity_on_a_gpu_follows_the_engine_budget():
    spec = load_model_spec("llama-3.1-8b")
    h200, _ = resolve_target("h200")
    base = InferPlan(prompt_len=32000, gen_len=768, continuous_batching=True, max_batch_size=1024)
    cap = serving_capacity(spec, base, h200)
    assert cap.layout == "paged" and cap.bytes_per_token == 2 * 32 * 8 * 128 * 2  # bf16 KV of the 8B shape
    assert cap.num_blocks == cap.capacity_tokens // 16
    assert cap.kv_concurrent_seqs == cap.num_blocks // -(-32767 // 16) == cap.max_concurrent_seqs
    # fp8 blocks: half the bytes per token, twice the blocks
    fp8 = serving_capacity(spec, base.with_(kv_cache="fp8"), h200)
    assert fp8.bytes_per_token * 2 == cap.bytes_per_token and abs(fp8.num_blocks - 2 * cap.num_blocks) <= 1
    # --max-batch-size caps short contexts; the copt default (256) when not given
    short = serving_capacity(spec, base.with_(prompt_len=512, gen_len=256, max_batch_size=None), h200)
    assert short.kv_concurrent_seqs > 256 and short.max_concurrent_seqs == 256
    # a 2,000-token shared prefix: stored once, so far more sequences of 2,128 + 128 tokens fit
    plain = serving_capacity(spec, base.with_(prompt_len=2128, gen_len=128), h200)
    shared = serving_capacity(spec, base.with_(prompt_len=2128, gen_len=128, shared_prefix_len=2000), h200)
    assert shared.shared_blocks == 125 and shared.kv_concurrent_seqs > 8 * plain.kv_concurrent_seqs
    off = serving_capacity(spec, base.with_(prompt_len=2128, gen_len=128, shared_prefix_len=2000,
                                            prefix_caching=False), h200)
    assert off.kv_concurrent_seqs == plain.kv_concurrent_seqs and off.prefix_hit_rate == 0
    # --gpu-memory-utilization: the engine's own budget (utilization × total − weights − activation_reserve)
    from clusteropt_cli.core.advise.memory import _engine_config, weight_bytes
    from clusteropt_cli.core.serve.kv_budget import activation_reserve

    util = serving_capacity(spec, base.with_(gpu_memory_utilization=0.9), h200)
    reserve = activation_reserve(_engine_config(spec), 2048, 1024, 2)
    budget = int(h200.memory_bytes * 0.9) - int(weight_bytes(spec, "bf16")) - reserve
    assert util.capacity_tokens == budget // cap.bytes_per_token // 16 * 16
    # the old slot layout reserves max_model_len per sequence: 8k-token requests under a 32k max_model_len
    eight_k = base.with_(prompt_len=8000, gen_len=193, max_model_len=32768)
    slots = serving_capacity(spec, eight_k.with_(kv_layout="slots"), h200)
    paged = serving_capacity(spec, eight_k, h200)
    assert slots.layout == "slots" and slots.max_concurrent_seqs == cap.capacity_tokens // 32768 == 26
    assert paged.max_concurrent_seqs == cap.num_blocks // 512 > 4 * slots.max_concurrent_seqs


def test_prefix_caching_lowers_ttft_and_raises_throughput():
    spec = load_model_spec("llama-3.1-8b")
    h200, _ = resolve_target("h200")
    plan = InferPlan(batch=256, prompt_len=2128, gen_len=128, continuous_batching=True, max_batch_size=256)
    plain = advise(spec, h200, plan)
    shared = advise(spec, h200, plan.with_(shared_prefix_len=2000))
    assert shared["time"]["prefix_hit_rate"] == pytest.approx(2000 / 2128)
    assert shared["time"]["ttft_s"] < plain["time"]["ttft_s"] / 3
    assert shared["time"]["output_tokens_per_s"] > plain["time"]["output_tokens_per_s"]
    assert shared["memory"]["breakdown"]["kv_cache"] < plain["memory"]["breakdown"]["kv_cache"] / 5
    # with caching off the prefix is not priced as shared, and prefix caching is recommended
    off = advise(spec, h200, plan.with_(shared_prefix_len=2000, prefix_caching=False), ["high-ttft"])
    assert off["time"]["ttft_s"] == pytest.approx(plain["time"]["ttft_s"])
    rec = next(r for r in off["recommendations"] if r["id"] == "prefix-caching")
    assert rec["predicted"]["ttft_s"] == pytest.approx(shared["time"]["ttft_s"])
    assert "--enable-prefix-caching" in rec["command"] or "--no-enable-prefix-caching" not in rec["command"]
    # no shared prefix named: prefix caching is listed as not applicable, saying how to price one
    assert "prefix-caching" in [n["id"] for n in plain["not_applicable"]]


def test_shared_prefix_flag(copt):
    import json

    r = copt("advise", "--task", "infer", "--model", "llama-3.1-8b", "--gpu", "h200", "--batch", "256",
             "--prompt-len", "2128", "--gen-len", "128", "--shared-prefix-len", "2000", "max_batch_size=512", "--json")
    doc = json.loads(r.stdout)
    assert doc["workload"]["shared_prefix_len"] == 2000 and doc["workload"]["max_batch_size"] == 512
    assert doc["kv_cache"]["shared_blocks"] == 125 and doc["time"]["max_concurrent_seqs"] == 512
    r = copt("advise", "--task", "infer", "--model", "llama-3.1-8b", "--gpu", "h200", "--prompt-len", "100",
             "--shared-prefix-len", "200")
    assert r.returncode == 2 and "--shared-prefix-len" in r.stderr


# ---- against the engine (CPU fixture model) ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("layout,kv_dtype", [("paged", "auto"), ("paged", "fp8"), ("slots", "auto")])
def test_predicted_concurrency_is_what_the_engine_sizes(fixtures, layout, kv_dtype):
    spec = load_model_spec(str(fixtures.teacher))
    with _engine(fixtures, kv_layout=layout, kv_cache_dtype=kv_dtype) as engine:
        engine.load()
        kv = advise(spec, CPU, _plan(100, kv_layout=layout, kv_cache="fp8" if kv_dtype == "fp8" else "bf16"))[
            "kv_cache"]
        if layout == "paged":
            pool = engine.pool
            assert kv["num_blocks"] == pool.num_blocks and kv["block_size"] == pool.block_size
            for context in (1, 16, 17, 40, 100, 128):
                admitted = min(engine.config.max_batch_size, pool.num_blocks // pool.blocks_for(context))
                plan = _plan(context, kv_layout=layout, kv_cache="fp8" if kv_dtype == "fp8" else "bf16")
                assert _predicted(spec, plan) == admitted, context
        else:
            assert engine.pool is None and kv["layout"] == "slots"
            for context in (16, 100, 128):
                assert _predicted(spec, _plan(context, kv_layout="slots")) == engine.num_slots
            assert _predicted(spec, _plan(129, kv_layout="slots")) == 0  # beyond max_model_len


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("shared", [0, 64])
def test_engine_admits_what_advise_predicts(fixtures, shared):
    """Requests of 100 prompt tokens (+ 8 generated, within the prompt's last block: no block grows, nothing is
    preempted) run at most as many at once as advise predicts; with a 64-token shared prefix (4 blocks) cached by
    a first request, 9 instead of 4."""
    from clusteropt_cli.core.serve.engine import GenerationRequest

    spec = load_model_spec(str(fixtures.teacher))
    plan = _plan(100, gen_len=8, shared_prefix_len=shared)
    predicted = _predicted(spec, plan)
    assert predicted == (9 if shared else 4)
    prefix = _prompts(1, shared, seed=1)[0] if shared else []
    prompts = _prompts(3 * predicted, 100, seed=2, prefix=prefix)
    with _engine(fixtures) as engine:
        if shared:  # one request computes the prefix (the first request of a real workload does)
            engine.generate([GenerationRequest(prompt_ids=_prompts(1, 100, 3, prefix)[0], max_new_tokens=1)])
        results = engine.generate([GenerationRequest(prompt_ids=p, max_new_tokens=8, ignore_eos=True)
                                   for p in prompts], timeout=300)
        peak = engine.stats.peak_running
        hits = engine.pool.stats.hits
    assert all(r.finish_reason == "length" for r in results)
    assert abs(peak - predicted) <= 0.1 * predicted, (peak, predicted)
    if shared:
        assert hits >= len(prompts) * shared // 16 * 16


def test_layout_is_the_engines_choice_for_every_preset():
    """advise reads the raw config.json; the engine the config transformers loads (which derives sliding-window
    layer types): both choose the same KV layout for every preset."""
    from transformers import AutoConfig

    from clusteropt_cli.core.advise.memory import kv_layout
    from clusteropt_cli.core.serve.architectures import inspect_architecture
    from clusteropt_cli.modelspec import list_presets

    plan = InferPlan(continuous_batching=True)
    layouts = {}
    for name in list_presets():
        spec = load_model_spec(name)
        arch = inspect_architecture(AutoConfig.for_model(**spec.to_hf_config()), spec.max_position_embeddings)
        layouts[name] = kv_layout(spec, plan)
        assert layouts[name] == ("paged" if arch.native and not arch.sliding_layers else "slots"), name
    assert layouts["qwen2.5-7b"] == "paged" and layouts["mistral-7b"] == "slots"  # use_sliding_window false / 4096
