"""The training loop shared by `copt train`, `copt distill logits` and `copt distill sft`.

    from clusteropt_cli.core.train import run_training
    result = run_training(options, model, dataset, output_dir, loss_fn=my_loss, tokenizer=tok,
                          callbacks=[my_progress])

`options` is a TrainingOptions (or a recipe extending it); `model` an HF causal LM on the CPU (the engine moves
it); `dataset` indexable, item i a dict of equally shaped tensors (input_ids, labels, ...); `loss_fn(model, batch)
-> (loss, {name: float})` with `model` the unwrapped HF model (default: the fused chunked LM cross-entropy when
the model supports it, else the model's own loss). It handles precision (autocast, fp16 loss scaling, fp8),
activation checkpointing, torch.compile, DDP (+ gradient compression), DeepSpeed ZeRO (+ offload), pipeline
parallelism, metrics.jsonl, atomic resumable checkpoints and the final HF save into `output_dir`.
Under a launcher every rank calls it; only rank 0 writes files other than checkpoint shards.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusteropt_cli.core.train.checkpoint import (
    DEFAULT_KEEP,
    commit_checkpoint,
    load_torch_file,
    rng_state,
    save_torch_file,
    select_checkpoint,
    set_rng_state,
    staging_dir,
)
from clusteropt_cli.core.train.data import DataCursor, collate
from clusteropt_cli.core.train.distributed import (
    DistContext,
    all_reduce_mean,
    barrier,
    setup_distributed,
    teardown_distributed,
)
from clusteropt_cli.core.train.metrics import (
    MetricsWriter,
    SavedTensorMeter,
    StepValues,
    model_state_bytes,
    peak_flops_per_device,
    training_flops_per_token,
)
from clusteropt_cli.errors import BadInputError

METRICS_FILE = "metrics.jsonl"
DEEPSPEED_CONFIG_FILE = "ds_config.json"
RESULT_FILE = "train_result.json"


@dataclass
class TrainResult:
    """What a training run did (rank 0's view; the figures are global)."""

    output_dir: str
    engine: str
    world_size: int
    precision: str
    steps: int
    start_step: int
    total_steps: int
    tokens: int
    first_loss: float | None
    final_loss: float | None
    losses: list[float]
    tokens_per_s: float | None  # mean over the steps after the first (compile/warm-up excluded)
    mfu: float | None
    peak_mem_bytes: int | None
    peak_reserved_bytes: int | None
    step_time_s: float | None
    elapsed_s: float
    metrics_path: str
    deepspeed_config: str | None = None
    resumed_from: int | None = None
    model_saved: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class TrainCallback:
    """Override what you need; the command renders progress from these (core has no rich)."""

    def on_start(self, total_steps: int, start_step: int) -> None: ...

    def on_step(self, row: dict[str, Any]) -> None: ...

    def on_log(self, message: str) -> None: ...

    def on_end(self, result: TrainResult) -> None: ...


def plan_total_steps(options: Any, num_examples: int, global_batch: int) -> int:
    """max_steps, else ceil(epochs × examples / global batch) (epochs default 1)."""
    import math

    if options.max_steps:
        return int(options.max_steps)
    epochs = options.epochs if options.epochs is not None else 1.0
    return max(1, math.ceil(epochs * num_examples / global_batch))


def prepare_model(options: Any, model: Any, device_type: str, *, for_deepspeed: bool = False,
                  log: Callable[[str], None] = lambda _m: None) -> Any:
    """Attention implementation, checkpointing, fp8 swap and torch.compile on the bare model (in place)."""
    from clusteropt_cli.core.train.attention import use_causal_sdpa
    from clusteropt_cli.core.train.precision import convert_to_fp8

    config = model.config
    config.use_cache = False
    model.train()  # from_pretrained returns eval mode: dropout and HF's checkpointing need train mode
    if getattr(options, "attn", None) and hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(options.attn)
        except (ValueError, ImportError) as exc:
            raise BadInputError(f"--attn {options.attn} is not available: {exc}",
                                hint="use --attn sdpa") from None
    if getattr(options, "attn", "sdpa") in (None, "sdpa") and use_causal_sdpa(model):
        log("attention: SDPA with is_causal (packed batches have no padding: no mask is built, also under compile)")
    if options.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.precision == "fp8":
        converted = convert_to_fp8(model)
        log(f"fp8: {converted} linear layers run through torchao Float8Linear")
    if runs_compiled(options, device_type, engine_kind="deepspeed" if for_deepspeed else None):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        decoder.compile()
        log("torch.compile: decoder compiled (the first step includes compilation)")
    elif for_deepspeed and getattr(options, "compile", None):
        log("torch.compile: not applied under DeepSpeed ZeRO (its engine wraps the module): the decoder runs eager")
    return model


def compile_enabled(options: Any, device_type: str) -> bool:
    """options.compile, where None means: on for CUDA, off on CPU."""
    value = getattr(options, "compile", None)
    return bool(device_type == "cuda") if value is None else bool(value)


def runs_compiled(options: Any, device_type: str, engine_kind: str | None = None) -> bool:
    """Whether the decoder runs under torch.compile: options.compile (None: on for CUDA), never under DeepSpeed
    (its engine wraps the module). `copt advise` predicts with this same rule."""
    kind = engine_kind or _engine_kind(options)
    return compile_enabled(options, device_type) and kind != "deepspeed"


def loss_kind(options: Any, fused_supported: bool = True, engine_kind: str | None = None) -> str:
    """'fused' (chunked head + cross-entropy) or 'hf' (the model's own loss) for these options. auto = fused
    unless ZeRO-3 (its partitioned head weight is only gathered inside the head's own forward) or the model's head
    does not allow it. `copt advise` predicts with this same rule."""
    kind = engine_kind or _engine_kind(options)
    choice = getattr(options, "loss_impl", "auto")
    fused_ok = fused_supported and not (kind == "deepspeed" and options.zero == 3)
    if choice == "fused" and not fused_ok:
        raise BadInputError("loss_impl=fused does not apply to this model/engine (needs a bias-free LM head and "
                            "zero < 3).", hint="set loss_impl to auto or hf")
    return "hf" if choice == "hf" or not fused_ok else "fused"


def default_loss_fn(options: Any, model: Any, engine_kind: str) -> Any:
    """The fused chunked LM cross-entropy when it applies (loss_kind), else the model's own loss."""
    from clusteropt_cli.core.train.losses import hf_causal_lm_loss, make_fused_causal_lm_loss, supports_fused_loss

    if loss_kind(options, supports_fused_loss(model), engine_kind) == "hf":
        return hf_causal_lm_loss
    return make_fused_causal_lm_loss(getattr(options, "loss_chunk_tokens", None))


def _engine_kind(options: Any) -> str:
    if getattr(options, "pipeline_stages", 1) > 1:
        return "pipeline"
    if options.zero > 0:
        return "deepspeed"
    return "torch"


def _emit(callbacks: Sequence[Any], name: str, *args: Any) -> None:
    for cb in callbacks:
        fn = getattr(cb, name, None)
        if fn is not None:
            fn(*args)


def run_training(
    options: Any,
    model: Any,
    dataset: Any,
    output_dir: str | Path,
    *,
    loss_fn: Callable[[Any, dict[str, Any]], tuple[Any, dict[str, float]]] | None = None,
    tokenizer: Any = None,
    callbacks: Sequence[Any] = (),
    save_final: bool = True,
    extra_result: dict[str, Any] | None = None,
) -> TrainResult:
    """Train `model` on `dataset` with `options`; returns a TrainResult (see the module docstring)."""
    import torch

    output_dir = Path(output_dir)
    world = int(options.gpus) * int(options.nodes)
    ctx = setup_distributed(world)
    from clusteropt_cli.core.train.precision import check_precision_supported

    check_precision_supported(options.precision, ctx.device_type)  # fp8/bf16 support, before any work
    log = lambda message: _emit(callbacks, "on_log", message) if ctx.is_main else None  # noqa: E731
    kind = _engine_kind(options)
    if kind == "pipeline" and loss_fn is not None:
        raise BadInputError("Pipeline parallelism trains with the LM cross-entropy only; a custom loss "
                            "(distillation) cannot run pipelined.", hint="use --zero or --gpus (data parallel)")

    if ctx.is_main:
        from clusteropt_cli.core.io import write_output_marker

        fresh = not output_dir.exists() or not any(output_dir.iterdir())
        output_dir.mkdir(parents=True, exist_ok=True)
        if fresh:
            write_output_marker(output_dir, "train")
    barrier(ctx)
    resume_dir, resume_meta = _agreed_resume_point(options, output_dir, log, ctx) if options.resume else (None, None)

    torch.manual_seed(int(options.seed) + ctx.rank)
    model = prepare_model(options, model, ctx.device_type, for_deepspeed=(kind == "deepspeed"), log=log)
    if loss_fn is None and kind != "pipeline":
        loss_fn = default_loss_fn(options, model, kind)

    dp_world = 1 if kind == "pipeline" else ctx.world_size
    global_batch = int(options.micro_batch) * int(options.grad_accum) * dp_world
    total_steps = plan_total_steps(options, len(dataset), global_batch)
    engine, ds_config_path = _make_engine(options, model, loss_fn, ctx, kind, total_steps, output_dir)

    cursor = DataCursor(len(dataset), seed=int(options.seed))
    start_step = 0
    if resume_dir is not None:
        start_step = _load_checkpoint(engine, cursor, resume_dir, resume_meta, ctx, kind)
        log(f"resumed from {resume_dir.name} (step {start_step} of {total_steps})")

    writer = MetricsWriter(output_dir / METRICS_FILE, resume_step=start_step if resume_dir else None) \
        if ctx.is_main else None
    if ctx.is_main:
        _emit(callbacks, "on_start", total_steps, start_step)

    if ctx.device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    readout = _StepReadout(ctx, kind, engine, writer, callbacks, total_steps,
                           flops_per_token=training_flops_per_token(model.config, int(options.seq_len)),
                           peak_flops=peak_flops_per_device(options.precision, ctx.device_type))
    tokens_per_step = 0
    pending: tuple[int, StepValues, dict[str, Any], float] | None = None
    step = start_step
    try:
        for step in range(start_step + 1, total_steps + 1):
            t0 = time.perf_counter()
            indices = cursor.next_indices(global_batch)
            step_loss, step_metrics, tokens_per_step = _forward_backward(engine, model, dataset, indices, options,
                                                                         ctx, kind, dp_world, readout)
            info = {"lr": engine.lr, "tokens": tokens_per_step, "epoch": cursor.epoch}
            grad_norm = engine.optimizer_step()
            step_loss = all_reduce_mean(step_loss, ctx) if kind != "pipeline" else step_loss
            info["loss_scale"] = engine.loss_scale
            values = StepValues({"loss": step_loss, "grad_norm": grad_norm, **step_metrics})
            if pending is not None:  # the previous step: done once this one is queued behind it
                readout.finish(*pending)
                pending = None
            saving = bool(options.save_every and step % int(options.save_every) == 0 and step < total_steps)
            if values.deferred and not saving:
                pending = (step, values, info, t0)
            else:
                readout.finish(step, values, info, t0)
            if saving:
                _save_checkpoint(engine, output_dir, step, cursor, ctx, kind, options)
                log(f"checkpoint step-{step} saved")
        if pending is not None:
            readout.finish(*pending)
    finally:
        if writer is not None:
            writer.close()

    final_state = engine.final_state_dict() if save_final else None  # collective (ZeRO-3, pipeline)
    model_saved = False
    if save_final and ctx.is_main:
        _save_final_model(model, tokenizer, output_dir, final_state, options)
        model_saved = True
    barrier(ctx)

    result = readout.result(
        output_dir=str(output_dir), engine=engine.name, world_size=ctx.world_size, precision=options.precision,
        steps=step - start_step, start_step=start_step, total_steps=total_steps, tokens_per_step=tokens_per_step,
        metrics_path=str(output_dir / METRICS_FILE),
        deepspeed_config=str(ds_config_path) if ds_config_path else None,
        resumed_from=start_step if resume_dir else None, model_saved=model_saved, extra=dict(extra_result or {}),
    )
    if ctx.is_main:
        from clusteropt_cli.core.io import atomic_write_text

        atomic_write_text(output_dir / RESULT_FILE, json.dumps(_jsonable(result), indent=2))
        _emit(callbacks, "on_end", result)
    # every rank past the end (rank 0's result written), then the process group torn down: left to interpreter
    # exit, a ZeRO-3 rank's gloo threads sometimes aborted ("terminate called without an active exception") and the
    # launcher reported a finished run as failed
    barrier(ctx)
    teardown_distributed(ctx)
    return result


def _make_engine(options: Any, model: Any, loss_fn: Any, ctx: DistContext, kind: str, total_steps: int,
                 output_dir: Path) -> tuple[Any, Path | None]:
    """The engine for `kind` (DeepSpeed ZeRO, pipeline or plain torch/DDP) and the DeepSpeed config's path."""
    if kind == "deepspeed":
        from clusteropt_cli.core.train.deepspeed_config import deepspeed_config
        from clusteropt_cli.core.train.engines import DeepSpeedEngine

        ds_config_path = output_dir / DEEPSPEED_CONFIG_FILE
        return DeepSpeedEngine(options, model, loss_fn, ctx, total_steps, deepspeed_config(options, ctx.world_size),
                               ds_config_path), ds_config_path
    if kind == "pipeline":
        from clusteropt_cli.core.train.pipeline import PipelineEngine

        model.to(ctx.device)
        return PipelineEngine(options, model, ctx, total_steps), None
    from clusteropt_cli.core.train.engines import TorchEngine

    model.to(ctx.device)
    return TorchEngine(options, model, loss_fn, ctx, total_steps, getattr(options, "gradient_compression", "none")), \
        None


def _load_checkpoint(engine: Any, cursor: DataCursor, resume_dir: Path, meta: dict[str, Any], ctx: DistContext,
                     kind: str) -> int:
    """Restore the engine, the data cursor and this rank's RNG from a verified checkpoint; returns its step."""
    if meta.get("world_size") != ctx.world_size or meta.get("engine_kind") != kind:
        raise BadInputError(
            f"Checkpoint {resume_dir} was written by a {meta.get('engine_kind')} run on "
            f"{meta.get('world_size')} process(es); this run is {kind} on {ctx.world_size}.",
            hint="resume with the same --zero/--pipeline-stages/--gpus/--nodes, or start a new --output")
    engine.load(resume_dir)
    cursor.load_state_dict(meta["data"])
    rng_file = resume_dir / f"rng_rank{ctx.rank}.pt"
    if rng_file.exists():
        set_rng_state(load_torch_file(rng_file))
    return int(meta["step"])


def _forward_backward(engine: Any, model: Any, dataset: Any, indices: Sequence[int], options: Any,
                      ctx: DistContext, kind: str, dp_world: int, readout: _StepReadout) -> tuple[Any, dict, int]:
    """One step's forward and backward passes over this rank's micro-batches (a whole pipeline step for the
    pipeline engine); returns the step's mean loss and metrics (tensors, not read) and the tokens it trained on.
    On the CPU the first micro-batch's saved activations are measured (readout.cpu_activation_bytes)."""
    import torch

    step_loss = torch.zeros((), device=ctx.device, dtype=torch.float32)
    step_metrics: dict[str, Any] = {}
    if kind == "pipeline":
        batch = collate([dataset[i] for i in indices])
        return engine.train_step(batch), step_metrics, int(batch["input_ids"].numel())
    tokens = 0
    accum, micro_batch = int(options.grad_accum), int(options.micro_batch)
    for micro in range(accum):
        offset = (micro * dp_world + ctx.rank) * micro_batch
        batch = collate([dataset[i] for i in indices[offset : offset + micro_batch]])
        tokens += int(batch["input_ids"].numel()) * dp_world
        if ctx.device_type == "cpu" and readout.cpu_activation_bytes is None:
            meter = SavedTensorMeter()
            with meter.watch(model, checkpointed=bool(options.activation_checkpointing)):
                loss, metrics = engine.micro_step(batch, micro == accum - 1)
            readout.cpu_activation_bytes = meter.bytes
        else:
            loss, metrics = engine.micro_step(batch, micro == accum - 1)
        step_loss += loss.float() / accum
        for key, value in metrics.items():  # tensors stay on the device until the step is read
            step_metrics[key] = step_metrics.get(key, 0.0) + value / accum
    return step_loss, step_metrics, tokens


class _StepReadout:
    """Reads finished steps back (waiting for their kernels only), times them, tracks peak memory, writes the
    metrics rows (rank 0) and sums up the run."""

    def __init__(self, ctx: DistContext, kind: str, engine: Any, writer: MetricsWriter | None,
                 callbacks: Sequence[Any], total_steps: int, *, flops_per_token: float | None,
                 peak_flops: float | None):
        self.ctx, self.kind, self.engine, self.writer, self.callbacks = ctx, kind, engine, writer, callbacks
        self.total_steps, self.flops_per_token, self.peak_flops = total_steps, flops_per_token, peak_flops
        self.cpu_activation_bytes: int | None = None
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.tokens_done = 0
        self.peak: int | None = None
        self.reserved: int | None = None
        self.started = time.perf_counter()
        self.last_done = self.started  # when the previous step's values were read (its kernels had finished)

    def finish(self, step_no: int, values: StepValues, info: dict[str, Any], step_started: float) -> None:
        """Read a step's values (waiting for its kernels only), time it, write its metrics row."""
        import torch

        ctx = self.ctx
        scalars = values.read()
        now = time.perf_counter()
        # queued behind the previous step, this one started on the GPU when that one ended
        elapsed = now - max(step_started, self.last_done)
        self.last_done = now
        if ctx.device_type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(ctx.device))
            self.reserved = int(torch.cuda.max_memory_reserved(ctx.device))
        elif self.cpu_activation_bytes is not None or self.kind == "pipeline":
            self.peak = model_state_bytes(self.engine.model, self.engine.optimizer,
                                          full_gradients=self.kind != "deepspeed") + int(self.cpu_activation_bytes or 0)
        loss_value = scalars.pop("loss")
        grad_norm = scalars.pop("grad_norm")
        self.step_times.append(elapsed)
        self.losses.append(loss_value)
        self.tokens_done += info["tokens"]
        tps = info["tokens"] / elapsed if elapsed > 0 else None
        mfu = (tps * self.flops_per_token / (self.peak_flops * ctx.world_size)
               if tps and self.flops_per_token and self.peak_flops else None)
        row = {"step": step_no, "loss": loss_value, "lr": info["lr"], "tokens_per_s": tps, "mfu": mfu,
               "peak_mem_bytes": self.peak, "peak_reserved_bytes": self.reserved, "step_time_s": elapsed,
               "grad_norm": grad_norm, "tokens": info["tokens"], "epoch": info["epoch"],
               "total_steps": self.total_steps}
        if info["loss_scale"] is not None:
            row["loss_scale"] = info["loss_scale"]
        row.update(scalars)
        if self.writer is not None:
            self.writer.write(row)
            _emit(self.callbacks, "on_step", row)
        if not math.isfinite(loss_value):
            from clusteropt_cli.errors import CheckFailedError

            raise CheckFailedError(f"Training diverged: the loss of step {step_no} is {loss_value}; the weights it "
                                   "would save are not numbers.",
                                   hint="Lower --lr (or use bf16 instead of fp16); checkpoints saved before this step "
                                        "are kept, and --resume continues from the last one.")

    def result(self, *, tokens_per_step: int, **fields: Any) -> TrainResult:
        """The run's TrainResult: losses, throughput (mean over the steps after the first), MFU, peak memory."""
        timed = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        mean_tps = (tokens_per_step / (sum(timed) / len(timed))) if timed and tokens_per_step else None
        losses = self.losses
        return TrainResult(
            tokens=self.tokens_done, first_loss=losses[0] if losses else None,
            final_loss=losses[-1] if losses else None, losses=losses, tokens_per_s=mean_tps,
            mfu=(mean_tps * self.flops_per_token / (self.peak_flops * self.ctx.world_size)
                 if mean_tps and self.flops_per_token and self.peak_flops else None),
            peak_mem_bytes=self.peak, peak_reserved_bytes=self.reserved,
            step_time_s=(sum(timed) / len(timed)) if timed else None,
            elapsed_s=time.perf_counter() - self.started, **fields)


def _agreed_resume_point(options: Any, output_dir: Path, log: Callable[[str], None],
                         ctx: DistContext) -> tuple[Path | None, Any]:
    """Rank 0 verifies the checkpoints (reading them once, not once per rank) and tells every rank its choice, or
    the error every rank then raises."""
    if ctx.world_size == 1:
        return resume_point(output_dir, log)
    import torch.distributed as dist

    box: list[Any] = [None]
    if ctx.is_main:
        try:
            path, meta = resume_point(output_dir, log)
            box[0] = ("ok", str(path) if path is not None else None, meta)
        except BadInputError as exc:
            box[0] = ("error", exc.message, exc.hint)
    dist.broadcast_object_list(box, src=0)
    status, first, second = box[0]
    if status == "error":
        raise BadInputError(first, hint=second)
    return (Path(first) if first is not None else None), second


def resume_point(output_dir: Path, log: Callable[[str], None] = lambda _m: None, *,
                 hashes: bool = True) -> tuple[Path | None, Any]:
    """The newest checkpoint that verifies (saying which newer ones were skipped and why), or (None, None) for a
    fresh start when the output holds neither checkpoints nor metrics. Refuses (exit 2) rather than restart from
    step 0 over an existing history. `hashes=False`: sizes only (a launching parent's quick check)."""
    import sys

    output_dir = Path(output_dir)
    chosen = select_checkpoint(output_dir, hashes)  # raises when checkpoints exist and none verifies
    if chosen is not None:
        if int(os.environ.get("RANK", "0")) == 0 and hashes:
            for problem in chosen.skipped:
                print(f"warning: --resume: skipping a damaged checkpoint: {problem}; falling back to "
                      f"{chosen.path.name}", file=sys.stderr)
        return chosen.path, chosen.meta
    metrics = output_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        raise BadInputError(f"--resume: {output_dir} has a training history ({metrics}) but no checkpoint under "
                            f"{output_dir / 'checkpoints'}; starting from step 0 would rewrite it.",
                            hint="Restore the checkpoints, or start over without --resume (with --overwrite, or a "
                                 "new --output).")
    log(f"--resume: no checkpoint under {output_dir}/checkpoints, starting from step 0")
    return None, None


def _jsonable(result: TrainResult) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(result)


def _save_checkpoint(engine: Any, output_dir: Path, step: int, cursor: DataCursor, ctx: DistContext,
                     kind: str, options: Any = None) -> None:
    """Every rank writes into the staging directory; after a barrier rank 0 commits it atomically."""
    staging = staging_dir(output_dir, step)
    if ctx.is_main:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier(ctx)
    from clusteropt_cli.core.io import disk_full_as_error

    def checkpoint_bytes() -> int:  # parameters + optimizer states, about what a checkpoint holds
        return model_state_bytes(engine.model, engine.optimizer) - sum(
            p.numel() * p.element_size() for p in engine.model.parameters() if p.grad is not None)

    # a full disk: no partial checkpoint is left behind
    with disk_full_as_error(staging, cleanup=staging, needed_bytes=checkpoint_bytes):
        engine.save(staging)
        save_torch_file(rng_state(), staging / f"rng_rank{ctx.rank}.pt")
    barrier(ctx)
    if ctx.is_main:
        commit_checkpoint(output_dir, step, {"step": step, "data": cursor.state_dict(), "world_size": ctx.world_size,
                                             "engine_kind": kind, "engine": engine.name, "time": time.time()},
                          keep=int(getattr(options, "keep_checkpoints", DEFAULT_KEEP) or DEFAULT_KEEP))
    barrier(ctx)


def _save_final_model(model: Any, tokenizer: Any, output_dir: Path, state_dict: dict[str, Any] | None,
                      options: Any) -> None:
    """save_pretrained (safetensors) + tokenizer into a staging directory, then move the files into output_dir."""

    from clusteropt_cli.core.io import TMP_OWNER, disk_full_as_error, make_temp_dir, open_permissions

    staging = make_temp_dir(output_dir, ".final-")  # (removes the staging directories of killed runs)
    try:
        with disk_full_as_error(output_dir, cleanup=staging):  # no partial model on a full disk
            if options.activation_checkpointing and hasattr(model, "gradient_checkpointing_disable"):
                model.gradient_checkpointing_disable()
            model.config.use_cache = True
            if state_dict is None:
                state_dict = {k: v for k, v in model.state_dict().items()}
            state_dict = {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}
            if options.precision == "fp8":  # torchao Float8Linear keeps plain weights: save them as a normal model
                state_dict = {k: (v.to_original_precision() if hasattr(v, "to_original_precision") else v)
                              for k, v in state_dict.items()}
            weight_dtypes = {str(v.dtype).removeprefix("torch.") for v in state_dict.values()
                             if hasattr(v, "is_floating_point") and v.is_floating_point()}
            model.save_pretrained(staging, state_dict=state_dict, safe_serialization=True)  # (empties state_dict)
            if len(weight_dtypes) == 1:
                _set_config_dtype(staging / "config.json", weight_dtypes.pop())
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            open_permissions(staging)
            for item in staging.iterdir():
                if item.name != TMP_OWNER:
                    os.replace(item, output_dir / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    """save_pretrained writes the model's dtype into config.json; under DeepSpeed's bf16/fp16 mode the model holds
    16-bit copies while the saved weights are the fp32 masters, and from_pretrained loads in config's dtype."""
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    if config.get("dtype", dtype) != dtype:
        config["dtype"] = dtype
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
