"""Careless or hostile command lines and files: each is refused before any work with a clear message and its exit
code, and nothing of the user's is written over, taken over or lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


def _train_args(fixtures, out, *extra: str) -> list[str]:
    return ["train", "--model", str(fixtures.student), "--data", str(fixtures.train_text), "--output", str(out),
            "--seq-len", "32", "--micro-batch", "2", "--max-steps", "2", "--precision", "fp32", *extra]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_resume_refuses_a_directory_copt_did_not_write(copt, fixtures, tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("precious\n")
    (user / "config.json").write_text('{"mine": 1}\n')
    before = _snapshot(user)
    proc = copt(*_train_args(fixtures, user, "--resume"))
    assert proc.returncode == 2, proc.stderr
    assert "was not written by copt" in proc.stderr and "--resume" in proc.stderr
    assert _snapshot(user) == before


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_launcher_environment_does_not_turn_off_the_checks(copt, fixtures, tmp_path, world):
    """WORLD_SIZE and RANK are set in any torchrun, SLURM or Kubeflow job: only copt's own launch makes a rank, so
    --dry-run and the output checks still hold (WORLD_SIZE=1), and a rank of an outside launcher is refused."""
    model = tmp_path / "model"
    model.mkdir()
    for f in fixtures.student.iterdir():
        if f.is_file():
            (model / f.name).write_bytes(f.read_bytes())
    before = _snapshot(model)
    env = {"WORLD_SIZE": world, "RANK": "0" if world == "1" else "1", "LOCAL_RANK": "0"}
    dry = copt(*_train_args(fixtures, tmp_path / "out", "--dry-run", "--json"), env=env)
    args = _train_args(fixtures, model)
    args[args.index("--model") + 1] = str(model)  # the output is the input model itself
    into_input = copt(*args, env=env)
    assert _snapshot(model) == before
    assert not (tmp_path / "out").exists()
    if world == "1":
        assert dry.returncode == 0, dry.stderr
        assert json.loads(dry.stdout)["world_size"] == 1
    else:
        assert dry.returncode == 2 and "WORLD_SIZE=2" in dry.stderr and "--gpus" in dry.stderr
    assert into_input.returncode == 2


def test_copts_own_launch_marks_its_ranks():
    from types import SimpleNamespace

    from clusteropt_cli.core.train.launch import LAUNCHED_RANK_FLAG, plan_launch

    options = SimpleNamespace(gpus=2, nodes=1, hostfile=None, launcher="torchrun", master_addr=None,
                              master_port=None)
    command = plan_launch(options, ["train", "--model", "m"]).command
    assert command[command.index("clusteropt_cli") + 1] == LAUNCHED_RANK_FLAG
    options.launcher = "deepspeed"
    command = plan_launch(options, ["train", "--model", "m"]).command
    assert command[command.index("clusteropt_cli") + 1] == LAUNCHED_RANK_FLAG


def test_sigterm_during_an_overwrite_restores_the_previous_output(copt, fixtures, tmp_path):
    out = tmp_path / "out"
    first = copt(*_train_args(fixtures, out))
    assert first.returncode == 0, first.stderr
    before = _snapshot(out)
    args = _train_args(fixtures, out, "--overwrite")
    args[args.index("--max-steps") + 1] = "100000"
    proc = subprocess.Popen([sys.executable, "-m", "clusteropt_cli", *args, "--save-every", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            # the old output moved aside (its directory is made first), then the new run's own metrics
            moved_aside = [d for d in tmp_path.glob(".out.replaced-*") if (d / "old").exists()]
            metrics = out / "metrics.jsonl"
            if moved_aside and metrics.exists() and metrics.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert "terminated" in stderr
    assert _snapshot(out) == before
    assert not list(tmp_path.glob(".out.replaced-*"))


def test_debug_prints_the_traceback_and_keeps_the_exit_code(copt):
    proc = copt("--debug", "advise", "--model", "no-such-model-anywhere")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "error:" in proc.stderr


def test_the_current_directory_is_not_an_output(copt, fixtures, tmp_path):
    here = tmp_path / "work"
    here.mkdir()
    proc = copt("quantize", str(fixtures.student), "--method", "rtn", "--group-size", "32", "--output", ".", cwd=here)
    assert proc.returncode == 2 and "current directory" in proc.stderr
    assert list(here.iterdir()) == []


@pytest.mark.parametrize("args, words", [
    (["advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--memory-budget", "nan"], "--memory-budget"),
    (["advise", "-m", "llama-3.2-1b", "--task", "infer", "--temperature", "inf"], "--temperature"),
    (["profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--rate", "nan"], "--rate"),
    (["profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--duration", "nan"], "--duration"),
    (["profile", "model", "llama-3.2-1b", "--memory-budget", "nan"], "--memory-budget"),
], ids=["advise-budget", "advise-temperature", "endpoint-rate", "endpoint-duration", "profile-budget"])
def test_numbers_that_are_not_finite_are_refused(copt, args, words):
    proc = copt(*args)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "internal error" not in proc.stderr


def test_an_infinite_learning_rate_is_refused(copt, fixtures, tmp_path):
    proc = copt(*_train_args(fixtures, tmp_path / "out", "--lr", "inf"))
    assert proc.returncode == 2 and "lr" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [
    b"\xff\xfe\x00",
    b"[" * 100_000,
    b'{"benchmarks": [{"metrics": {}}, "x"]}',
    b'{"output_throughput": 1e999, "completed": 1e999, "mean_ttft_ms": 1}',
    b'{"schema_version": "copt.profile/1", "kind": ' + b"9" * 5000 + b"}",
], ids=["binary", "nested", "guidellm-string-benchmark", "vllm-infinite-count", "huge-integer"])
def test_hostile_profile_files_are_refused_cleanly(copt, tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    proc = copt("advise", "--from-profile", str(path))
    assert proc.returncode == 2, proc.stderr
    assert "internal error" not in proc.stderr and str(path.name) in proc.stderr


def test_two_outputs_of_one_run_may_not_share_a_path(copt, tmp_path):
    target = tmp_path / "same.yaml"
    proc = copt("advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--emit-recipe", str(target),
                "--emit-ds-config", str(target))
    assert proc.returncode == 2 and "both name" in proc.stderr
    assert not target.exists()
    report = tmp_path / "g.json"
    proc = copt("profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--save-guidellm", str(report),
                "--save-vllm-bench", str(report))
    assert proc.returncode == 2 and "both name" in proc.stderr


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1", "http://:80", "http://256.1.1.1"])
def test_a_url_that_cannot_name_a_server_is_bad_input(copt, url):
    proc = copt("profile", "endpoint", "--url", url, "--model", "m")
    assert proc.returncode == 2 and "--url" in proc.stderr, proc.stderr


def test_recipes_cp_keeps_a_dangling_symlink(copt, tmp_path):
    link = tmp_path / "plan.yaml"
    link.symlink_to(tmp_path / "nowhere.yaml")
    proc = copt("recipes", "cp", "train-oom-zero3-offload", str(link))
    assert proc.returncode == 2 and link.is_symlink() and not (tmp_path / "nowhere.yaml").exists()


def test_outputs_follow_the_users_umask(copt, fixtures, tmp_path):
    """mkdtemp and safetensors create private (0700/0600) paths; an output is made as mkdir and open() make it."""
    out = tmp_path / "q"
    proc = copt("quantize", str(fixtures.student), "--method", "rtn", "--group-size", "32", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in out.rglob("*") if f.is_file())


def test_every_json_document_starts_with_its_schema_version(copt, fixtures, tmp_path):
    """README's contract: `--json` prints one JSON object with a versioned schema_version, whatever the command."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("task: train\nmodel: m\ndata: d.txt\noutput: o\n")
    runs = {
        "copt.env/1": ["env", "--json"],
        "copt.recipes/1": ["recipes", "list", "--json"],
        "copt.advise-lists/1": ["advise", "--list-gpus", "--json"],
        "copt.advise/1": ["advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--json"],
        "copt.train/1": _train_args(fixtures, tmp_path / "out", "--dry-run", "--json"),
        "copt.serve/1": ["serve", str(fixtures.student), "--dry-run", "--json"],
    }
    for schema, args in runs.items():
        proc = copt(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        doc = json.loads(proc.stdout)
        assert next(iter(doc)) == "schema_version" and doc["schema_version"] == schema, (args, list(doc)[:3])
    valid = json.loads(copt("recipes", "validate", str(recipe), "--json").stdout)
    assert valid["schema_version"] == "copt.recipes/1" and valid["valid"] is True


def test_a_missing_model_and_missing_data_are_reported_together(copt, tmp_path):
    proc = copt("train", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "no.txt"), "--output",
                str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "--data" in proc.stderr and "no.txt does not exist" in proc.stderr


def test_an_emitted_recipe_runs_from_any_directory(copt, fixtures, tmp_path):
    """advise was given ./model (relative): the recipe names the model absolutely, so `--recipe` works elsewhere."""
    here = tmp_path / "here"
    (here / "model").mkdir(parents=True)
    for f in fixtures.student.iterdir():
        if f.is_file():
            (here / "model" / f.name).write_bytes(f.read_bytes())
    proc = copt("advise", "-m", "./model", "--gpu", "h100-sxm", "--task", "train", "--emit-recipe", "plan.yaml",
                cwd=here)
    assert proc.returncode == 0, proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dry = copt("train", "--recipe", str(here / "plan.yaml"), "--data", str(fixtures.train_text), "--output", "out",
               "--dry-run", "--json", cwd=elsewhere)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["settings"]["model"] == str((here / "model").resolve())


def test_quantize_reports_every_bad_key_at_once(copt, fixtures, tmp_path):
    proc = copt("quantize", str(fixtures.student), "--method", "rtn", "--bits", "5", "--group-size", "0",
                "--output", str(tmp_path / "q"))
    assert proc.returncode == 2 and "--bits" in proc.stderr and "--group-size" in proc.stderr
    assert not (tmp_path / "q").exists()


def test_a_diverged_run_stops_and_its_metrics_stay_json(copt, fixtures, tmp_path):
    """--lr 1e30 saved a model of NaNs and exited 0, with bare NaN in metrics.jsonl: now exit 6 at the step the
    loss stops being a number, the row written with null."""
    out = tmp_path / "out"
    proc = copt("train", "--model", str(fixtures.student), "--data", str(fixtures.train_text), "--output", str(out),
                "--seq-len", "32", "--max-steps", "3", "--lr", "1e30", "--precision", "fp32")
    assert proc.returncode == 6 and "diverged" in proc.stderr, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] is None and not (out / "model.safetensors").exists()


def test_sizes_no_run_can_use_are_refused_up_front(copt, fixtures, tmp_path):
    """A 10^20 micro-batch loaded everything before running out of memory; a 1-token sequence trained on no
    target (loss 0); calibration text of one token failed with StopIteration after the model loaded."""
    base = ("train", "--model", str(fixtures.student), "--data", str(fixtures.train_text), "--output",
            str(tmp_path / "o"), "--dry-run")
    proc = copt(*base, "--micro-batch", "99999999999999999999", "--seq-len", "1")
    assert proc.returncode == 2 and "--micro-batch" in proc.stderr and "--seq-len" in proc.stderr, proc.stderr
    one = tmp_path / "one.txt"
    one.write_text("a\n")
    proc = copt("quantize", str(fixtures.student), "--method", "int8", "--calib", str(one), "--output",
                str(tmp_path / "q"))
    assert proc.returncode == 2 and "--calib" in proc.stderr and not (tmp_path / "q").exists(), proc.stderr[-2000:]


def test_limits_checked_before_any_work(copt, fixtures, tmp_path):
    """A tokenizer with more tokens than the model's embedding (IndexError, exit 1, after the data and the model
    loaded), 10^8 profile clients (killed by the kernel), `recipes cp NAME newdir/` (wrote a file named newdir), a
    --report where no file can be created (found after the sweep)."""
    import shutil

    small = tmp_path / "small-vocab"
    shutil.copytree(fixtures.student, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 16
    (small / "config.json").write_text(json.dumps(config))
    proc = copt("train", "--model", str(small / "config.json"), "--tokenizer", str(fixtures.tokenizer), "--data",
                str(fixtures.train_text), "--output", str(tmp_path / "o"), "--max-steps", "1", "--seq-len", "16")
    assert proc.returncode == 2 and "vocab_size" in proc.stderr, proc.stderr[-2000:]
    proc = copt("profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "100000000")
    assert proc.returncode == 2 and "at most" in proc.stderr, proc.stderr[-2000:]
    proc = copt("recipes", "cp", "train-oom-checkpointing", str(tmp_path / "newdir") + "/")
    assert proc.returncode == 2 and not (tmp_path / "newdir").exists(), proc.stderr
    if Path("/proc").is_dir():  # a report nobody can create failed only after the whole sweep, losing it
        proc = copt("profile", "endpoint", "--url", "http://127.0.0.1:9", "--model", "m", "--report", "/proc/r.json")
        assert proc.returncode == 2 and "cannot create a file" in proc.stderr, proc.stderr[-2000:]


def _copt_in_bounded_memory(*args: str) -> subprocess.CompletedProcess:
    """copt with its address space capped at 6 GiB: a model built before the host-memory check fails there at once
    instead of filling the machine's RAM."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("COPT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "clusteropt_cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, preexec_fn=cap)


def test_a_model_larger_than_host_memory_is_refused_before_loading(fixtures, tmp_path):
    """profile model and distill logits on a 405B preset (1.5 TiB of fp32 weights) on the CPU were killed by the
    kernel (exit 137) while the random weights were written: now exit 5 before anything is allocated, teacher and
    student counted together."""
    proc = _copt_in_bounded_memory("profile", "model", "llama-3.1-405b", "--device", "cpu")
    assert proc.returncode == 5 and "Not enough host memory" in proc.stderr, proc.stderr[-2000:]
    assert "--dtype" in proc.stderr
    out = tmp_path / "out"
    proc = _copt_in_bounded_memory("distill", "logits", "--teacher", str(fixtures.teacher), "--student",
                                   "llama-3.1-405b", "--data", str(fixtures.train_text), "--output", str(out))
    assert proc.returncode == 5 and "Not enough host memory" in proc.stderr, proc.stderr[-2000:]
    assert "--student llama-3.1-405b" in proc.stderr and not out.exists()
    import torch

    if not torch.cuda.is_available():  # on a CPU the teacher is held beside the student
        assert "--teacher" in proc.stderr and "--teacher-dtype" in proc.stderr


def test_distill_sft_refuses_a_tokenizer_larger_than_the_students_vocabulary(copt, fixtures, tmp_path):
    """A student directory (config + tokenizer, trained from scratch) whose vocab_size is below its tokenizer's
    size failed with an IndexError (exit 1) in the first step, after the traces and the model loaded: refused up front
    with copt train's check."""
    student = tmp_path / "student"
    student.mkdir()
    for f in fixtures.student.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (student / f.name).write_bytes(f.read_bytes())
    config = json.loads((student / "config.json").read_text())
    config["vocab_size"] = 16
    (student / "config.json").write_text(json.dumps(config))
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "completion": f"It is {i + 1}."}) + "\n"
                              for i in range(4)))
    out = tmp_path / "out"
    proc = copt("distill", "sft", "--student", str(student), "--traces", str(traces), "--output", str(out),
                "--max-steps", "1", "--seq-len", "32", "--precision", "fp32")
    assert proc.returncode == 2 and "the model's embedding has 16 (vocab_size)" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def _copt_here(capsys, *args) -> tuple[int, str]:
    """copt in this process (for runs refused before any work)."""
    from clusteropt_cli.app import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    return int(info.value.code or 0), " ".join(capsys.readouterr().err.split())


def test_a_directory_as_a_recipe_is_named_a_directory(capsys, tmp_path):
    """`recipes validate some_dir.yaml` said the path was 'neither a file nor a built-in recipe'."""
    folder = tmp_path / "some_dir.yaml"
    folder.mkdir()
    for args in (["recipes", "validate", folder], ["train", "--recipe", folder]):
        code, err = _copt_here(capsys, *args)
        assert code == 2 and f"Recipe {folder} is a directory." in err and "neither" not in err, err


def test_a_model_file_where_a_model_directory_is_wanted_names_the_directory(capsys, fixtures, tmp_path):
    """`distill onpolicy --student x/config.json` said 'is not a model directory (no config.json)'."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    config, out = fixtures.student / "config.json", ["--output", tmp_path / "out"]
    for args, named, folder in [
        (["distill", "onpolicy", "--teacher", fixtures.teacher, "--student", config, "--prompts", prompts, *out],
         f"--student {config}", fixtures.student),
        (["distill", "onpolicy", "--teacher", fixtures.teacher / "config.json", "--student", fixtures.student,
          "--prompts", prompts, *out], f"--teacher {fixtures.teacher / 'config.json'}", fixtures.teacher),
        (["distill", "logits", "--teacher", fixtures.teacher / "config.json", "--student", fixtures.student,
          "--data", fixtures.train_text, *out], f"--teacher {fixtures.teacher / 'config.json'}", fixtures.teacher),
        (["serve", config], f"MODEL {config}", fixtures.student),
        (["quantize", config, "--method", "rtn", *out], f"MODEL {config}", fixtures.student),
    ]:
        code, err = _copt_here(capsys, *args)
        assert code == 2 and f"{named} is a file in a model directory (its config.json)" in err, err
        assert f"Pass the directory instead: {folder}" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["missing.txt", "empty.txt", "folder", "binary.txt", "/dev/null"])
def test_eval_data_problems_read_as_the_same_problems_of_data(capsys, fixtures, tmp_path, bad):
    """--eval-data that is a directory or a device said 'does not exist', and an empty one failed only after the
    models loaded; --data's messages, named --eval-data, before any load (logits and onpolicy)."""
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00text")
    path = Path(bad) if bad.startswith("/") else tmp_path / bad
    models = ["--teacher", fixtures.teacher, "--student", fixtures.student, "--output", tmp_path / "out"]
    code, as_data = _copt_here(capsys, "distill", "logits", *models, "--data", path, "--max-steps", "1")
    assert code == 2, as_data
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    for args in (["distill", "logits", *models, "--data", fixtures.train_text],
                 ["distill", "onpolicy", *models, "--prompts", prompts]):
        code, err = _copt_here(capsys, *args, "--eval-data", path)
        assert code == 2 and err == as_data.replace("--data", "--eval-data"), (err, as_data)
    assert not (tmp_path / "out").exists()


def test_a_key_value_after_a_recipe_is_an_override_not_the_model(capsys, fixtures, tmp_path):
    """`copt quantize --recipe r.yaml bits=8` (the model in the recipe) read `bits=8` as the model directory: it is an
    override there as it is for serve; a directory whose name holds '=' stays the model."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {fixtures.student}\nmethod: rtn\ngroup_size: 32\n")
    code, err = _copt_here(capsys, "quantize", "--recipe", recipe, "bits=8", "--dry-run", "--output", tmp_path / "q")
    assert code == 0, err
    from clusteropt_cli.options import model_and_overrides

    named = tmp_path / "a=b"
    named.mkdir()
    assert model_and_overrides(str(named), ["bits=8"]) == (str(named), ["bits=8"])
    assert model_and_overrides("bits=8", ["seq_len=64"]) == (None, ["bits=8", "seq_len=64"])


def test_train_tokenizer_without_tokenizer_files_is_named(capsys, tmp_path):
    """`copt train --tokenizer DIR` with no tokenizer files in DIR failed in transformers with a message about the
    model's files; refused up front naming the files looked for."""
    data = tmp_path / "d.txt"
    data.write_text("some text\n")
    (tmp_path / "tok").mkdir()
    code, err = _copt_here(capsys, "train", "--model", "llama-3.2-1b", "--tokenizer", tmp_path / "tok", "--data", data,
                           "--output", tmp_path / "out", "--dry-run")
    assert code == 2 and f"--tokenizer {tmp_path / 'tok'} holds no tokenizer files" in err, err


def test_train_counts_every_rank_of_the_node_against_host_memory(capsys, fixtures, tmp_path, monkeypatch):
    """Each rank of `copt train --gpus N` builds the whole fp32 model on the host: the launching parent checks N
    copies before starting any rank (each rank had checked one copy alone, while the others were filling the RAM)."""
    from clusteropt_cli.modelspec import load_model_spec, read_config_json

    one = load_model_spec(read_config_json(fixtures.student / "config.json")).num_params * 4
    monkeypatch.setattr("clusteropt_cli.core.models.host_memory_available", lambda: int(one * 1.5))
    out = tmp_path / "out"
    code, err = _copt_here(capsys, "train", "--model", fixtures.student, "--data", fixtures.train_text, "--output",
                           out, "--gpus", "2", "--max-steps", "1")
    assert code == 5 and "2 copies" in err and "Not enough host memory" in err, err
    assert not out.exists()


@pytest.mark.parametrize("mode", ["logits", "sft"])
def test_distill_counts_every_ranks_student_against_host_memory(capsys, fixtures, tmp_path, monkeypatch, mode):
    """distill --gpus N builds N fp32 students on the host: the launching parent counts them all (logits checked one
    copy, sft none before its ranks started)."""
    from clusteropt_cli.modelspec import load_model_spec, read_config_json

    one = load_model_spec(read_config_json(fixtures.student / "config.json")).num_params * 4
    monkeypatch.setattr("clusteropt_cli.core.models.host_memory_available", lambda: int(one * 1.5))
    out = tmp_path / "out"
    if mode == "logits":
        args = ["--teacher", fixtures.teacher, "--data", fixtures.train_text]
    else:
        traces = tmp_path / "t.jsonl"
        traces.write_text(json.dumps({"prompt": "What is 1 + 1?", "completion": "It is 2."}) + "\n")
        args = ["--traces", traces]
    code, err = _copt_here(capsys, "distill", mode, "--student", fixtures.student, *args, "--output", out,
                           "--gpus", "2", "--max-steps", "1")
    assert code == 5 and "Not enough host memory" in err and "2 copies" in err, err
    assert not out.exists()


def test_serve_refuses_a_tokenizer_only_its_shipped_code_implements(capsys, fixtures, tmp_path):
    """`copt serve MODEL` (or `--tokenizer DIR`) whose tokenizer_config.json maps AutoTokenizer to the directory's
    own module: transformers asked on the engine's terminal whether to run it, then copt reported the refusal as an
    internal error. Refused up front (exit 2) naming the file; the module is never imported."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(fixtures.student, model)
    (model / "my_tokenizer.py").write_text(f"open({str(model / 'RAN')!r}, 'w').close()\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    code, err = _copt_here(capsys, "serve", model, "--dry-run")
    assert code == 2 and f"MODEL {model}: tokenizer_config.json maps AutoTokenizer to Python code" in err, err
    assert "--tokenizer DIR" in err  # the way out: a tokenizer transformers implements
    code, err = _copt_here(capsys, "serve", fixtures.student, "--tokenizer", model, "--dry-run")
    assert code == 2 and f"--tokenizer {model}: tokenizer_config.json maps AutoTokenizer" in err, err
    code, err = _copt_here(capsys, "serve", model, "--tokenizer", fixtures.student, "--dry-run")
    assert code == 0, err  # another directory's tokenizer: MODEL's is never loaded
    assert not (model / "RAN").exists()
