"""Output for commands: results on stdout (a table for people or one JSON document), everything else on stderr.

Only `commands/` and `app.py` import this module; `core/` stays free of rich.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

out: Console  # results
err: Console  # logs, progress, errors


def __getattr__(name: str) -> Any:
    """`out` and `err`, made on first use: rich.console stays out of `copt ... --help`."""
    if name in ("out", "err"):
        from rich.console import Console

        globals()["out"] = Console(soft_wrap=True)
        globals()["err"] = Console(stderr=True, soft_wrap=True)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _err() -> Console:
    return globals()["err"] if "err" in globals() else __getattr__("err")


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, pydantic models, paths and tuples → plain JSON types."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "model_dump"):
        return to_jsonable(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    return obj


def print_json(obj: Any, schema: str) -> None:
    """Write exactly one JSON document to stdout: an object whose first key is schema_version (`schema`, e.g.
    "copt.train/1", where the document does not carry its own)."""
    doc = to_jsonable(obj)
    if not isinstance(doc, dict):
        raise TypeError("a --json document is an object")
    if "schema_version" not in doc:
        doc = {"schema_version": schema, **doc}
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def markup(text: str) -> Any:
    """A table cell styled with rich markup (`[green]fits[/green]`); every other cell is printed as text."""
    from rich.text import Text

    return Text.from_markup(text)


def _cell(value: Any) -> Any:
    """A table cell as text: brackets in a path or a server's words are not markup (markup() cells pass as they are)."""
    from rich.markup import escape
    from rich.text import Text

    if isinstance(value, Text):
        return value
    return "" if value is None else escape(str(value))


def kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    """A two-column key/value table."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(_cell(key), _cell(value))
    return table


def grid(title: str, headers: list[str], rows: list[list[Any]]) -> Table:
    """A table with a header row."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title), title_justify="left")
    for h in headers:
        table.add_column(escape(h))
    for row in rows:
        table.add_row(*[_cell(v) for v in row])
    return table


def log(message: str) -> None:
    """A progress/log line on stderr, printed as text: brackets in a path or a server's message are not markup."""
    from rich.markup import escape

    _err().print(escape(message), highlight=False)


def warn(message: str) -> None:
    from rich.markup import escape

    _err().print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)


@contextmanager
def progress_bar(description: str, total: int | None):
    """A rich progress bar on stderr; yields `advance(n=1, **fields)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=_err(), transient=False) as progress:
        task = progress.add_task(description, total=total, info="")

        def advance(n: int = 1, info: str = "") -> None:
            progress.update(task, advance=n, info=info)

        yield advance


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
