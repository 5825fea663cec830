"""Distillation losses: forward KL, reverse KL and JSD between teacher and student next-token distributions.

Conventions (documented in docs/distill.md):
- Both logits are divided by the temperature T before the softmax and the divergence is multiplied by T² so its
  gradient scale does not shrink with T (Hinton et al.).
- With `top_k`, the teacher is represented by its k most likely tokens plus one "tail" bucket holding the rest of
  its probability mass; the student's distribution is coarse-grained onto the same k+1 buckets. Every divergence
  stays well defined (no zero-probability support), is exact when k covers the vocabulary, and only k values per
  position have to be kept from the teacher.
- `alpha` weights the distillation term and 1-alpha the ordinary next-token cross-entropy on the data.
- Losses are means over the positions whose label is not -100 (the same positions the cross-entropy uses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

LossName = Literal["forward-kl", "reverse-kl", "jsd"]
LOSSES: tuple[str, ...] = ("forward-kl", "reverse-kl", "jsd")
IGNORE_INDEX = -100


@dataclass(frozen=True)
class DistillLossConfig:
    """How the student is pulled towards the teacher."""

    loss: LossName = "forward-kl"
    temperature: float = 2.0
    alpha: float = 0.5
    top_k: int | None = None


def _tail_log_mass(log_probs_topk: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(log_probs_topk))) along the last dim, computed stably (clamped at a tiny floor)."""
    import torch

    covered = torch.logsumexp(log_probs_topk, dim=-1, keepdim=True).clamp(max=0.0)
    # log(1 - exp(c)) = log(-expm1(c)); c <= 0. Floor avoids -inf when k covers all the mass.
    return torch.log((-torch.expm1(covered)).clamp(min=1e-30))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T, without a copy when they are fp32 already and T is 1 (vocab-sized tensors are large)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def teacher_topk(teacher_logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely tokens: (log-probs at temperature T over the full vocabulary, indices).

    This is all that has to be kept of the teacher per position when distilling with `top_k`.
    """
    import torch

    log_probs = torch.log_softmax(_scaled(teacher_logits, temperature), dim=-1)
    values, indices = torch.topk(log_probs, k=min(k, log_probs.size(-1)), dim=-1)
    return values, indices


def bucket_log_probs(log_probs_full: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Coarse-grain a full log-distribution onto the buckets [top-k tokens..., tail]: shape (..., k+1)."""
    import torch

    picked = torch.gather(log_probs_full, -1, indices)
    return torch.cat([picked, _tail_log_mass(picked)], dim=-1)


def _divergence(log_p: torch.Tensor, log_q: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-position divergence between teacher log-probs log_p and student log-probs log_q (summed over the vocab)."""
    import torch

    if loss == "forward-kl":  # KL(teacher || student): mass-covering
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if loss == "reverse-kl":  # KL(student || teacher): mode-seeking
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if loss == "jsd":  # 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        return 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1)
    raise ValueError(f"unknown distillation loss {loss!r}; choose one of {', '.join(LOSSES)}")


def per_token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    *,
    loss: str = "forward-kl",
    temperature: float = 1.0,
    top_k: int | None = None,
    teacher_topk_values: torch.Tensor | None = None,
    teacher_topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divergence at every position (shape logits.shape[:-1]), at temperature T, *without* the T² factor.

    Pass either full `teacher_logits` (optionally with `top_k`) or precomputed `teacher_topk_values`/`indices`
    (from `teacher_topk` at the same temperature).
    """
    import torch

    log_q_full = torch.log_softmax(_scaled(student_logits, temperature), dim=-1)
    if teacher_topk_values is None and top_k is None:
        if teacher_logits is None:
            raise ValueError("per_token_divergence needs teacher_logits or teacher_topk_values")
        log_p = torch.log_softmax(_scaled(teacher_logits, temperature), dim=-1)
        return _divergence(log_p, log_q_full, loss)
    if teacher_topk_values is None:
        teacher_topk_values, teacher_topk_indices = teacher_topk(teacher_logits, top_k, temperature)
    log_p = torch.cat([teacher_topk_values, _tail_log_mass(teacher_topk_values)], dim=-1)
    log_q = bucket_log_probs(log_q_full, teacher_topk_indices)
    return _divergence(log_p, log_q, loss)


def shift_for_next_token(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align position t's logits with label t+1 (causal LM); returns (logits[:, :-1], labels[:, 1:])."""
    return logits[:, :-1, :], labels[:, 1:]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    config: DistillLossConfig,
    *,
    teacher_topk_values: torch.Tensor | None = None,
    teacher_topk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """alpha · T² · divergence + (1 - alpha) · cross-entropy, both averaged over the labelled positions.

    `student_logits`/`teacher_logits` are (batch, seq, vocab) *unshifted* model outputs; `labels` (batch, seq)
    are the input ids with -100 where no loss is wanted (prompt tokens, padding). Returns the loss and its parts
    (floats, for logging: `kd_loss`, `ce_loss`).
    """
    import torch

    s_logits, s_labels = shift_for_next_token(student_logits, labels)
    s_logits = s_logits.float()  # one fp32 copy shared by the CE and the divergence
    mask = s_labels != IGNORE_INDEX
    count = mask.sum().clamp(min=1)
    parts: dict[str, float] = {}
    total = student_logits.new_zeros((), dtype=torch.float32)
    if config.alpha < 1.0:
        ce = torch.nn.functional.cross_entropy(
            s_logits.reshape(-1, s_logits.size(-1)), s_labels.reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="sum") / count
        total = total + (1.0 - config.alpha) * ce
        parts["ce_loss"] = float(ce.detach())
    if config.alpha > 0.0:
        t_logits = teacher_logits[:, :-1, :] if teacher_logits is not None else None
        values = teacher_topk_values[:, :-1, :] if teacher_topk_values is not None else None
        indices = teacher_topk_indices[:, :-1, :] if teacher_topk_indices is not None else None
        div = per_token_divergence(s_logits, t_logits, loss=config.loss, temperature=config.temperature,
                                   top_k=config.top_k, teacher_topk_values=values, teacher_topk_indices=indices)
        kd = (div * mask).sum() / count * (config.temperature ** 2)
        total = total + config.alpha * kd
        parts["kd_loss"] = float(kd.detach())
    return total, parts


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    student_head: Any,
    teacher_hidden: torch.Tensor | None,
    teacher_head: Any,
    labels: torch.Tensor,
    config: DistillLossConfig,
    *,
    chunk_tokens: int = 1024,
    shared_logits: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`distillation_loss` computed from hidden states, `chunk_tokens` positions at a time.

    Inputs are already shifted and flattened: hidden [N, H], labels [N] (-100 ignored). Each chunk's logits (student
    and teacher) exist only inside an activation-checkpointed function, so neither [N, vocab] tensor is ever held;
    backward recomputes one chunk's head matmuls. Same value and gradients as `distillation_loss`.
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    mask = labels != IGNORE_INDEX
    count = mask.sum().clamp(min=1)

    def chunk(h_s: torch.Tensor, h_t: torch.Tensor | None, lab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s_logits = student_head(h_s)
        if shared_logits is not None:
            s_logits = s_logits[..., :shared_logits]
        s_logits = s_logits.float()
        ok = lab != IGNORE_INDEX
        ce = kd = s_logits.new_zeros(())
        if config.alpha < 1.0:
            ce = torch.nn.functional.cross_entropy(s_logits, lab, ignore_index=IGNORE_INDEX, reduction="sum")
        if config.alpha > 0.0:
            with torch.no_grad():
                t_logits = teacher_head(h_t)
                if shared_logits is not None:
                    t_logits = t_logits[..., :shared_logits]
            div = per_token_divergence(s_logits, t_logits, loss=config.loss, temperature=config.temperature,
                                       top_k=config.top_k)
            kd = (div * ok).sum()
        return ce, kd

    ce_sum = kd_sum = student_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, student_hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        h_t = teacher_hidden[start:stop] if teacher_hidden is not None else None
        ce, kd = checkpoint(chunk, student_hidden[start:stop], h_t, labels[start:stop], use_reentrant=False)
        ce_sum = ce_sum + ce
        kd_sum = kd_sum + kd
    total = student_hidden.new_zeros((), dtype=torch.float32)
    parts: dict[str, float] = {}
    if config.alpha < 1.0:
        ce_mean = ce_sum / count
        total = total + (1.0 - config.alpha) * ce_mean
        parts["ce_loss"] = float(ce_mean.detach())
    if config.alpha > 0.0:
        kd_mean = kd_sum / count * (config.temperature ** 2)
        total = total + config.alpha * kd_mean
        parts["kd_loss"] = float(kd_mean.detach())
    return total, parts
