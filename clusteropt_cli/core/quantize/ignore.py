"""--ignore against the model's modules: every entry must keep something in full precision.

llm-compressor (compressed-tensors' matching) reads an entry as a module's exact name, `re:` + a regular expression
matched from the start of a module name, or the class name of a module or one of its bases (`Linear`). An entry that
matches nothing is silently dropped there, and the modules it was meant to keep get quantized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from clusteropt_cli.errors import BadInputError


def meta_modules(model_dir: Path) -> list[tuple[str, Any]]:
    """(name, module) of the causal LM that `model_dir`'s config.json builds, on the meta device (no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(model.named_modules())


def _matches(entry: str, names: list[str], classes: set[str]) -> bool:
    if entry.startswith("re:"):
        try:
            pattern = re.compile(entry.removeprefix("re:"))
        except re.error as exc:
            raise BadInputError(
                f"--ignore {entry}: not a regular expression ({exc}).",
                hint="Write re: followed by a Python regular expression matched from the start of "
                r"a module name, e.g. re:.*\.down_proj$.",
            ) from None
        return any(pattern.match(name) for name in names)
    return entry in names or entry in classes


def _is_linear(module: Any) -> bool:
    return any(cls.__name__ == "Linear" for cls in type(module).__mro__)


def check_ignore(entries: Iterable[str], modules: Iterable[tuple[str, Any]]) -> None:
    """Refuse (exit 2) --ignore entries that match no module of the model, naming some of its modules."""
    modules = list(modules)
    names = [name for name, _ in modules if name]
    classes = {cls.__name__ for _, module in modules for cls in type(module).__mro__ if cls is not object}
    missing = [entry for entry in entries if not _matches(entry, names, classes)]
    if not missing:
        return
    linears = [name for name, module in modules if name and _is_linear(module)] or names
    # one of each: the modules outside the repeated layers and the first layer's
    shown = [name for name in linears if all(not part.isdigit() or part == "0" for part in name.split("."))] or linears
    shown = shown[:6] + ([shown[-1]] if len(shown) > 6 else [])
    listed = ", ".join(shown) + (", ..." if len(linears) > len(shown) else "")
    notes = []
    for entry in missing:
        ends = sum(name.endswith("." + entry) for name in names)
        if ends:
            notes.append(f"{entry} ends {ends} module names: re:.*\\.{re.escape(entry)}$ matches them")
    what = "that name" if len(missing) == 1 else "these names"
    raise BadInputError(
        f"--ignore {', '.join(missing)}: no module of the model has {what}"
        + (f" ({'; '.join(notes)})." if notes else "."),
        hint=f"Give exact module names ({listed}), re:REGEX matched from the start of a name "
        r"(e.g. re:.*\.down_proj$), or a class name (Linear).",
    )
