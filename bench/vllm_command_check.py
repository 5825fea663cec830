"""Check copt's `serve --engine vllm` commands against the vLLM installed here: each command is parsed by vLLM's own
`vllm serve` argument parser and turned into vLLM's engine config (EngineArgs.create_engine_config: the model's and
draft's configs are read and vLLM's validations run; no weights are loaded, no server starts). copt's refusals
(draft models before 0.15, --async-scheduling with what vLLM rejects) must be refusals in vLLM too.

    python3 bench/vllm_command_check.py --model /models/Llama-3.2-1B [--draft /models/draft] --out vllm_check.json

Prints one row per case: copt's decision (command / refused), vLLM's (config built / error), agreement.
Exit 0 when they agree on every case, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = {
    "plain": {},
    "user-set max-num-seqs/block-size": {"max_batch_size": 64, "block_size": 16},
    "kv-cache-memory + gpu-memory-utilization": {"kv_cache_memory": 4.0, "gpu_memory_utilization": 0.5},
    "ngram speculation, limit 4": {"prompt_lookup": 3, "num_speculative_tokens": 3, "speculative_max_batch": 4},
    "draft-model speculation, limit 4": {"draft_model": "DRAFT", "num_speculative_tokens": 3,
                                         "speculative_max_batch": 4},
    "async scheduling": {"async_scheduling": True},
    "async scheduling + ngram": {"async_scheduling": True, "prompt_lookup": 3},
    "async scheduling + draft": {"async_scheduling": True, "draft_model": "DRAFT"},
    "no async scheduling + eager": {"async_scheduling": False, "cuda_graphs": False},
}


def vllm_parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def vllm_verdict(argv: list[str]) -> str | None:
    """None when vLLM parses the command and builds its engine config, else vLLM's error."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    serve = argv.index("serve")
    try:
        args = vllm_parser().parse_args(argv[serve + 1:])
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except SystemExit as exc:
        return f"argument parser exit {exc.code}"
    except Exception as exc:  # noqa: BLE001 - vLLM's validation errors are what we compare
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def unchecked_argv(settings) -> list[str]:
    """The command copt would write without its version checks (to see vLLM refuse it as well)."""
    from clusteropt_cli.core.serve.vllm import plan_vllm_command

    if settings.async_scheduling:
        base = settings.model_copy(update={"async_scheduling": None})
        try:
            return plan_vllm_command(base, "0.33").argv + ["--async-scheduling"]
        except Exception:  # noqa: BLE001 - the draft refusal below
            pass
    return plan_vllm_command(settings.model_copy(update={"async_scheduling": None}), "0.33").argv + (
        ["--async-scheduling"] if settings.async_scheduling else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Local HF model directory (config + tokenizer; weights unused).")
    ap.add_argument("--draft", help="Draft model directory (default: --model itself).")
    ap.add_argument("--cases", help="Comma-separated case names (default: all).")
    ap.add_argument("--out", type=Path, help="JSON results.")
    args = ap.parse_args()
    from importlib.metadata import PackageNotFoundError, version

    from clusteropt_cli.core.serve.vllm import plan_vllm_command
    from clusteropt_cli.errors import CoptError
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    try:
        installed = version("vllm")
    except PackageNotFoundError:
        print("vLLM is not installed here: pip install vllm (on a CUDA machine), then run this again.")
        return 2
    names = args.cases.split(",") if args.cases else list(CASES)
    rows, agree = [], True
    for name in names:
        fields = {k: (args.draft or args.model) if v == "DRAFT" else v for k, v in CASES[name].items()}
        settings = ServeRecipe(model=args.model, engine="vllm", max_model_len=1024, **fields)
        try:
            plan = plan_vllm_command(settings, installed)
            copt, argv, warnings = "command", plan.argv, plan.warnings
        except CoptError as exc:
            copt, argv, warnings = f"refused: {exc.message[:120]}", unchecked_argv(settings), []
        err = vllm_verdict(argv)
        verdict = "config built" if err is None else err
        # a command copt writes must build; a command copt refuses must fail in vLLM too
        ok = (err is None) if copt == "command" else (err is not None)
        agree &= ok
        rows.append({"case": name, "copt": copt, "argv": argv, "warnings": warnings, "vllm": verdict, "agree": ok})
    print(f"vLLM {installed}")
    for r in rows:
        print(f"{r['case']:42s} {'ok ' if r['agree'] else 'BAD'} copt: {r['copt'][:40]:40s} vLLM: {r['vllm'][:90]}")
    if args.out:
        args.out.write_text(json.dumps({"vllm": installed, "rows": rows}, indent=2) + "\n")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
