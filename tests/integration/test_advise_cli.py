"""copt advise end to end: JSON schema, exit codes, emitted recipe/DeepSpeed config, CPU plans, profiles."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from clusteropt_cli.app import main
from clusteropt_cli.recipe.load import validate_recipe

GiB = 1024**3


@pytest.fixture
def cli(capsys):
    """copt in-process (same entry point and error boundary as the console script, without a new interpreter)."""

    def run(*args: str) -> subprocess.CompletedProcess:
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, int(exit_info.value.code or 0), captured.out, captured.err)

    return run


def test_json_schema_and_anchor(cli) -> None:
    proc = cli("advise", "--model", "llama-3.2-1b", "--gpu", "h200", "--micro-batch", "8", "--seq-len", "2048",
                "--no-compile", "loss_impl=hf", "--json")  # the eager HF loop of the 73.8 GiB anchor
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["schema_version"] == "copt.advise/1"
    assert set(r["memory"]["breakdown"]) >= {"weights", "gradients", "optimizer", "activations", "logits",
                                             "kv_cache"}
    assert abs(r["memory"]["per_gpu_bytes"] / GiB - 73.8) / 73.8 < 0.10
    assert r["memory"]["fits"] is True
    assert {"step_time_s", "tokens_per_s", "mfu"} <= set(r["time"])
    assert all("id" in rec and "command" in rec for rec in r["recommendations"])


def test_compiled_step_terms_printed(cli) -> None:
    """copt train's compiled step on the 8B shape: the human output names the optimizer step's time and the GEMM
    efficiency it assumed; the JSON carries the terms."""
    args = ("advise", "--model", "llama-3.1-8b", "--gpu", "h200", "--micro-batch", "2", "--seq-len", "2048")
    proc = cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "optimizer step (clip + update)" in proc.stdout and "gemm_efficiency=0.747" in proc.stdout
    r = json.loads(cli(*args, "--json").stdout)
    assert r["time"]["optimizer_s"] > 0 and r["time"]["loss_s"] > 0
    assert r["time"]["step_time_s"] > r["time"]["optimizer_s"] + r["time"]["compute_s"] - 1e-9


def test_emit_recipe_and_ds_config(cli, tmp_path) -> None:
    recipe, ds = tmp_path / "plan.yaml", tmp_path / "ds.json"
    proc = cli("advise", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "8", "--seq-len", "4096",
                "--symptom", "oom", "--emit-recipe", str(recipe), "--emit-ds-config", str(ds), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    data = yaml.safe_load(recipe.read_text())
    settings = validate_recipe("train", data)
    assert settings.zero == 3 and settings.prediction is not None
    assert settings.prediction.figures["peak_mem_bytes"] == r["prediction"]["peak_mem_bytes"]
    assert settings.prediction.figures["peak_mem_bytes"] < 80 * GiB
    config = json.loads(ds.read_text())
    assert config["zero_optimization"]["stage"] == 3
    assert config["train_batch_size"] == settings.micro_batch * settings.grad_accum * 8
    # an existing output is never overwritten without --overwrite
    again = cli("advise", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--emit-recipe", str(recipe))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_tensor_parallel_is_not_chained_to_copt_train(cli, tmp_path) -> None:
    """copt train has no tensor parallelism: no recipe for a --tp plan, and the TP command says where to run it."""
    recipe = tmp_path / "tp.yaml"
    proc = cli("advise", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "8", "--tp", "8",
               "--emit-recipe", str(recipe))
    assert proc.returncode == 2 and "tensor parallelism" in proc.stderr and not recipe.exists()
    proc = cli("advise", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--gpus", "8", "--symptom", "oom", "--json")
    tp = next(r for r in json.loads(proc.stdout)["recommendations"] if r["id"] == "tensor-parallel")
    assert "copt train" not in tp["command"].split("#")[0] and "Megatron-LM" in tp["command"]


def test_fail_if_oom_exit_6(copt) -> None:
    proc = copt("advise", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--fail-if-oom")
    assert proc.returncode == 6
    assert "does not fit" in proc.stdout or "budget" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_input_exit_2(cli, tmp_path) -> None:
    cases = [
        (["--model", "llama-9b", "--gpu", "h100"], "neither a preset"),
        (["--model", str(tmp_path / "missing.json"), "--gpu", "h100"], "neither a preset"),
        (["--model", "llama-3.2-1b", "--gpu", "h100", "--seq-len", "0"], "--seq-len"),
        (["--model", "llama-3.2-1b", "--gpu", "h100", "--gpus", "8", "--pp", "32"], "--pipeline-stages 32"),
        (["--model", "llama-3.2-1b", "--gpu", "v100"], "--gpu"),
        (["--model", "llama-3.2-1b", "--gpu", "h100", "--symptom", "slow"], "--symptom"),
    ]
    bad = tmp_path / "config.json"
    bad.write_text("{oops")
    cases.append((["--model", str(bad), "--gpu", "h100"], "not valid JSON"))
    for args, needle in cases:
        proc = cli("advise", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_cpu_plan_for_the_fixture_model(cli, fixtures, tmp_path) -> None:
    recipe = tmp_path / "cpu.yaml"
    proc = cli("advise", "--model", str(fixtures.teacher), "--gpu", "cpu", "--memory-budget", "0.1",
                "--precision", "fp32", "--micro-batch", "4", "--seq-len", "128", "--emit-recipe", str(recipe),
                "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["hardware"]["device"] == "cpu" and r["memory"]["fits"] is True
    cpu = r["memory"]["cpu"]
    assert cpu["model_states"] == 16 * r["model"]["num_params"]
    settings = validate_recipe("train", yaml.safe_load(recipe.read_text()))
    assert settings.prediction.gpu == "cpu"
    assert settings.prediction.figures["peak_mem_bytes"] == cpu["peak_mem_bytes"]
    tight = cli("advise", "--model", str(fixtures.teacher), "--gpu", "cpu", "--memory-budget", "0.01",
                 "--micro-batch", "4", "--seq-len", "128", "--fail-if-oom")
    assert tight.returncode == 6


def test_from_profile(cli, tmp_path) -> None:
    profile = {
        "schema_version": "copt.profile/1", "kind": "model", "mode": "train", "created_at": "2026-11-30T00:00:00Z",
        "copt_version": "0", "hardware": {"device": "cuda", "name": "NVIDIA H200", "catalog": "h200", "count": 1},
        "model": {"name": "llama-3.2-1b"},
        # the eager HF loop measured there (copt profile model records compile and loss_impl)
        "workload": {"micro_batch": 8, "seq_len": 2048, "precision": "bf16", "compile": False, "loss_impl": "hf"},
        "metrics": {"peak_mem_bytes": 73.8 * GiB, "tokens_per_s": 46600.0},
        "verdict": {"bottleneck": "memory-capacity-bound", "symptoms": ["oom"]},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    proc = cli("advise", "--from-profile", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["symptoms"] == ["oom"] and r["workload"]["micro_batch"] == 8
    errors = {row["metric"]: row["error_pct"] for row in r["measured"]}
    assert abs(errors["peak_mem_bytes"]) < 10 and abs(errors["tokens_per_s"]) < 10
    assert r["recommendations"][0]["id"] in {"activation-checkpointing", "cpu-offload", "gradient-accumulation"}


def test_human_output_and_presets(cli) -> None:
    proc = cli("advise", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "8", "--task", "infer",
                "--batch", "16", "--symptom", "slow-tpot")
    assert proc.returncode == 0, proc.stderr
    assert "Memory per GPU" in proc.stdout and "Recommendations" in proc.stdout
    listing = cli("advise", "--list-presets", "--json")
    assert "deepseek-v3" in {p["name"] for p in json.loads(listing.stdout)["presets"]}
