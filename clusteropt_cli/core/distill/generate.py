"""The one place `distill traces` generates text: copt serve's in-process engine
(clusteropt_cli.core.serve.engine.Engine: continuous batching over a slot KV cache, chunked prefill, CUDA graphs
on GPU). Every sample of every prompt is one GenerationRequest; the engine batches them itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clusteropt_cli.core.distill.traces import Generation, SamplingSettings

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.distill import DistillRecipe


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


# chat-template variables that switch a model's reasoning on or off (Qwen3 and most reasoning templates:
# enable_thinking; DeepSeek-V3.1: thinking)
REASONING_SWITCHES = ("enable_thinking", "thinking")


@dataclass
class ThinkingMode:
    """How `distill traces` asks the teacher to reason: the template's own switch, a forced '<think>' prefix, or
    neither (a model that knows no thinking format: its answers are traces without reasoning)."""

    template_kwargs: dict[str, bool]
    think_prefix: str
    reason: str


def thinking_mode(tokenizer: Any, think: bool | None) -> ThinkingMode:
    """think None (the default): the chat template's reasoning switch when it has one (switched on); else the
    '<think>' prefix only when '<think>' is a token of the teacher's vocabulary; else nothing forced.
    think True: the switch, or the prefix even for a vocabulary without it. think False: the switch off, no
    prefix."""
    from clusteropt_cli.core.distill.traces import THINK_OPEN
    from clusteropt_cli.core.serve.openai_routes import template_variables

    switch = next((v for v in REASONING_SWITCHES if v in template_variables(tokenizer)), None)
    if switch is not None:
        on = think is not False
        return ThinkingMode({switch: on}, "", f"chat template's {switch}={on}")
    if think is False:
        return ThinkingMode({}, "", "--no-think")
    known = THINK_OPEN in tokenizer.get_vocab()
    if known or think:
        return ThinkingMode({}, THINK_OPEN + "\n", "forced '<think>' prefix" + ("" if known else
                            " (think: true; the vocabulary has no <think> token)"))
    return ThinkingMode({}, "", "no thinking format: the chat template has no reasoning switch and the vocabulary "
                                "no <think> token")


class TeacherGenerator:
    """Loads the teacher into copt serve's engine once and generates traces for batches of formatted prompts."""

    def __init__(self, teacher: Path, *, dtype: str = "auto", device: str | None = None, max_batch_size: int = 64):
        self.teacher = Path(teacher)
        self.dtype = dtype
        self.device = device
        self.max_batch_size = max_batch_size
        self.engine: Any = None
        self._tokenizer: Any = None
        self._context: tuple[int, int] | None = None  # _check_lengths' (context, longest vocabulary entry)
        self.template_kwargs: dict[str, Any] = {}  # e.g. {"enable_thinking": True} (thinking_mode)

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
                                           add_generation_prompt=True, **self.template_kwargs)
        return prompt + "\n"

    def _engine(self, max_len: int) -> Any:
        """Start the engine sized for the longest sequence needed (restarted only if a longer one comes)."""
        if self.engine is not None and self.engine.max_model_len >= max_len:
            return self.engine
        if self.engine is not None:
            self.engine.stop()
        from clusteropt_cli.core.distill.vocab import read_config
        from clusteropt_cli.core.serve.engine import Engine
        from clusteropt_cli.recipe.schema.serve import ServeRecipe

        config = read_config(self.teacher)
        context = int(config.get("max_position_embeddings") or max_len)
        if max_len > context:
            from clusteropt_cli.errors import BadInputError

            raise BadInputError(f"A prompt plus --max-new-tokens needs {max_len} tokens; the teacher's context is "
                                f"{context}.", hint="Lower --max-new-tokens or shorten the prompts.")
        settings = ServeRecipe(model=str(self.teacher), dtype=self.dtype, max_batch_size=self.max_batch_size,
                               max_model_len=max_len)
        self.engine = Engine.from_settings(settings, device=self.device).start()
        return self.engine

    def _check_lengths(self, prompts: list[str], max_new_tokens: int) -> None:
        """Refuse a prompt that cannot fit the teacher's context before tokenizing it (a 200 MB prompt took
        8.5 GB to tokenize): no token spans more characters than the vocabulary's longest entry."""
        from clusteropt_cli.core.distill.vocab import read_config
        from clusteropt_cli.errors import BadInputError

        if self._context is None:  # read once: (the teacher's context, its vocabulary's longest entry)
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
            self._context = (int(read_config(self.teacher).get("max_position_embeddings") or 0), longest)
        context, longest = self._context
        if not context:
            return
        room = max(0, context - max_new_tokens - 1)
        for prompt in prompts:
            fewest = -(-len(prompt) // longest)  # tokens this many characters take at the least
            if fewest > room:
                raise BadInputError(
                    f"A prompt of {len(prompt):,} characters takes at least {fewest:,} tokens; with --max-new-tokens "
                    f"{max_new_tokens} the teacher's context of {context:,} leaves room for {room:,}.",
                    hint="Shorten or split the prompts (or lower --max-new-tokens).")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
            self.engine = None

    def __call__(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Generation]]:
        from clusteropt_cli.core.serve.engine import GenerationRequest

        tok = self.tokenizer
        self._check_lengths(prompts, sampling.max_new_tokens)
        encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        longest = max(len(ids) for ids in encoded) + sampling.max_new_tokens + 1
        engine = self._engine(longest)
        stops = stop_token_ids(tok)
        requests = [
            GenerationRequest(prompt_ids=ids, max_new_tokens=sampling.max_new_tokens,
                              temperature=sampling.temperature, top_p=sampling.top_p,
                              seed=sampling.seed * 1_000_003 + hash_ids(ids) * 131 + k,
                              stop_token_ids=stops, speculative=False)
            for ids in encoded for k in range(sampling.samples)
        ]
        results = engine.generate(requests)
        failed = [r for r in results if r.finish_reason in ("error", "abort")]
        if failed:
            raise RuntimeError(f"the serve engine failed on {len(failed)} request(s): {failed[0].error}")
        out: list[list[Generation]] = []
        for i in range(len(prompts)):
            group = results[i * sampling.samples : (i + 1) * sampling.samples]
            out.append([Generation(tok.decode(r.output_ids, skip_special_tokens=False), len(r.output_ids),
                                   "stop" if r.finish_reason == "stop" else "length") for r in group])
        return out


def hash_ids(ids: list[int]) -> int:
    """A small stable hash of a prompt's ids (per-prompt sampling seeds that do not depend on batch order)."""
    value = 0
    for token in ids:
        value = (value * 1_000_003 + token) % 2_147_483_647
    return value


def distill_traces(settings: DistillRecipe, *, output: Path, overwrite: bool = False, on_batch: Any = None,
                   generator: Any = None) -> Any:
    """`copt distill traces`: validate up front, then generate (resumable) and return TraceStats."""
    from clusteropt_cli.core.distill.traces import check_traces_output, run_traces
    from clusteropt_cli.core.distill.traces import read_prompts as _read
    from clusteropt_cli.errors import BadInputError
    from clusteropt_cli.modelspec import refuse_config_file

    refuse_config_file(settings.teacher, "--teacher")
    if not settings.teacher or not Path(settings.teacher).is_dir():
        raise BadInputError(f"--teacher {settings.teacher} is not a model directory.",
                            hint="Pass the teacher's local Hugging Face directory.")
    if not settings.prompts:
        raise BadInputError("distill traces needs --prompts.", hint="Pass a .jsonl file, one {\"prompt\": ...} a line.")
    prompts = _read(settings.prompts)
    if settings.verify and not any(p.answer is not None for p in prompts):
        raise BadInputError(f"--verify: no prompt in {settings.prompts} has an 'answer' field.",
                            hint="Add \"answer\" to the prompts, or drop --verify.")
    check_traces_output(output)  # before the teacher loads
    sampling = SamplingSettings(samples=settings.samples, max_new_tokens=settings.max_new_tokens,
                                temperature=settings.sample_temperature, top_p=settings.top_p, seed=settings.seed)
    teacher = generator or TeacherGenerator(Path(settings.teacher), dtype=settings.teacher_dtype,
                                            max_batch_size=min(64, settings.gen_batch * settings.samples))
    mode = thinking_mode(teacher.tokenizer, settings.think)
    teacher.template_kwargs = dict(mode.template_kwargs)
    try:
        stats = run_traces(prompts, output, teacher, teacher.format_prompt, teacher=str(settings.teacher),
                           sampling=sampling, verify=settings.verify, default_match=settings.match,
                           think_prefix=mode.think_prefix, template_kwargs=mode.template_kwargs,
                           batch_prompts=settings.gen_batch, overwrite=overwrite, on_batch=on_batch)
        stats.thinking = mode.reason
        return stats
    finally:
        if generator is None:
            teacher.close()
