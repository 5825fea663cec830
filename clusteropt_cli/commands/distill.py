"""copt distill (issue 8)."""

from __future__ import annotations

import typer

from clusteropt_cli.errors import CoptError

app = typer.Typer(help="Distill a teacher into a student: logits, traces, sft.", no_args_is_help=True)


@app.command("logits")
def logits() -> None:
    """Not built yet (issue 8)."""
    raise CoptError("copt distill logits is not built yet (issue 8).")
