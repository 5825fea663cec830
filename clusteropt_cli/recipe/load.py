"""Load a recipe: YAML file or built-in name → dict → key.sub=value overrides → CLI flags → one validation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import RecipeError

MAX_RECIPE_BYTES = 1 << 20
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr=3e-4' → (['optim', 'lr'], 0.0003). Values are parsed as YAML scalars/lists."""
    import yaml

    if "=" not in text:
        raise RecipeError(f"Override '{text}' is not key=value.", hint="Write overrides as key.sub=value, e.g. zero=3")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"Override '{text}' has an empty key.", hint="Write overrides as key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 3e-4 as a string
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str] | list[tuple[list[str], Any]]) -> dict[str, Any]:
    """Merge key.sub=value overrides (texts, or what parse_override made of them) into a nested dict (a copy)."""
    import copy

    merged = copy.deepcopy(data)
    for override in overrides:
        path, value = parse_override(override) if isinstance(override, str) else override
        node = merged
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return merged


def _recipe_loader() -> type:
    """yaml.SafeLoader that refuses aliases (`*name`: a few lines of them expand into billions of values when the
    recipe is written back out) and a key given twice in one mapping (silently the last one otherwise)."""
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):  # noqa: ANN001, ANN202 - PyYAML's signature
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.constructor.ConstructorError(
                    None, None, f"a YAML alias (*{event.anchor}): recipes do not use anchors and aliases; write "
                                "the values out", event.start_mark)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):  # noqa: ANN001, ANN202 - PyYAML's signature
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, (str, int, float, bool)) and key is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"a {type(key).__name__} as a key: recipe keys are names", key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return RecipeLoader


def read_recipe_text(source: str | Path) -> tuple[Path, str]:
    """A recipe's file (a path or a built-in name) and its text: a short UTF-8 file, checked before it is read."""
    from clusteropt_cli.recipe.registry import resolve_recipe

    path = resolve_recipe(str(source))  # a directory is refused there
    try:
        size = path.stat().st_size  # before reading: a data file passed by mistake is not read into memory
        raw = b""
        if size <= MAX_RECIPE_BYTES:
            with path.open("rb") as handle:
                raw = handle.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"Cannot read recipe {path}: {exc.strerror}", hint="Check the path.") from exc
    if max(size, len(raw)) > MAX_RECIPE_BYTES:
        raise RecipeError(f"Recipe {path} is {max(size, len(raw)):,} bytes; a recipe is a short YAML file (at most "
                          f"{MAX_RECIPE_BYTES:,}).", hint="Check that --recipe names the recipe, not a data file.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"Recipe {path} is not UTF-8 text (byte {exc.start}); is it a binary file?",
                          hint="Pass a YAML recipe (copt recipes show NAME prints one).") from None
    return path, text


def read_recipe_file(source: str | Path) -> dict[str, Any]:
    """Read a recipe YAML (a path or a built-in name) into a dict; errors name the file and line."""
    import yaml

    path, text = read_recipe_text(source)
    try:
        data = yaml.load(text, Loader=_recipe_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}: " if mark else ": "
        raise RecipeError(f"Recipe {path}{where}{exc.problem}.", hint="Fix the recipe file.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise RecipeError(f"Recipe {path} is not valid YAML{where}.", hint="Fix the YAML syntax.") from exc
    except RecursionError:
        raise RecipeError(f"Recipe {path} nests too deeply to be a recipe.",
                          hint="A recipe is a flat mapping of keys (a few nested levels at most); check the file.") \
            from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe {path} must be a mapping of keys to values, not {type(data).__name__}.")
    return data


_KEY_REFERENCE = re.compile(r"`([a-z][a-z0-9_]*)`")


def split_problems(message: str) -> list[str]:
    """A schema check's message → its problems (one a line, see recipe.schema.base.raise_problems)."""
    return [line.strip() for line in message.removeprefix("Value error, ").splitlines() if line.strip()]


def format_validation_error(exc: Any, names: dict[str, str] | None = None,
                            flags: dict[str, str] | None = None) -> list[str]:
    """pydantic ValidationError → one line per problem, each naming its key, or the flag `names` gives for it (a
    value typed on the command line is named as the user typed it, e.g. --temperature, not sample_temperature); a
    required key missing is named by its flag in `flags` (how to give it), e.g. 'MODEL is required'."""
    names, flags = names or {}, flags or {}

    def name(key: str) -> str:
        return names.get(key, key)

    def render(text: str) -> str:  # another key named in a message is written `key`
        return _KEY_REFERENCE.sub(lambda m: name(m.group(1)), text)

    problems = []
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ())]
        msg = error.get("msg", "invalid")
        if error.get("type") == "missing" and len(loc) == 1 and loc[0] in flags:
            problems.append(f"{flags[loc[0]]} is required")
            continue
        if loc:
            loc[0] = name(loc[0])
        where = ".".join(loc)
        if error.get("type") == "extra_forbidden":
            msg = "unknown key (not part of this recipe's schema)"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if not where:
            # model-level checks: one problem a line, each naming its key at the start
            for part in split_problems(msg):
                key, sep, rest = part.partition(": ")
                shown = flags[key] if rest.startswith("required") and key in flags else name(key)
                problems.append(render(f"{shown}{sep}{rest}" if sep else part))
            continue
        problems.append(render(f"{where}: {msg}"))
    return problems


def validate_recipe(task: str, data: dict[str, Any], *, origin: str = "recipe", names: dict[str, str] | None = None,
                    flags: dict[str, str] | None = None):
    """Validate a dict against the task's schema; every problem reported at once (`names` and `flags`: see
    format_validation_error)."""
    from pydantic import ValidationError

    from clusteropt_cli.recipe.schema import RECIPE_MODELS

    declared = data.get("task", task)
    if not isinstance(declared, str):
        raise RecipeError(f"{origin}: task must be one word (train, serve, quantize, distill, profile), not "
                          f"{declared!r}.", hint="Write e.g. 'task: train'.")
    if declared != task:
        raise RecipeError(
            f"{origin} is a '{declared}' recipe, not a '{task}' recipe.",
            hint=f"Run it with 'copt {declared} --recipe ...'",
        )
    model = RECIPE_MODELS[task]
    try:
        return model.model_validate({**data, "task": task})
    except ValidationError as exc:
        problems = format_validation_error(exc, names, flags)  # a model-level check may name several keys
        shown = (*(names or {}).values(), *(flags or {}).values())
        flagged = [p.startswith(shown) for p in problems] if shown else [False]
        hint = ("Fix the flags named above (--help lists them)." if all(flagged) else
                "Fix the flags and keys named above (--help lists the flags; copt recipes show NAME prints a valid "
                "recipe)." if any(flagged) else
                "Fix the keys named above (copt recipes show NAME prints a valid example).")
        raise RecipeError(f"{origin} has {len(problems)} problem(s):", problems=problems, hint=hint) from None


def flag_names(cli_values: dict[str, Any], flags: dict[str, str | None] | None = None) -> dict[str, str]:
    """Recipe key → the flag that sets it on this command: --key-with-dashes unless `flags` says otherwise (a
    positional argument's name such as MODEL, or None for a value the command sets itself)."""
    renamed = flags or {}
    names = {key: renamed.get(key, "--" + key.replace("_", "-")) for key in cli_values}
    return {key: flag for key, flag in names.items() if flag}


def load_settings(
    task: str,
    recipe: str | None = None,
    overrides: list[str] | None = None,
    cli_values: dict[str, Any] | None = None,
    flags: dict[str, str | None] | None = None,
):
    """The one entry point for commands: recipe (optional) + overrides + typed flags → validated settings.

    `cli_values` holds the values of the command's flags by recipe key; only those the user typed count (None means
    "not given" and is dropped). `flags` names a key's flag where it is not --key-with-dashes (see flag_names). A
    problem is named by the flag the user typed; by the key when a recipe or a key=value override set it (or nothing
    did, under --recipe); by the flag again when nothing set it on a plain command line, and when a required key is
    missing (MODEL is required).
    """
    data: dict[str, Any] = read_recipe_file(recipe) if recipe else {}
    parsed = [parse_override(text) for text in overrides or []]
    given = set(data) | {path[0] for path, _ in parsed}
    data = apply_overrides(data, parsed)
    typed = set()
    for key, value in (cli_values or {}).items():
        if value is not None:
            data[key] = value
            typed.add(key)
    all_flags = flag_names(cli_values or {}, flags)
    names = {key: flag for key, flag in all_flags.items() if key in typed or (key not in given and not recipe)}
    origin = f"Recipe '{recipe}'" if recipe else "The command line"
    return validate_recipe(task, data, origin=origin, names=names, flags=all_flags)
