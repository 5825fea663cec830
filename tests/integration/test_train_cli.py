"""copt train through the CLI: 2-process ZeRO-2/ZeRO-3+offload and pipelines on CPU (gloo), kill -9 and resume,
--dry-run for a 2-node hostfile, and validation before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


def _common(fixtures, out, model="student", steps=6, micro_batch=4, extra=(), precision="fp32", pretrained=False,
            lr="3e-3"):
    path = getattr(fixtures, model) if pretrained else getattr(fixtures, model) / "config.json"
    return ["train", "--model", str(path), "--tokenizer", str(fixtures.tokenizer),
            "--data", str(fixtures.train_text), "--output", str(out), "--seq-len", "64", "--micro-batch",
            str(micro_batch), "--max-steps", str(steps), "--lr", lr, "--schedule", "constant",
            "--precision", precision, "--json", *extra]


def _run(copt, args):
    proc = copt(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _cli(capsys, *args) -> subprocess.CompletedProcess:
    """copt in this process, as from the command line, for the runs that start nothing (validation, --dry-run): a
    subprocess would spend its ~3 s importing what this process has imported already."""
    from clusteropt_cli.app import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["copt", *args], int(info.value.code or 0), out, err)


@pytest.fixture(scope="module")
def single_process_losses(fixtures, tmp_path_factory):
    """The reference loss curves of one process (in this process) on the same global batch (4 sequences per step;
    constant LR, so the first steps do not depend on the run's length): student 12 steps, teacher 6, and the
    student 6 steps in bf16 (autocast over fp32 weights, the plain loop's mixed precision), and that from the trained
    student's weights (ZeRO-3 builds a model from a config under deepspeed.zero.Init, whose random initialization
    draws differently: its curve is compared from the same trained weights)."""
    from clusteropt_cli.core.train import build_text_dataset, run_training
    from clusteropt_cli.core.train.model import load_model, load_tokenizer, resolve_model_source
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    tokenizer = load_tokenizer(resolve_model_source(str(fixtures.student), str(fixtures.tokenizer)))
    dataset = build_text_dataset(fixtures.train_text, tokenizer, 64)
    out = {}
    for key, model, steps, precision in (("student", "student", 12, "fp32"), ("teacher", "teacher", 6, "fp32"),
                                         ("student-bf16", "student", 6, "bf16"),
                                         ("trained-student-bf16", "student", 6, "bf16")):
        path = getattr(fixtures, model) if key.startswith("trained") else getattr(fixtures, model) / "config.json"
        recipe = TrainRecipe(model=str(path), seq_len=64, micro_batch=4, max_steps=steps,
                             lr=1e-4 if key.startswith("trained") else 3e-3, schedule="constant", precision=precision)
        source = resolve_model_source(recipe.model, str(fixtures.tokenizer))
        result = run_training(recipe, load_model(source, seed=0), dataset, tmp_path_factory.mktemp(model),
                              save_final=False)
        out[key] = result.losses
    return out


# ZeRO-3 with CPU offload runs once, in bf16: the partitioned fp32 masters gathered for the save and the partitioned
# checkpoint's resume are the same code in fp32 (ZeRO-2 fp32 checks the fp32 config against the single process, the
# unit tests its ds_config, test_advise_zero_gloo.py DeepSpeed's per-rank ZeRO-3 states), and a second 2-process
# run plus its resume cost ~40 s of CI time
@pytest.mark.slow
@pytest.mark.jit
@pytest.mark.parametrize(("zero_args", "precision"), [
    (["--zero", "2"], "fp32"), (["--zero", "2"], "bf16"), (["--zero", "3", "--offload", "cpu"], "bf16"),
], ids=["zero2", "zero2-bf16", "zero3-offload-bf16"])
def test_zero_with_two_processes(copt, fixtures, tmp_path, single_process_losses, zero_args, precision):
    out = tmp_path / "out"
    zero3 = "--offload" in zero_args
    extra = ["--gpus", "2", *zero_args, *(["--save-every", "3"] if zero3 else [])]
    proc = copt(*_common(fixtures, out, micro_batch=2, extra=extra, precision=precision, pretrained=zero3,
                         lr="1e-4" if zero3 else "3e-3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["world_size"] == 2 and result["engine"].startswith(f"deepspeed-zero{zero_args[1]}")
    if zero3:  # built partitioned (deepspeed.zero.Init), not whole on every rank before deepspeed.initialize
        assert "partitioned by ZeRO-3 as built" in proc.stderr
    else:
        assert result["final_loss"] < result["first_loss"] - 0.15
    # 2 ranks × 2 sequences = the single process's 4: the same curve. bf16: DeepSpeed's bf16 weights against the
    # plain loop's autocast over fp32 weights (measured within 4e-4 over these 6 steps; ZeRO-3 from the trained
    # weights at lr 1e-4 within 3.4e-4)
    reference = single_process_losses["trained-student-bf16" if zero3 else
                                      "student" if precision == "fp32" else "student-bf16"][:6]
    assert result["losses"] == pytest.approx(reference, abs=2e-3)
    cfg = json.loads((out / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] == int(zero_args[1]) and cfg["train_batch_size"] == 4
    assert cfg.get("bf16", {}).get("enabled", False) == (precision == "bf16")  # DeepSpeed's own bf16 mode
    if "--offload" in zero_args:
        assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)  # ZeRO-3 partitions were gathered for the save
    assert sum(p.numel() for p in model.parameters()) == 229696
    # the fp32 master weights are saved (and config.json says so), not the 16-bit copies DeepSpeed trains with
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    if precision == "bf16":
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert not torch.equal(weights, weights.to(torch.bfloat16).float())
    if zero3:  # DeepSpeed's partitioned checkpoint of step 3 resumes onto the same curve
        resumed = _run(copt, _common(fixtures, out, micro_batch=2, extra=[*extra, "--resume"], precision=precision,
                                     pretrained=True, lr="1e-4"))
        assert resumed["resumed_from"] == 3
        assert resumed["losses"] == pytest.approx(result["losses"][3:], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [["1f1b"], ["interleaved-1f1b", "--virtual-stages", "2"]],
                         ids=["1f1b", "interleaved"])
def test_pipeline_two_ranks_matches_single_process(copt, fixtures, tmp_path, single_process_losses, schedule):
    result = _run(copt, _common(fixtures, tmp_path / "out", model="teacher",
                                extra=["--gpus", "2", "--pipeline-stages", "2", "--pipeline-schedule", *schedule]))
    assert result["engine"].startswith(f"pipeline-{schedule[0]}")
    assert result["losses"] == pytest.approx(single_process_losses["teacher"], abs=1e-4)
    assert result["final_loss"] < result["first_loss"] - 0.15


@pytest.mark.slow
def test_kill_9_and_resume_continues_the_same_curve(fixtures, tmp_path, single_process_losses):
    out = tmp_path / "out"
    args = _common(fixtures, out, steps=12, extra=["--save-every", "3"])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "clusteropt_cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and proc.poll() is None:
            if (out / "checkpoints" / "step-6" / "meta.json").exists():
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (out / "model.safetensors").exists()  # nothing final was written
    rows_before = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resumed = subprocess.run([sys.executable, "-m", "clusteropt_cli", *args, "--resume"], capture_output=True,
                             text=True, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(resumed.stdout)
    assert result["resumed_from"] is not None and result["resumed_from"] >= 6
    assert len(rows_before) - result["resumed_from"] <= 3 + 1  # at most one save interval (+ a cut row) lost
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    # the same curve as the uninterrupted reference run
    assert [r["loss"] for r in rows] == pytest.approx(single_process_losses["student"], abs=1e-5)
    assert (out / "model.safetensors").exists()


def test_dry_run_two_node_hostfile(capsys, fixtures, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    proc = _cli(capsys, *_common(fixtures, tmp_path / "out", extra=["--gpus", "8", "--nodes", "2", "--hostfile",
                                                                    str(hostfile), "--zero", "3", "--offload", "cpu",
                                                                    "--dry-run"]))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["launcher"] == "deepspeed" and plan["world_size"] == 16 and plan["master_addr"] == "node-a"
    cmd = plan["command"]
    assert cmd[0] == "deepspeed" and cmd[cmd.index("--hostfile") + 1] == str(hostfile)
    assert cmd[cmd.index("--num_nodes") + 1] == "2" and cmd[cmd.index("--num_gpus") + 1] == "8"
    assert cmd[cmd.index("--module") + 1] == "clusteropt_cli" and "train" in cmd and "--dry-run" not in cmd
    assert plan["deepspeed_config"]["train_batch_size"] == 4 * 16
    assert plan["deepspeed_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    text = _cli(capsys, *[a for a in _common(fixtures, tmp_path / "out", extra=[
        "--gpus", "8", "--nodes", "2", "--hostfile", str(hostfile), "--launcher", "torchrun", "--dry-run"])
        if a != "--json"])
    assert text.returncode == 0, text.stderr
    assert "--rdzv-endpoint node-a:29500" in text.stdout and "on every node" in text.stdout


def test_bad_inputs_fail_before_any_work(capsys, fixtures, tmp_path):
    proc = _cli(capsys, "train", "--model", str(fixtures.student), "--data", str(tmp_path / "missing.txt"),
                "--output", str(tmp_path / "o"), "--seq-len", "4096", "--pipeline-stages", "4", "--gpus", "4")
    assert proc.returncode == 2
    for needle in ("--data", "missing.txt", "--seq-len: 4096 exceeds", "max_position_embeddings (1024)",
                   "--pipeline-stages: 4 stages", "2 layers"):
        assert needle in proc.stderr, proc.stderr
    proc = _cli(capsys, "train", "--model", str(fixtures.student), "--data", str(fixtures.train_text),
                "--output", str(tmp_path / "o"), "--zero", "3", "--pipeline-stages", "2", "--gpus", "2")
    assert proc.returncode == 2 and "ZeRO-3 cannot be combined" in proc.stderr
    proc = _cli(capsys, "train", "--model", str(fixtures.student), "--data", str(fixtures.train_text),
                "--output", str(tmp_path / "o"), "--precision", "fp8")
    assert proc.returncode == 4 and "compute capability >= 8.9" in proc.stderr
    assert not (tmp_path / "o").exists()
