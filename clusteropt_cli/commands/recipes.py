"""copt recipes: list, show, validate and copy the built-in recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clusteropt_cli.options import JsonOpt, OverwriteOpt

app = typer.Typer(help="List, show, validate and copy recipes.", no_args_is_help=True)


@app.command("list")
def list_cmd(json_output: JsonOpt = False) -> None:
    """List the built-in recipes and the command that runs each."""
    from clusteropt_cli import console
    from clusteropt_cli.recipe.registry import list_recipes

    recipes = list_recipes()
    if json_output:
        console.print_json({"recipes": [{"name": r.name, "task": r.task, "command": r.command,
                                         "description": r.description, "path": str(r.path)} for r in recipes]},
                           "copt.recipes/1")
        return
    console.out.print(console.grid("Built-in recipes (copt recipes show NAME for the command and keys)",
                                   ["name", "task", "what it does"],
                                   [[r.name, r.task, r.description] for r in recipes]))


@app.command("show")
def show_cmd(name: Annotated[str, typer.Argument(help="Built-in recipe name or a path.")]) -> None:
    """Print a recipe's YAML."""
    from clusteropt_cli.recipe.load import read_recipe_text

    typer.echo(read_recipe_text(name)[1], nl=False)


@app.command("validate")
def validate_cmd(
    file: Annotated[str, typer.Argument(help="Recipe file (or built-in name) to validate.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides.")] = None,
    json_output: JsonOpt = False,
) -> None:
    """Validate a recipe against its task's schema; every problem is reported at once."""
    from clusteropt_cli import console
    from clusteropt_cli.errors import RecipeError
    from clusteropt_cli.recipe.load import apply_overrides, read_recipe_file, validate_recipe
    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    data = apply_overrides(read_recipe_file(file), list(overrides or []))
    task = data.get("task")
    if not isinstance(task, str) or task not in RECIPE_MODELS:
        raise RecipeError(f"Recipe '{file}' has no valid 'task' key (got {task!r}).",
                          hint=f"Add 'task:' with one of: {', '.join(RECIPE_MODELS)}")
    settings = validate_recipe(task, data, origin=f"Recipe '{file}'")
    if json_output:
        console.print_json({"valid": True, "task": task, "settings": settings}, "copt.recipes/1")
    else:
        from rich.markup import escape

        console.out.print(f"[green]valid[/green] {task} recipe: {escape(str(file))}")


@app.command("cp")
def cp_cmd(
    name: Annotated[str, typer.Argument(help="Built-in recipe name.")],
    dest_text: Annotated[str, typer.Argument(metavar="DEST", help="Destination file or directory.")],
    overwrite: OverwriteOpt = False,
) -> None:
    """Copy a built-in recipe to edit it."""
    import os

    from clusteropt_cli import console
    from clusteropt_cli.core.io import atomic_write_text, check_parent_is_directory
    from clusteropt_cli.errors import BadInputError
    from clusteropt_cli.recipe.registry import builtin_recipe

    source = builtin_recipe(name)
    dest = Path(dest_text).expanduser()
    if dest_text.endswith(("/", os.sep)) and not dest.is_dir():  # Path() drops the slash that names a directory
        raise BadInputError(f"DEST {dest_text} names a directory that does not exist.",
                            hint=f"Create it first (mkdir -p {dest_text}), or drop the trailing slash to name a file.")
    target = dest / source.name if dest.is_dir() else dest
    check_parent_is_directory(target, "DEST", dest)
    if os.path.lexists(target) and not overwrite:  # a dangling symlink is the user's too
        raise BadInputError(f"{target} exists.", hint="Pass --overwrite to replace it, or choose another path.")
    atomic_write_text(target, source.read_text())
    console.err.print(f"copied {source.name} → {target}")
