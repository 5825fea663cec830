"""The layering holds: `clusteropt_cli/core` is plain importable code (no terminal, no CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "clusteropt_cli" / "core"
FORBIDDEN = ("typer", "rich", "click", "clusteropt_cli.app", "clusteropt_cli.commands", "clusteropt_cli.console",
             "clusteropt_cli.options")


def imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, at any depth (function-level imports included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def violations(path: Path) -> list[str]:
    out = []
    for line, module in imports(path):
        if module.startswith(".") and path.is_relative_to(CORE):
            # a relative import may not climb out of core/ (core/x.py is level 1; core/a/x.py level 2)
            depth = len(path.relative_to(CORE).parts)
            if len(module) - len(module.lstrip(".")) >= depth:
                out.append(f"{path.name}:{line} imports {module} (outside core/)")
        elif any(module == f or module.startswith(f + ".") for f in FORBIDDEN):
            out.append(f"{path.name}:{line} imports {module}")
    return out


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_imports_no_cli_or_terminal_code(path: Path):
    assert not violations(path)


def test_the_check_catches_each_forbidden_import(tmp_path):
    bad = tmp_path / "probe.py"
    for line in ("import typer", "from rich.console import Console", "from clusteropt_cli import console",
                 "from clusteropt_cli.commands import train", "from clusteropt_cli.options import opt",
                 "def f():\n    from clusteropt_cli.console import emit_json"):
        bad.write_text(line + "\n")
        assert violations(bad), line
    bad.write_text("import torch\nfrom clusteropt_cli.errors import BadInputError\n")
    assert not violations(bad)
