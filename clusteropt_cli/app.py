"""The root app: every command is registered here, and main() is the one error boundary."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from clusteropt_cli import __version__
from clusteropt_cli.commands import advise, distill, env, profile, quantize, recipes, serve, train

app = typer.Typer(
    name="copt",
    help="copt: optimize LLM training and inference on GPUs — advise, quantize, distill, train, serve, profile.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"copt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks (or set COPT_DEBUG=1).")] = False,
) -> None:
    """copt: a command-line optimization toolkit for large language models."""
    if debug:
        os.environ["COPT_DEBUG"] = "1"


# ---- the command registry: one visible place --------------------------------------------------------------
app.command("advise")(advise.advise)
app.command("quantize")(quantize.quantize)
app.add_typer(distill.app, name="distill")
app.command("train")(train.train)
app.command("serve")(serve.serve)
app.add_typer(profile.app, name="profile")
app.add_typer(recipes.app, name="recipes")
app.command("env")(env.env)


def _debug_enabled(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("COPT_DEBUG", "").lower() in ("1", "true", "yes")


def _render_error(message: str, hint: str | None) -> None:
    from rich.console import Console
    from rich.markup import escape

    stderr = Console(stderr=True, soft_wrap=True)
    stderr.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    if hint:
        stderr.print(f"[bold]hint:[/bold] {escape(hint)}", highlight=False)


def main(argv: list[str] | None = None) -> None:
    """Run copt; known errors become one message + hint on stderr and an exit code (see errors.py)."""
    from clusteropt_cli.errors import map_exception

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_enabled(argv)
    previous_debug = os.environ.get("COPT_DEBUG")
    try:
        command = typer.main.get_command(app)
        result = command.main(args=argv, prog_name="copt", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        _render_error("interrupted", None)
        code = 130
    except typer.Abort:
        _render_error("aborted", None)
        code = 130
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.TyperException as exc:  # click's usage errors: unknown command/option, bad value
        if debug:
            raise
        text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "copt"
        _render_error(text.splitlines()[0] if text else "usage error", f"run '{where} --help'")
        code = getattr(exc, "exit_code", 2)
    except Exception as exc:  # noqa: BLE001 - the one boundary
        mapped = map_exception(exc)
        if debug:
            raise
        if mapped is None:
            _render_error(f"internal error: {type(exc).__name__}: {exc}",
                          "this is a bug; run again with --debug (or COPT_DEBUG=1) for the traceback")
            code = 1
        else:
            _render_error(mapped.message, mapped.hint)
            code = mapped.exit_code
    finally:  # --debug sets COPT_DEBUG for this run (and processes it launches), not for the caller
        if previous_debug is None:
            os.environ.pop("COPT_DEBUG", None)
        else:
            os.environ["COPT_DEBUG"] = previous_debug
    sys.exit(code)
