"""Hostile and careless files given to copt: each is refused before any work with exit 2 and a message naming the
file, nothing hangs, nothing is left behind (an audit's findings, one test each)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("fixtures")


def _refused(proc, *words: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


def _bomb(path: Path) -> None:
    """Nine levels of nine aliases: a few hundred bytes that expand into 9**9 strings when written back out."""
    lines = ["task: train", "model: model", "prediction:", "  assumptions:",
             '    a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"    {name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    path.write_text("\n".join(lines) + "\n")


def test_recipes_refuse_aliases_repeated_keys_and_a_task_that_is_not_a_word(copt, tmp_path) -> None:
    bomb = tmp_path / "bomb.yaml"
    _bomb(bomb)
    _refused(copt("recipes", "validate", "--json", str(bomb), timeout=60), "alias")
    twice = tmp_path / "twice.yaml"
    twice.write_text("task: train\nmodel: m\nlr: 1.0e-4\nlr: 5\n")
    _refused(copt("recipes", "validate", str(twice)), "'lr' is given twice", "line 4")
    listed = tmp_path / "listed.yaml"
    listed.write_text("task: [train]\n")
    _refused(copt("recipes", "validate", str(listed)), "task")
    _refused(copt("train", "--recipe", str(listed), "--dry-run"), "task")
    keyed = tmp_path / "keyed.yaml"  # a list as a key: "unhashable type" and exit 1 before
    keyed.write_text("task: train\n? [a, b]\n: 1\n")
    _refused(copt("recipes", "validate", str(keyed)), "a list as a key")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"task: train\nmodel: caf\xe9\n")
    _refused(copt("recipes", "show", str(latin)), "UTF-8")
    big = tmp_path / "big.yaml"
    with big.open("wb") as handle:  # sparse: 64 MiB that are never read
        handle.truncate(64 << 20)
    _refused(copt("recipes", "show", str(big)), "bytes")


def test_a_pipe_a_device_or_a_directory_is_not_a_profile(copt, tmp_path) -> None:
    fifo = tmp_path / "profile.json"
    os.mkfifo(fifo)
    _refused(copt("advise", "--from-profile", str(fifo), timeout=60), "not a regular file")
    _refused(copt("profile", "endpoint", "--from-profile", str(fifo), timeout=60), "not a regular file")
    _refused(copt("advise", "--from-profile", "/dev/zero", timeout=60), "not a regular file")
    _refused(copt("advise", "--from-profile", str(tmp_path), timeout=60), "is a directory")


def test_link_loops_and_outputs_under_a_file(copt, fixtures, tmp_path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    model, data = str(fixtures.student), str(fixtures.train_text)
    _refused(copt("train", "--model", model, "--data", data, "-o", str(tmp_path / "a"), "--dry-run"), "links")
    _refused(copt("distill", "traces", "--teacher", str(fixtures.teacher), "--prompts", str(tmp_path / "a"),
                  "-o", str(tmp_path / "t.jsonl")), "links")
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    _refused(copt("recipes", "cp", "train-oom-checkpointing", str(afile / "r.yaml")), "is a file")
    _refused(copt("advise", "-m", "llama-3.2-1b", "--gpu", "h100-sxm", "--emit-recipe", str(afile / "r.yaml")),
             "is a file")
    _refused(copt("quantize", model, "--method", "rtn", "--group-size", "32", "-o", str(afile / "q"), "--dry-run"),
             "is a file")
    assert afile.read_text() == "mine\n"


def test_a_recipe_output_under_home_is_where_its_checks_looked(copt, fixtures, tmp_path) -> None:
    """`output: ~/x` means the home directory's x for the checks and for the write alike (a literal '~' directory
    used to appear in the working directory, and inside the model when run from there)."""
    home = tmp_path / "home"
    home.mkdir()
    model = tmp_path / "model"
    shutil.copytree(fixtures.student, model)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"task: train\nmodel: {model}\ndata: {fixtures.train_text}\noutput: ~/run\nmax_steps: 1\n"
                      "seq_len: 32\nprecision: fp32\n")
    proc = copt("train", "--recipe", str(recipe), env={"HOME": str(home)}, cwd=model, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (home / "run" / "config.json").is_file()
    assert not (model / "~").exists()


def test_broken_model_files_are_named_before_any_load(copt, fixtures, tmp_path) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(fixtures.student, cut)
    weights = (fixtures.student / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:1000])
    bad_tokenizer = tmp_path / "tok"
    shutil.copytree(fixtures.student, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("{not json")
    huge_header = tmp_path / "huge"
    shutil.copytree(fixtures.student, huge_header)
    (huge_header / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    data = str(fixtures.train_text)
    for model, word in ((cut, "model.safetensors"), (bad_tokenizer, "tokenizer.json"), (huge_header, "header")):
        _refused(copt("serve", str(model), "--dry-run"), word)
        _refused(copt("train", "--model", str(model), "--data", data, "-o", str(tmp_path / "o"), "--dry-run"), word)
        _refused(copt("quantize", str(model), "--method", "rtn", "--group-size", "32", "-o", str(tmp_path / "q"),
                      "--dry-run"), word)
    mismatched = tmp_path / "mismatched"
    shutil.copytree(fixtures.student, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["intermediate_size"] = config["intermediate_size"] * 2
    (mismatched / "config.json").write_text(json.dumps(config))
    proc = copt("train", "--model", str(mismatched), "--data", data, "-o", str(tmp_path / "m"), "--max-steps", "1",
                "--seq-len", "32", "--precision", "fp32", timeout=300)
    _refused(proc, "cannot be loaded", "save_pretrained")
    assert not (tmp_path / "m").exists()


def test_json_nested_too_deep_or_numbers_too_long(copt, fixtures, tmp_path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    long_number = tmp_path / "long.jsonl"
    long_number.write_text('{"text": ' + "9" * 5000 + "}\n")
    model = str(fixtures.student)
    for data in (deep, long_number):
        _refused(copt("train", "--model", model, "--data", str(data), "-o", str(tmp_path / "o"), "--max-steps", "1"),
                 "line 1")
    config_dir = tmp_path / "cfg"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(copt("advise", "-m", str(config_dir), "--gpu", "h100-sxm"), "config")
    absurd = dict(json.loads((fixtures.student / "config.json").read_text()), hidden_size=10**29)
    (config_dir / "config.json").write_text(json.dumps(absurd))
    _refused(copt("advise", "-m", str(config_dir), "--gpu", "h100-sxm"), "hidden_size", "2**31")


def test_small_files_read_as_users_write_them(copt, fixtures, tmp_path) -> None:
    """A byte-order mark opens a file as text; a hostfile that is not UTF-8 is named; --eval-data's problems name
    --eval-data; quantization_config that is not an object is named."""
    bom = tmp_path / "bom.jsonl"
    bom.write_text('{"text": "hello world"}\n', encoding="utf-8-sig")
    from clusteropt_cli.core.train.data import read_texts

    assert read_texts(bom) == ["hello world"]
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"h\xe9st slots=2\n")
    model, data = str(fixtures.student), str(fixtures.train_text)
    _refused(copt("train", "--model", model, "--data", data, "-o", str(tmp_path / "o"), "--dry-run", "--hostfile",
                  str(hostfile), "--nodes", "2"), "--hostfile", "UTF-8")
    odd = tmp_path / "odd"
    shutil.copytree(fixtures.student, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "quantization_config": "gptq"}))
    _refused(copt("quantize", str(odd), "--method", "rtn", "--group-size", "32", "-o", str(tmp_path / "q"),
                  "--dry-run"), "quantization_config")
    from clusteropt_cli.core.train.data import build_text_dataset
    from clusteropt_cli.errors import BadInputError

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(BadInputError, match="--eval-data"):
        build_text_dataset(empty, None, 8, flag="--eval-data")


def test_a_config_naming_layers_the_weights_lack_is_refused(copt, fixtures, tmp_path) -> None:
    """config.json with one layer more than the checkpoint: copt train, quantize and serve's engine started that
    layer from random values (transformers' load report only); now exit 2 naming the missing tensors."""
    model = tmp_path / "one-more-layer"
    shutil.copytree(fixtures.teacher, model)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (model / "config.json").write_text(json.dumps(config))
    layer = f"model.layers.{config['num_hidden_layers'] - 1}."
    train = copt("train", "--model", str(model), "--data", str(fixtures.train_text), "--output",
                str(tmp_path / "out"), "--max-steps", "1", "--seq-len", "32", "--micro-batch", "1")
    quantize = copt("quantize", str(model), "--method", "rtn", "--output", str(tmp_path / "q"))
    for proc in (train, quantize):
        assert proc.returncode == 2 and layer in proc.stderr and "random values" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "q").exists()
    from clusteropt_cli.core.serve.runner import ModelRunner
    from clusteropt_cli.errors import BadInputError

    with pytest.raises(BadInputError, match="random values"):
        ModelRunner(str(model), device="cpu", num_slots=1, max_len=64)
