"""Chain-of-thought trace distillation, step 2: supervised fine-tuning on the kept traces.

Each trace becomes one chat (user: prompt, assistant: completion) rendered with the tokenizer's chat template;
the prompt part (everything up to and including the assistant generation prompt) gets label -100, so the loss is
only on the completion tokens (the reasoning, the answer and the end-of-turn marker).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clusteropt_cli.errors import BadInputError

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

IGNORE_INDEX = -100


def render_prompt_and_completion(tokenizer: Any, prompt: str, completion: str) -> tuple[str, str]:
    """(prompt text incl. the assistant generation prompt, completion text incl. the end-of-turn marker)."""
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        full = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": completion}], tokenize=False)
        if not full.startswith(head):
            raise BadInputError("The chat template renders the prompt differently with and without the answer; "
                                "cannot tell the completion tokens apart.",
                                hint="Use a tokenizer whose chat template appends the assistant turn after the "
                                     "generation prompt.")
        return head, full[len(head):]
    eos = tokenizer.eos_token or ""
    return prompt + "\n", completion + eos


def encode_example(tokenizer: Any, prompt: str, completion: str, max_len: int) -> dict[str, list[int]] | None:
    """input_ids and labels (-100 on the prompt); None when the prompt alone fills `max_len`.

    The prompt and the completion are tokenized separately and concatenated, which is exactly what the model
    sees at generation time (prompt tokens, then generated tokens).
    """
    head, tail = render_prompt_and_completion(tokenizer, prompt, completion)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if len(head_ids) >= max_len:
        return None
    ids = (head_ids + tail_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(head_ids) + tail_ids)[:max_len]
    return {"input_ids": ids, "labels": labels}


@dataclass
class SFTDataset:
    """Right-padded examples of one length (so a plain stacking collate works); padding has label -100.

    Right padding leaves every real token's causal context unchanged, so no attention mask is needed.
    """

    input_ids: Any  # LongTensor [n, length]
    labels: Any  # LongTensor [n, length]
    num_completion_tokens: int
    dropped: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}

    @property
    def num_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum()) if len(self) else 0


def build_sft_dataset(rows: list[dict[str, Any]], tokenizer: Any, max_len: int) -> SFTDataset:
    """Tokenize traces (dicts with prompt and completion) into an SFTDataset padded to the longest example."""
    import torch

    encoded = [encode_example(tokenizer, r["prompt"], r["completion"], max_len) for r in rows]
    kept = [e for e in encoded if e is not None and any(x != IGNORE_INDEX for x in e["labels"])]
    if not kept:
        raise BadInputError(f"No trace fits --seq-len {max_len} with at least one completion token.",
                            hint="Raise --seq-len or shorten the prompts.")
    length = max(len(e["input_ids"]) for e in kept)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.full((len(kept), length), int(pad if pad is not None else 0), dtype=torch.long)
    labels = torch.full((len(kept), length), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(kept):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        labels[i, : len(e["labels"])] = torch.tensor(e["labels"])
    completion_tokens = int((labels != IGNORE_INDEX).sum())
    return SFTDataset(ids, labels, completion_tokens, len(rows) - len(kept))


def completion_loss(model: Any, dataset: SFTDataset, batch_size: int = 16) -> float:
    """Mean cross-entropy per completion token of a dataset (the quantity SFT lowers)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            x = dataset.input_ids[start : start + batch_size].to(device)
            y = dataset.labels[start : start + batch_size].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            target = y[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                     ignore_index=IGNORE_INDEX, reduction="sum")
            total += float(loss)
            count += int((target != IGNORE_INDEX).sum())
    return total / max(count, 1)


@dataclass
class SFTResult:
    """What `distill sft` reports."""

    output: str
    student: str
    traces: str
    examples: int
    dropped: int
    completion_tokens: int
    steps: int
    train: dict[str, Any]
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None


def sft_inputs(settings: DistillRecipe, recipe: str | None = None) -> dict[str, Any]:
    """The input paths of `copt distill sft` (what --output must stay clear of)."""
    return {"--student": settings.student, "--traces": settings.traces, "--eval-traces": settings.eval_traces,
            "--recipe": recipe}


def distill_sft(settings: DistillRecipe, *, output_dir: Any, overwrite: bool = False,
                callbacks: tuple = ()) -> SFTResult:
    """Fine-tune the student on the kept traces with copt train's loop (loss only on completion tokens)."""
    from pathlib import Path

    from clusteropt_cli.core.distill.logits import (
        _train_summary,
        build_student,
        check_distill_host_memory,
        load_causal_lm,
        pick_device,
        prepare_output_dir,
        resolve_student,
        write_result,
    )
    from clusteropt_cli.core.distill.traces import iter_kept, read_traces
    from clusteropt_cli.core.distill.vocab import load_tokenizer
    from clusteropt_cli.core.train import run_training
    from clusteropt_cli.core.train.model import check_tokenizer_fits
    from clusteropt_cli.modelspec import has_tokenizer_files

    if not settings.traces:
        raise BadInputError("distill sft needs --traces.", hint="Pass the traces.jsonl written by copt distill traces.")
    all_rows = read_traces(settings.traces)
    rows = iter_kept(all_rows)
    if all_rows and not rows:
        raise BadInputError(f"--traces {settings.traces}: all {len(all_rows)} traces are marked verified: false "
                            "(answers that did not match), so none is trained on.",
                            hint="Regenerate with `copt distill traces --verify` on prompts the teacher gets right, or "
                                 "pass traces that were not verified.")
    eval_rows = iter_kept(read_traces(settings.eval_traces, flag="--eval-traces")) if settings.eval_traces else None
    from clusteropt_cli.core.train.validate import check_hardware

    check_hardware(settings, "cuda" if pick_device().startswith("cuda") else "cpu")
    source = resolve_student(settings.student)
    tokenizer_dir = source.path if source.path is not None and source.path.is_dir() else None
    if tokenizer_dir is None or not has_tokenizer_files(tokenizer_dir):
        raise BadInputError(f"--student {settings.student} has no tokenizer files.",
                            hint="SFT renders the traces with the student's chat template: pass a model directory "
                                 "that holds its tokenizer.")
    tokenizer = load_tokenizer(tokenizer_dir)
    check_tokenizer_fits(tokenizer, source.config, tokenizer_dir,
                         hint="The student's config.json and tokenizer must come from the same save_pretrained: "
                              "restore the directory from the model's source, or resize its embeddings to the "
                              "tokenizer.")
    check_distill_host_memory(settings, source)
    from clusteropt_cli.core.io import replacing_output_dir
    from clusteropt_cli.core.train.launch import is_launched_child

    launched = is_launched_child()  # under a launcher the parent prepared the output
    if not launched:
        prepare_output_dir(Path(output_dir), overwrite=overwrite, resume=settings.resume, inputs=sft_inputs(settings))
    with replacing_output_dir(Path(output_dir), overwrite=overwrite, resume=settings.resume, command="distill sft",
                              enabled=not launched):
        dataset = build_sft_dataset(rows, tokenizer, settings.seq_len)
        eval_set = build_sft_dataset(eval_rows, tokenizer, settings.seq_len) if eval_rows else None
        student = build_student(source, settings.seed)
        device = pick_device()
        result = SFTResult(str(output_dir), str(settings.student), str(settings.traces), len(dataset), dataset.dropped,
                           dataset.num_completion_tokens, 0, {})
        if eval_set is not None:
            result.eval_loss_before = completion_loss(student.to(device), eval_set)
            student.to("cpu")
        train = run_training(settings, student, dataset, Path(output_dir), tokenizer=tokenizer, callbacks=callbacks,
                             extra_result={"sft": {"traces": str(settings.traces), "examples": len(dataset)}})
        result.train = _train_summary(train)
        result.steps = int(train.steps)
        if eval_set is not None:
            result.eval_loss_after = completion_loss(load_causal_lm(output_dir, "fp32", device), eval_set)
        write_result(Path(output_dir), result)
    return result
