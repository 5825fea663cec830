"""copt never deletes, corrupts or executes what the user did not ask it to: outputs over inputs and --overwrite of
foreign directories refused (sentinels survive), verified checkpoints loaded without unpickling code (a planted
pickle's side effect never happens), damaged checkpoints fallen back from or refused, metrics history kept, full
disks named with their exit code, and bad input files answered with exit 2 and the fix."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from clusteropt_cli.app import main
from clusteropt_cli.errors import BadInputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run copt in this process as from the command line: (exit code, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, " ".join(err.split())  # rich wraps long lines


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(fixtures, tmp_path):
    """p/base-model (a copy of the fixture teacher), p/train.jsonl and the user's p/keep.txt."""
    p = tmp_path / "p"
    shutil.copytree(fixtures.teacher, p / "base-model")
    (p / "train.jsonl").write_text(json.dumps({"text": fixtures.train_text.read_text()[:20000]}) + "\n")
    (p / "keep.txt").write_text("the user's notes")
    return p


# ---- rule 1: outputs never over inputs; --overwrite only replaces copt's own output ----------------------------
def test_quantize_overwrite_never_deletes_the_model_or_the_users_files(capsys, project, tmp_path):
    before = _tree(project)
    code, _, err = cli(capsys, "quantize", project / "base-model", "--output", project, "--method", "rtn", "--bits",
                       "8", "--group-size", "64", "--overwrite")
    assert code == 2 and "contains the input MODEL" in err
    code, _, err = cli(capsys, "quantize", project / "base-model", "--output", project / "base-model" / "q",
                       "--method", "rtn", "--bits", "8", "--overwrite")
    assert code == 2 and "lies inside the input MODEL" in err
    calib = project / "train.jsonl"
    code, _, err = cli(capsys, "quantize", project / "base-model", "--output", calib, "--method", "awq", "--calib",
                       calib, "--overwrite")
    assert code == 2 and "is the input --calib" in err
    user_dir = tmp_path / "results"
    user_dir.mkdir()
    (user_dir / "keep.txt").write_text("mine")
    code, _, err = cli(capsys, "quantize", project / "base-model", "--output", user_dir, "--method", "rtn",
                       "--bits", "8", "--overwrite")
    assert code == 2 and "not written by copt" in err and "would delete: keep.txt" in err
    assert (user_dir / "keep.txt").read_text() == "mine"
    assert _tree(project) == before


def _train_args(project: Path, output: Path, data: Path | None = None, steps: int = 2, *extra: str) -> list:
    return ["train", "--model", project / "base-model", "--data", data or project / "train.jsonl", "--output", output,
            "--seq-len", "32", "--micro-batch", "2", "--max-steps", str(steps), "--json", *extra]


def test_train_overwrite_never_deletes_inputs_and_a_failed_replacement_keeps_the_old_output(capsys, project,
                                                                                             tmp_path):
    before = _tree(project)
    code, _, err = cli(capsys, *_train_args(project, project, None, 2, "--overwrite"))
    assert code == 2 and "contains the input --model" in err
    assert _tree(project) == before  # nothing deleted: the issue's `--output q --overwrite` lost model and data
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "keep.txt").write_text("mine")
    code, _, err = cli(capsys, *_train_args(project, user_dir, None, 2, "--overwrite"))
    assert code == 2 and "would delete: keep.txt" in err and (user_dir / "keep.txt").exists()

    out = tmp_path / "run"
    code, stdout, err = cli(capsys, *_train_args(project, out))
    assert code == 0, err
    assert (out / ".copt-output.json").is_file() and (out / "model.safetensors").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".copt-output.json"]
    first = _tree(out)
    code, _, err = cli(capsys, *_train_args(project, out))
    assert code == 2 and "already exists" in err  # never replaced without --overwrite
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, _, err = cli(capsys, *_train_args(project, out, empty, 2, "--overwrite"))  # fails after validation
    assert code == 2 and "holds no text" in err and "empty.jsonl" in err
    assert _tree(out) == first  # the failed replacement left the old output intact
    code, _, err = cli(capsys, *_train_args(project, out, None, 3, "--overwrite"))
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl", "mine", "p", "run"]  # no temporaries


# ---- rule 2: checkpoints ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data32(fixtures):
    from clusteropt_cli.core.train import build_text_dataset
    from clusteropt_cli.core.train.model import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(str(fixtures.student), str(fixtures.tokenizer)))
    return tokenizer, build_text_dataset(fixtures.train_text, tokenizer, 32)


def _train(fixtures, data32, output: Path, **kw):
    from clusteropt_cli.core.train import run_training
    from clusteropt_cli.core.train.model import load_model, resolve_model_source
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    recipe = TrainRecipe(**{**dict(model=str(fixtures.student / "config.json"), tokenizer=str(fixtures.tokenizer),
                                   output=str(output), seq_len=32, micro_batch=2, max_steps=7, lr=3e-3,
                                   schedule="constant", precision="fp32", save_every=2), **kw})
    tokenizer, dataset = data32
    source = resolve_model_source(recipe.model, recipe.tokenizer)
    return run_training(recipe, load_model(source, seed=0), dataset, output, tokenizer=tokenizer, save_final=False)


@pytest.fixture(scope="module")
def trained(fixtures, data32, tmp_path_factory):
    """A 7-step run saving every 2 steps (checkpoints 2, 4, 6; the newest two kept) and its losses."""
    out = tmp_path_factory.mktemp("ckpt") / "out"
    result = _train(fixtures, data32, out)
    return out, result.losses


def _copy(trained, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(trained[0], out)
    return out


def test_checkpoints_keep_the_newest_two_with_checksums(trained):
    out, _ = trained
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4", "step-6"]
    meta = json.loads((out / "checkpoints" / "step-6" / "meta.json").read_text())
    state = out / "checkpoints" / "step-6" / "training_state.pt"
    assert meta["files"]["training_state.pt"] == {"bytes": state.stat().st_size,
                                                  "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}
    assert set(meta["files"]) == {"training_state.pt", "rng_rank0.pt"}


class _Planted:
    """Unpickling this creates a file: the side effect a planted checkpoint would have."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("checksum", ["updated", "stale"])
def test_a_planted_pickle_never_runs_on_resume(fixtures, data32, trained, tmp_path, checksum, capsys):
    import torch

    out = _copy(trained, tmp_path)
    side_effect = tmp_path / "pwned"
    step6 = out / "checkpoints" / "step-6"
    torch.save({"model": _Planted(str(side_effect))}, step6 / "training_state.pt")
    if checksum == "updated":  # the planter also fixed the manifest: weights_only=True is what stops it
        meta = json.loads((step6 / "meta.json").read_text())
        data = (step6 / "training_state.pt").read_bytes()
        meta["files"]["training_state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (step6 / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(BadInputError, match="training_state.pt holds objects other than tensors"):
            _train(fixtures, data32, out, resume=True)
    else:  # a file that does not match its checksum is never opened: the run falls back to step 4
        result = _train(fixtures, data32, out, resume=True)
        err = capsys.readouterr().err
        assert result.start_step == 4 and "skipping a damaged checkpoint" in err and "training_state.pt" in err
    assert not side_effect.exists()


def test_a_planted_pickle_in_a_deepspeed_checkpoint_is_refused_before_deepspeed_loads_it(tmp_path):
    """DeepSpeed loads its files with weights_only=False: copt scans their pickled globals first (running none)."""
    import torch

    from clusteropt_cli.core.train.checkpoint import check_pickled_globals

    side_effect = tmp_path / "pwned"
    (tmp_path / "deepspeed").mkdir()
    torch.save({"module": {"w": torch.zeros(2)}}, tmp_path / "deepspeed" / "mp_rank_00_model_states.pt")
    check_pickled_globals(tmp_path)  # tensors and containers only: fine
    torch.save({"optimizer": _Planted(str(side_effect))}, tmp_path / "deepspeed" / "zero_pp_rank_0_optim_states.pt")
    with pytest.raises(BadInputError, match=r"zero_pp_rank_0_optim_states.pt references Python objects.*open"):
        check_pickled_globals(tmp_path)
    assert not side_effect.exists()


def test_a_truncated_checkpoint_falls_back_to_the_newest_valid_one(fixtures, data32, trained, tmp_path, capsys):
    out = _copy(trained, tmp_path)
    state = out / "checkpoints" / "step-6" / "training_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    capsys.readouterr()
    result = _train(fixtures, data32, out, resume=True)
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err and "training_state.pt" in err and "step-4" in err
    assert result.start_step == 4 and result.losses == pytest.approx(trained[1][4:], abs=1e-5)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))  # the history up to step 4 kept, 5-7 appended again


def _metrics(out: Path) -> bytes:
    return (out / "metrics.jsonl").read_bytes()


def test_no_valid_checkpoint_is_exit_2_naming_the_file_and_keeps_the_history(fixtures, data32, trained, tmp_path):
    out = _copy(trained, tmp_path)
    history = _metrics(out)
    for step in ("step-4", "step-6"):
        state = out / "checkpoints" / step / "training_state.pt"
        state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(BadInputError, match=r"step-6/training_state.pt has 1000 bytes") as info:
        _train(fixtures, data32, out, resume=True)
    assert "step-4/training_state.pt" in info.value.message and info.value.exit_code == 2
    assert _metrics(out) == history


def test_checkpoints_without_metadata_are_refused_never_restarted_from_step_0(fixtures, data32, trained, tmp_path):
    out = _copy(trained, tmp_path)
    history = _metrics(out)
    for meta in (out / "checkpoints").glob("step-*/meta.json"):
        meta.unlink()
    with pytest.raises(BadInputError, match="meta.json is missing"):
        _train(fixtures, data32, out, resume=True)
    assert _metrics(out) == history
    shutil.rmtree(out / "checkpoints")  # no checkpoint at all, but a history: still refused
    with pytest.raises(BadInputError, match="has a training history"):
        _train(fixtures, data32, out, resume=True)
    with pytest.raises(BadInputError, match="already holds a training history"):  # a fresh run never truncates it
        _train(fixtures, data32, out)
    assert _metrics(out) == history


# ---- rule 3: full disks -------------------------------------------------------------------------------------
def test_train_on_a_full_disk_is_exit_7_and_leaves_no_partial_checkpoint(capsys, project, tmp_path, monkeypatch):
    import torch

    def full_disk_save(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk_save)
    out = tmp_path / "run"
    code, _, err = cli(capsys, *_train_args(project, out, None, 3, "--save-every", "1"))
    assert code == 7 and "No space left on device at" in err and "checkpoints" in err
    assert "needs ~12.0 MiB" in err  # parameters + AdamW states of the fixture teacher (1,049,728 fp32 params x 12 B)
    assert not list((out / "checkpoints").iterdir())  # the partial checkpoint was removed


def test_quantize_on_a_full_disk_is_exit_7_and_keeps_the_old_output(capsys, project, tmp_path, monkeypatch):
    from clusteropt_cli.core.io import atomic_output_dir
    from clusteropt_cli.core.quantize import backends

    out = tmp_path / "q"
    with atomic_output_dir(out, command="quantize") as tmp:
        (tmp / "model.safetensors").write_bytes(b"the previous run")

    def full_disk(model, tokenizer, settings, texts, output_dir, **kwargs):
        (output_dir / "model.safetensors").write_bytes(b"x" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(output_dir / "model.safetensors"))

    monkeypatch.setattr(backends, "quantize", full_disk)
    code, _, err = cli(capsys, "quantize", project / "base-model", "--output", out, "--method", "rtn", "--bits", "8",
                       "--overwrite")
    assert code == 7 and f"No space left on device at {out} (needs ~" in err
    assert (out / "model.safetensors").read_bytes() == b"the previous run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p", "q"]  # the temporary output was removed


# ---- rule 5: bad input files → exit 2 naming the file and the fix ------------------------------------------
def _model_variant(fixtures, root: Path, name: str, edit) -> Path:
    target = root / name
    shutil.copytree(fixtures.teacher, target)
    edit(target)
    return target


def _config_edit(**changes):
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))
    return edit


def _pickle_only(path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


def _tokenizer_code(path: Path) -> None:
    """The tokenizer maps AutoTokenizer to a module of the directory (which, imported, leaves RAN behind) and names
    a class only that module defines."""
    (path / "my_tokenizer.py").write_text(f"open({str(path / 'RAN')!r}, 'w').close()\n")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTokenizer", auto_map={"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]})
    (path / "tokenizer_config.json").write_text(json.dumps(config))


BAD_MODELS = {
    "non-utf8-config": (lambda p: (p / "config.json").write_bytes(b"\xff\xfe{"), "config.json is not UTF-8",
                        "restore it"),
    "non-object-config": (lambda p: (p / "config.json").write_text("[1, 2]"), "is not a JSON object",
                          "one JSON object"),
    "unknown-model-type": (_config_edit(model_type="zzz_unknown"), "unknown model_type 'zzz_unknown'",
                           "upgrade transformers"),
    "custom-code": (_config_edit(model_type="my_custom_lm", auto_map={"AutoModelForCausalLM": "m.M"}),
                    "trust_remote_code is off", "architecture transformers implements"),
    "pickle-only-weights": (_pickle_only, "weights only as pickle files (pytorch_model.bin)", "save_pretrained"),
    "custom-tokenizer-code": (_tokenizer_code, "maps AutoTokenizer to Python code shipped in the directory",
                              "does not run code from model directories"),
}


@pytest.fixture(scope="module")
def bad_files(fixtures, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    models = {name: _model_variant(fixtures, root, name, edit) for name, (edit, _, _) in BAD_MODELS.items()}
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 8)
    (root / "deep.yaml").write_text("a:\n" + "- " * 5000 + "x\n")
    (root / "empty.jsonl").write_text("")
    (root / "datadir").mkdir()
    (root / "train.txt").write_text(fixtures.train_text.read_text()[:5000])
    return root, models


def _bad_cases():
    cases = []
    for name, (_, message, fix) in BAD_MODELS.items():
        cases.append(pytest.param("quantize", name, message, fix, id=f"quantize-{name}"))
        cases.append(pytest.param("train", name, message, fix, id=f"train-{name}"))
    cases += [pytest.param("quantize", "binary.yaml", "binary.yaml is not UTF-8 text", "YAML recipe",
                           id="binary-recipe"),
              pytest.param("quantize", "deep.yaml", "deep.yaml nests too deeply", "flat mapping",
                           id="5000-deep-recipe"),
              pytest.param("train", "empty.jsonl", "empty.jsonl holds no text", ".jsonl file with a 'text'",
                           id="empty-jsonl-data"),
              pytest.param("train", "datadir", "datadir is a directory", "one .txt or .jsonl file",
                           id="data-is-a-directory"),
              pytest.param("distill", "datadir", "datadir is a directory", ".txt or .jsonl",
                           id="distill-data-is-a-directory")]
    return cases


@pytest.mark.parametrize(("command", "bad", "message", "fix"), _bad_cases())
def test_bad_input_files_are_exit_2_naming_the_file_and_the_fix(capsys, fixtures, bad_files, tmp_path, command, bad,
                                                                  message, fix):
    root, models = bad_files
    out = tmp_path / "out"
    model = models.get(bad, fixtures.teacher)
    data = root / bad if bad in ("empty.jsonl", "datadir") else root / "train.txt"
    if command == "quantize":
        args = ["quantize", model, "--method", "rtn", "--bits", "8", "--output", out]
        if bad.endswith(".yaml"):
            args += ["--recipe", root / bad]
    elif command == "train":
        args = ["train", "--model", model, "--data", data, "--output", out, "--seq-len", "32", "--max-steps", "1"]
    else:
        args = ["distill", "logits", "--teacher", fixtures.teacher, "--student", fixtures.student, "--data", data,
                "--output", out]
    code, _, err = cli(capsys, *args)
    assert code == 2, err
    assert message in err and fix in err
    assert not out.exists()  # nothing written
    assert not (model / "RAN").exists()  # no code of the model's directory ran


# ---- rule 4: a killed quantize's temporary output is cleaned by the next run ---------------------------------
@pytest.mark.slow
def test_the_temporary_output_of_a_killed_quantize_is_removed_by_the_next_run(capsys, fixtures, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    words = ["quantize", str(fixtures.teacher), "--method", "rtn", "--bits", "8", "--output", str(tmp_path / "q")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # kill -9 at the last moment of the run: the weights are in the temporary directory, the swap has not happened
    # (killing from outside after seeing the directory raced the swap of a fast run)
    killed_before_swap = ("import os, signal, clusteropt_cli.core.io as io\n"
                          "io.write_output_marker = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
                          "from clusteropt_cli.app import main\nmain()")
    proc = subprocess.run([sys.executable, "-c", killed_before_swap, *words], env=env, capture_output=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL
    stale = list(tmp_path.glob(".q.tmp-*"))
    assert len(stale) == 1 and not (tmp_path / "q").exists()  # kill -9: no output, one temporary left
    # the next run (in this process, as the other tests here run copt: the dead one needed a process of its own)
    code, _, err = cli(capsys, *words, "--json")
    assert code == 0, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # the dead run's temporary is gone
