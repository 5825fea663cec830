"""Built-in recipes: YAML files shipped in `recipes/` (source tree) and `clusteropt_cli/_recipes` (wheel)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from clusteropt_cli.errors import BadInputError


def recipe_dirs() -> list[Path]:
    """Where built-in recipes live: the wheel's packaged copy, then the source checkout's recipes/."""
    package = Path(__file__).resolve().parent.parent
    return [p for p in (package / "_recipes", package.parent / "recipes") if p.is_dir()]


@dataclass(frozen=True)
class BuiltinRecipe:
    name: str
    path: Path
    task: str
    command: str  # the command line from the YAML's opening comment
    description: str


def _header(path: Path) -> tuple[str, str]:
    """The opening comment: its first line is the command; the first sentence after it is the summary."""
    command, description = "", []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not command and text.startswith("copt "):
            command = text
        elif command and text and not text.startswith("Override example"):
            description.append(text)
    summary = " ".join(description)
    return command, summary.split(". ")[0].rstrip(".") + "." if summary else ""


def list_recipes() -> list[BuiltinRecipe]:
    import yaml

    found: dict[str, BuiltinRecipe] = {}
    for directory in recipe_dirs():
        for path in sorted(directory.glob("*.yaml")):
            if path.stem in found:
                continue
            data = yaml.safe_load(path.read_text()) or {}
            command, description = _header(path)
            found[path.stem] = BuiltinRecipe(path.stem, path, str(data.get("task", "?")), command, description)
    return sorted(found.values(), key=lambda r: r.name)


def resolve_recipe(name_or_path: str) -> Path:
    """A path to an existing file, or the name of a built-in recipe."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():  # a folder of recipes, or one named like a recipe: not "neither a file nor a built-in recipe"
        try:
            return builtin_recipe(name_or_path)
        except BadInputError:
            raise BadInputError(f"Recipe {name_or_path} is a directory.",
                                hint="Pass a recipe YAML file or a built-in name (copt recipes list).") from None
    return builtin_recipe(name_or_path, what="neither a file nor a built-in recipe")


def builtin_recipe(name: str, what: str = "not a built-in recipe") -> Path:
    """The file of the built-in recipe `name` (a bare name, `.yaml` optional; never a path)."""
    stem = name.removesuffix(".yaml")
    if stem and "/" not in stem and "\\" not in stem and stem not in (".", ".."):
        for directory in recipe_dirs():
            candidate = directory / f"{stem}.yaml"
            if candidate.is_file():
                return candidate
    names = ", ".join(r.name for r in list_recipes()) or "none"
    raise BadInputError(f"Recipe '{name}' is {what}.", hint=f"Built-in recipes: {names} (copt recipes list)")
