"""The output rule every writing command follows (core/io.py): never over an input, --overwrite replaces only what
copt wrote, replacements are atomic, stale temporary directories of dead runs are cleaned, full disks are named."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusteropt_cli.core import io
from clusteropt_cli.errors import BadInputError, DiskFullError, map_exception


@pytest.fixture
def tree(tmp_path):
    """model/ with weights, data.jsonl beside it, and a sentinel file of the user's."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "keep.txt").write_text("the user's")
    return tmp_path


@pytest.mark.parametrize("output, relation", [
    ("model", "is the input"),  # equals
    (".", "contains the input"),  # contains
    ("model/sub", "lies inside the input"),  # inside
    ("data.jsonl", "is the input"),
])
def test_an_output_never_touches_an_input(tree, output, relation):
    with pytest.raises(BadInputError, match=relation) as info:
        io.check_output(tree / output, {"MODEL": tree / "model", "--data": tree / "data.jsonl"}, overwrite=True)
    assert info.value.exit_code == 2


def test_symlinks_are_resolved(tree):
    (tree / "alias").symlink_to(tree / "model")
    with pytest.raises(BadInputError, match="is the input MODEL"):
        io.check_output(tree / "alias", {"MODEL": tree / "model"}, overwrite=True)
    (tree / "link-to-data").symlink_to(tree / "data.jsonl")
    with pytest.raises(BadInputError, match="contains the input --data"):
        io.check_output(tree, {"--data": tree / "link-to-data"}, overwrite=True)


def test_overwrite_replaces_only_what_copt_wrote_or_an_empty_dir(tree):
    out = tree / "out"
    io.check_output(out, {}, overwrite=False)  # new: fine
    out.mkdir()
    io.check_output(out, {}, overwrite=False)  # empty: fine
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError, match="already exists"):
        io.check_output(out, {}, overwrite=False)
    with pytest.raises(BadInputError, match=r"not written by copt.*would delete: notes.txt"):
        io.check_output(out, {}, overwrite=True)
    io.write_output_marker(out, "train")
    io.check_output(out, {}, overwrite=True)  # copt's own output: replaceable
    io.check_output(out, {}, overwrite=False, resume=True)  # resuming continues it


def test_atomic_output_dir_keeps_the_old_output_on_failure_and_marks_the_new_one(tree):
    out = tree / "out"
    with io.atomic_output_dir(out, command="test") as tmp:
        (tmp / "a").write_text("first")
    assert (out / io.OUTPUT_MARKER).is_file() and not (out / io.TMP_OWNER).exists()
    with pytest.raises(RuntimeError), io.atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "a").write_text("second")
        raise RuntimeError("the run failed")
    assert (out / "a").read_text() == "first"
    assert [p.name for p in tree.iterdir() if p.name.startswith(".out")] == []  # no temporary left
    with io.atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "a").write_text("second")
    assert (out / "a").read_text() == "second"
    (out / io.OUTPUT_MARKER).unlink()
    with pytest.raises(BadInputError, match="not written by copt"), io.atomic_output_dir(out, overwrite=True):
        pass
    assert (out / "a").read_text() == "second"


def test_replacing_output_dir_restores_the_old_output_when_the_run_fails(tree):
    out = tree / "out"
    with io.replacing_output_dir(out, overwrite=False, command="test"):
        (out / "metrics.jsonl").write_text("old\n")
    with pytest.raises(KeyboardInterrupt), io.replacing_output_dir(out, overwrite=True, command="test"):
        assert not (out / "metrics.jsonl").exists()  # the old output is aside, not deleted
        (out / "metrics.jsonl").write_text("new, partial\n")
        raise KeyboardInterrupt
    assert (out / "metrics.jsonl").read_text() == "old\n"
    with io.replacing_output_dir(out, overwrite=True, command="test"):
        (out / "metrics.jsonl").write_text("new\n")
    assert (out / "metrics.jsonl").read_text() == "new\n"
    assert sorted(p.name for p in tree.iterdir()) == ["data.jsonl", "keep.txt", "model", "out"]


@pytest.mark.parametrize("stop_at", ["move", "mkdir", "marker"])
def test_a_stop_while_the_old_output_is_moved_aside_restores_it(tree, monkeypatch, stop_at):
    """SIGTERM (copt's Terminated) or Ctrl-C between the new run's start and its first step: the old output is
    back where it was, nothing is left beside it."""
    out = tree / "out"
    with io.replacing_output_dir(out, overwrite=False, command="test"):
        (out / "metrics.jsonl").write_text("old\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    if stop_at == "move":  # the old output renamed aside, then the stop
        real_replace, calls = os.replace, []

        def replace_then_stop(src, dst):
            real_replace(src, dst)
            calls.append(dst)
            if len(calls) == 1:
                raise KeyboardInterrupt

        monkeypatch.setattr(io.os, "replace", replace_then_stop)
    elif stop_at == "mkdir":
        monkeypatch.setattr(Path, "mkdir", stopped)
    else:
        monkeypatch.setattr(io, "write_output_marker", stopped)
    with pytest.raises(KeyboardInterrupt), io.replacing_output_dir(out, overwrite=True, command="test"):
        pytest.fail("the run started")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tree.iterdir()) == ["data.jsonl", "keep.txt", "model", "out"]


def test_stale_temp_dirs_of_dead_runs_are_cleaned_live_and_foreign_ones_kept(tree):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tree / ".out.tmp-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    (stale / io.TMP_OWNER).write_text(json.dumps({"pid": dead_pid, "host": os.uname().nodename}))
    live = tree / ".out.tmp-live"
    live.mkdir()
    (live / io.TMP_OWNER).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                 "start": io._start_time(os.getpid())}))
    foreign = tree / ".out.tmp-foreign"  # no owner file: not provably copt's, left alone
    foreign.mkdir()
    with io.atomic_output_dir(tree / "out") as tmp:
        (tmp / "x").write_text("x")
    assert not stale.exists() and live.is_dir() and foreign.is_dir()


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_is_a_named_error_with_its_exit_code_and_no_partial_output(tree, monkeypatch):
    out = tree / "out"
    with pytest.raises(DiskFullError, match=r"No space left on device at .*needs ~") as info:
        with io.atomic_output_dir(out) as tmp:
            (tmp / "part").write_bytes(b"x" * 1000)
            _enospc()
    assert info.value.exit_code == 7 and not out.exists()
    assert [p for p in tree.iterdir() if p.name.startswith(".out")] == []
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/3: file write failed")
    assert isinstance(map_exception(torch_error), DiskFullError)
    assert isinstance(map_exception(OSError(errno.ENOSPC, "No space left on device", "/x/y")), DiskFullError)
    assert map_exception(RuntimeError("something else")) is None
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _enospc())
    with pytest.raises(DiskFullError):
        io.atomic_write_text(tree / "report.json", "{}")
    assert not list(tree.glob(".report.json*"))


def test_train_checkpoint_save_on_a_full_disk_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    import torch

    from clusteropt_cli.core.train import checkpoint

    def failing_save(obj, path, *a, **k):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    monkeypatch.setattr(torch, "save", failing_save)
    target = tmp_path / "state.pt"
    with pytest.raises(DiskFullError, match="state.pt"):
        checkpoint.save_torch_file({"x": torch.zeros(2)}, target)
    assert not target.exists()


def test_unwritable_or_misnamed_paths_are_bad_input_not_bugs():
    mapped = map_exception(PermissionError(errno.EACCES, "Permission denied", "/ro/out"))
    assert isinstance(mapped, BadInputError) and mapped.exit_code == 2 and "/ro/out" in mapped.message
    mapped = map_exception(IsADirectoryError(errno.EISDIR, "Is a directory", "/data"))
    assert isinstance(mapped, BadInputError) and "/data is a directory" in mapped.message


def _staged(output: Path, step: int) -> None:
    from clusteropt_cli.core.train.checkpoint import staging_dir

    staging = staging_dir(output, step)
    (staging / "deepspeed").mkdir(parents=True)
    (staging / "training_state.pt").write_bytes(b"state %d" % step)
    (staging / "deepspeed" / "shard.pt").write_bytes(b"shard %d" % step)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_commit_keeps_the_newest_n_checkpoints_and_verifies_them(tmp_path, keep):
    from clusteropt_cli.core.train.checkpoint import commit_checkpoint, select_checkpoint, verify_checkpoint

    for step in (2, 4, 6, 8):
        _staged(tmp_path, step)
        commit_checkpoint(tmp_path, step, {"step": step, "data": {}}, keep=keep)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == [f"step-{s}" for s in (2, 4, 6, 8)[4 - keep:]]
    meta, problem = verify_checkpoint(tmp_path / "checkpoints" / "step-8")
    assert problem is None and set(meta["files"]) == {"training_state.pt", "deepspeed/shard.pt"}
    (tmp_path / "checkpoints" / "step-8" / "deepspeed" / "shard.pt").write_bytes(b"shard 9")  # same size
    chosen = select_checkpoint(tmp_path) if keep > 1 else None
    if keep > 1:
        assert chosen.path.name == "step-6" and "shard.pt does not match its sha256" in chosen.skipped[0]
    else:
        with pytest.raises(BadInputError, match="no checkpoint .* is valid"):
            select_checkpoint(tmp_path)


def test_a_launched_ranks_copt_error_keeps_its_exit_code_in_the_launching_copt(tmp_path):
    """A rank that exits with a copt error (exit 2 bad checkpoint, 7 full disk) records it; the parent re-raises it
    instead of a generic exit-1 'the processes failed'."""
    import sys

    from clusteropt_cli.core.train.launch import LaunchPlan, run_launch_checked
    from clusteropt_cli.errors import CoptError

    rank = ("import os, sys; os.environ.update(RANK='{r}', WORLD_SIZE='2'); "
            "from clusteropt_cli.core.train.launch import record_rank_error; "
            "record_rank_error({code}, 'rank {r}: no space left', 'free space'); sys.exit(1)")
    script = tmp_path / "ranks.sh"
    script.write_text("".join(f'{sys.executable} -c "{rank.format(r=r, code=7)}"\n' for r in (1, 0)) + "exit 1\n")
    plan = LaunchPlan("torchrun", 2, 1, 2, ["bash", str(script)], env={"PYTHONPATH": str(Path.cwd())})
    with pytest.raises(CoptError) as info:
        run_launch_checked(plan, "training")
    assert info.value.exit_code == 7 and info.value.message == "rank 0: no space left"
    (tmp_path / "fail.sh").write_text("exit 3\n")
    with pytest.raises(CoptError, match="training processes exited with code 3") as info:
        run_launch_checked(LaunchPlan("torchrun", 2, 1, 2, ["bash", str(tmp_path / "fail.sh")]), "training")
    assert info.value.exit_code == 1


def test_a_full_disk_behind_any_librarys_error_is_exit_7_and_leaves_no_partial_files(tmp_path):
    """safetensors raises its own SafetensorError and torch's zip writer a RuntimeError about positions; both are a
    full disk (exit 7, partial files removed), not an internal error."""
    from clusteropt_cli.core.io import disk_full_as_error, is_disk_full
    from clusteropt_cli.errors import DiskFullError, map_exception

    class SafetensorError(Exception):
        pass

    rust = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    torch_zip = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 569152 vs 569040")
    assert is_disk_full(rust) and is_disk_full(torch_zip)
    assert not is_disk_full(RuntimeError("unexpected pos in a list"))
    assert isinstance(map_exception(rust), DiskFullError) and map_exception(rust).exit_code == 7
    for exc in (rust, torch_zip):
        partial = tmp_path / "staging"
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"half")
        with pytest.raises(DiskFullError), disk_full_as_error(tmp_path / "out", cleanup=partial):
            raise exc
        assert not partial.exists()


def test_resume_continues_only_a_training_runs_output(tmp_path) -> None:
    """`--resume` on a directory `copt quantize` wrote went on to write a trained model over the quantized one."""
    from clusteropt_cli.core.io import write_output_marker

    quantized = tmp_path / "q"
    quantized.mkdir()
    write_output_marker(quantized, "quantize")
    (quantized / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(BadInputError, match="written by 'copt quantize'"):
        io.check_output(quantized, None, resume=True)
    trained = tmp_path / "t"
    trained.mkdir()
    write_output_marker(trained, "train")
    (trained / "metrics.jsonl").write_text('{"step": 1}\n')
    io.check_output(trained, None, resume=True)


def test_a_run_that_wrote_nothing_leaves_an_output_a_rerun_takes(tmp_path) -> None:
    """A failed run's directory with copt's marker and an empty metrics.jsonl counts as empty: the rerun needs no
    --overwrite; a user's directory with an empty file of that name does not."""
    from clusteropt_cli.core.io import write_output_marker

    failed = tmp_path / "failed"
    failed.mkdir()
    write_output_marker(failed, "train")
    (failed / "metrics.jsonl").write_text("")
    io.check_output(failed, None)
    users = tmp_path / "mine"
    users.mkdir()
    (users / "metrics.jsonl").write_text("")
    with pytest.raises(BadInputError, match="already exists"):
        io.check_output(users, None)
