"""The engine's fallback model runner: transformers' own attention and KV cache, one sequence at a time.

Used for models copt's slot attention is not verified for (architectures.inspect_architecture says why): the
engine's scheduler, streaming, stops, sampling and API stay the same, but each sequence keeps the cache object
transformers' model creates for itself (full, sliding-window, hybrid or recurrent layers alike) and every forward
is the model's own `forward(past_key_values=...)`, as in `generate`. Correct, not fast: no batching across
sequences, no CUDA graphs, no compiled layers. A sequence whose cache must step back (rejected speculative tokens)
is recomputed from its token history, since not every cache layer can be cropped; so is every step of a model
whose forward hands back no `past_key_values` (recurrent models that keep `cache_params`, say): slower still,
never wrong.
"""

from __future__ import annotations

from typing import Any

from clusteropt_cli.core.serve.runner import PendingTokens, resolve_dtype


class TransformersRunner:
    """Same interface as runner.ModelRunner (what the engine calls), backed by transformers' own caches."""

    decode_attention = "transformers"
    compiled_layers = 0
    use_graphs = False
    compile_error: str | None = None
    graph_error: str | None = None
    fp8_linears = 0
    fp8_kernels = False
    fused_projections = 0

    def __init__(self, model_path: str, *, device: str, dtype: str = "auto", num_slots: int | None,
                 max_len: int | None, reason: str = "", trust_remote_code: bool = False, **_ignored: Any):
        import torch
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.reason = reason
        self.dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None))
        self.device = torch.device(device)
        from clusteropt_cli.core.models import pretrained_causal_lm

        model = pretrained_causal_lm(model_path, dtype=self.dtype, trust_remote_code=trust_remote_code)
        model.to(self.device).eval()
        model.requires_grad_(False)
        self.model = model
        import inspect

        accepted = set(inspect.signature(model.forward).parameters)
        self._takes_cache = "past_key_values" in accepted
        self._takes_keep = "logits_to_keep" in accepted
        self.config = text_config
        self.vocab_size = int(text_config.vocab_size)
        self.max_len = int(max_len or min(int(getattr(text_config, "max_position_embeddings", 2048)), 4096))
        self.caches: list[tuple[Any, Any]] = []  # no slot cache: transformers' caches grow per sequence
        self._batch_buckets: list[int] = []
        self.num_slots = 0
        if num_slots is not None:
            self.allocate(num_slots)

    @property
    def attention_path(self) -> str:
        return f"transformers' own attention and cache, one sequence at a time (fallback: {self.reason})"

    def allocate(self, num_slots: int) -> None:
        self.num_slots = int(num_slots)
        self.scratch_pos = self.max_len
        self._cache: list[Any] = [None] * self.num_slots
        self._tokens: list[list[int]] = [[] for _ in range(self.num_slots)]
        from clusteropt_cli.core.serve.device_sampling import SlotSampler

        self.sampler = SlotSampler(self.num_slots, self.vocab_size, self.device)

    def capture_graphs(self, max_batch: int) -> int:
        return 0

    def capture_prefill_graphs(self, max_tokens: int) -> int:
        return 0

    def _run(self, slot: int, start: int, tokens: list[int], wanted: list[int]):
        """Feed `tokens` at position `start` of `slot`; float32 logits of the `wanted` indices (of `tokens`)."""
        import torch

        if start + len(tokens) > self.max_len:
            raise ValueError(f"sequence of {start + len(tokens)} tokens exceeds the cache length {self.max_len}")
        history = self._tokens[slot]
        cache = self._cache[slot]
        if start > len(history):
            raise ValueError(f"slot {slot} holds {len(history)} tokens; cannot continue at position {start}")
        if start == 0:
            history, cache = [], None
        elif start != len(history) or cache is None:
            # step back (rejected speculative tokens) or no reusable cache: recompute the prefix from scratch
            kept = history[:start]
            wanted = [len(kept) + i for i in wanted]
            tokens = kept + tokens
            history, cache = [], None
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        keep = len(tokens) - min(wanted) if wanted else 1
        kwargs: dict[str, Any] = {"logits_to_keep": keep} if self._takes_keep else {}
        if self._takes_cache:
            kwargs.update(past_key_values=cache, use_cache=True)
        else:
            kwargs["use_cache"] = False
        out = self.model(input_ids=ids, **kwargs)
        self._cache[slot] = getattr(out, "past_key_values", None) if self._takes_cache else None
        self._tokens[slot] = history + list(tokens)
        if not self._takes_keep:
            keep = len(tokens)
        if not wanted:
            return out.logits.new_empty(0, self.vocab_size).float()
        rows = torch.tensor([i - (len(tokens) - keep) for i in wanted], dtype=torch.long, device=self.device)
        return out.logits[0].index_select(0, rows).float()

    def forward_packed(self, chunks: list[tuple[int, int, list[int]]], logits_for: list[list[int]]):
        import torch

        with torch.inference_mode():
            parts = [self._run(slot, start, tokens, wanted)
                     for (slot, start, tokens), wanted in zip(chunks, logits_for, strict=True)]
        parts = [p for p in parts if p.shape[0]]
        return torch.cat(parts) if parts else torch.empty(0, self.vocab_size, device=self.device)

    def forward_decode(self, slots: list[int], positions: list[int], tokens: list[int]):
        import torch

        with torch.inference_mode():
            return torch.cat([self._run(slot, pos, [tok], [0])
                              for slot, pos, tok in zip(slots, positions, tokens, strict=True)])

    def decode_sample(self, slots: list[int], positions: list[int], tokens: list[int]):
        logits = self.forward_decode(slots, positions, tokens)
        return self.sampler.sample(logits, slots, [p + 1 for p in positions])

    def start_chain(self, slots: list[int], positions: list[int], tokens: list[int]) -> _Chain:
        return _Chain(self, slots, positions, tokens)


class _Chain:
    """Decode steps (runner.DecodeChain's interface); each step runs when launched."""

    def __init__(self, runner: TransformersRunner, slots: list[int], positions: list[int], tokens: list[int]):
        self.runner, self.slots = runner, list(slots)
        self.positions, self.tokens = list(positions), list(tokens)

    def launch(self) -> PendingTokens:
        logits = self.runner.forward_decode(self.slots, self.positions, self.tokens)
        sampler = self.runner.sampler
        if sampler.flags(self.slots)[0]:
            chosen = logits.argmax(-1).cpu()
        else:
            chosen = sampler.sample(logits, self.slots, [p + 1 for p in self.positions]).cpu()
        self.tokens = chosen.tolist()
        self.positions = [p + 1 for p in self.positions]
        return PendingTokens(chosen, None)
