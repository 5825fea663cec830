"""`copt distill onpolicy`: on-policy distillation through TRL's DistillationTrainer (GKD).

The student samples completions of the prompts itself and is trained, on those tokens, towards the teacher's
next-token distribution under the generalized Jensen-Shannon divergence (beta 0 = forward KL(teacher‖student),
1 = reverse KL, 0.5 = JSD; Agarwal et al., "On-Policy Distillation of Language Models", ICLR 2024). Off-policy
`distill logits` trains on fixed text instead; the gap between the two is what the student meets at inference time:
its own continuations. `on_policy_kl` measures exactly that (the teacher's KL to the student on the student's own
samples), beside the held-out-text KL that `distill logits` reports.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.core.textfiles import jsonl_rows, string_field
from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

RESULT_FILE = "distill_result.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class OnPolicyResult:
    """What `distill onpolicy` reports (also distill_result.json in the output directory)."""

    output: str
    teacher: str
    student: str
    beta: float
    temperature: float
    steps: int
    batch: int
    max_new_tokens: int
    lr: float
    trl_version: str
    first_loss: float | None = None
    final_loss: float | None = None
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    eval_kl_before: float | None = None  # KL(teacher‖student) on held-out text
    eval_kl_after: float | None = None
    on_policy_kl_before: float | None = None  # KL(teacher‖student) on the student's own samples of eval prompts
    on_policy_kl_after: float | None = None
    losses: list[float] = field(default_factory=list)


def read_prompt_texts(path: str | Path, flag: str = "--prompts") -> list[str]:
    """Prompts from .jsonl ({"prompt": ...} or {"text": ...} or a JSON string per line) or .txt (one a line)."""
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"{flag} {path} does not exist.", hint="Pass a .jsonl (prompt) or .txt file.")
    if p.suffix == ".jsonl":
        hint = 'One JSON object per line with a "prompt" (or "text") string.'
        prompts = []
        for number, row in jsonl_rows(p, flag, hint):
            text = row if isinstance(row, str) else string_field(row, "prompt", "text")
            if not text:
                raise BadInputError(f"{flag} {path}: line {number} has no 'prompt' string.", hint=hint)
            prompts.append(text)
    else:
        prompts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise BadInputError(f"{flag} {path} holds no prompts.", hint="Add prompts, one per line.")
    return prompts


def check_onpolicy_inputs(settings: DistillRecipe) -> list[str]:
    """Every up-front check: models, shared vocabulary, prompts, --eval-data, options TRL's trainer cannot honour
    here."""
    from clusteropt_cli.core.distill.vocab import check_vocab_compatible
    from clusteropt_cli.modelspec import refuse_config_file

    for flag, value in (("--teacher", settings.teacher), ("--student", settings.student)):
        refuse_config_file(value, flag)
        if not value or not (Path(value) / "config.json").is_file():
            what = "the student checkpoint it trains" if flag == "--student" else "the teacher"
            raise BadInputError(f"{flag} {value} is not a model directory (no config.json).",
                                hint=f"distill onpolicy loads {what}: pass its local Hugging Face directory.")
    unsupported = [f"{flag} {value}" for flag, value, default in (
        ("--zero", settings.zero, 0), ("--offload", settings.offload, "none"), ("--gpus", settings.gpus, 1),
        ("--nodes", settings.nodes, 1)) if value != default]
    if settings.precision not in ("bf16", "fp32"):
        unsupported.append(f"--precision {settings.precision}")
    if unsupported:
        raise BadInputError(f"distill onpolicy runs TRL's trainer in one process: {', '.join(unsupported)} "
                            "not supported.", hint="Drop those options (bf16 or fp32, one device).")
    if not settings.prompts:
        raise BadInputError("--prompts is required.", hint="Pass prompts the student should learn to continue.")
    prompts = read_prompt_texts(settings.prompts)
    if settings.eval_data:  # held out: read now, so an empty one fails before the models load, as --data would
        from clusteropt_cli.core.train.data import check_text_input

        check_text_input(settings.eval_data, "--eval-data", read=True)
    check_vocab_compatible(Path(settings.teacher), Path(settings.student))  # loads both tokenizers: the last check
    return prompts


def _generate(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, seed: int) -> list[Any]:
    """(prompt ids, completion ids) per prompt: the model's own samples at temperature 1 (seeded, one batch)."""
    import torch

    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(next(model.parameters()).device)
    finally:
        tokenizer.padding_side = side
    torch.manual_seed(seed)
    with torch.no_grad():
        seqs = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    width = batch["input_ids"].shape[1]
    out = []
    for row, mask, seq in zip(batch["input_ids"], batch["attention_mask"], seqs, strict=True):
        completion = seq[width:]
        eos = (completion == tokenizer.eos_token_id).nonzero()
        if len(eos):  # keep the EOS itself, drop the padding after it
            completion = completion[: int(eos[0]) + 1]
        out.append((row[mask.bool()], completion))
    return out


def on_policy_kl(student: Any, teacher: Any, tokenizer: Any, prompts: list[str], *, max_new_tokens: int,
                 seed: int = 0) -> float:
    """Mean per-token KL(teacher‖student) over the student's own sampled continuations of `prompts`."""
    import torch

    from clusteropt_cli.core.distill.losses import per_token_divergence

    student.eval()
    teacher.eval()
    total, count = 0.0, 0
    for prompt_ids, completion in _generate(student, tokenizer, prompts, max_new_tokens, seed):
        if completion.numel() == 0:
            continue
        seq = torch.cat([prompt_ids, completion]).unsqueeze(0)
        n = prompt_ids.numel()
        with torch.no_grad():
            s = student(input_ids=seq).logits[:, n - 1 : -1]
            t = teacher(input_ids=seq).logits[:, n - 1 : -1]
        div = per_token_divergence(s, t, loss="forward-kl", temperature=1.0)
        total += float(div.sum())
        count += div.numel()
    return total / max(count, 1)


def distill_onpolicy(settings: DistillRecipe, *, output_dir: Path, overwrite: bool = False,
                     eval_text: str | Path | None = None, eval_prompts: list[str] | None = None,
                     log: Any = None) -> OnPolicyResult:
    """Train the student on its own samples towards the teacher (TRL DistillationTrainer); save it (HF format,
    atomically) in output_dir with metrics.jsonl and distill_result.json."""
    from clusteropt_cli.core.io import atomic_output_dir, check_output
    from clusteropt_cli.deps import require

    prompts = check_onpolicy_inputs(settings)
    check_output(output_dir, {"--teacher": settings.teacher, "--student": settings.student,
                              "--prompts": settings.prompts, "--eval-data": eval_text or settings.eval_data},
                 overwrite=overwrite)
    require("trl", "distill")
    require("datasets", "distill")
    import torch
    import trl
    from datasets import Dataset

    from clusteropt_cli.core.distill.logits import EVAL_BLOCKS, mean_kl_to_teacher
    from clusteropt_cli.core.distill.vocab import load_tokenizer
    from clusteropt_cli.core.models import load_causal_lm
    from clusteropt_cli.core.train import build_text_dataset

    log = log or (lambda _msg: None)
    cuda = torch.cuda.is_available()
    torch.manual_seed(settings.seed)
    temperature = settings.temperature if "temperature" in settings.model_fields_set else 1.0
    beta = 1.0 if settings.beta is None else settings.beta
    max_new = settings.max_new_tokens if "max_new_tokens" in settings.model_fields_set else 128
    tokenizer = load_tokenizer(Path(settings.teacher))
    tokenizer.padding_side = "left"  # TRL generates from left-padded prompt batches
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = torch.bfloat16 if settings.precision == "bf16" and cuda else torch.float32
    student = load_causal_lm(settings.student, dtype)
    teacher = load_causal_lm(settings.teacher, dtype)
    result = OnPolicyResult(str(output_dir), str(settings.teacher), str(settings.student), beta, temperature, 0,
                            settings.micro_batch, max_new, settings.lr, trl.__version__)
    blocks = None
    if eval_text is not None:
        blocks = build_text_dataset(eval_text, tokenizer, settings.seq_len, flag="--eval-data").blocks[:EVAL_BLOCKS]
        result.eval_kl_before = mean_kl_to_teacher(student, teacher, blocks)
    if eval_prompts:
        result.on_policy_kl_before = on_policy_kl(student, teacher, tokenizer, eval_prompts, max_new_tokens=max_new,
                                                  seed=settings.seed)
    started = time.perf_counter()
    with atomic_output_dir(output_dir, overwrite=overwrite, command="distill onpolicy") as tmp:
        config = trl.DistillationConfig(
            output_dir=str(tmp / "trl"), max_steps=settings.max_steps or 100,
            per_device_train_batch_size=settings.micro_batch, gradient_accumulation_steps=settings.grad_accum,
            learning_rate=settings.lr, lr_scheduler_type=settings.schedule, warmup_steps=settings.warmup_steps,
            weight_decay=settings.weight_decay, max_grad_norm=settings.grad_clip or 0.0,
            max_completion_length=max_new, beta=beta, temperature=temperature,
            bf16=dtype == torch.bfloat16, gradient_checkpointing=settings.activation_checkpointing,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=not cuda, seed=settings.seed,
            disable_tqdm=True)
        trainer = trl.DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                                          processing_class=tokenizer)
        log(f"training {settings.student} on its own samples of {len(prompts)} prompts "
            f"(TRL {trl.__version__} DistillationTrainer, beta {beta:g}, {config.max_steps} steps)")
        trainer.train()
        rows = [row for row in trainer.state.log_history if "loss" in row]
        result.losses = [float(r["loss"]) for r in rows]
        result.steps = int(trainer.state.global_step)
        result.first_loss = result.losses[0] if result.losses else None
        result.final_loss = result.losses[-1] if result.losses else None
        result.completion_tokens = int(sum(float(r.get("completions/mean_length", 0)) * settings.micro_batch
                                           * settings.grad_accum for r in rows))
        result.elapsed_s = round(time.perf_counter() - started, 3)
        student = trainer.model
        student.save_pretrained(tmp)
        tokenizer.padding_side = "right"
        tokenizer.save_pretrained(tmp)
        import shutil

        shutil.rmtree(tmp / "trl", ignore_errors=True)
        (tmp / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if blocks is not None:
            result.eval_kl_after = mean_kl_to_teacher(student, teacher, blocks)
        if eval_prompts:
            result.on_policy_kl_after = on_policy_kl(student, teacher, tokenizer, eval_prompts,
                                                     max_new_tokens=max_new, seed=settings.seed)
        (tmp / RESULT_FILE).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result
