"""advise's decode step against copt serve's engine on H100s (bench/gpu_moe_decode.py, 2026-12-07): dense
Llama-3.2-1B and Llama-3.1-8B widths on 4 and 16 layers (two hosts), Qwen3-30B-A3B's MoE width (128 experts, top-8)
over 8 layers and Mixtral-8x7B's (8 experts of 14,336, top-2) over 4 and 8, decode steps through CUDA graphs, fp16
(copt's dense experts: every expert read) and bf16 (transformers' grouped GEMM: the routed ones), batch 1, 16 and
64. The step is priced as the bytes it reads at a fraction of the bandwidth plus a cost per layer (and per MoE layer)
and per sequence (calibration.SERVING_ENGINES), fitted to the dense runs; the MoE runs are held out but for the cost
per MoE layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from gpu_moe_decode import advise_ms_per_step  # noqa: E402 - the function the bench records advise's figures with

RESULTS = BENCH / "results"
REPORTS = {name: json.loads((RESULTS / name).read_text()) for name in (
    "moe-h100-2026-12-07/moe.json", "moe-h100-2026-12-07/moe-mixtral.json",
    "decode-steps-h100-2026-12-07/moe-mixtral-host1.json", "decode-steps-h100-2026-12-07/dense-host1.json",
    "decode-steps-h100-2026-12-07/dense-host2.json")}
STEPS = [(name, case["shape"], case["dtype"], int(batch), step["ms_per_step"])
         for name, report in REPORTS.items() for case in report["cases"] if case["graphs"]
         for batch, step in case["per_batch"].items()]


def _predicted_ms(report: str, shape: str, dtype: str, batch: int) -> float:
    """advise now, for the case that ran (64 new tokens per request)."""
    return advise_ms_per_step(REPORTS[report]["configs"][shape], REPORTS[report]["device"], dtype, batch,
                              new_tokens=64)


def test_the_runs_cover_both_expert_paths_and_two_depths_at_three_batches() -> None:
    for shape, layers in (("qwen3moe-8l", 8), ("mixtral-4l", 4)):
        assert sorted({(dtype, batch) for _, s, dtype, batch, _ in STEPS if s == shape}) == [
            (dtype, batch) for dtype in ("bf16", "fp16") for batch in (1, 16, 64)]
        captured = [case for report in REPORTS.values() for case in report["cases"]
                    if case["graphs"] and case["shape"] == shape]
        assert all(case["graphs_captured"] > 0 and case["moe_layers"] == layers for case in captured)
    dense = {(shape, batch) for name, shape, _, batch, _ in STEPS if "dense" in name}
    assert dense == {(f"llama{w}-{n}l", b) for w in ("1b", "8b") for n in (4, 16) for b in (1, 16, 64)}
    assert sum(1 for _, shape, *_ in STEPS if shape == "mixtral-8l") == 3


@pytest.mark.parametrize(("report", "shape", "dtype", "batch", "measured_ms"), STEPS,
                         ids=[f"{r.split('/')[-1][:-5]}-{s}-{d}-b{b}" for r, s, d, b, _ in STEPS])
def test_decode_step_within_15_percent(report: str, shape: str, dtype: str, batch: int, measured_ms: float) -> None:
    """advise's decode step (`decode_step_s`, what the bench measures: the round less its first token) ÷ measured:
    0.89-1.12 over the 42 steps (with one cost per step for every model, as before: 1.61-1.74 on the 4-layer dense
    shapes, 1.25 on the 4-layer Mixtral at batch 1)."""
    assert _predicted_ms(report, shape, dtype, batch) / measured_ms == pytest.approx(1.0, abs=0.15)


def test_a_layer_costs_more_than_its_bytes_and_a_step_little_beyond_its_layers() -> None:
    """Batch 1, each host: 16 layers less 4 gives the cost per layer, 1B width 61.9 and 70.7 µs, 8B width 164.7 and
    173.1 µs — 26-43 µs above their bytes at the datasheet bandwidth (36.3 and 130.2 µs) — and what is left of the
    4-layer step beyond its 4 layers and the LM head is 0.12-0.17 ms (not the 0.57 ms advise charged per step)."""
    from clusteropt_cli.hardware import get_gpu

    bandwidth = get_gpu("h100-sxm").hbm_bandwidth
    for report in ("decode-steps-h100-2026-12-07/dense-host1.json", "decode-steps-h100-2026-12-07/dense-host2.json"):
        b1 = {shape: ms for name, shape, _, batch, ms in STEPS if name == report and batch == 1}
        for width, layer_bytes, head_bytes in (("1b", 2 * 60.8e6, 2 * 128256 * 2048), ("8b", 2 * 218.1e6,
                                                                                        2 * 128256 * 4096)):
            per_layer_ms = (b1[f"llama{width}-16l"] - b1[f"llama{width}-4l"]) / 12
            over_bytes_ms = per_layer_ms - layer_bytes / bandwidth * 1e3
            assert 0.020 < over_bytes_ms < 0.050, (report, width, per_layer_ms)
            rest_ms = b1[f"llama{width}-4l"] - 4 * per_layer_ms - head_bytes / bandwidth * 1e3
            assert 0.05 < rest_ms < 0.25, (report, width, rest_ms)


MIXTRAL = "moe-h100-2026-12-07/moe-mixtral.json"


def test_with_eight_experts_the_routed_path_reads_them_all_from_batch_16() -> None:
    """Top-2 of 8 experts: a batch of 16 routes to all eight (1 - (6/8)^16 = 99% each), so bf16's grouped GEMM reads
    what fp16's dense experts read and the steps meet (H100: 4.99 and 4.65 ms at batch 16, 5.03 and 4.83 at 64);
    advise prices both the same there."""
    steps = {(dtype, batch): ms for name, shape, dtype, batch, ms in STEPS
             if shape == "mixtral-4l" and name.endswith("moe-mixtral.json")}
    for batch in (16, 64):
        assert steps["bf16", batch] / steps["fp16", batch] == pytest.approx(1.0, abs=0.1)
        assert _predicted_ms(MIXTRAL, "mixtral-4l", "bf16", batch) == pytest.approx(
            _predicted_ms(MIXTRAL, "mixtral-4l", "fp16", batch), rel=0.02)
    assert steps["fp16", 1] / steps["bf16", 1] > 2.5  # at batch 1 bf16 reads 2 of the 8


H200_DENSE = json.loads((RESULTS / "decode-steps-h200-2026-12-07/dense.json").read_text())
H200_STEPS = [(case["shape"], "greedy" if key == "per_batch" else key.removeprefix("per_batch_"), int(batch),
               step["ms_per_step"])
              for case in H200_DENSE["cases"] for key in case if key.startswith("per_batch")
              for batch, step in case[key].items()]


def test_h200_dense_steps_held_out_greedy_and_sampled() -> None:
    """Held out (nothing fitted to them): the same dense shapes on an H200, greedy and temperature-1 sampling, batch
    1, 16 and 64 (2026-12-07). advise ÷ measured 0.82-1.13, 20 of 24 within ±10%; its one step outside ±15% is the
    4-layer 1B at batch 1 (0.82), shallower than any real model."""
    assert len(H200_STEPS) == 24 and H200_DENSE["device"] == "NVIDIA H200"
    ratios = {(shape, mode, batch): advise_ms_per_step(H200_DENSE["configs"][shape], H200_DENSE["device"], "bf16",
                                                       batch, 64, mode) / ms
              for shape, mode, batch, ms in H200_STEPS}
    assert sum(abs(r - 1) <= 0.10 for r in ratios.values()) >= 20, ratios
    assert [k for k, r in ratios.items() if abs(r - 1) > 0.15] == [("llama1b-4l", "greedy", 1)], ratios
    assert all(abs(r - 1) <= 0.15 for (shape, _, _), r in ratios.items() if shape.endswith("16l"))


PASSES = [json.loads((RESULTS / "decode-parts-h100-2026-12-08" / name).read_text())
          for name in ("llama1b.json", "llama8b.json")]


def _pass_ratios(report: dict) -> dict[tuple[str, int, int], float]:
    """advise ÷ measured per (shape, prompt tokens, rows) of a gpu_moe_decode.py report: the decode pass of the step
    trace (the round's ms per step where no traced pass ran), advise at the case's compile mode."""
    ratios = {}
    for case in report["cases"]:
        for batch, step in case["per_batch"].items():
            predicted = advise_ms_per_step(report["configs"][case["shape"]], report["device"], "bf16", int(batch),
                                           new_tokens=64, prompt_len=case["prompt_len"],
                                           compile_mode=case["compile_mode"])
            ratios[case["shape"], case["prompt_len"], int(batch)] = predicted / (step.get("decode_ms_per_pass")
                                                                                 or step["ms_per_step"])
    return ratios


def test_decode_passes_of_the_engine_now_at_three_contexts_held_out() -> None:
    """Held out (nothing fitted to them): the engine as it runs now (one context bucket, no merge pass at one split)
    on an H100, 2026-12-08, 1B and 8B widths on 16 layers, 16/320/1,024-token prompts, 1-256 rows; the decode pass
    from the step trace (the round's ms per step at batch 1 and 16 where no trace pass ran). advise ÷ measured
    0.86-1.09: 29 of 30 within ±10%, the 1B's 256 rows at 1,024 tokens 0.86 (its pass 1.5 ms over its kernels; on a
    fresh machine 5.04-5.14 ms: 1.08-1.10, checked below)."""
    ratios = {key: ratio for report in PASSES for key, ratio in _pass_ratios(report).items()}
    assert len(ratios) == 30 and all(abs(r - 1) <= 0.15 for r in ratios.values()), ratios
    assert [k for k, r in ratios.items() if abs(r - 1) > 0.10] == [("llama1b-16l", 1024, 256)], ratios


def test_the_one_miss_did_not_repeat_on_a_fresh_machine() -> None:
    """The same engine again (1,024-, 320- and 1,024-token prompts in turn, 128 and 256 rows): every pass within
    ±10% of advise, the 256-row one at 1,024 tokens 5.04 and 5.14 ms where the first machine's took 6.445."""
    report = json.loads((RESULTS / "decode-parts-h100-2026-12-08/repeat-1b-256/spread.json").read_text())
    assert [case["prompt_len"] for case in report["cases"]] == [1024, 320, 1024]
    assert all(step.get("decode_ms_per_pass") for case in report["cases"] for step in case["per_batch"].values())
    for case in report["cases"]:  # one at a time: 1,024 tokens twice
        for key, ratio in _pass_ratios({**report, "cases": [case]}).items():
            assert ratio == pytest.approx(1.0, abs=0.10), key
