"""Shared option aliases (Annotated) so every command spells a flag the same way.

Options default to None where a recipe may supply the value: the schema owns the defaults, and the command
passes only what the user typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output directory.")]
RecipeOpt = Annotated[
    str | None,
    typer.Option("--recipe", "-r", help="A recipe YAML file or the name of a built-in recipe (copt recipes list)."),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Recipe key overrides as key=value, nested keys as key.sub=value (keys: docs/reference/).",
                  show_default=False),
]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Output directory.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Random seed.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print what would run, then exit.")]


def model_and_overrides(model: str | None, overrides: list[str] | None) -> tuple[str | None, list[str]]:
    """MODEL and the key=value overrides after it: with --recipe and no MODEL, the first override lands in MODEL
    (`copt quantize --recipe r.yaml bits=8`); a path that exists stays MODEL."""
    from pathlib import Path

    overrides = list(overrides or [])
    if model is not None and "=" in model and not Path(model).expanduser().exists():
        return None, [model, *overrides]
    return model, overrides


def opt(name: str, help: str, kind: Any = str):  # noqa: A002 - mirrors typer's keyword
    """An optional typed flag whose default (None: not given) leaves the value to the recipe schema."""
    return Annotated[kind | None, typer.Option(name, help=help, show_default=False)]


# Training flags shared by `copt train` and `copt distill logits|sft` (TrainingOptions in the recipe schema).
PrecisionOpt = opt("--precision", "bf16 | fp16 | fp8 | fp32 (default bf16): autocast over fp32 weights; with --zero, "
                   "DeepSpeed's bf16/fp16 mode (16-bit weights, fp32 master weights in the optimizer).")
CheckpointingOpt = Annotated[bool | None, typer.Option(
    "--activation-checkpointing/--no-activation-checkpointing", help="Recompute activations in backward.",
    show_default=False)]
MicroBatchOpt = opt("--micro-batch", "Sequences per micro-batch per process.", int)
GradAccumOpt = opt("--grad-accum", "Micro-batches per optimizer step.", int)
SeqLenOpt = opt("--seq-len", "Tokens per sequence.", int)
MaxStepsOpt = Annotated[int | None, typer.Option("--max-steps", "--steps", help="Optimizer steps.",
                                                 show_default=False)]
EpochsOpt = opt("--epochs", "Passes over the data (when --max-steps is not given).", float)
LrOpt = opt("--lr", "Peak learning rate.", float)
ZeroOpt = opt("--zero", "DeepSpeed ZeRO stage 0 | 1 | 2 | 3.", int)
OffloadOpt = opt("--offload", "none | cpu | nvme (ZeRO optimizer/parameter offload).")
GpusOpt = opt("--gpus", "Processes per node (GPUs; on CPU, processes).", int)
SaveEveryOpt = opt("--save-every", "Write a resumable checkpoint every N steps.", int)
KeepCheckpointsOpt = opt("--keep-checkpoints", "Checkpoints to keep, the newest N (default 2).", int)
ResumeOpt = Annotated[bool | None, typer.Option("--resume", help="Continue from the latest checkpoint in --output.",
                                                show_default=False)]
