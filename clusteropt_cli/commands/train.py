"""copt train (issue 7)."""

from __future__ import annotations

from clusteropt_cli.errors import CoptError


def train() -> None:
    """Not built yet (issue 7)."""
    raise CoptError("copt train is not built yet (issue 7).", hint="See 'copt --help' for the commands that work.")
