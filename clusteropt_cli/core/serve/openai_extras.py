"""OpenAI response pieces beyond text: logprobs (completions' legacy shape and chat's), and vLLM's /tokenize and
/detokenize bodies. Plain functions over the engine's (token id, logprob, top alternatives) entries.

Which distribution: a generated token's logprob (and its alternatives) comes from the distribution it was sampled
from before truncation — after logit_bias, min_tokens suppression, the penalties and the temperature (1 for greedy
requests); top-k/top-p/min-p do not renormalize it (vLLM's `processed_logprobs`; vLLM's own default since V1 is the
raw model output, which equals this one for requests without temperature, penalties or bias). Prompt logprobs (echo)
are the raw model's.
"""

from __future__ import annotations

from typing import Any

Entry = tuple[int, float, list[tuple[int, float]]]


class TokenText:
    """Token id → its text (the token decoded alone), cached."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self.cache[token_id] = text
        return text


def completion_logprobs(text_of: TokenText, entries: list[Entry], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs (token text → logprob), text_offset.
    An entry whose logprob is None (the first echoed prompt token) has null logprob and top_logprobs."""
    tokens, values, tops, offsets = [], [], [], []
    for token, value, alternatives in entries:
        text = text_of(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(value)
        if value is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for tid, lp in alternatives:
            top.setdefault(text_of(tid), lp)
        top.setdefault(text, value)  # the chosen token is always listed (OpenAI: up to logprobs + 1 entries)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echo_entries(prompt_ids: list[int], prompt_lp: list[Entry | None] | None) -> list[Entry]:
    """Echoed prompt tokens as entries; tokens without a logprob (the first) as (id, None, [])."""
    out = []
    for i, tok in enumerate(prompt_ids):
        entry = prompt_lp[i] if prompt_lp is not None and i < len(prompt_lp) else None
        out.append(entry if entry is not None else (tok, None, []))
    return out


def vllm_prompt_logprobs(text_of: TokenText, entries: list[Entry | None], ranks: list[int | None] | None,
                         k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per token a dict token id (a
    string in JSON) → {logprob, rank, decoded_token}: the prompt token itself (its rank in the distribution) first,
    then the k most likely tokens (ranks 1..k)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        token, value, alternatives = entry
        rank = ranks[i] if ranks is not None and i < len(ranks) else None
        position = {str(token): {"logprob": value, "rank": rank, "decoded_token": text_of(token)}}
        for j, (tid, lp) in enumerate(alternatives[:k]):
            position.setdefault(str(tid), {"logprob": lp, "rank": j + 1, "decoded_token": text_of(tid)})
        out.append(position)
    return out


def chat_logprobs(text_of: TokenText, entries: list[Entry | None]) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for entry in entries:
        if entry is None:
            continue
        text = text_of(entry[0])
        content.append({"token": text, "logprob": entry[1], "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": text_of(t), "logprob": lp,
                                          "bytes": list(text_of(t).encode("utf-8"))} for t, lp in entry[2]]})
    return {"content": content}
