"""bench/gpu_moe_decode.py --kernels: a profiled round summarised per kernel (calls, µs, share) with the time the
kernels kept the device busy against the round's span."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from gpu_moe_decode import profile_summary  # noqa: E402


def _kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, cpu_parent=None,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_overlapping_kernels_count_once_and_gaps_show_as_idle() -> None:
    events = [_kernel("gemm", 0, 1000), _kernel("gemm", 500, 1500), _kernel("norm", 2000, 3000),
              SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU, cpu_parent=None,
                              time_range=SimpleNamespace(start=0, end=9000, elapsed_us=lambda: 9000))]
    summary = profile_summary(events, "cuda")
    assert summary["events"] == 3 and summary["busy_ms"] == 2.5 and summary["span_ms"] == 3.0
    assert summary["busy_share"] == pytest.approx(0.833, abs=1e-3)
    assert [(k["name"], k["calls"], k["total_us"]) for k in summary["top"]] == [("gemm", 2, 2000), ("norm", 1, 1000)]
    assert profile_summary([], "cuda") == {"events": 0}


def test_a_cpu_profile_counts_top_level_ops_only() -> None:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (a @ a).relu_()
    summary = profile_summary(prof.events(), "cpu")
    names = {k["name"]: k["calls"] for k in summary["top"]}
    assert names["aten::matmul"] == 3 and names["aten::relu_"] == 3 and "aten::mm" not in names
    assert 0 < summary["busy_ms"] <= summary["span_ms"]


def test_decode_passes_exclude_prefill_and_partial_batches() -> None:
    from gpu_moe_decode import decode_pass_seconds

    # (start, end, running, waiting, decode passes, chained, prompt tokens, generated tokens)
    steps = [(0.0, 0.5, 4, 0, 0, 0, 2048, 2), (0.5, 0.9, 4, 0, 1, 0, 500, 4),  # prefill, then a mixed step
             (1.0, 1.1, 4, 0, 1, 0, 0, 4), (1.1, 1.5, 4, 0, 6, 6, 0, 24), (1.5, 1.6, 2, 0, 1, 0, 0, 2)]
    # the two pure steps after the last prompt token at all 4 rows: 0.5 s over 7 passes (not the mixed step's 0.4)
    assert decode_pass_seconds(steps, 4) == pytest.approx(0.5 / 7)
    assert decode_pass_seconds(steps[:3], 4) is None  # one pass: no figure
    assert decode_pass_seconds(steps, 8) is None


def test_decode_kernels_are_the_full_round_less_the_first_token_by_part() -> None:
    from gpu_moe_decode import decode_kernels, kernel_part

    assert kernel_part("paged_decode_stage1") == "attention"
    assert kernel_part("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_part("nvjet_sm90_tst_128x64_64x8_2x1_v_bz_TNT") == "gemm"
    assert kernel_part("void cublasLt::splitKreduce_kernel<32, 16>") == "gemm"
    assert kernel_part("triton_red_fused__to_copy_mean_mul_pow_rsqrt_0") == "other"
    # a prefill (flash, a large GEMM) and one step in both rounds; three more steps in the full one
    first = [_kernel("flash_fwd", 0, 900), _kernel("nvjet_big", 1000, 3000), _kernel("paged_decode_stage1", 3000, 3010),
             _kernel("nvjet_small", 3010, 3040), _kernel("rmsnorm", 3040, 3045)]
    steps = [k for i in range(1, 4) for k in (_kernel("paged_decode_stage1", 4000 + 100 * i, 4012 + 100 * i),
                                             _kernel("nvjet_small", 4012 + 100 * i, 4042 + 100 * i),
                                             _kernel("rmsnorm", 4042 + 100 * i, 4047 + 100 * i))]
    full = profile_summary(first + steps, "cuda", every_name=True)
    parts = decode_kernels(full, profile_summary(first, "cuda", every_name=True), 3)
    assert parts["attention_us"] == pytest.approx(12) and parts["gemm_us"] == pytest.approx(30)
    assert parts["other_us"] == pytest.approx(5) and parts["total_us"] == pytest.approx(47)
    assert parts["top"][0] == {"name": "nvjet_small", "calls_per_step": 1.0, "us": 30.0, "part": "gemm"}
    assert "by_name" not in profile_summary(first, "cuda")
