"""Token selection: greedy, temperature/top-p sampling with per-request seeds, and the speculative acceptance rule."""

from __future__ import annotations

from typing import Any

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults a model ships in generation_config.json, as vLLM applies them (`--generation-config
    auto`): the values that differ from transformers' GenerationConfig defaults, whatever `do_sample` says. A
    request that omits one of these gets the model's value (else 1.0 / 1.0 / off)."""
    from pathlib import Path

    if not (Path(model_dir) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except (OSError, ValueError):
        return {}
    return {key: diff[key] for key in SAMPLING_DEFAULT_KEYS if diff.get(key) is not None}


def processed_probs(logits, temperature: float, top_p: float):
    """The distribution a request samples from: softmax(logits / T) restricted to the top-p nucleus."""
    import torch

    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        drop = (cumulative - sorted_probs) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def to_host(ids) -> list[int]:
    """Device ids → Python ints. On CUDA the wait happens with the GIL released (pinned copy + event), so the
    server's event loop keeps running while the GPU finishes the step."""
    import torch

    if ids.device.type != "cuda":
        return ids.tolist()
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()


def suppress(logits, token_ids: list[int]) -> None:
    """Forbid tokens in place (min_tokens keeps EOS/stop ids out until enough tokens were produced)."""
    if token_ids:
        logits[..., token_ids] = float("-inf")


def sample_rows(logits, params: list[Any], generator=None) -> list[int]:
    """One token per row. params[i] has temperature, top_p and `generator` (a seeded torch.Generator or None)."""
    import torch

    n = logits.shape[0]
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:
        rows = logits if len(greedy) == n else logits[greedy]
        for i, tok in zip(greedy, to_host(rows.argmax(-1)), strict=True):
            out[i] = tok
    seeded = [i for i, p in enumerate(params) if p.temperature > 0 and p.generator is not None]
    for i in seeded:
        p = params[i]
        probs = processed_probs(logits[i], p.temperature, p.top_p)
        out[i] = int(torch.multinomial(probs, 1, generator=p.generator))
    shared = [i for i, p in enumerate(params) if p.temperature > 0 and p.generator is None]
    if shared:
        # rows with the same (temperature, top_p) are sampled together
        groups: dict[tuple[float, float], list[int]] = {}
        for i in shared:
            groups.setdefault((params[i].temperature, params[i].top_p), []).append(i)
        for (temperature, top_p), idx in groups.items():
            probs = processed_probs(logits[idx], temperature, top_p)
            for i, tok in zip(idx, torch.multinomial(probs, 1, generator=generator)[:, 0].tolist(), strict=True):
                out[i] = tok
    return out


def accept_drafts(target_logits, draft_tokens: list[int], draft_probs, params: Any, generator=None) -> list[int]:
    """Speculative verification for one sequence; returns the tokens to append (accepted drafts + one more).

    target_logits: [k+1, V] target logits at the k draft positions plus the bonus position.
    draft_probs: [k, V] the draft's (processed) distributions, or None for a deterministic drafter
    (prompt lookup: a one-hot proposal). Greedy requests keep drafts while they equal the target's argmax,
    so the output is token-for-token the target's greedy output. Sampling requests use the rule of
    Leviathan et al. / Chen et al.: accept d with probability min(1, p(d)/q(d)); on rejection sample from
    normalize(max(0, p - q)); when every draft is accepted sample the bonus token from p. The output then
    follows exactly the target's distribution.
    """
    import torch

    k = len(draft_tokens)
    if params.temperature <= 0:
        best = target_logits.argmax(-1).tolist()
        out = []
        for i in range(k):
            out.append(best[i])
            if best[i] != draft_tokens[i]:
                return out
        out.append(best[k])
        return out
    gen = params.generator if params.generator is not None else generator
    probs = processed_probs(target_logits, params.temperature, params.top_p)
    out = []
    for i, token in enumerate(draft_tokens):
        p = probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i].to(p.dtype)
        ratio = float(p[token]) / max(float(q[token]), 1e-20)
        u = float(torch.rand((), generator=gen, device=p.device))
        if u < min(1.0, ratio):
            out.append(token)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=gen)))
    return out
