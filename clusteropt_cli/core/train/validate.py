"""Everything `copt train` checks before any work starts; all problems are reported together, each naming its flag."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.core.train.data import TEXT_SUFFIXES
from clusteropt_cli.core.train.model import ModelSource, resolve_model_source
from clusteropt_cli.errors import BadInputError, OutOfMemoryError, UnsupportedHardwareError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.base import TrainingOptions
    from clusteropt_cli.recipe.schema.train import TrainRecipe


def train_inputs(settings: TrainRecipe, recipe: str | None = None) -> dict[str, Any]:
    """Every input path of a training run (what its --output must stay clear of)."""
    return {"--model": settings.model, "--tokenizer": getattr(settings, "tokenizer", None),
            "--data": getattr(settings, "data", None), "--hostfile": getattr(settings, "hostfile", None),
            "--recipe": recipe}


def validate_train(settings: TrainRecipe, *, overwrite: bool = False, check_output: bool = True,
                   device_type: str | None = None, recipe: str | None = None) -> ModelSource:
    """Validate a TrainRecipe against the files and the hardware; returns the resolved model source."""
    from clusteropt_cli.deps import version_of
    from clusteropt_cli.modelspec import tokenizer_dir_problem

    problems: list[str] = []
    try:
        source: ModelSource | None = resolve_model_source(settings.model, settings.tokenizer)
    except BadInputError as exc:  # reported with every other problem of the command line
        source = None
        problems.append(exc.message + (f" ({exc.hint})" if exc.hint else ""))
    config = source.config if source is not None else {}
    if not settings.data:
        problems.append("--data: give a .txt or .jsonl file to train on")
    elif Path(settings.data).is_dir():
        problems.append(f"--data: {settings.data} is a directory; pass one .txt or .jsonl file (concatenate the "
                        "directory's files into one)")
    elif not Path(settings.data).is_file():
        problems.append(f"--data: {settings.data} " + ("is not a regular file (a pipe or a device?); pass a .txt or "
                                                       ".jsonl file" if Path(settings.data).exists()
                                                       else "does not exist"))
    elif Path(settings.data).suffix not in TEXT_SUFFIXES:
        problems.append(f"--data: {settings.data} is neither .txt nor .jsonl")
    if source is None:
        pass
    elif source.tokenizer_path is None:
        problems.append("--tokenizer: training from a config/preset needs a local tokenizer directory")
    elif (problem := tokenizer_dir_problem(source.tokenizer_path, "--tokenizer" if settings.tokenizer
                                           else "--model")) is not None:
        problems.append(problem)
    problems += layout_problems(settings, config)
    if settings.zero > 0 and version_of("deepspeed") is None:
        problems.append("--zero: DeepSpeed is not installed (pip install 'clusteropt-cli[train]')")
    if settings.offload == "nvme" and settings.nvme_path and not Path(settings.nvme_path).is_dir():
        problems.append(f"--nvme-path: {settings.nvme_path} is not a directory")
    if settings.nodes > 1 and not (settings.hostfile or settings.master_addr):
        problems.append("--hostfile: a multi-node run needs a hostfile (or --master-addr)")
    if settings.hostfile and not Path(settings.hostfile).is_file():
        problems.append(f"--hostfile: {settings.hostfile} does not exist")
    if not settings.output:
        problems.append("--output: give the directory for the trained model and metrics")
    elif check_output:
        from clusteropt_cli.core.io import check_output as check_output_path

        try:
            check_output_path(settings.output, train_inputs(settings, recipe), overwrite=overwrite,
                              resume=bool(settings.resume), can_resume=True)
        except BadInputError as exc:
            problems.append(f"{exc.message} ({exc.hint})" if exc.hint else exc.message)
    if problems:
        raise BadInputError("copt train cannot start:\n" + "\n".join(f"  - {p}" for p in problems),
                            hint="fix the flags named above")
    if device_type is not None:
        check_hardware(settings, device_type)
    assert source is not None  # a model that did not resolve is one of the problems above
    return source


def layout_problems(settings: TrainRecipe, config: dict[str, Any]) -> list[str]:
    """What copt train refuses in a schema-valid recipe given the model's config (no files, no hardware): the
    sequence length against the model's positions, the pipeline's chunks against its layers and micro-batches,
    gradient compression without data parallelism. copt advise checks its plans with the same function."""
    problems: list[str] = []
    max_positions = config.get("max_position_embeddings")
    if max_positions and settings.seq_len > int(max_positions):
        problems.append(f"--seq-len: {settings.seq_len} exceeds the model's max_position_embeddings ({max_positions})")
    layers = config.get("num_hidden_layers")
    chunks = settings.pipeline_stages * (settings.virtual_stages if settings.pipeline_schedule == "interleaved-1f1b"
                                         else 1)
    if settings.pipeline_stages > 1 and layers and chunks > int(layers):
        problems.append(f"--pipeline-stages: {settings.pipeline_stages} stages × {settings.virtual_stages} virtual "
                        f"stages = {chunks} chunks exceed the model's {layers} layers")
    if settings.pipeline_stages > 1 and settings.pipeline_schedule != "gpipe":
        n_micro = settings.pipeline_micro_batches or settings.micro_batch * settings.grad_accum
        if n_micro < settings.pipeline_stages:
            problems.append(f"--pipeline-micro-batches: {settings.pipeline_schedule} needs at least "
                            f"{settings.pipeline_stages} micro-batches per step, got {n_micro} (raise --micro-batch)")
    if settings.gradient_compression != "none" and settings.gpus * settings.nodes == 1:
        problems.append("--gradient-compression: compresses gradients between data-parallel ranks; it needs "
                        "--gpus/--nodes > 1")
    if settings.gradient_compression != "none" and settings.pipeline_stages > 1:
        problems.append("--gradient-compression: applies to data-parallel (DDP) runs, not pipelines")
    return problems


def check_hardware(settings: TrainingOptions, device_type: str) -> None:
    """fp8/bf16 support and the attention implementation against this machine."""
    from clusteropt_cli.core.train.precision import check_precision_supported

    check_precision_supported(settings.precision, device_type)
    if settings.attn == "flash_attention_2":
        if device_type != "cuda":
            raise UnsupportedHardwareError("--attn flash_attention_2 needs a CUDA GPU.", hint="use --attn sdpa")
        from clusteropt_cli.deps import version_of

        if version_of("flash-attn") is None and version_of("flash_attn") is None:
            raise BadInputError("--attn flash_attention_2 needs the flash-attn package.",
                                hint="pip install flash-attn, or use --attn sdpa (also flash kernels on CUDA)")


def check_offload_resources(settings: TrainingOptions, config: dict, host_bytes: int | None = None,
                            disk_free_bytes: int | None = None) -> None:
    """What ZeRO-Offload needs from this machine, before any loading (copt advise's host model): host RAM for the
    fp32 load and DeepSpeed's offloaded states, and for NVMe the drive's free space at --nvme-path and DeepSpeed's
    async I/O op (libaio). A run that overshoots the RAM is ended by the kernel's out-of-memory killer minutes later,
    with no message. Refuses only what cannot fit at all (the processes themselves are not counted)."""
    if settings.offload == "none":
        return
    from clusteropt_cli.core.advise.memory import host_train_memory
    from clusteropt_cli.core.advise.plan import Target, TrainPlan
    from clusteropt_cli.modelspec import load_model_spec

    gib = 1024**3
    if host_bytes is None:
        import psutil

        host_bytes = int(psutil.virtual_memory().total)
    spec = load_model_spec(config)
    plan = TrainPlan(zero=settings.zero, offload=settings.offload)  # the host's share depends on nothing else
    host = host_train_memory(spec, plan, Target(None, settings.gpus, settings.nodes))
    needed = host["terms"]["model_load"] + host["terms"]["offload_buffers"]
    what = f"{spec.num_params / 1e9:.2f}B parameters"
    if needed > host_bytes:
        raise OutOfMemoryError(
            f"--offload {settings.offload} needs about {needed / gib:.0f} GiB of host RAM per node for this model "
            f"({what}: DeepSpeed's offloaded fp32 masters, Adam moments and gradients); this machine has "
            f"{host_bytes / gib:.0f} GiB.",
            hint=("use --offload nvme --nvme-path DIR, " if settings.offload == "cpu" else "")
            + "spread the states over more nodes (--nodes), or a machine with more RAM (copt advise --host-memory GIB "
              "ranks the plans that fit)")
    if settings.offload != "nvme" or not settings.nvme_path:
        return
    if disk_free_bytes is None:
        import shutil

        disk_free_bytes = shutil.disk_usage(settings.nvme_path).free
    if host["nvme_bytes"] > disk_free_bytes:
        raise BadInputError(
            f"--offload nvme swaps about {host['nvme_bytes'] / gib:.0f} GiB per node to {settings.nvme_path} for "
            f"this model ({what}: fp32 masters and Adam moments); it has {disk_free_bytes / gib:.0f} GiB free.",
            hint="point --nvme-path at a drive with room, or spread the states over more nodes (--nodes)")
    from clusteropt_cli.deps import version_of

    if version_of("deepspeed") is not None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise BadInputError(
                "--offload nvme needs DeepSpeed's async I/O op, which builds against libaio (its headers and "
                "shared library), not found here.",
                hint="install libaio (apt install libaio-dev), or use --offload cpu")
