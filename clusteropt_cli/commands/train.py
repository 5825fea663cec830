"""copt train: train or fine-tune a causal LM (mixed precision, checkpointing, ZeRO + offload, pipelines)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from clusteropt_cli import console
from clusteropt_cli.options import (
    CheckpointingOpt,
    DryRunOpt,
    EpochsOpt,
    GpusOpt,
    GradAccumOpt,
    JsonOpt,
    KeepCheckpointsOpt,
    LrOpt,
    MaxStepsOpt,
    MicroBatchOpt,
    OffloadOpt,
    OverridesArg,
    OverwriteOpt,
    PrecisionOpt,
    RecipeOpt,
    ResumeOpt,
    SaveEveryOpt,
    SeedOpt,
    SeqLenOpt,
    ZeroOpt,
)
from clusteropt_cli.options import opt as _opt


def train(
    overrides: OverridesArg = None,
    model: _opt("--model", "Local HF model dir (fine-tune), a config.json or a preset name (from scratch).") = None,
    data: _opt("--data", ".txt or .jsonl (text field) to train on; tokenized and packed to --seq-len.") = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Output dir: the model (HF format), "
                                                "metrics.jsonl, checkpoints/.", show_default=False)] = None,
    tokenizer: _opt("--tokenizer", "Tokenizer dir (default: the model dir).") = None,
    precision: PrecisionOpt = None,
    activation_checkpointing: CheckpointingOpt = None,
    attn: _opt("--attn", "sdpa | flash_attention_2 | eager.") = None,
    micro_batch: MicroBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    seq_len: SeqLenOpt = None,
    max_steps: MaxStepsOpt = None,
    epochs: EpochsOpt = None,
    lr: LrOpt = None,
    schedule: _opt("--schedule", "cosine | linear | constant.") = None,
    warmup_steps: _opt("--warmup-steps", "Linear warm-up steps.", int) = None,
    compile: Annotated[bool | None, typer.Option("--compile/--no-compile", help="torch.compile the decoder "
                                                 "(default: on for CUDA).", show_default=False)] = None,
    zero: ZeroOpt = None,
    offload: OffloadOpt = None,
    nvme_path: _opt("--nvme-path", "Directory for --offload nvme.") = None,
    gradient_compression: _opt("--gradient-compression", "none | fp16 | bf16 | powersgd (DDP comm hooks).") = None,
    pipeline_stages: _opt("--pipeline-stages", "Pipeline stages (one per process).", int) = None,
    pipeline_schedule: _opt("--pipeline-schedule", "gpipe | 1f1b | interleaved-1f1b.") = None,
    pipeline_micro_batches: _opt("--pipeline-micro-batches", "Micro-batches per pipeline step.", int) = None,
    virtual_stages: _opt("--virtual-stages", "Model chunks per rank (interleaved-1f1b).", int) = None,
    gpus: GpusOpt = None,
    nodes: _opt("--nodes", "Nodes.", int) = None,
    hostfile: _opt("--hostfile", "Hostfile ('hostname slots=N' per line) for multi-node runs.") = None,
    launcher: _opt("--launcher", "auto | deepspeed | torchrun.") = None,
    master_addr: _opt("--master-addr", "Rendezvous address (default: first host).") = None,
    master_port: _opt("--master-port", "Rendezvous port (default 29500).", int) = None,
    save_every: SaveEveryOpt = None,
    keep_checkpoints: KeepCheckpointsOpt = None,
    resume: ResumeOpt = None,
    seed: SeedOpt = None,
    overwrite: OverwriteOpt = False,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
    recipe: RecipeOpt = None,
) -> None:
    """Train or fine-tune a causal LM on a text file; writes the model (HF format) and metrics.jsonl to --output."""
    from clusteropt_cli.core.train.launch import (
        child_args,
        is_launched_child,
        leave_finished_rank,
        plan_launch,
        refuse_outside_launcher,
        run_or_launch,
    )
    from clusteropt_cli.recipe.load import load_settings

    settings = load_settings("train", recipe, overrides, dict(
        model=model, data=data, output=str(output) if output else None, tokenizer=tokenizer, precision=precision,
        activation_checkpointing=activation_checkpointing, attn=attn, micro_batch=micro_batch, grad_accum=grad_accum,
        seq_len=seq_len, max_steps=max_steps, epochs=epochs, lr=lr, schedule=schedule, warmup_steps=warmup_steps,
        compile=compile, zero=zero, offload=offload, nvme_path=nvme_path, gradient_compression=gradient_compression,
        pipeline_stages=pipeline_stages, pipeline_schedule=pipeline_schedule,
        pipeline_micro_batches=pipeline_micro_batches, virtual_stages=virtual_stages, gpus=gpus, nodes=nodes,
        hostfile=hostfile, launcher=launcher, master_addr=master_addr, master_port=master_port,
        save_every=save_every, keep_checkpoints=keep_checkpoints, resume=resume, seed=seed))
    if is_launched_child():  # one rank under copt's launcher: the parent validated and renders
        _train_here(settings, overwrite)
        leave_finished_rank()
    refuse_outside_launcher("train")

    from clusteropt_cli.core.train.loop import RESULT_FILE
    from clusteropt_cli.core.train.run import check_host_memory_for_ranks, device_type
    from clusteropt_cli.core.train.validate import check_offload_resources, validate_train

    # the hardware check imports torch: a launching parent leaves it to the ranks, which check before any work
    launching = settings.gpus * settings.nodes > 1
    source = validate_train(settings, overwrite=overwrite,
                            device_type=None if dry_run or launching else device_type(), recipe=recipe)
    if launching and settings.nodes == 1 and not dry_run:  # this machine is the node: refuse before starting the ranks
        check_offload_resources(settings, source.config)
        check_host_memory_for_ranks(settings, source.config, processes=settings.gpus)
    ranks_args = child_args(settings, ["train"], exclude={"task", "prediction"}, extra=["--json"] if json_out else [])
    plan = plan_launch(settings, [a for a in ranks_args if a != "--dry-run"])
    if dry_run:
        _render_dry_run(settings, plan, json_out)
        return
    result = run_or_launch(plan, lambda: _train_here(settings, overwrite), output=settings.output,
                           overwrite=overwrite, resume=bool(settings.resume), command="train",
                           result_file=RESULT_FILE, what="training", log=console.log)
    if result is not None:
        _render_result(console.to_jsonable(result), json_out)


class _ProgressCallback:
    """Renders run_training's events with rich on stderr (rank 0 only)."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack, self.advance = stack, None

    def on_start(self, total_steps: int, start_step: int) -> None:
        self.advance = self.stack.enter_context(console.progress_bar("training", total=total_steps))
        if start_step:
            self.advance(start_step, info=f"resumed at step {start_step}")

    def on_step(self, row: dict[str, Any]) -> None:
        if self.advance is not None:
            tps = row.get("tokens_per_s")
            self.advance(1, info=f"loss {row['loss']:.4f}  lr {row['lr']:.2e}" + (f"  {tps:,.0f} tok/s" if tps else ""))

    def on_log(self, message: str) -> None:
        console.log(message)


def _train_here(settings: Any, overwrite: bool) -> Any:
    """This process's part of the run, with a progress bar on rank 0 and library chatter off stdout."""
    import os

    from clusteropt_cli.core.train.run import train_from_settings

    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # library chatter (DeepSpeed logs) off stdout
        callbacks = [_ProgressCallback(stack)] if int(os.environ.get("RANK", "0")) == 0 else []
        return train_from_settings(settings, overwrite=overwrite, callbacks=callbacks, log=console.log)


def _render_result(result: dict[str, Any], json_out: bool) -> None:
    if json_out:
        console.print_json(result, "copt.train/1")
        return
    loss = f"{result['first_loss']:.4f} → {result['final_loss']:.4f}" if result.get("final_loss") is not None else "-"
    tps = result.get("tokens_per_s")
    console.out.print(console.kv_table("copt train", [
        ("output", result["output_dir"]),
        ("engine", f"{result['engine']} × {result['world_size']}"),
        ("precision", result["precision"]),
        ("steps", f"{result['start_step'] + result['steps']} / {result['total_steps']}"
         + (f" (resumed at {result['resumed_from']})" if result.get("resumed_from") is not None else "")),
        ("loss", loss),
        ("tokens/s", f"{tps:,.0f}" if tps else "-"),
        ("MFU", f"{result['mfu']:.3f}" if result.get("mfu") is not None else "- (CPU or unknown GPU)"),
        ("peak memory", console.human_bytes(result.get("peak_mem_bytes"))),
        ("metrics", result["metrics_path"]),
    ]))


def _render_dry_run(settings: Any, plan: Any, json_out: bool) -> None:
    from clusteropt_cli.core.train.deepspeed_config import deepspeed_config

    ds = deepspeed_config(settings, plan.world_size) if settings.zero > 0 else None
    doc = {"launcher": plan.launcher, "world_size": plan.world_size, "nodes": plan.nodes,
           "procs_per_node": plan.procs_per_node, "command": plan.command, "shell": plan.shell or None,
           "run_on_every_node": plan.per_node, "hosts": plan.hosts, "master_addr": plan.master_addr,
           "master_port": plan.master_port, "deepspeed_config": ds,
           "deepspeed_config_path": str(Path(settings.output) / "ds_config.json") if ds else None,
           "settings": settings.model_dump(mode="json")}
    if json_out:
        console.print_json(doc, "copt.train/1")
        return
    import json

    if ds is not None:
        console.out.print(f"# DeepSpeed config (written to {doc['deepspeed_config_path']})")
        console.out.print(json.dumps(ds, indent=2), highlight=False, markup=False)
    if plan.launcher == "none":
        console.out.print("# single process: copt trains in this process (no launcher)")
    else:
        where = "on every node" if plan.per_node else ("on the first host (starts the others)" if plan.nodes > 1
                                                        else "here")
        console.out.print(f"# launch command ({plan.launcher}, {plan.world_size} processes), run {where}:")
        console.out.print(plan.shell, highlight=False, markup=False)
