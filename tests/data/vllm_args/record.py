"""Record the `vllm serve` flags and speculative-config keys of one vLLM release from its source (no vLLM install).

    python3 tests/data/vllm_args/record.py VLLM_SOURCE_DIR VERSION > tests/data/vllm_args/VERSION.json

VLLM_SOURCE_DIR is an unpacked sdist (vllm-X.Y.Z/). Flags are the string literals of `add_argument` calls in
vllm/engine/arg_utils.py and the serve front end, plus `--field` for every field of the front end's FrontendArgs
dataclass (vLLM generates those); boolean fields (BooleanOptionalAction) also accept `--no-field`. The
speculative-config keys are the fields of SpeculativeConfig, which forbids extra keys.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _dataclass_fields(tree: ast.Module, names: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in names:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out[item.target.id] = ast.unparse(item.annotation)
    return out


def _argument_flags(tree: ast.Module) -> set[str]:
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    flags.add(arg.value)
    return flags


def record(src: Path, version: str) -> dict:
    arg_utils = ast.parse((src / "vllm/engine/arg_utils.py").read_text())
    flags = _argument_flags(arg_utils)
    engine_fields = _dataclass_fields(arg_utils, ("EngineArgs",))
    bools = {f"--{k.replace('_', '-')}" for k, t in engine_fields.items() if "bool" in t}
    for rel in ("vllm/entrypoints/openai/cli_args.py", "vllm/entrypoints/common/cli_args.py"):
        path = src / rel
        if path.is_file():
            tree = ast.parse(path.read_text())
            flags |= _argument_flags(tree)
            front = _dataclass_fields(tree, ("FrontendArgs", "BaseFrontendArgs"))
            flags |= {f"--{k.replace('_', '-')}" for k in front}
            bools |= {f"--{k.replace('_', '-')}" for k, t in front.items() if "bool" in t}
    flags |= {"--no-" + f[2:] for f in bools if f in flags}
    spec_path = src / "vllm/config/speculative.py"
    spec_tree = ast.parse((spec_path if spec_path.is_file() else src / "vllm/config.py").read_text())
    spec_fields = sorted(_dataclass_fields(spec_tree, ("SpeculativeConfig",)))
    return {"version": version, "source": f"vllm-{version} sdist: vllm/engine/arg_utils.py, the serve front end's "
            "cli_args.py, vllm/config/speculative.py", "flags": sorted(flags), "speculative_config_keys": spec_fields}


if __name__ == "__main__":
    print(json.dumps(record(Path(sys.argv[1]), sys.argv[2]), indent=1))
