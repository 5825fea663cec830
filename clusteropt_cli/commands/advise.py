"""copt advise (issue 3)."""

from __future__ import annotations

from clusteropt_cli.errors import CoptError


def advise() -> None:
    """Not built yet (issue 3)."""
    raise CoptError("copt advise is not built yet (issue 3).", hint="See 'copt --help' for the commands that work.")
