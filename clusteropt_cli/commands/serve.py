"""copt serve (issue 5)."""

from __future__ import annotations

from clusteropt_cli.errors import CoptError


def serve() -> None:
    """Not built yet (issue 5)."""
    raise CoptError("copt serve is not built yet (issue 5).", hint="See 'copt --help' for the commands that work.")
