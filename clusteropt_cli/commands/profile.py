"""copt profile (issue 6)."""

from __future__ import annotations

import typer

from clusteropt_cli.errors import CoptError

app = typer.Typer(help="Measure a model or an endpoint and name the bottleneck.", no_args_is_help=True)


@app.command("model")
def model() -> None:
    """Not built yet (issue 6)."""
    raise CoptError("copt profile model is not built yet (issue 6).")


@app.command("endpoint")
def endpoint() -> None:
    """Not built yet (issue 6)."""
    raise CoptError("copt profile endpoint is not built yet (issue 6).")
