"""advise prices each serve plan on the engine its printed command runs: copt's engine is one GPU and dequantizes
int4/int8 checkpoints at load (core/serve/quantized.py); tensor parallelism and packed 4-bit kernels are vLLM's."""

from __future__ import annotations

import re

import pytest

from clusteropt_cli.core.advise.api import advise, evaluate_infer, resolve_target
from clusteropt_cli.core.advise.memory import weight_bytes
from clusteropt_cli.core.advise.plan import InferPlan
from clusteropt_cli.modelspec import load_model_spec

GiB = 1024**3


def _infer(model: str, gpu: str, gpus: int = 1, symptoms: list[str] | None = None, **plan) -> dict:
    target, _ = resolve_target(gpu, gpus=gpus)
    plan.setdefault("continuous_batching", True)  # what `copt advise --task infer` builds: copt serve batches
    return advise(load_model_spec(model), target, InferPlan(**plan), symptoms or [], model_arg=model)


def _rec(result: dict, rid: str) -> dict:
    return next(r for r in result["recommendations"] if r["id"] == rid)


def _serve_commands(result: dict) -> list[tuple[str, dict | None]]:
    """(the `copt serve` step of every printed command, the figures predicted for it)."""
    out = [(r["command"], r["predicted"]) for r in result["recommendations"]]
    out.append((result["top_plan"]["command"], {"fits": result["top_plan"]["memory"]["fits"],
                                                "peak_mem_bytes": result["top_plan"]["memory"]["per_gpu_bytes"]}))
    return [(c.split("&&")[-1].strip(), p) for c, p in out if c and "copt serve" in c]


def _tp(command: str) -> int:
    found = re.search(r"--tensor-parallel (\d+)", command)
    return int(found.group(1)) if found else 1


def _assert_engines_honest(result: dict) -> None:
    """No `--engine copt` command for a plan that does not fit one GPU; every multi-GPU command is vLLM's."""
    for command, predicted in _serve_commands(result):
        assert "--engine" in command, command
        if "--engine copt" in command:
            assert "--tensor-parallel" not in command, command
            assert predicted["fits"] is True, (command, predicted)
        if _tp(command) > 1:
            assert "--engine vllm" in command, command


def test_70b_on_4xh200_routes_awq_to_vllm_and_tensor_parallelism_to_vllm() -> None:
    """The case of the issue: `copt advise --task infer --model llama-3.1-70b --gpu h200 --gpus 4 --symptom
    low-throughput` printed `copt serve llama-3.1-70b-awq --engine copt` as a 38 GiB plan."""
    result = _infer("llama-3.1-70b", "h200", 4, ["low-throughput"])
    _assert_engines_honest(result)
    for rid in ("awq", "gptq"):
        rec = _rec(result, rid)
        serve = rec["command"].split("&&")[-1]
        assert f"copt serve llama-3.1-70b-{rid} --engine vllm" in serve and "--engine copt" not in rec["command"]
        assert rec["predicted"]["peak_mem_bytes"] < 45 * GiB  # packed int4 on vLLM's kernels
        assert "dequantizes" in rec["why"] and "vLLM" in rec["why"]
    tp = _rec(result, "tensor-parallel")
    assert tp["command"] == "copt serve MODEL_DIR --tensor-parallel 4 --engine vllm"
    # the top plan is a vLLM plan (tensor parallelism or 4-bit on Marlin), never the dequantized 4-bit on copt
    assert "--engine vllm" in result["top_plan"]["command"]
    # by the memory model the bf16 weights (141.1 GB) fit one H200 (150.8 GB): copt-engine commands that stay are
    # the ones predicted to fit, with the model's bf16 weights
    for command, predicted in _serve_commands(result):
        if "--engine copt" in command and "-fp8" not in command:
            assert predicted["peak_mem_bytes"] > weight_bytes(load_model_spec("llama-3.1-70b"), "bf16")


def test_70b_on_4xh100_prints_no_copt_engine_command() -> None:
    """bf16 70B (131 GiB of weights) does not fit one H100: nothing runs it on copt's engine."""
    result = _infer("llama-3.1-70b", "h100-sxm", 4, ["low-throughput"])
    assert result["memory"]["fits"] is False
    _assert_engines_honest(result)
    for command, _ in _serve_commands(result):
        if "-fp8" not in command:  # FP8 70B (68 GiB) fits one H100 and stays on copt's native FP8 GEMMs
            assert "--engine copt" not in command, command
    assert "copt serve llama-3.1-70b-fp8 --engine copt" in _rec(result, "fp8-w8a8")["command"]
    # what vLLM runs as well is rewritten for it, with the fewest GPUs that fit
    spec = _rec(result, "speculative-decoding")
    assert "--tensor-parallel 2 --engine vllm --prompt-lookup 3" in spec["command"] and spec["predicted"]["fits"]
    assert "tensor parallelism" in spec["why"]
    # CUDA graphs / torch.compile: copt serve and vLLM run them by default, so neither recommended nor rejected
    assert "operator-fusion" not in {n["id"] for n in result["not_applicable"]} | {r["id"] for r in
                                                                                     result["recommendations"]}


def test_one_gpu_not_applicable_names_the_way_out() -> None:
    result = _infer("llama-3.1-70b", "h100-sxm", 1, ["slow-tpot"])
    _assert_engines_honest(result)
    reasons = {n["id"]: " ".join(n["reasons"]) for n in result["not_applicable"]}
    assert "copt's engine serves on one GPU" in reasons["speculative-decoding"]
    assert "--gpus N" in reasons["speculative-decoding"]  # no second GPU to split over: quantize or add GPUs
    assert result["top_plan"]["memory"]["fits"] is True


def test_awq_on_copt_engine_is_priced_dequantized() -> None:
    """copt's engine holds a 4-bit (or int8) checkpoint in bf16 and decodes at bf16 speed; vLLM keeps it packed."""
    spec = load_model_spec("llama-3.1-8b")
    target, _ = resolve_target("h200")
    base = InferPlan(batch=1, continuous_batching=True)
    bf16 = evaluate_infer(spec, base, target)
    for weights in ("int4", "int8"):
        on_copt = evaluate_infer(spec, base.with_(weights=weights), target)
        assert on_copt["memory"]["breakdown"]["weights"] == bf16["memory"]["breakdown"]["weights"]
        assert on_copt["time"]["tpot_s"] == pytest.approx(bf16["time"]["tpot_s"])
        assert on_copt["time"]["output_tokens_per_s"] == pytest.approx(bf16["time"]["output_tokens_per_s"])
        assert any("dequantizes" in n for n in on_copt["time_notes"])
    on_vllm = evaluate_infer(spec, base.with_(weights="int4", engine="vllm"), target)
    assert on_vllm["memory"]["breakdown"]["weights"] == pytest.approx(weight_bytes(spec, "int4"))
    assert on_vllm["memory"]["breakdown"]["weights"] < 0.4 * bf16["memory"]["breakdown"]["weights"]
    assert on_vllm["time"]["tpot_s"] < bf16["time"]["tpot_s"]
    # FP8 runs natively on copt's engine (Fp8Linear): its own bytes, not dequantized
    fp8 = evaluate_infer(spec, base.with_(weights="fp8"), target)
    assert fp8["memory"]["breakdown"]["weights"] == pytest.approx(weight_bytes(spec, "fp8"))
    assert not any("dequantizes" in n for n in fp8["time_notes"])


def test_8b_awq_on_one_h200_is_served_by_vllm_on_one_gpu() -> None:
    result = _infer("llama-3.1-8b", "h200", 1, ["slow-tpot"])
    _assert_engines_honest(result)
    rec = _rec(result, "awq")
    assert rec["command"] == ("copt quantize MODEL_DIR --method awq --calib CALIB.txt --output llama-3.1-8b-awq"
                              " && copt serve llama-3.1-8b-awq --engine vllm")
    assert rec["predicted"]["peak_mem_bytes"] < 8 * GiB
    assert rec["predicted"]["tpot_s"] < result["time"]["tpot_s"]
    # FP8 stays on copt's engine
    assert _rec(result, "fp8-w8a8")["command"].endswith("copt serve llama-3.1-8b-fp8 --engine copt")


def test_int4_plan_on_copt_engine_offers_vllms_kernels() -> None:
    result = _infer("llama-3.1-8b", "h200", 1, ["slow-tpot"], weights="int4")
    assert any("dequantizes int4" in n for n in result["notes"])
    assert result["memory"]["breakdown"]["weights"] == pytest.approx(weight_bytes(load_model_spec("llama-3.1-8b"),
                                                                                  "bf16"))
    rec = _rec(result, "quantized-kernels")
    assert rec["command"].endswith("copt serve llama-3.1-8b-awq --engine vllm")
    assert rec["predicted"]["peak_mem_bytes"] < 0.5 * result["memory"]["per_gpu_bytes"]
    assert rec["predicted"]["tpot_s"] < result["time"]["tpot_s"]


def test_tensor_parallel_plan_is_priced_and_printed_for_vllm() -> None:
    """`--tensor-parallel 2` without `--engine vllm`: copt serve hands it to vLLM, so advise prices vLLM."""
    result = _infer("llama-3.1-8b", "h200", 2, [], tp=2)
    assert result["workload"]["engine"] == "vllm"
    assert any("--tensor-parallel 2 is served by vLLM" in n for n in result["notes"])
    assert result["assumptions"]["engine"] == "vllm"
    assert result["top_plan"]["command"] == "copt serve MODEL_DIR --tensor-parallel 2 --engine vllm"
    _assert_engines_honest(_infer("llama-3.1-8b", "h200", 2, ["slow-tpot"], tp=2))


def test_vllm_plan_that_does_not_fit_gets_tensor_parallelism() -> None:
    """405B: AWQ (~200 GiB) needs two H200s, FP8 (~380 GiB) four; each printed with --tensor-parallel N."""
    result = _infer("llama-3.1-405b", "h200", 8, ["slow-tpot"])
    _assert_engines_honest(result)
    assert _tp(_rec(result, "awq")["command"]) == 2
    assert _tp(_rec(result, "fp8-w8a8")["command"]) == 4
    for command, predicted in _serve_commands(result):
        assert "--engine vllm" in command and predicted["fits"] is True, command


@pytest.mark.parametrize("model,gpu,gpus,batch", [
    ("llama-3.1-70b", "h200", 4, 64), ("llama-3.1-8b", "rtx4090", 1, 64), ("qwen2.5-72b", "a100-80g", 8, 8),
    ("mixtral-8x7b", "h100-sxm", 2, 1)])
@pytest.mark.parametrize("symptom", ["low-throughput", "slow-tpot", "high-ttft", "oom"])
def test_no_copt_engine_command_that_does_not_fit(model: str, gpu: str, gpus: int, batch: int, symptom: str) -> None:
    _assert_engines_honest(_infer(model, gpu, gpus, [symptom], batch=batch, prompt_len=2048))


def test_no_run_it_command_when_copts_engine_cannot_load_the_weights() -> None:
    target, _ = resolve_target("h200", memory_budget_gib=4)
    result = advise(load_model_spec("llama-3.1-8b"), target, InferPlan(weights="fp8", continuous_batching=True),
                    ["oom"], model_arg="llama-3.1-8b")
    assert result["top_plan"]["memory"]["fits"] is False
    assert result["top_plan"]["command"] is None
    assert any("no plan fits" in n for n in result["notes"])
