"""copt distill: logits (KL/JSD against a teacher), traces (teacher's <think> traces), sft (train on traces)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from clusteropt_cli.options import (
    CheckpointingOpt,
    EpochsOpt,
    GpusOpt,
    GradAccumOpt,
    JsonOpt,
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

app = typer.Typer(help="Distill a teacher into a student: logits, traces, sft, onpolicy.", no_args_is_help=True)

TeacherOpt = Annotated[str | None, typer.Option("--teacher", help="Teacher model directory (HF format).")]
StudentOpt = Annotated[str | None, typer.Option(
    "--student", help="Student: model directory, config.json or preset (random init); must share the tokenizer.")]
OutputDirOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Where the trained student is saved (HF).")]
# recipe keys whose flag is not --key-with-dashes (recipe.load.flag_names); the subcommand sets `mode`
_MODE_FLAG: dict[str, str | None] = {"mode": None}
TeacherDtypeOpt = Annotated[str | None, typer.Option(
    "--teacher-dtype", help="Teacher weights: auto (bf16/fp16 on GPU, fp32 on CPU), bf16, fp16, fp32.")]


def _training_values(precision, activation_checkpointing, micro_batch, grad_accum, seq_len, steps, epochs, lr,
                     zero, offload, gpus, save_every, resume, seed) -> dict[str, Any]:
    return {"precision": precision, "activation_checkpointing": activation_checkpointing,
            "micro_batch": micro_batch, "grad_accum": grad_accum, "seq_len": seq_len, "max_steps": steps,
            "epochs": epochs, "lr": lr, "zero": zero, "offload": offload, "gpus": gpus, "save_every": save_every,
            "resume": resume or None, "seed": seed}


def _require_output(settings: Any, flag: str = "--output") -> Path:
    from clusteropt_cli.errors import BadInputError

    if not settings.output:
        raise BadInputError(f"{flag} is required.", hint=f"Pass {flag} PATH (or set output: in the recipe).")
    return Path(settings.output)


def _progress_callbacks(description: str):
    """A TrainCallback that drives a rich progress bar on stderr; used as a context manager."""
    from contextlib import contextmanager

    from clusteropt_cli import console
    from clusteropt_cli.core.train import TrainCallback

    @contextmanager
    def managed():
        state: dict[str, Any] = {}

        class Progress(TrainCallback):
            def on_start(self, total_steps: int, start_step: int) -> None:
                state["cm"] = console.progress_bar(description, total_steps)
                state["advance"] = state["cm"].__enter__()
                if start_step:
                    state["advance"](start_step, "resumed")

            def on_step(self, row: dict[str, Any]) -> None:
                info = f"loss {row['loss']:.4f}"
                if row.get("kd_loss") is not None:
                    info += f"  kd {row['kd_loss']:.4f}"
                if row.get("tokens_per_s"):
                    info += f"  {row['tokens_per_s']:.0f} tok/s"
                state["advance"](1, info)

            def on_log(self, message: str) -> None:
                console.log(message)

        try:
            yield (Progress(),)
        finally:
            if "cm" in state:
                state["cm"].__exit__(None, None, None)

    return managed()


def _library_output_to_stderr():
    """Keep stdout for the result: libraries print there (deepspeed's import banner, via accelerate in
    save_pretrained), which would break --json."""
    import contextlib
    import sys

    return contextlib.redirect_stdout(sys.stderr)


def _run_maybe_launched(settings: Any, subcommand: str, overwrite: bool, run_here: Any) -> Any:
    """Run in this process, or (--gpus/--nodes > 1) relaunch copt under copt train's launcher (torchrun or
    deepspeed) with the same arguments; every rank runs `run_here`, the parent reads distill_result.json.
    None in a rank under a launcher (the parent renders)."""
    from clusteropt_cli import console
    from clusteropt_cli.core.distill.logits import RESULT_FILE
    from clusteropt_cli.core.train.launch import (
        child_args,
        is_launched_child,
        plan_launch,
        refuse_outside_launcher,
        run_or_launch,
    )

    if is_launched_child():
        run_here()
        return None
    refuse_outside_launcher(f"distill {subcommand}")
    argv = child_args(settings, ["distill", subcommand], exclude={"task", "prediction", "mode"})
    return run_or_launch(plan_launch(settings, argv), run_here, output=settings.output, overwrite=overwrite,
                         resume=bool(settings.resume), command=f"distill {subcommand}", result_file=RESULT_FILE,
                         what="distillation", log=console.log)


def _is_rank() -> bool:
    from clusteropt_cli.core.train.launch import is_launched_child

    return is_launched_child()


class _Obj:
    """Attribute access over a result dict (a dataclass here, or distill_result.json from a launched run)."""

    def __init__(self, data: dict[str, Any]):
        self.__dict__.update(data)


def _fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@app.command("logits")
def logits(
    teacher: TeacherOpt = None,
    student: StudentOpt = None,
    data: Annotated[str | None, typer.Option("--data", help="Training text: .txt, or .jsonl with a text field.")]
    = None,
    output: OutputDirOpt = None,
    loss: Annotated[str | None, typer.Option("--loss", help="forward-kl | reverse-kl | jsd (default forward-kl).")]
    = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="Soft-label temperature T for both models; the loss is scaled by T² (default 2).")]
    = None,
    alpha: Annotated[float | None, typer.Option(
        "--alpha", help="Weight of the distillation loss; 1-alpha goes to cross-entropy on the data (default 0.5).")]
    = None,
    top_k: Annotated[int | None, typer.Option(
        "--top-k", help="Distill against the teacher's top-k tokens (+ one bucket for the rest) to save memory.")]
    = None,
    teacher_dtype: TeacherDtypeOpt = None,
    eval_data: Annotated[str | None, typer.Option(
        "--eval-data", help="Held-out text: report the student's KL to the teacher before and after.")] = None,
    precision: PrecisionOpt = None,
    activation_checkpointing: CheckpointingOpt = None,
    micro_batch: MicroBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    seq_len: SeqLenOpt = None,
    steps: MaxStepsOpt = None,
    epochs: EpochsOpt = None,
    lr: LrOpt = None,
    zero: ZeroOpt = None,
    offload: OffloadOpt = None,
    gpus: GpusOpt = None,
    save_every: SaveEveryOpt = None,
    resume: ResumeOpt = False,
    seed: SeedOpt = None,
    recipe: RecipeOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """Train a student to match the teacher's next-token distributions (KL/JSD soft labels + CE)."""
    from clusteropt_cli import console
    from clusteropt_cli.core.distill.logits import (
        check_logits_inputs,
        distill_logits,
        logits_inputs,
        prepare_output_dir,
    )
    from clusteropt_cli.recipe.load import load_settings

    values = {"mode": "logits", "teacher": teacher, "student": student, "data": data,
              "output": str(output) if output else None, "loss": loss, "temperature": temperature, "alpha": alpha,
              "top_k": top_k, "teacher_dtype": teacher_dtype, "eval_data": eval_data,
              **_training_values(precision, activation_checkpointing, micro_batch, grad_accum, seq_len, steps, epochs,
                                 lr, zero, offload, gpus, save_every, resume, seed)}
    settings = load_settings("distill", recipe, overrides, values, flags=_MODE_FLAG)
    out_dir = _require_output(settings)
    if not _is_rank():
        prepare_output_dir(out_dir, overwrite=overwrite, resume=settings.resume,
                           inputs=logits_inputs(settings, recipe))
    if settings.gpus * settings.nodes > 1 and not _is_rank():  # a single process checks in distill_logits
        check_logits_inputs(settings)  # every input problem before any rank starts

    def run_here() -> Any:
        with _library_output_to_stderr(), _progress_callbacks(f"distill {settings.loss}") as callbacks:
            return distill_logits(settings, output_dir=out_dir, overwrite=overwrite, callbacks=callbacks)

    result = _run_maybe_launched(settings, "logits", overwrite, run_here)
    if result is None:  # a rank under a launcher: the parent renders
        return
    if json_out:
        console.print_json(result, "copt.distill/1")
        return
    result = _Obj(console.to_jsonable(result))
    train = result.train
    rows = [("output", result.output), ("teacher", result.teacher), ("student", result.student),
            ("loss", f"{result.loss} (T={result.temperature:g}, alpha={result.alpha:g}"
                     + (f", top-k {result.top_k})" if result.top_k else ")")),
            ("steps", result.steps), ("loss first → final", f"{_fmt(train.get('first_loss'))} → "
                                                            f"{_fmt(train.get('final_loss'))}"),
            ("tokens/s", _fmt(train.get("tokens_per_s"), 0)),
            ("peak memory", console.human_bytes(train.get("peak_mem_bytes")))]
    if result.eval_kl_before is not None:
        rows.append(("held-out KL(teacher‖student)", f"{_fmt(result.eval_kl_before)} → {_fmt(result.eval_kl_after)}"))
    console.out.print(console.kv_table("copt distill logits", rows))


@app.command("traces")
def traces(
    teacher: TeacherOpt = None,
    prompts: Annotated[str | None, typer.Option(
        "--prompts", help='Prompts .jsonl: {"prompt": ..., "answer": optional, "id"/"match": optional}.')] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Traces .jsonl (appended; resumable).")]
    = None,
    samples: Annotated[int | None, typer.Option("--samples", "-k", help="Samples per prompt (default 4).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", help="Longest trace (default 512).")]
    = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="Sampling temperature (default 0.7; 0 = greedy).")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling mass (default 1).")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Keep only samples whose final answer matches the prompt's answer (rejection sampling).")]
    = False,
    match: Annotated[str | None, typer.Option(
        "--match", help="exact | numeric | regex | math (Math-Verify: LaTeX fractions, radicals, intervals, "
                  "percentages) for prompts without 'match' (default: numeric for numbers).")]
    = None,
    think: Annotated[bool | None, typer.Option(
        "--think/--no-think", help="Reasoning first (default: the chat template's own switch, else '<think>\\n' "
                                   "when the vocabulary has it, else nothing forced).")] = None,
    batch: Annotated[int | None, typer.Option("--batch", help="Prompts handed to the engine at once.")] = None,
    teacher_dtype: TeacherDtypeOpt = None,
    seed: SeedOpt = None,
    recipe: RecipeOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start the traces file over.")] = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """Have the teacher write <think>…</think> traces for prompts (resumable; --verify filters by answer)."""
    from clusteropt_cli import console
    from clusteropt_cli.core.distill.generate import distill_traces
    from clusteropt_cli.recipe.load import load_settings

    values = {"mode": "traces", "teacher": teacher, "prompts": prompts, "output": str(output) if output else None,
              "samples": samples, "max_new_tokens": max_new_tokens, "sample_temperature": temperature,
              "top_p": top_p, "verify": verify or None, "match": match, "think": think,
              "gen_batch": batch, "teacher_dtype": teacher_dtype, "seed": seed}
    settings = load_settings("distill", recipe, overrides, values,
                             flags={**_MODE_FLAG, "sample_temperature": "--temperature", "gen_batch": "--batch"})
    out = _require_output(settings)
    from clusteropt_cli.core.io import check_output

    # an existing traces file is resumed (or replaced with --overwrite); never one of the inputs
    check_output(out, {"--teacher": settings.teacher, "--prompts": settings.prompts, "--recipe": recipe},
                 overwrite=True, kind="file")
    with _library_output_to_stderr(), console.progress_bar("traces (prompts)", None) as advance:
        def on_batch(done: int, total: int) -> None:
            advance(0, f"{done}/{total} prompts")

        stats = distill_traces(settings, output=out, overwrite=overwrite, on_batch=on_batch)
    if json_out:
        console.print_json(stats, "copt.distill/1")
        return
    rows = [("output", stats.output), ("prompts", f"{stats.prompts} ({stats.prompts_done_before} done before, "
                                                  f"{stats.prompts_generated} generated now)"),
            ("thinking", stats.thinking),
            ("kept / total", f"{stats.samples_kept} / {stats.samples_total} ({stats.kept_fraction:.1%})"),
            ("verified correct", stats.verified_correct),
            ("mean length (tokens)", f"{stats.mean_tokens_kept:.1f} kept, {stats.mean_tokens_all:.1f} all"),
            ("output tokens/s", f"{stats.output_tokens_per_s:.0f}")]
    console.out.print(console.kv_table("copt distill traces", rows))


@app.command("sft")
def sft(
    student: StudentOpt = None,
    traces_file: Annotated[str | None, typer.Option("--traces", help="Traces .jsonl from copt distill traces.")]
    = None,
    output: OutputDirOpt = None,
    eval_traces: Annotated[str | None, typer.Option(
        "--eval-traces", help="Held-out traces: report the completion loss before and after.")] = None,
    precision: PrecisionOpt = None,
    activation_checkpointing: CheckpointingOpt = None,
    micro_batch: MicroBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    seq_len: SeqLenOpt = None,
    steps: MaxStepsOpt = None,
    epochs: EpochsOpt = None,
    lr: LrOpt = None,
    zero: ZeroOpt = None,
    offload: OffloadOpt = None,
    gpus: GpusOpt = None,
    save_every: SaveEveryOpt = None,
    resume: ResumeOpt = False,
    seed: SeedOpt = None,
    recipe: RecipeOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """Fine-tune the student on the kept traces (chat template; loss only on the completion tokens)."""
    from clusteropt_cli import console
    from clusteropt_cli.core.distill.logits import prepare_output_dir
    from clusteropt_cli.core.distill.sft import distill_sft, sft_inputs
    from clusteropt_cli.recipe.load import load_settings

    values = {"mode": "sft", "student": student, "traces": traces_file, "eval_traces": eval_traces,
              "output": str(output) if output else None,
              **_training_values(precision, activation_checkpointing, micro_batch, grad_accum, seq_len, steps, epochs,
                                 lr, zero, offload, gpus, save_every, resume, seed)}
    settings = load_settings("distill", recipe, overrides, values, flags=_MODE_FLAG)
    out_dir = _require_output(settings)
    if not _is_rank():
        if settings.gpus > 1:  # the ranks' students, counted together before any rank starts
            from clusteropt_cli.core.distill.logits import check_distill_host_memory, resolve_student

            check_distill_host_memory(settings, resolve_student(settings.student))
        prepare_output_dir(out_dir, overwrite=overwrite, resume=settings.resume, inputs=sft_inputs(settings, recipe))

    def run_here() -> Any:
        with _library_output_to_stderr(), _progress_callbacks("distill sft") as callbacks:
            return distill_sft(settings, output_dir=out_dir, overwrite=overwrite, callbacks=callbacks)

    result = _run_maybe_launched(settings, "sft", overwrite, run_here)
    if result is None:
        return
    if json_out:
        console.print_json(result, "copt.distill/1")
        return
    result = _Obj(console.to_jsonable(result))
    train = result.train
    rows = [("output", result.output), ("student", result.student), ("traces", result.traces),
            ("examples", f"{result.examples} ({result.dropped} dropped: prompt longer than --seq-len)"),
            ("completion tokens", result.completion_tokens), ("steps", result.steps),
            ("loss first → final", f"{_fmt(train.get('first_loss'))} → {_fmt(train.get('final_loss'))}"),
            ("tokens/s", _fmt(train.get("tokens_per_s"), 0))]
    if result.eval_loss_before is not None:
        rows.append(("held-out completion loss", f"{_fmt(result.eval_loss_before)} → {_fmt(result.eval_loss_after)}"))
    console.out.print(console.kv_table("copt distill sft", rows))


@app.command("onpolicy")
def onpolicy(
    teacher: TeacherOpt = None,
    student: Annotated[str | None, typer.Option("--student", help="Student model directory (HF format).")] = None,
    prompts: Annotated[str | None, typer.Option(
        "--prompts", help='Prompts the student continues: .jsonl ({"prompt": ...}) or .txt (one a line).')] = None,
    output: OutputDirOpt = None,
    beta: Annotated[float | None, typer.Option(
        "--beta", help="0 forward KL(teacher‖student), 1 reverse KL (default), 0.5 JSD.")] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", help="Sampling and loss temperature (default 1).")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", help="Tokens the student samples per prompt and step (default 128).")] = None,
    eval_data: Annotated[str | None, typer.Option(
        "--eval-data", help="Held-out text: KL(teacher‖student) before and after.")] = None,
    eval_prompts: Annotated[str | None, typer.Option(
        "--eval-prompts", help="Held-out prompts: KL(teacher‖student) on the student's own samples, before/after.")]
    = None,
    precision: PrecisionOpt = None,
    activation_checkpointing: CheckpointingOpt = None,
    micro_batch: MicroBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    seq_len: SeqLenOpt = None,
    steps: MaxStepsOpt = None,
    lr: LrOpt = None,
    seed: SeedOpt = None,
    recipe: RecipeOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """On-policy distillation (GKD) with TRL's DistillationTrainer: the student samples, the teacher scores."""
    from clusteropt_cli import console
    from clusteropt_cli.core.distill.onpolicy import distill_onpolicy, read_prompt_texts
    from clusteropt_cli.recipe.load import load_settings

    values = {"mode": "onpolicy", "teacher": teacher, "student": student, "prompts": prompts,
              "output": str(output) if output else None, "beta": beta, "temperature": temperature,
              "max_new_tokens": max_new_tokens, "eval_data": eval_data, "precision": precision,
              "activation_checkpointing": activation_checkpointing, "micro_batch": micro_batch,
              "grad_accum": grad_accum, "seq_len": seq_len, "max_steps": steps, "lr": lr, "seed": seed}
    settings = load_settings("distill", recipe, overrides, values, flags=_MODE_FLAG)
    out_dir = _require_output(settings)
    held_out = read_prompt_texts(eval_prompts, "--eval-prompts") if eval_prompts else None
    with _library_output_to_stderr():
        result = distill_onpolicy(settings, output_dir=out_dir, overwrite=overwrite, eval_text=settings.eval_data,
                                  eval_prompts=held_out, log=console.log)
    if json_out:
        console.print_json(result, "copt.distill/1")
        return
    rows = [("output", result.output), ("teacher", result.teacher), ("student", result.student),
            ("trainer", f"TRL {result.trl_version} DistillationTrainer (beta {result.beta:g}, "
                        f"T={result.temperature:g})"),
            ("steps", f"{result.steps} × {result.batch} prompts, ≤ {result.max_new_tokens} sampled tokens each"),
            ("loss first → final", f"{_fmt(result.first_loss)} → {_fmt(result.final_loss)}"),
            ("time", f"{result.elapsed_s:.1f} s")]
    if result.eval_kl_before is not None:
        rows.append(("held-out KL(teacher‖student)", f"{_fmt(result.eval_kl_before)} → {_fmt(result.eval_kl_after)}"))
    if result.on_policy_kl_before is not None:
        rows.append(("KL on the student's samples", f"{_fmt(result.on_policy_kl_before)} → "
                                                    f"{_fmt(result.on_policy_kl_after)}"))
    console.out.print(console.kv_table("copt distill onpolicy", rows))
