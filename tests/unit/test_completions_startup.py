"""Completions stay current with the app; --help stays free of heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clusteropt_cli.completions import command_tree, render_all

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "deepspeed", "llmcompressor", "trl", "vllm", "fastapi", "matplotlib")


def test_completion_files_are_current():
    stale = [name for name, text in render_all().items() if (REPO / "completions" / name).read_text() != text]
    assert not stale, f"completions/{stale} are stale: run `python -m clusteropt_cli.completions`"


def test_completion_tree_covers_every_command():
    paths = {node.path for node in command_tree()}
    for command in ("advise", "quantize", "train", "serve", "env", "distill logits", "profile model",
                    "profile endpoint", "recipes list", "recipes validate"):
        assert f"copt {command}" in paths


def test_bash_completion_completes_subcommands(tmp_path):
    script = REPO / "completions" / "copt.bash"
    probe = f'source {script}; COMP_WORDS=(copt recipes va); COMP_CWORD=2; _copt; echo "${{COMPREPLY[@]}}"'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["validate"]


def _help_imports(args: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from clusteropt_cli.app import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print('HEAVY:' + ' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    marker = [line for line in out.stderr.splitlines() if line.startswith("HEAVY:")]
    assert marker, out.stderr
    return set(marker[-1].removeprefix("HEAVY:").split())


@pytest.mark.parametrize(
    "args",
    [["--help"], ["advise", "--help"], ["train", "--help"], ["serve", "--help"], ["quantize", "--help"],
     ["profile", "model", "--help"], ["distill", "--help"], ["recipes", "list"]],
    ids=lambda a: " ".join(a),
)
def test_help_does_not_import_heavy_modules(args):
    assert _help_imports(args) == set()


@pytest.mark.parametrize(("shell", "name"), [("zsh", "_copt"), ("fish", "copt.fish")])
def test_zsh_and_fish_scripts_parse(shell, name):
    import shutil

    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    subprocess.run([shell, "-n", str(REPO / "completions" / name)], check=True)


def test_zsh_tables_hold_the_command_tree():
    import shutil

    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    probe = f'source {REPO / "completions" / "_copt"} 2>/dev/null; print -r -- "${{_copt_children[copt distill]}}"'
    out = subprocess.run(["zsh", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["logits", "sft", "traces"]
