"""Shared option aliases (Annotated) so every command spells a flag the same way.

Options default to None where a recipe may supply the value: the schema owns the defaults, and the command
passes only what the user typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")]
RecipeOpt = Annotated[
    str | None,
    typer.Option("--recipe", "-r", help="A recipe YAML file or the name of a built-in recipe (copt recipes list)."),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Recipe overrides as key.sub=value (e.g. optim.lr=3e-4).", show_default=False),
]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Output directory.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print what would run, then exit.")]
