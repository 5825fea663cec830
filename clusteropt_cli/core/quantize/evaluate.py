"""Quality and size measurements: blocked perplexity, checkpoint size on disk, a generation smoke test."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weights_bytes(model_dir: str | Path) -> int:
    """Bytes of the weight files (safetensors/bin) in a checkpoint directory."""
    return sum(p.stat().st_size for p in Path(model_dir).rglob("*")
               if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


REFERENCE_BYTES = 2**30  # the original model's kept log-probabilities (fp32, host memory) for KL and top-1


@dataclass
class Perplexity:
    """Perplexity over non-overlapping blocks of an evaluation text (and, against a reference, how close the next-token
    distributions stay)."""

    ppl: float
    nll: float  # mean next-token negative log-likelihood (nats)
    tokens: int  # predicted tokens
    blocks: int
    block_len: int
    kl: float | None = None  # mean KL(reference ‖ model), nats per token, over the reference's blocks
    top1: float | None = None  # fraction of positions where the argmax equals the reference's
    kl_tokens: int = 0  # positions KL and top-1 cover
    logprobs: list | None = field(default=None, repr=False)  # kept per-block log-probs [T-1, V] (a reference)


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default (add_special_tokens=True): its BOS where it adds one
    (Llama-3, Gemma), nothing where it does not (SmolLM2, Qwen)."""
    probe = "Hello"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def eval_blocks(tokenizer, text: str, block_len: int, max_tokens: int):
    """Tokenize `text` and cut it into [n, block_len] blocks (at most max_tokens tokens, at least one block).

    Each block starts the way the tokenizer starts a text by default — with its BOS where it adds one, as a model
    sees every prompt (HF tokenizer(...), vLLM): without it a BOS-trained model scores far worse than it serves
    (a Gemma model: perplexity 53.2 without, 24.2 with). The BOS is context only, never a predicted token."""
    import torch

    prefix = special_prefix(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    block_len = max(len(prefix) + 2, min(block_len, len(ids) + len(prefix)))
    body = block_len - len(prefix)
    n = max(1, min(len(ids) // body, max(1, max_tokens // block_len)))
    rows = [prefix + ids[i * body : (i + 1) * body] for i in range(n)]
    return torch.tensor(rows, dtype=torch.long)


def perplexity(model, blocks, batch_size: int = 8, keep_bytes: int = 0, reference: list | None = None) -> Perplexity:
    """exp(mean NLL) of next-token prediction over each block (blocked evaluation, no context across blocks).

    keep_bytes: keep the log-probabilities of the first blocks that fit in that many bytes (fp32, CPU), as the
    reference of a later call. reference: such a list from the original model: KL(reference ‖ model) and top-1
    agreement over those blocks, in the same forward passes."""
    import torch

    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    kept: list = []
    kl_sum, agree, compared = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), batch_size):
            x = blocks[i : i + batch_size].to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += nll.item()
            count += x[:, 1:].numel()
            if not keep_bytes and not reference:
                continue
            logprobs = torch.log_softmax(logits, dim=-1)
            for row in range(x.shape[0]):
                index = i + row
                if keep_bytes and (len(kept) + 1) * logprobs[row].numel() * 4 <= keep_bytes:
                    kept.append(logprobs[row].cpu())
                if reference and index < len(reference):
                    ref = reference[index].to(device)
                    kl_sum += (ref.exp() * (ref - logprobs[row])).sum().item()
                    agree += (ref.argmax(-1) == logprobs[row].argmax(-1)).sum().item()
                    compared += ref.shape[0]
    mean = total / max(count, 1)
    result = Perplexity(ppl=math.exp(mean), nll=mean, tokens=count, blocks=len(blocks), block_len=blocks.shape[1])
    if keep_bytes:
        result.logprobs = kept
    if compared:
        result.kl, result.top1, result.kl_tokens = kl_sum / compared, agree / compared, compared
    return result


def generate_smoke(model, tokenizer, prompt: str = "def ", max_new_tokens: int = 8) -> str:
    """Greedy-generate a few tokens (proves the checkpoint runs end to end)."""
    import torch

    device = next(model.parameters()).device
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
