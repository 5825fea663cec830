"""The one place `distill traces` generates text. It goes through copt serve's in-process engine
(clusteropt_cli.core.serve.engine, continuous batching) when that is importable; `generate_with_hf` is the
fallback used only until then (plain batched `model.generate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clusteropt_cli.core.distill.traces import Generation, SamplingSettings


def stop_token_ids(tokenizer: Any) -> list[int]:
    """eos plus the chat template's end-of-turn marker when the vocabulary has one."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for marker in ("<|end|>", "<|eot_id|>", "<|im_end|>", "<end_of_turn>"):
        if marker in vocab and vocab[marker] not in ids:
            ids.append(int(vocab[marker]))
    return ids


def _trim(tokens: list[int], stops: set[int], pad_id: int | None) -> tuple[list[int], str]:
    """Cut a generated sequence at its first stop token (excluded); finish_reason stop/length."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i], "stop"
    if pad_id is not None:
        while tokens and tokens[-1] == pad_id:
            tokens = tokens[:-1]
    return tokens, "length"


def generate_with_hf(model: Any, tokenizer: Any, prompts: list[str], sampling: SamplingSettings,
                     batch_size: int = 16) -> list[list[Generation]]:
    """Batched `model.generate` with left padding; `sampling.samples` sequences per prompt."""
    import torch

    stops = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    results: list[list[Generation]] = []
    generator_seed = sampling.seed
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        torch.manual_seed(generator_seed + start)
        do_sample = sampling.temperature > 0
        kwargs: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, do_sample=do_sample,
                                      num_return_sequences=sampling.samples, eos_token_id=stops, pad_token_id=pad_id)
        if do_sample:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or 0)
        with torch.no_grad():
            out = model.generate(**enc, **kwargs)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        for i in range(len(chunk)):
            samples = []
            for row in new[i * sampling.samples : (i + 1) * sampling.samples]:
                tokens, reason = _trim(row, set(stops), pad_id)
                samples.append(Generation(tokenizer.decode(tokens, skip_special_tokens=False), len(tokens), reason))
            results.append(samples)
    return results


class TeacherGenerator:
    """Loads the teacher once and generates traces for batches of formatted prompts."""

    def __init__(self, teacher: Path, *, dtype: str = "auto", device: str | None = None, batch_size: int = 16):
        self.teacher = Path(teacher)
        self.dtype = dtype
        self.device = device
        self.batch_size = batch_size
        self.backend = "hf-generate"
        self._model: Any = None
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from clusteropt_cli.core.distill.vocab import load_tokenizer

            self._tokenizer = load_tokenizer(self.teacher)
        return self._tokenizer

    def format_prompt(self, prompt: str) -> str:
        """The user turn rendered with the teacher's chat template and the assistant generation prompt."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
        return prompt + "\n"

    def _load(self) -> Any:
        if self._model is None:
            from clusteropt_cli.core.distill.logits import load_causal_lm, pick_device

            device = self.device or pick_device()
            self._model = load_causal_lm(self.teacher, self.dtype, device).eval()
        return self._model

    def __call__(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Generation]]:
        return generate_with_hf(self._load(), self.tokenizer, prompts, sampling, self.batch_size)


def distill_traces(settings: Any, *, output: Path, overwrite: bool = False, on_batch: Any = None,
                   generator: Any = None) -> Any:
    """`copt distill traces`: validate up front, then generate (resumable) and return TraceStats."""
    from clusteropt_cli.core.distill.traces import THINK_OPEN, run_traces
    from clusteropt_cli.core.distill.traces import read_prompts as _read
    from clusteropt_cli.errors import BadInputError

    if not settings.teacher or not Path(settings.teacher).is_dir():
        raise BadInputError(f"--teacher {settings.teacher} is not a model directory.",
                            hint="Pass the teacher's local Hugging Face directory.")
    if not settings.prompts:
        raise BadInputError("distill traces needs --prompts.", hint="Pass a .jsonl file, one {\"prompt\": ...} a line.")
    prompts = _read(settings.prompts)
    if settings.verify and not any(p.answer is not None for p in prompts):
        raise BadInputError(f"--verify: no prompt in {settings.prompts} has an 'answer' field.",
                            hint="Add \"answer\" to the prompts, or drop --verify.")
    if output.exists() and output.is_dir():
        raise BadInputError(f"--output {output} is a directory.", hint="Pass a file path such as traces.jsonl.")
    sampling = SamplingSettings(samples=settings.samples, max_new_tokens=settings.max_new_tokens,
                                temperature=settings.sample_temperature, top_p=settings.top_p, seed=settings.seed)
    teacher = generator or TeacherGenerator(Path(settings.teacher), dtype=settings.teacher_dtype)
    return run_traces(prompts, output, teacher, teacher.format_prompt, teacher=str(settings.teacher),
                      sampling=sampling, verify=settings.verify, default_match=settings.match,
                      think_prefix=(THINK_OPEN + "\n") if settings.think else "", batch_prompts=settings.gen_batch,
                      overwrite=overwrite, on_batch=on_batch)
