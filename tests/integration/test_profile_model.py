"""copt profile model on the fixture teacher: infer and train figures, CPU peak memory, verdicts, --trace,
--memory-budget and the --expect closed-loop check (exit 6 on a miss)."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.core.profile.report import SYMPTOMS, load_profile

VERDICTS = {"compute-bound", "memory-bandwidth-bound", "overhead-bound", "memory-capacity-bound"}


def _run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """copt in-process (torch is already imported here, which keeps the test fast)."""
    from clusteropt_cli.app import main

    with pytest.raises(SystemExit) as info:
        main(args)
    captured = capsys.readouterr()
    return int(info.value.code or 0), captured.out, captured.err


@pytest.fixture(scope="module")
def train_profiles(fixtures):
    """One training step profiled without and with activation checkpointing (fp32, HF loss, CPU)."""
    from clusteropt_cli.core.profile.model import profile_model
    from clusteropt_cli.core.profile.settings import ModelProfileSettings

    common = dict(model=str(fixtures.teacher), mode="train", device="cpu", micro_batch=2, seq_len=64, warmup=1,
                  repeats=2, loss_impl="hf")
    return (profile_model(ModelProfileSettings(**common)),
            profile_model(ModelProfileSettings(**common, activation_checkpointing=True)))


def test_train_step_figures_and_cpu_peak_memory(train_profiles, fixtures):
    plain, ckpt = train_profiles
    m = plain.metrics
    tokens = 2 * 64
    assert m["step_time_s"] > 0 and m["tokens_per_s"] == pytest.approx(tokens / m["step_time_s"])
    assert m["forward_frac"] + m["backward_frac"] + m["optimizer_frac"] == pytest.approx(1.0)
    assert all(m[k] > 0 for k in ("forward_frac", "backward_frac", "optimizer_frac"))
    assert plain.spread["step_time_s"].n == 2 and m["mfu"] is None  # no catalog peak for a CPU
    assert m["achieved_flops"] > 0 and 0 < m["cpu_matmul_frac"] < 5
    params = plain.model["num_params"]
    assert params == 1049728
    # model states: fp32 params + grads + AdamW exp_avg/exp_avg_sq, plus AdamW's scalar step counters
    assert 16 * params <= m["model_states_bytes"] <= 16 * params + 4096
    # the HF loss path: [2, 64, 1024] fp32 logits from the head plus the scalar loss
    assert m["logits_loss_bytes"] == 2 * 64 * 1024 * 4 + 4
    # saved activations hold at least the log-softmax output of the same size
    assert m["saved_activations_bytes"] > 2 * 64 * 1024 * 4
    assert m["peak_mem_bytes"] == m["model_states_bytes"] + m["saved_activations_bytes"] + m["logits_loss_bytes"]
    # checkpointing: same states, fewer saved activations (it keeps layer inputs + one layer's recomputation)
    c = ckpt.metrics
    assert c["model_states_bytes"] == m["model_states_bytes"]
    assert c["saved_activations_bytes"] < 0.6 * m["saved_activations_bytes"]
    assert ckpt.workload["activation_checkpointing"] is True
    for report in (plain, ckpt):
        assert report.verdict.bottleneck in VERDICTS and set(report.verdict.symptoms) <= set(SYMPTOMS)
        assert report.verdict.evidence


def test_cli_infer_json_report_and_trace(fixtures, tmp_path, capsys):
    report_path, trace = tmp_path / "p.json", tmp_path / "trace.json"
    code, out, err = _run_main(["profile", "model", str(fixtures.teacher), "--mode", "infer", "--batch", "2",
                                "--prompt-len", "32", "--gen-len", "8", "--warmup", "1", "--repeats", "2",
                                "--trace", str(trace), "--report", str(report_path), "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    m = doc["metrics"]
    assert doc["kind"] == "model" and doc["mode"] == "infer" and doc["hardware"]["device"] == "cpu"
    assert m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["output_tokens_per_s"] > 0
    assert m["output_tokens_per_s"] == pytest.approx(2 * 8 / (m["ttft_s"] + m["decode_s"]), rel=1e-9)
    assert m["mfu"] is None and m["mbu"] is None
    # KV cache: 4 layers × 2 (K, V) × 2 KV heads × 32 dims × fp32 per token, for 2 × (32 + 7) cached tokens
    assert m["kv_cache_bytes"] == 4 * 2 * 2 * 32 * 4 * 2 * (32 + 7)
    assert m["peak_mem_bytes"] >= m["weights_bytes"] + m["kv_cache_bytes"]
    assert doc["verdict"]["bottleneck"] in VERDICTS
    assert set(doc["verdict"]["symptoms"]) <= set(SYMPTOMS)
    assert doc["top_ops"] and doc["top_ops"][0]["self_time_s"] > 0 and doc["trace_file"] == str(trace)
    assert "traceEvents" in json.loads(trace.read_text())
    assert load_profile(str(report_path)).metrics["ttft_s"] == m["ttft_s"]
    # existing outputs are never replaced without --overwrite
    code, _, err = _run_main(["profile", "model", str(fixtures.teacher), "--report", str(report_path)], capsys)
    assert code == 2 and "--overwrite" in err


def test_cli_memory_budget_then_expect_miss(train_profiles, fixtures, tmp_path, capsys):
    """A step over a stated budget → memory-capacity-bound/oom; a recipe whose prediction is off by 2× → --expect
    runs the recipe's (checkpointed) step and exits 6 with the comparison in JSON. (The passing case runs in
    test_profile_advise.py and test_profile_core.py.)"""
    common = ["--mode", "train", "--micro-batch", "2", "--seq-len", "64", "--warmup", "0", "--repeats", "1",
              "--loss-impl", "hf"]
    code, out, err = _run_main(["profile", "model", str(fixtures.teacher), *common, "--memory-budget", "0.0195",
                                "--json"], capsys)
    assert code == 0, err
    over = json.loads(out)
    assert over["verdict"]["bottleneck"] == "memory-capacity-bound" and over["verdict"]["symptoms"][0] == "oom"
    assert over["workload"]["memory_budget_bytes"] == int(0.0195 * 1024**3)
    assert over["metrics"]["peak_mem_bytes"] > 0.0195 * 1024**3

    def recipe(name: str, peak: float) -> str:
        path = tmp_path / name
        path.write_text(f"task: train\nmodel: {fixtures.teacher}\nmicro_batch: 2\nseq_len: 64\nprecision: fp32\n"
                        "activation_checkpointing: true\nloss_impl: hf\nprediction:\n  gpu: cpu\n"
                        f"  budget_bytes: {int(0.0195 * 1024**3)}\n  figures:\n    peak_mem_bytes: {peak}\n"
                        "    mfu: 0.5\n")
        return str(path)

    # the checkpointed step's peak (same shape, measured by the module fixture; deterministic on CPU)
    ckpt_peak = train_profiles[1].metrics["peak_mem_bytes"]
    assert ckpt_peak < 0.0195 * 1024**3 < over["metrics"]["peak_mem_bytes"]
    code, out, err = _run_main(["profile", "model", "--expect", recipe("bad.yaml", ckpt_peak / 2), "--warmup", "0",
                                "--repeats", "1", "--json"], capsys)
    assert code == 6, err
    doc = json.loads(out)
    check = {f["name"]: f for f in doc["check"]["figures"]}
    assert doc["check"]["passed"] is False
    assert check["peak_mem_bytes"]["status"] == "miss"
    assert check["peak_mem_bytes"]["rel_error"] == pytest.approx(1.0, abs=1e-9)
    assert check["mfu"]["status"] == "not-measured"
    assert doc["profile"]["workload"]["activation_checkpointing"] is True
    assert "Prediction missed" in err


def test_cli_bad_model_and_flags(tmp_path, capsys):
    code, _, err = _run_main(["profile", "model", str(tmp_path / "nope"), "--batch", "0"], capsys)
    assert code == 2 and "--batch" in err
    code, _, err = _run_main(["profile", "model", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such file" in err
