"""`copt distill logits`: train a student to match a frozen teacher's next-token distributions.

The training itself (precision, checkpointing, ZeRO, micro-batches, save/resume, metrics.jsonl, the final HF save)
is copt train's loop (clusteropt_cli.core.train); this module supplies the models, the data and a `loss_fn` that
runs the teacher (eval mode, no gradients, optionally in lower precision) and mixes the divergence with CE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.core.distill.losses import DistillLossConfig, distillation_loss, per_token_divergence
from clusteropt_cli.core.distill.vocab import VocabCheck, check_vocab_compatible, load_tokenizer, read_config
from clusteropt_cli.core.models import load_causal_lm, pick_device
from clusteropt_cli.core.train.attention import check_unpadded
from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.distill import DistillRecipe


RESULT_FILE = "distill_result.json"


def is_main_process() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


def write_result(output_dir: Path, result: Any) -> None:
    """distill_result.json next to the model (rank 0): what the parent of a multi-process run renders."""
    import dataclasses

    from clusteropt_cli.core.io import atomic_write_text

    if is_main_process():
        atomic_write_text(Path(output_dir) / RESULT_FILE, json.dumps(dataclasses.asdict(result), indent=2))


def resolve_student(student: str) -> Any:
    """copt train's model resolution (directory with weights, config.json or preset), errors naming --student."""
    from clusteropt_cli.core.train.model import resolve_model_source

    try:
        return resolve_model_source(student)
    except BadInputError as exc:
        raise BadInputError(exc.message.replace("--model", "--student"), exc.hint) from None


def build_student(source: Any, seed: int = 0) -> Any:
    """copt train's model loading: fp32 master weights, from_pretrained or seeded random init from the config."""
    from clusteropt_cli.core.train.model import load_model

    return load_model(source, seed)


def prepare_output_dir(output_dir: Path, *, overwrite: bool, resume: bool, inputs: dict | None = None) -> None:
    """copt's output rule (core/io.check_output): never over an input; an existing directory only with --resume, or
    with --overwrite when copt wrote it. Deletes nothing (the replacement happens in `replacing_output_dir`)."""
    from clusteropt_cli.core.io import check_output

    check_output(output_dir, inputs, overwrite=overwrite, resume=resume, can_resume=True)


def logits_inputs(settings: DistillRecipe, recipe: str | None = None) -> dict[str, Any]:
    """The input paths of `copt distill logits` (what --output must stay clear of)."""
    return {"--teacher": settings.teacher, "--student": settings.student, "--data": settings.data,
            "--eval-data": settings.eval_data, "--recipe": recipe}


CHUNK_ABOVE_ELEMENTS = 2**26  # logits of more than 64M elements (256 MiB in fp32) per micro-batch: go chunked


def supports_chunked_loss(model: Any) -> bool:
    """A decoder plus a plain linear head (no softcapping/scaling): what the chunked loss needs."""
    from clusteropt_cli.core.train.losses import supports_fused_loss

    return supports_fused_loss(model)


def make_distill_loss_fn(teacher: Any, config: DistillLossConfig, shared_logits: int | None = None, *,
                         chunk_tokens: int | None = None, zero_stage: int = 0):
    """A `loss_fn(model, batch) -> (loss, metrics)` for copt train's loop: the teacher's forward runs here, under
    torch.no_grad, in eval mode, on the batch's device; logits are cut to the ids both vocabularies share.

    chunk_tokens: None = automatic (chunked when a micro-batch's logits exceed 64M elements and both models allow
    it, never under ZeRO-3 whose partitioned head is only gathered inside its own forward); 0 = never; N = chunks
    of N positions (see `chunked_distillation_loss`).
    """
    teacher.eval()
    teacher.requires_grad_(False)

    def use_chunks(model: Any, batch_tokens: int) -> int:
        if chunk_tokens == 0 or zero_stage == 3:
            return 0
        if not (supports_chunked_loss(model) and supports_chunked_loss(teacher)):
            return 0
        vocab = int(model.get_output_embeddings().weight.shape[0])
        if chunk_tokens is None:
            if batch_tokens * vocab <= CHUNK_ABOVE_ELEMENTS:
                return 0
            return max(128, (2**28) // (4 * vocab))  # ~256 MiB of fp32 logits per chunk
        return int(chunk_tokens)

    def distill_loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        import torch

        input_ids = batch["input_ids"]
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
        check_unpadded(model, batch)
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        if config.alpha > 0 and next(teacher.parameters()).device != input_ids.device:
            teacher.to(input_ids.device)
        chunk = use_chunks(model, int(input_ids.numel()))
        if chunk:
            from clusteropt_cli.core.distill.losses import chunked_distillation_loss

            hidden = model.get_decoder()(**kwargs).last_hidden_state
            teacher_hidden = None
            if config.alpha > 0:
                with torch.no_grad():
                    teacher_hidden = teacher.get_decoder()(**kwargs).last_hidden_state[:, :-1]
                    teacher_hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
            hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            labels = batch["labels"][:, 1:].reshape(-1)
            return chunked_distillation_loss(hidden, model.get_output_embeddings(), teacher_hidden,
                                             teacher.get_output_embeddings(), labels, config, chunk_tokens=chunk,
                                             shared_logits=shared_logits)
        teacher_logits = None
        if config.alpha > 0:
            with torch.no_grad():
                teacher_logits = teacher(**kwargs).logits
            if shared_logits is not None:
                teacher_logits = teacher_logits[..., :shared_logits]
        student_logits = model(**kwargs).logits
        if shared_logits is not None:
            student_logits = student_logits[..., :shared_logits]
        values = indices = None
        if config.top_k is not None and teacher_logits is not None:
            from clusteropt_cli.core.distill.losses import teacher_topk

            values, indices = teacher_topk(teacher_logits, config.top_k, config.temperature)
            teacher_logits = None  # only k values per position are kept from here on
        return distillation_loss(student_logits, teacher_logits, batch["labels"], config,
                                 teacher_topk_values=values, teacher_topk_indices=indices)

    return distill_loss_fn


def mean_kl_to_teacher(student: Any, teacher: Any, blocks: Any, *, batch: int = 16, temperature: float = 1.0,
                       shared_logits: int | None = None, loss: str = "forward-kl", top_k: int | None = None) -> float:
    """Mean per-token divergence of the student from the teacher over [n, seq_len] token blocks (all positions).

    Default: KL(teacher ‖ student) at T=1, the figure `distill logits --eval-data` reports; `loss`, `temperature`
    and `top_k` select any of the training divergences instead (without the T² factor).
    """
    import torch

    student.eval()
    teacher.eval()
    device = next(student.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch):
            x = blocks[start : start + batch].to(device)
            s = student(input_ids=x).logits
            t = teacher(input_ids=x.to(next(teacher.parameters()).device)).logits.to(device)
            if shared_logits is not None:
                s, t = s[..., :shared_logits], t[..., :shared_logits]
            div = per_token_divergence(s, t, loss=loss, temperature=temperature, top_k=top_k)
            total += float(div.sum())
            count += div.numel()
    return total / max(count, 1)


@dataclass
class LogitsResult:
    """What `distill logits` reports."""

    output: str
    teacher: str
    student: str
    loss: str
    temperature: float
    alpha: float
    top_k: int | None
    steps: int
    train: dict[str, Any] = field(default_factory=dict)  # copt train's result (tokens/s, peak memory, ...)
    eval_kl_before: float | None = None
    eval_kl_after: float | None = None


def check_logits_inputs(settings: DistillRecipe) -> tuple[Any, VocabCheck]:
    """Every up-front check of `distill logits`: paths, --data and --eval-data, the student, the shared vocabulary,
    the host memory the models are built in."""
    from clusteropt_cli.modelspec import refuse_config_file

    refuse_config_file(settings.teacher, "--teacher")
    if not settings.teacher or not Path(settings.teacher).is_dir():
        raise BadInputError(f"--teacher {settings.teacher} is not a model directory.",
                            hint="Pass the teacher's local Hugging Face directory (config.json, weights, tokenizer).")
    from clusteropt_cli.core.train.data import check_text_input

    if not settings.data:
        raise BadInputError("--data is required.", hint="Pass a .txt or .jsonl (text) file to distill on.")
    check_text_input(settings.data, "--data")
    if settings.eval_data:  # held out: read now, so an empty one fails before the models load, as --data would
        check_text_input(settings.eval_data, "--eval-data", read=True)
    from clusteropt_cli.modelspec import check_loadable_model

    check_loadable_model(Path(settings.teacher), read_config(Path(settings.teacher)), "--teacher", tokenizer=True)
    student = resolve_student(settings.student or "")
    from clusteropt_cli.core.train.validate import check_hardware

    check_hardware(settings, "cuda" if pick_device().startswith("cuda") else "cpu")  # precision/attn vs this machine
    student_dir = student.path if student.path is not None and student.path.is_dir() else None
    vocab = check_vocab_compatible(Path(settings.teacher), student_dir or Path(settings.student or ""),
                                   student_config=student.config)
    check_distill_host_memory(settings, student, Path(settings.teacher))
    return student, vocab


def check_distill_host_memory(settings: DistillRecipe, student: Any, teacher: Path | None = None) -> None:
    """The student is built in fp32 on the host (copt train's loading); on a CPU-only machine the teacher is held
    there beside it. Refused (exit 5) before either is loaded when their weights exceed the available memory; with
    --gpus N the launching parent counts its N ranks' students (the ranks do not check again)."""
    from clusteropt_cli.core.models import check_host_memory, torch_dtype
    from clusteropt_cli.core.train.launch import is_launched_child

    if is_launched_child():
        return
    models = [(f"--student {settings.student}", student.config, 4)]
    cpu = pick_device() == "cpu"
    if teacher is not None and cpu:
        dtype = torch_dtype(settings.teacher_dtype, "cpu", settings.precision)
        models.insert(0, (f"--teacher {teacher}", read_config(teacher), dtype.itemsize))
    hint = ("Load the teacher in bf16 (--teacher-dtype bf16), run on a GPU, or use smaller models." if len(models) > 1
            else "Use a smaller student, or a machine with more host memory.")
    check_host_memory(models, hint=hint, copies=max(1, int(settings.gpus)))


def distill_logits(settings: DistillRecipe, *, output_dir: Path, overwrite: bool = False,
                   eval_text: str | Path | None = None, callbacks: tuple = ()) -> LogitsResult:
    """Run logit distillation with copt train's loop; the distilled student lands in HF format in output_dir."""
    from clusteropt_cli.core.train import build_text_dataset, run_training

    student_source, vocab = check_logits_inputs(settings)
    eval_text = eval_text or settings.eval_data
    if eval_text is not None and eval_text != settings.eval_data:
        from clusteropt_cli.core.train.data import check_text_input

        check_text_input(eval_text, "--eval-data", read=True)
    from clusteropt_cli.core.io import replacing_output_dir
    from clusteropt_cli.core.train.launch import is_launched_child

    launched = is_launched_child()  # under a launcher the parent prepared the output
    if not launched:
        prepare_output_dir(output_dir, overwrite=overwrite, resume=settings.resume, inputs=logits_inputs(settings))
    with replacing_output_dir(output_dir, overwrite=overwrite, resume=settings.resume, command="distill logits",
                              enabled=not launched):
        tokenizer = load_tokenizer(Path(settings.teacher))
        dataset = build_text_dataset(settings.data, tokenizer, settings.seq_len)
        device = pick_device()
        teacher = load_causal_lm(settings.teacher, settings.teacher_dtype, device, settings.precision)
        student = build_student(student_source, settings.seed)
        config = DistillLossConfig(settings.loss, settings.temperature, settings.alpha, settings.top_k)
        shared = vocab.shared_logits if vocab.teacher_vocab_size != vocab.student_vocab_size else None
        result = LogitsResult(str(output_dir), str(settings.teacher), str(settings.student), settings.loss,
                              settings.temperature, settings.alpha, settings.top_k, 0)
        eval_blocks = None
        if eval_text is not None:
            eval_blocks = build_text_dataset(eval_text, tokenizer, settings.seq_len,
                                             flag="--eval-data").blocks[:EVAL_BLOCKS]
            result.eval_kl_before = mean_kl_to_teacher(student.to(device), teacher, eval_blocks, shared_logits=shared)
            student.to("cpu")
        loss_fn = make_distill_loss_fn(teacher, config, shared, zero_stage=settings.zero)
        train = run_training(settings, student, dataset, output_dir, loss_fn=loss_fn,
                             tokenizer=tokenizer, callbacks=callbacks,
                             extra_result={"distill": {"loss": settings.loss, "temperature": settings.temperature,
                                                       "alpha": settings.alpha, "top_k": settings.top_k}})
        result.train = _train_summary(train)
        result.steps = int(train.steps)
        if eval_blocks is not None:
            trained = load_causal_lm(output_dir, "fp32", device)
            result.eval_kl_after = mean_kl_to_teacher(trained, teacher, eval_blocks, shared_logits=shared)
        write_result(output_dir, result)
    return result


EVAL_BLOCKS = 16


def _train_summary(train: Any) -> dict[str, Any]:
    """The figures of copt train's TrainResult worth reporting (the full result is in train_result.json)."""
    keys = ("engine", "world_size", "precision", "steps", "start_step", "total_steps", "tokens", "first_loss",
            "final_loss", "tokens_per_s", "mfu", "peak_mem_bytes", "peak_reserved_bytes", "step_time_s",
            "elapsed_s", "metrics_path", "resumed_from")
    return {k: getattr(train, k, None) for k in keys}
