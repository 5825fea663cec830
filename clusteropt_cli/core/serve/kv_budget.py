"""How long a sequence copt's engine serves by default, and how much memory its KV cache may take.

With the paged KV cache (the default) sequences hold only the blocks their tokens fill, so the default
`max_model_len` is the model's full context as soon as the budget holds one sequence of it (vLLM's rule: shorter
sequences share the pool; `choose_max_model_len` with `max_batch_size` 1).

The slot cache (`--kv-layout slots`, and models whose sliding-window layers keep a ring) keeps one fixed slot of
`max_model_len` tokens per running sequence, so the length and the number of concurrent sequences share one budget:
`slots × max_model_len × bytes per token ≤ budget`. Its default `max_model_len` (`choose_max_model_len`), when
--max-model-len is not given:

1. the model's full context, when the budget holds `--max-batch-size` sequences of it;
2. otherwise the longest power of two below the context that still holds `--max-batch-size` sequences, as long as
   that is at least 4,096 tokens;
3. otherwise 4,096 tokens (the model's context if shorter) with as many sequences as fit;
4. otherwise (not one 4,096-token sequence fits) one sequence, as long as a power of two allows.

vLLM instead refuses to start when one sequence of the full context does not fit; copt keeps the configured
concurrency first and says on stderr what it chose, why, and which flags change it.

`--gpu-memory-utilization` means what it means to vLLM: the fraction of the GPU's total memory this engine may use
for everything — weights, activations and the KV cache — regardless of what other processes hold (the memory free at
start-up must cover it, or the engine refuses to start, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MIN_LEN = 4096
DEFAULT_GPU_MEMORY_FRACTION = 0.85  # of the GPU memory free after loading, without --gpu-memory-utilization
# Sequences decoded together at most without --max-batch-size (vLLM V1's --max-num-seqs is 256 on GPUs under 70 GiB,
# 1024 above): on the H200 at 256 streaming clients the 1B shape served 14,860 output tok/s at a cap of 64 and 21,598
# at 256 (TTFT p50 1.29 -> 0.54 s), the 8B shape 5,447 and 8,072 (3.19 -> 1.30 s)
DEFAULT_MAX_BATCH_SIZE = 256
SHORTEST_LEN = 128  # the shortest length chosen when the budget forces a length below DEFAULT_MIN_LEN


@dataclass(frozen=True)
class LengthChoice:
    max_model_len: int
    slots: int  # sequences the budget holds at that length (at most max_batch_size; 0: not even one)
    reason: str


def choose_max_model_len(context: int, bytes_per_token: int | Callable[[int], int], budget: int,
                         max_batch_size: int, extra_tokens: int = 0) -> LengthChoice:
    """The default max_model_len for a model of `context` tokens (see the module docstring).

    `bytes_per_token`: KV bytes per token of a slot, or a function of the slot's length (models whose sliding-window
    layers keep a ring average fewer bytes per token over a longer slot); `budget`: bytes for the KV cache;
    `extra_tokens`: slot columns beyond max_model_len (speculative decoding's verification window)."""
    per_token = bytes_per_token if callable(bytes_per_token) else (lambda _n: bytes_per_token)
    wanted = int(max_batch_size)

    def slots_at(length: int) -> int:
        cache_len = length + extra_tokens
        return int(budget // max(1, cache_len * per_token(cache_len)))

    if slots_at(context) >= wanted:
        return LengthChoice(context, wanted, f"{wanted} sequences of the model's full context fit")
    floor = min(DEFAULT_MIN_LEN, context)
    length = 1 << max(0, (context - 1).bit_length() - 1)  # the largest power of two below the context
    while length >= floor:
        if slots_at(length) >= wanted:
            return LengthChoice(length, wanted, f"{wanted} sequences of the full {context:,}-token context do not fit; "
                                f"{length:,} tokens is the longest power of two that keeps {wanted}")
        length //= 2
    held = slots_at(floor)
    if held >= 1:
        return LengthChoice(floor, min(held, wanted), f"{wanted} sequences of {floor:,} tokens do not fit; "
                            f"only {held} {'does' if held == 1 else 'do'}")
    length = 1 << max(0, (floor - 1).bit_length() - 1)
    while length >= SHORTEST_LEN:
        if slots_at(length) >= 1:
            return LengthChoice(length, 1, f"not one sequence of {floor:,} tokens fits; one of {length:,} does")
        length //= 2
    return LengthChoice(floor, 0, f"not one sequence of {SHORTEST_LEN} tokens fits")


def default_max_batch_tokens(device: str) -> int:
    """Tokens per engine step (the chunked-prefill budget) when --max-batch-tokens is not given."""
    return 2048 if device.startswith("cuda") else 512


def checkpoint_weight_bytes(model_dir: str | Path, dtype_bytes: int, config: Any = None) -> int:
    """The weights' size once loaded, estimated before loading from the checkpoint files (safetensors, else
    PyTorch .bin), rescaled from the checkpoint's float width to the serving dtype's (quantized checkpoints as
    stored). 0 when there are no such files (a hub id: the engine then measures after loading)."""
    root = Path(model_dir)
    if not root.is_dir():
        return 0
    files = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    size = sum(f.stat().st_size for f in files if f.is_file())
    stored = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "").removeprefix("torch.")
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(stored)
    if width and not getattr(config, "quantization_config", None):
        size = size * dtype_bytes // width
    return int(size)


def activation_reserve(config: Any, max_batch_tokens: int, max_batch_size: int, dtype_bytes: int) -> int:
    """Memory kept out of the KV budget for everything but weights and cache: the largest prefill step's activations
    (hidden states, q/k/v, the MLP's gate/up) and the float32 logits of a full decode batch, doubled for the
    allocator, plus 1 GiB for the CUDA context, CUDA graphs and compiled kernels (vLLM profiles a forward instead)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    step = max_batch_tokens * (4 * hidden + 2 * inter) * dtype_bytes
    logits = max(max_batch_size, 1) * vocab * 4 * 2
    return int(2 * (step + logits) + 2**30)


def utilization_budget(total: int, free_at_start: int, engine_bytes: int, utilization: float, reserve: int) -> int:
    """KV-cache bytes under `--gpu-memory-utilization` (vLLM's meaning): the engine as a whole — `engine_bytes`
    (weights and whatever else it holds once loaded), `reserve` (activations) and the cache — within
    `utilization × total`. Raises ValueError when the memory free at start-up is less than that, as vLLM does."""
    requested = int(total * utilization)
    if free_at_start < requested:
        raise ValueError(f"--gpu-memory-utilization {utilization} asks for {requested / 2**30:.1f} GiB of the "
                         f"{total / 2**30:.1f} GiB GPU, but only {free_at_start / 2**30:.1f} GiB are free")
    return requested - engine_bytes - reserve


def describe_choice(choice: LengthChoice, context: int, slots: int, cache_bytes: int, budget_why: str) -> str:
    """The start-up line: what max_model_len and how many sequences the engine chose, why, and how to change it."""
    reason = choice.reason
    if slots < choice.slots:
        reason += f" (planned before loading; the memory measured after loading holds {slots})"
    return (f"copt serve: max_model_len {choice.max_model_len:,} of the model's {context:,}-token context, "
            f"{slots} concurrent sequences ({cache_bytes / 2**30:.2f} GiB of KV cache; {budget_why}): {reason}. "
            "--max-model-len sets the length; --gpu-memory-utilization (or --kv-cache-memory) sets the budget and "
            "--max-batch-size the concurrency it is shared by.")
