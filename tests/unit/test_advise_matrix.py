"""advise decision matrix: ranking per symptom and applicability checks (in-process, no subprocess)."""

from __future__ import annotations

import pytest

from clusteropt_cli.core.advise import calibration as cal
from clusteropt_cli.core.advise.api import advise, resolve_target
from clusteropt_cli.core.advise.plan import InferPlan, TrainPlan
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.modelspec import load_model_spec


def _ids(result: dict, n: int | None = None) -> list[str]:
    return [r["id"] for r in result["recommendations"]][:n]


def test_oom_70b_on_8xh100_ranks_partitioning_offload_checkpointing_first() -> None:
    target, _ = resolve_target("h100-sxm", gpus=8)
    result = advise(load_model_spec("llama-3.1-70b"), target, TrainPlan(micro_batch=1, seq_len=4096), ["oom"])
    assert result["memory"]["fits"] is False
    assert set(_ids(result, 3)) <= {"zero-3", "cpu-offload", "nvme-offload", "activation-checkpointing"}
    assert result["top_plan"]["memory"]["fits"] is True  # the stacked plan fits
    assert result["top_plan"]["workload"]["zero"] == 3


def test_high_ttft_chunked_prefill_first() -> None:
    target, _ = resolve_target("h100-sxm")
    result = advise(load_model_spec("llama-3.1-8b"), target, InferPlan(batch=32, prompt_len=2048), ["high-ttft"])
    assert _ids(result)[0] == "chunked-prefill"
    chunked = result["recommendations"][0]
    # the static batch's first tokens wait for every prompt; chunked, first come first served, the median request
    # waits for half of them (at copt serve's measured prefill efficiency, 0.13 of peak, against the static
    # baseline's 0.5): still a ~1.9x cut
    assert chunked["predicted"]["ttft_s"] < result["time"]["ttft_s"] / 1.8


def test_what_copt_serve_runs_by_default_is_not_recommended_to_it() -> None:
    """copt serve chunks prompts within --max-batch-tokens (2048 on CUDA) and compiles its decode with CUDA graphs: on
    its plan those recommendations would change nothing, so they are left out. With a larger step budget chunked
    prefill comes back (to 2048); a static batch on HF generate gets both, priced on copt serve."""
    target, _ = resolve_target("h200")
    spec = load_model_spec("llama-3.1-8b")
    served = InferPlan(batch=64, prompt_len=2048, continuous_batching=True)
    for symptom in ("high-ttft", "slow-tpot"):
        result = advise(spec, target, served, [symptom])
        listed = set(_ids(result)) | {n["id"] for n in result["not_applicable"]}
        assert not listed & {"chunked-prefill", "operator-fusion"}, listed
    wide = advise(spec, target, served.with_(chunked_prefill=8192), ["high-ttft"])
    chunked = next(r for r in wide["recommendations"] if r["id"] == "chunked-prefill")
    assert "--max-batch-tokens 2048" in chunked["command"]
    static = advise(spec, target, InferPlan(batch=64, prompt_len=2048), ["slow-tpot"])
    fused = next(r for r in static["recommendations"] if r["id"] == "operator-fusion")
    assert fused["predicted"]["tpot_s"] < static["time"]["tpot_s"] / 1.5  # 18 against 36 ms


def test_slow_tpot_speculative_quantization_kv() -> None:
    target, _ = resolve_target("h100-sxm")
    # the plan copt serve runs (continuous batching), as `copt advise --task infer` builds it
    result = advise(load_model_spec("llama-3.1-8b"), target, InferPlan(batch=1, prompt_len=1024,
                                                                       continuous_batching=True), ["slow-tpot"])
    top = _ids(result, 4)
    assert "speculative-decoding" in top and ({"awq", "gptq"} & set(top))
    assert "kv-cache-quantization" in _ids(result)
    # at batch 64 speculative decoding no longer pays: it is listed as not applicable
    busy = advise(load_model_spec("llama-3.1-8b"), target, InferPlan(batch=64, continuous_batching=True),
                  ["slow-tpot"])
    assert "speculative-decoding" in [n["id"] for n in busy["not_applicable"]]


def test_low_throughput_continuous_batching_first() -> None:
    target, _ = resolve_target("h100-sxm")
    result = advise(load_model_spec("llama-3.1-8b"), target, InferPlan(batch=32, prompt_len=2048),
                    ["low-throughput"])
    ids = _ids(result)
    assert ids[0] == "continuous-batching"
    assert {"kv-cache-quantization", "awq"} <= set(ids)


@pytest.mark.parametrize("symptom", ["oom", "low-mfu", "low-throughput", "slow-tpot", "high-ttft"])
def test_fp8_never_for_a100(symptom: str) -> None:
    target, _ = resolve_target("a100-80g", gpus=8)
    spec = load_model_spec("llama-3.1-8b")
    for plan in (TrainPlan(micro_batch=4, seq_len=4096), InferPlan(batch=16)):
        result = advise(spec, target, plan, [symptom])
        assert not {"fp8", "fp8-w8a8"} & set(_ids(result))
        assert result["top_plan"]["workload"].get("precision") != "fp8"
        assert result["top_plan"]["workload"].get("weights") != "fp8"


def test_zero_needs_more_than_one_gpu() -> None:
    target, _ = resolve_target("h200")
    result = advise(load_model_spec("llama-3.1-8b"), target, TrainPlan(micro_batch=8, seq_len=4096), ["oom"])
    assert not {"zero-1", "zero-2", "zero-3"} & set(_ids(result))
    assert {"zero-1", "zero-2", "zero-3"} <= {n["id"] for n in result["not_applicable"]}
    assert _ids(result)[0] in {"cpu-offload", "activation-checkpointing"}


def test_impossible_plans_name_the_flag() -> None:
    target, _ = resolve_target("h100-sxm", gpus=8)
    spec = load_model_spec("llama-3.2-1b")
    with pytest.raises(BadInputError, match="--pipeline-stages 32 is more pipeline stages than the model's 16 layers"):
        advise(spec, target, TrainPlan(pp=32))
    with pytest.raises(BadInputError, match="--seq-len must be at least 1"):
        advise(spec, target, TrainPlan(seq_len=0))
    with pytest.raises(BadInputError, match="--offload needs DeepSpeed ZeRO"):
        advise(spec, target, TrainPlan(offload="cpu"))


def test_batch_one_decode_is_priced_with_copt_serves_autotuned_kernels() -> None:
    """copt serve's default --compile-mode auto autotunes the batch-1 decode kernels: H200, 8B shape, 4.44 ms/token
    through the server (4.82 with cuBLAS, docs/benchmarks.md, real model sizes)."""
    from clusteropt_cli.core.advise.recipes import serve_recipe_data
    from clusteropt_cli.core.advise.timing import infer_time

    target, _ = resolve_target("h200")
    spec = load_model_spec("llama-3.1-8b")
    served = InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True)
    auto = infer_time(spec, served, target).figures
    plain = infer_time(spec, served.with_(compile_mode="default"), target).figures
    assert plain["tpot_s"] - auto["tpot_s"] == pytest.approx(cal.AUTOTUNED_B1_FLOOR_SHARE * auto["tpot_floor_s"],
                                                             rel=1e-6)
    assert auto["tpot_s"] == pytest.approx(4.44e-3, rel=0.05) and plain["tpot_s"] == pytest.approx(4.82e-3, rel=0.05)
    # above batch 1 the mode prices nothing (not measured there); vLLM has no such mode
    many = served.with_(batch=64)
    assert infer_time(spec, many, target).figures == infer_time(spec, many.with_(compile_mode="default"),
                                                                target).figures
    vllm = served.with_(engine="vllm")
    assert infer_time(spec, vllm, target).figures == infer_time(spec, vllm.with_(compile_mode="default"),
                                                                target).figures
    # a serve recipe carries the mode only where it is not copt serve's default
    assert "compile_mode" not in serve_recipe_data(served, "m")
    assert serve_recipe_data(served.with_(compile_mode="default"), "m")["compile_mode"] == "default"


def test_every_source_is_a_paper_vendor_doc_or_a_benchmarks_anchor() -> None:
    """A recommendation's source is something the user has: a paper, vendor docs or docs/benchmarks.md#anchor
    (whose heading exists), never a path outside the repository or a raw results folder."""
    import re
    from pathlib import Path

    bench = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", bench, flags=re.M)}
    sources = set()
    for gpus in (1, 8):
        target, _ = resolve_target("h200", gpus=gpus)
        spec = load_model_spec("llama-3.1-8b")
        for symptom in ("oom", "high-ttft", "slow-tpot", "low-throughput"):
            plan = TrainPlan(micro_batch=4, seq_len=2048, precision="fp32", attn="eager") if symptom == "oom" \
                else InferPlan(batch=1, prompt_len=1024)
            sources |= {r["gain_source"] for r in advise(spec, target, plan, [symptom])["recommendations"]}
    assert len(sources) > 10
    for source in sources:
        assert not re.search(r"\.\./|\.txt\b|bench/results|shared", source), source
        for anchor in re.findall(r"docs/benchmarks\.md#([\w-]+)", source):
            assert anchor in anchors, (source, sorted(anchors))


def test_kv_cache_quantization_only_where_fp8_exists() -> None:
    """No INT8 KV cache is offered: neither copt serve nor vLLM's command line takes one (an A100 has no FP8)."""
    plan = InferPlan(batch=32, prompt_len=2048, continuous_batching=True)
    a100, _ = resolve_target("a100-80g")
    h100, _ = resolve_target("h100-sxm")
    assert "kv-cache-quantization" not in _ids(advise(load_model_spec("llama-3.1-8b"), a100, plan,
                                                      ["low-throughput"]))
    on_h100 = advise(load_model_spec("llama-3.1-8b"), h100, plan, ["low-throughput"])
    assert "kv-cache-quantization" in _ids(on_h100)


def test_moe_decode_below_bf16_is_priced_dense_on_copts_engine() -> None:
    """copt serve decodes a MoE model's experts densely below bf16 (core/serve/moe.py): a batch-1 step reads every
    expert, not the two Mixtral routes to; bf16 (transformers' grouped GEMM) and vLLM read the routed ones."""
    from clusteropt_cli.core.advise.timing import infer_time

    target, _ = resolve_target("h200")
    spec = load_model_spec("mixtral-8x7b")
    served = InferPlan(batch=1, prompt_len=256, gen_len=128, continuous_batching=True)
    bf16 = infer_time(spec, served.with_(dtype="bf16"), target)
    fp16 = infer_time(spec, served.with_(dtype="fp16"), target)
    vllm = infer_time(spec, served.with_(dtype="fp16", engine="vllm"), target)
    assert fp16.figures["tpot_floor_s"] / bf16.figures["tpot_floor_s"] == pytest.approx(
        spec.num_params / spec.num_active_params, rel=0.05)
    assert vllm.figures["tpot_floor_s"] == pytest.approx(bf16.figures["tpot_floor_s"], rel=1e-6)
    assert any("MoE below bf16" in note for note in fp16.notes)
    assert not any("MoE below bf16" in note for note in bf16.notes + vllm.notes)
    # the routed path says what it assumes: uniform routing over the experts (Mixtral: 2 of 8 per row)
    assert bf16.assumptions["moe_routing"].startswith("uniform: a decode step of 1 row reads 2 of 8 experts")
    assert "moe_routing" not in fp16.assumptions
    many = infer_time(spec, served.with_(dtype="bf16", batch=64), target)
    assert many.assumptions["moe_routing"].startswith("uniform: a decode step of 64 rows reads 8 of 8 experts")
    assert "moe_routing" not in infer_time(load_model_spec("llama-3.1-8b"), served, target).assumptions
