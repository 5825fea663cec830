"""copt quantize (issue 4)."""

from __future__ import annotations

from clusteropt_cli.errors import CoptError


def quantize() -> None:
    """Not built yet (issue 4)."""
    raise CoptError("copt quantize is not built yet (issue 4).", hint="See 'copt --help' for the commands that work.")
