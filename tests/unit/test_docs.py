"""Documentation stays true: the generated reference is current, and every `copt ...` example in the README,
docs/ and --help texts parses against the real CLI (flags, types, choices, recipe keys of overrides)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_reference_is_current():
    from clusteropt_cli._docgen import REGENERATE, stale_files

    stale = stale_files()
    assert not stale, f"docs/reference/{stale} are stale: run `{REGENERATE}`"


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```(?:bash|sh|console)?\n(.*?)^```", text, flags=re.M | re.S)


def _examples(text: str) -> list[str]:
    """`copt ...` command lines of a text's code blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in _code_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ")[0].strip()
            if line.startswith("copt "):
                lines.append(line.rstrip("&").strip())
    return lines


def _help_examples() -> list[str]:
    import typer

    from clusteropt_cli.app import app

    found = []

    def visit(command) -> None:
        for text in (command.help or "", command.epilog or ""):  # example lines: a line that starts with copt
            found.extend(m.strip() for m in re.findall(r"^\s*(copt [^\n#]+)", text, flags=re.M))
        for sub in (getattr(command, "commands", {}) or {}).values():
            visit(sub)

    visit(typer.main.get_command(app))
    return found


def _all_examples() -> list[tuple[str, str]]:
    out = [(path.relative_to(REPO).as_posix(), line) for path in DOCS for line in _examples(path.read_text())]
    out += [("--help", line) for line in _help_examples()]
    return out


def test_the_docs_have_examples():
    sources = {source for source, _ in _all_examples()}
    assert "README.md" in sources and len(_all_examples()) > 40


def _schema_for(words: list[str]):
    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    return RECIPE_MODELS.get(words[0]) if words else None


def _check_override(schema, override: str) -> None:
    from pydantic import BaseModel

    from clusteropt_cli.recipe.load import parse_override

    path, _ = parse_override(override)
    model = schema
    for key in path:
        assert model is not None and key in model.model_fields, f"unknown recipe key {'.'.join(path)}"
        annotation = model.model_fields[key].annotation
        nested = [a for a in (annotation, *getattr(annotation, "__args__", ())) if isinstance(a, type)
                  and issubclass(a, BaseModel)]
        model = nested[0] if nested else None


@pytest.mark.parametrize(("source", "line"), _all_examples(), ids=lambda v: v[:60] if isinstance(v, str) else v)
def test_example_parses(source: str, line: str):
    """Parse the example with the CLI's own parser (nothing runs): unknown flags, bad values or unknown recipe
    keys in key=value overrides fail here. Shell variables stand for paths."""
    import typer

    from clusteropt_cli.app import app

    args = shlex.split(re.sub(r"\$\(?\w+\)?", "PATH", line))[1:]
    command = typer.main.get_command(app)
    words = []
    while args and hasattr(command, "commands") and args[0] in command.commands:
        words.append(args[0])
        command = command.commands[args.pop(0)]
    assert not hasattr(command, "commands") or args in ([], ["--help"]), f"{source}: unknown subcommand in {line}"
    ctx = command.make_context(" ".join(["copt", *words]), list(args), resilient_parsing=False)
    schema = _schema_for(words)
    for override in ctx.params.get("overrides") or []:
        assert schema is not None, f"{source}: {line}: overrides on a command without a recipe schema"
        _check_override(schema, override)


LAB_NOTES = re.compile(r"\bsessions?\b|\bruns? \d+|\.\./shared|shared_api|bench/results|explore\d|nvidia-h200", re.I)


def test_no_lab_notes_in_the_product():
    """What users read (package, docs, README, recipes) names no development runs or sessions, no paths outside the
    repository and no raw results folders: measured figures are cited as docs/benchmarks.md#anchors."""
    roots = [REPO / "clusteropt_cli", REPO / "docs", REPO / "recipes"]
    files = [REPO / "README.md", *(p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md", ".yaml"))]
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()[:100]}" for p in files
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if LAB_NOTES.search(line)]
    assert not hits, "\n".join(hits)


def test_readme_examples_that_need_no_model_run(tmp_path):
    """The README's examples that need no model files or GPU (env, advise on presets, the recipes workflow) run as
    written, in order, in an empty directory, and exit 0."""
    import subprocess
    import sys

    from clusteropt_cli.modelspec import list_presets

    presets = set(list_presets())
    runnable = []
    for line in _examples((REPO / "README.md").read_text()):
        args = shlex.split(line)[1:]
        model = args[args.index("--model") + 1] if "--model" in args else None
        if args[0] in ("env", "recipes") or (args[0] == "advise" and model in presets):
            runnable.append(args)
    assert len(runnable) >= 7 and ["recipes", "validate", "my-train.yaml"] in runnable
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in runnable:
        done = subprocess.run([sys.executable, "-m", "clusteropt_cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (args, done.stderr[-2000:])


def _anchors(path: Path) -> set[str]:
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)}


def test_relative_links_resolve():
    """Every relative link of the README and docs/ points at a file that exists, and at a heading that exists."""
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "bench" / "README.md",
             *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_readme_exit_codes_match_the_error_classes():
    """The README's exit-code table lists exactly the codes the CoptError family (and Ctrl-C, SIGTERM) exits with."""
    import clusteropt_cli.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.CoptError)]
    codes = {0, 130, 143} | {c.exit_code for c in classes}
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (\d+(?:, \d+)*) \|", readme, flags=re.M)
    table = {int(code) for row in rows for code in row.split(", ")}
    assert table == codes
