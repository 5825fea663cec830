"""The root app: every command is registered here, and main() is the one error boundary."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from clusteropt_cli import __version__


class Group(TyperGroup):
    """A command group whose unset --help is False, not None: typer coerces a None flag through a pydantic
    TypeAdapter, and importing pydantic for that was a third of `copt advise --help`'s start-up (every group a
    command line passes through processes its own --help)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None and option.default is None:
            option.default = False
        return option


APP_SETTINGS: dict = dict(
    name="copt",
    help="copt: optimize LLM training and inference on GPUs — advise, quantize, distill, train, serve, profile.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},  # up to the terminal's width
    cls=Group,
    # click's plain help: typer's rich help imports rich.markdown, rich.traceback and pygments (~100 ms) and
    # reads help text as rich markup, dropping the "[train]"/"[infer]" tags of advise's flags
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"copt {__version__}")
        raise typer.Exit()


def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks (or set COPT_DEBUG=1).")] = False,
    launched_rank: Annotated[bool, typer.Option("--launched-rank", hidden=True)] = False,
) -> None:
    """copt: a command-line optimization toolkit for large language models."""
    if debug:
        os.environ["COPT_DEBUG"] = "1"
    if launched_rank:  # a rank copt's own launcher started
        from clusteropt_cli.core.train.launch import LAUNCHED_RANK_ENV

        os.environ[LAUNCHED_RANK_ENV] = "1"


# ---- the command registry: one visible place --------------------------------------------------------------
# name → (module under clusteropt_cli.commands, attribute, a group of subcommands?)
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "advise": ("advise", "advise", False),
    "quantize": ("quantize", "quantize", False),
    "distill": ("distill", "app", True),
    "train": ("train", "train", False),
    "serve": ("serve", "serve", False),
    "profile": ("profile", "app", True),
    "recipes": ("recipes", "app", True),
    "env": ("env", "env", False),
}


def build_app(only: str | None = None, outline: bool = False) -> typer.Typer:
    """The typer app with every command, or with only `only` (what main() runs: `copt advise --help` then imports
    and builds one command module instead of all eight). `outline`: each command as its name and summary without
    its options, all that `copt --help` shows (typer building the options of all eight took half its start-up)."""
    import importlib
    import inspect

    built = typer.Typer(**APP_SETTINGS)
    built.callback()(root)
    outlined: dict[str, tuple[str | None, bool]] = {}
    for name, (module, attribute, group) in COMMANDS.items():
        if only is not None and name != only:
            continue
        target = getattr(importlib.import_module(f"clusteropt_cli.commands.{module}"), attribute)
        if outline:
            outlined[name] = (target.info.help if group else inspect.getdoc(target)), group
        elif group:
            built.add_typer(target, name=name, cls=Group)
        else:
            built.command(name)(target)
    for name, (summary, _) in sorted(outlined.items(), key=lambda item: item[1][1]):  # as typer lists them:
        built.command(name, help=summary)(_outlined)  # commands, then groups
    return built


def _outlined() -> None:
    """A command of the outline (never run: main() builds the outline only when argv names no command)."""


def __getattr__(name: str):
    """`app`: the whole command tree (completions, the reference generator, tests), built on first use."""
    if name == "app":
        globals()["app"] = build_app()
        return globals()["app"]
    raise AttributeError(name)


def _invoked(argv: list[str]) -> str | None:
    """The command argv runs, when it names one (global flags before it take no value)."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in COMMANDS else None


def _debug_enabled(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("COPT_DEBUG", "").lower() in ("1", "true", "yes")


# Libraries that log on import or on every call what is not the user's business: a missing optional kernel
# (torchao's "Failed to load ..._C_mxfp8..."), deprecations of their own calls (torch pytree), "no accelerator"
# notes on CPU (DeepSpeed, llm-compressor) and progress bars. Without --debug only their errors get through.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "DeepSpeed", "accelerate", "datasets", "gptqmodel", "optimum")
_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
              "LLM_COMPRESSOR_LOG_LEVEL": "ERROR"}


def _errors_only(record) -> bool:
    import logging

    return record.levelno >= logging.ERROR


def _quiet_libraries() -> None:
    """Route library warnings, info logs and progress bars away unless --debug (a filter, not a level: some
    libraries reset their logger's level when they create it)."""
    import logging
    import warnings

    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).addFilter(_errors_only)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(?!clusteropt_cli)")


def _render_error(message: str, hint: str | None) -> None:
    from rich.console import Console
    from rich.markup import escape

    stderr = Console(stderr=True, soft_wrap=True)
    stderr.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
    if hint:
        stderr.print(f"[bold]hint:[/bold] {escape(hint)}", highlight=False)


class Terminated(BaseException):  # noqa: N818 - named for the signal, like KeyboardInterrupt
    """SIGTERM (a job scheduler's stop, `kill`), raised in the main thread, so the cleanups a failed run does run:
    a replaced output is restored, temporary directories go. Not a KeyboardInterrupt: typer turns those into a
    silent exit 130 before main() sees them."""


def _raise_terminated(signum, frame) -> None:  # noqa: ANN001 - a signal handler's signature
    raise Terminated()


def _on_sigterm_raise() -> object | None:
    """Turn SIGTERM into Terminated while copt runs (only where nobody else handles it); the previous handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _raise_terminated)
    return previous


def _print_traceback() -> None:
    import traceback

    traceback.print_exc(file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """Run copt; known errors become one message + hint on stderr and an exit code (see errors.py). --debug adds
    the traceback; the exit code stays the same."""
    import signal

    from typer._click.exceptions import NoArgsIsHelpError

    from clusteropt_cli.errors import map_exception

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_enabled(argv)
    previous_debug = os.environ.get("COPT_DEBUG")
    if not debug:
        _quiet_libraries()
    previous_sigterm = _on_sigterm_raise()
    try:
        invoked = _invoked(argv)
        command = typer.main.get_command(build_app(invoked) if invoked else build_app(outline=True))
        result = command.main(args=argv, prog_name="copt", standalone_mode=False)
        code = result if isinstance(result, int) else 0
        if code == 130:  # typer's answer to Ctrl-C (KeyboardInterrupt becomes Exit(130) inside it)
            _render_error("interrupted", None)
    except Terminated:
        _render_error("terminated (SIGTERM)", None)
        code = 143
    except KeyboardInterrupt:
        _render_error("interrupted", None)
        code = 130
    except typer.Abort:
        _render_error("aborted", None)
        code = 130
    except typer.Exit as exc:
        code = exc.exit_code
    except NoArgsIsHelpError as exc:  # `copt` or a group without a subcommand: its help, and a usage exit code
        sys.stdout.write(exc.format_message() + "\n")
        code = exc.exit_code
    except typer.TyperException as exc:  # click's usage errors: unknown command/option, bad value
        text = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "copt"
        _render_error(text.splitlines()[0] if text else "usage error", f"run '{where} --help'")
        code = getattr(exc, "exit_code", 2)
    except Exception as exc:  # noqa: BLE001 - the one boundary
        mapped = map_exception(exc)
        if debug:
            _print_traceback()
        if mapped is None:
            _render_error(f"internal error: {type(exc).__name__}: {exc}",
                          "this is a bug; run again with --debug (or COPT_DEBUG=1) for the traceback")
            code = 1
        else:
            _render_error(mapped.message, mapped.hint)
            code = mapped.exit_code
            if os.environ.get("COPT_RANK_ERROR_DIR"):  # a launched rank: the launching copt exits with this code
                from clusteropt_cli.core.train.launch import record_rank_error

                record_rank_error(code, mapped.message, mapped.hint)
    finally:  # --debug sets COPT_DEBUG for this run (and processes it launches), not for the caller
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
        if previous_debug is None:
            os.environ.pop("COPT_DEBUG", None)
        else:
            os.environ["COPT_DEBUG"] = previous_debug
    sys.exit(code)
