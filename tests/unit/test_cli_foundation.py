"""The CLI's shared contract: error boundary, exit codes, --json discipline, --version."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli import __version__
from clusteropt_cli.app import main
from clusteropt_cli.errors import (
    BadInputError,
    CoptError,
    MissingDependencyError,
    OutOfMemoryError,
    map_exception,
)


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def test_version(capsys):
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0 and out.strip() == f"copt {__version__}"


@pytest.mark.parametrize("argv", [[], ["distill"], ["profile"]], ids=lambda a: " ".join(["copt", *a]))
def test_a_group_without_a_subcommand_prints_its_help(capsys, argv):
    code, out, err = run_main(argv, capsys)
    assert code == 2 and err == ""
    assert out.startswith(f"Usage: {' '.join(['copt', *argv])} [OPTIONS] COMMAND") and "Commands:" in out


def test_unknown_command_is_one_clear_line(copt):
    result = copt("nosuchcommand")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error:") and "nosuchcommand" in lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_option_names_it(capsys):
    code, out, err = run_main(["env", "--frobnicate"], capsys)
    assert code == 2 and out == ""
    assert "--frobnicate" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("exc", "code", "hint_part"),
    [
        (BadInputError("bad --seq-len", hint="use a positive number"), 2, "positive"),
        (MissingDependencyError("no llmcompressor", hint="pip install 'clusteropt-cli[quantize]'"), 3, "quantize"),
        (ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed"), 3, "clusteropt-cli[train]"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 5, "--activation-checkpointing"),
        (OSError("./nope is not a local folder and is not a valid model identifier"), 2, "local Hugging Face"),
    ],
)
def test_error_boundary_maps_library_errors(monkeypatch, capsys, exc, code, hint_part):
    import clusteropt_cli.core.env as env_core

    def boom():
        raise exc

    monkeypatch.setattr(env_core, "collect_env", boom)
    monkeypatch.delenv("COPT_DEBUG", raising=False)
    got, out, err = run_main(["env"], capsys)
    assert got == code
    assert out == ""
    assert err.startswith("error:") and "Traceback" not in err
    assert hint_part in err


def test_unknown_exception_is_internal_error_without_traceback(monkeypatch, capsys):
    import clusteropt_cli.core.env as env_core

    monkeypatch.setattr(env_core, "collect_env", lambda: 1 / 0)
    monkeypatch.delenv("COPT_DEBUG", raising=False)
    code, _, err = run_main(["env"], capsys)
    assert code == 1
    assert "internal error: ZeroDivisionError" in err and "--debug" in err and "Traceback" not in err


def test_debug_flag_and_env_var_add_the_traceback_and_keep_the_exit_code(monkeypatch, capsys):
    import clusteropt_cli.core.env as env_core

    monkeypatch.setattr(env_core, "collect_env", lambda: 1 / 0)
    for argv, env in ((["--debug", "env"], None), (["env"], "1")):
        if env:
            monkeypatch.setenv("COPT_DEBUG", env)
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 1
        assert "Traceback" in err and "ZeroDivisionError" in err and "internal error" in err


def test_map_exception_torch_oom_class():
    import torch

    mapped = map_exception(torch.OutOfMemoryError("CUDA out of memory"))
    assert isinstance(mapped, OutOfMemoryError) and mapped.exit_code == 5
    assert map_exception(ValueError("x")) is None
    assert isinstance(map_exception(CoptError("x")), CoptError)


def test_map_exception_host_out_of_memory():
    """Python's MemoryError and torch's CPU allocator failing (a RuntimeError) are the host's out of memory: exit 5,
    not an internal error."""
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
    )
    for exc in (MemoryError(), cpu):
        mapped = map_exception(exc)
        assert isinstance(mapped, OutOfMemoryError) and mapped.exit_code == 5, exc
        assert "host" in mapped.message and mapped.hint
    assert "8589934592 bytes" in map_exception(cpu).message


def test_env_json_is_one_document(copt):
    result = copt("env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["copt"] == __version__
    assert report["python"].count(".") == 2
    assert report["torch"]
    assert report["cuda_available"] in (True, False)
    assert isinstance(report["gpus"], list)
    assert report["backends"]["core"]["transformers"]
    assert set(report["backends"]) >= {"quantize", "gptq", "train", "serve", "distill", "optional"}


def test_env_human_output(copt):
    result = copt("env")
    assert result.returncode == 0, result.stderr
    assert "torch" in result.stdout and "Backends" in result.stdout


def test_library_noise_is_routed_to_debug():
    """Without --debug, library warnings/info logs (torchao's missing kernels, DeepSpeed's accelerator note, torch
    pytree deprecations) and foreign progress bars are silenced; their errors and copt's own warnings get through."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import logging, os, sys, warnings\n"
        "from clusteropt_cli import app\n"
        "if sys.argv[1] == 'quiet': app._quiet_libraries()\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "logging.getLogger('torchao').warning('Failed to load _C_mxfp8')\n"
        "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU')\n"
        "logging.getLogger('torch.utils._pytree').warning('register_constant is deprecated')\n"
        "logging.getLogger('DeepSpeed').error('a real library error')\n"
        "warnings.warn_explicit('old api', FutureWarning, 'x.py', 1, module='transformers.foo')\n"
        "warnings.warn_explicit('copt says', UserWarning, 'y.py', 1, module='clusteropt_cli.core.serve.runner')\n"
        "print(os.environ.get('TQDM_DISABLE'), os.environ.get('TRANSFORMERS_VERBOSITY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "TRANSFORMERS_VERBOSITY")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    quiet = subprocess.run([sys.executable, "-c", code, "quiet"], capture_output=True, text=True, env=env)
    loud = subprocess.run([sys.executable, "-c", code, "debug"], capture_output=True, text=True, env=env)
    for noise in ("_C_mxfp8", "accelerator to CPU", "register_constant", "old api"):
        assert noise not in quiet.stderr and noise in loud.stderr, noise
    assert "a real library error" in quiet.stderr and "copt says" in quiet.stderr
    assert quiet.stdout.split() == ["1", "error"] and loud.stdout.split() == ["None", "None"]


def test_log_and_warning_lines_print_brackets_as_text(capsys):
    """A path or a server's message holding '[/x]' or '[bold]' raised rich's MarkupError (exit 1) in a log line."""
    from clusteropt_cli import console

    console.log("loading runs/exp[/x] and [bold]m[/bold]")
    console.warn("server said [/x]")
    err = capsys.readouterr().err
    assert "runs/exp[/x] and [bold]m[/bold]" in err and "warning: server said [/x]" in err


def test_paths_with_brackets_print_as_text_in_recipes_validate_and_advise(copt, tmp_path):
    """'[/x]' in a recipe's path or a model directory's path raised rich's MarkupError (exit 1) where a command
    printed it inside markup: recipes validate's verdict, advise's recommended commands."""
    import json

    folder = tmp_path / "m[" / "x]"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
        "max_position_embeddings": 512}))
    recipe = tmp_path / "m[" / "x].yaml"
    recipe.write_text("task: train\nmodel: m\n")
    r = copt("recipes", "validate", str(recipe))
    assert r.returncode == 0 and f"valid train recipe: {recipe}" in r.stdout, r.stderr
    r = copt("advise", "--model", str(folder), "--gpu", "h100-sxm", "--task", "train")
    assert r.returncode == 0, r.stderr
    assert f"--model'{folder}'" in "".join(r.stdout.split()), r.stdout  # rich may wrap a long path


def test_table_cells_print_brackets_as_text_and_markup_cells_styled():
    """A path or a server's words in a table cell ('[/x]') raised rich's MarkupError; styled cells say so."""
    from rich.console import Console

    from clusteropt_cli import console

    out = Console(record=True, width=200, color_system="truecolor")
    out.print(console.kv_table("runs/[/x]", [("model", "runs/exp[/x]"), ("[bold]k", None)]))
    out.print(console.grid("t", ["a[/x]"], [["[red]v[/red]"], [console.markup("[green]fits[/green]")]]))
    text = out.export_text()
    assert "runs/exp[/x]" in text and "[bold]k" in text and "[red]v[/red]" in text and "a[/x]" in text
    assert "fits" in text and "[green]" not in text
