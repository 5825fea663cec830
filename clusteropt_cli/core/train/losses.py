"""Loss functions for causal LMs, with the signature the training loop expects: `loss_fn(model, batch) ->
(loss, metrics)`.

`fused_causal_lm_loss` computes the LM head and the cross-entropy chunk by chunk and produces the gradients
in the same pass, so the [tokens, vocab] logits are never held in fp32 (on a 128k vocabulary at 8 × 2048 tokens
that is 8 GiB per copy) and the head's matmul is not recomputed in backward.
"""

from __future__ import annotations

from typing import Any

from clusteropt_cli.core.train.data import IGNORE_INDEX

LossFn = Any  # Callable[[torch.nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, float]]]


def hf_causal_lm_loss(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
    """The model's own loss (`model(input_ids, labels=labels).loss`): works for every HF causal LM and engine."""
    kwargs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "use_cache": False}
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    return model(**kwargs).loss, {}


def _fused_linear_cross_entropy_function():
    import torch

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """mean CE of (hidden @ weight.T) against labels; gradients computed chunk by chunk in forward."""

        @staticmethod
        def forward(ctx, hidden, weight, labels, chunk_tokens: int, compute_dtype):  # noqa: ANN001
            n_tokens = hidden.shape[0]
            valid = labels != IGNORE_INDEX
            n_valid = valid.sum().clamp(min=1)
            w = weight.to(compute_dtype)
            grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
            loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
            for start in range(0, n_tokens, chunk_tokens):
                h = hidden[start : start + chunk_tokens].to(compute_dtype)
                lab = labels[start : start + chunk_tokens]
                ok = valid[start : start + chunk_tokens]
                logits = (h @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                safe = torch.where(ok, lab, torch.zeros_like(lab))
                target_logit = logits.gather(1, safe[:, None]).squeeze(1)
                loss_sum += ((lse - target_logit) * ok).sum()
                # d(sum CE)/d logits = softmax - onehot, zero on ignored rows
                grad = logits.sub_(lse[:, None]).exp_()
                grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
                grad.mul_(ok[:, None])
                grad = grad.to(compute_dtype)
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk_tokens] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    if _has_out_dtype():
                        grad_weight.addmm_(grad.t(), h, out_dtype=torch.float32)
                    else:
                        grad_weight.add_((grad.t() @ h).float())
            scale = 1.0 / n_valid.to(torch.float32)
            if grad_hidden is not None:
                grad_hidden.mul_(scale.to(grad_hidden.dtype))
            if grad_weight is not None:
                grad_weight.mul_(scale)
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
            return loss_sum * scale

        @staticmethod
        def backward(ctx, grad_output):  # noqa: ANN001
            grad_hidden, grad_weight = ctx.saved_tensors
            gh = grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None
            gw = (grad_weight * grad_output).to(ctx.weight_dtype) if grad_weight is not None else None
            return gh, gw, None, None, None

    return FusedLinearCrossEntropy


_FUNCTION = None
_OUT_DTYPE: bool | None = None


def _has_out_dtype() -> bool:
    """Whether Tensor.addmm_ accepts out_dtype (newer torch); otherwise the product is upcast after the matmul."""
    global _OUT_DTYPE
    if _OUT_DTYPE is None:
        import torch

        try:
            a = torch.zeros(1, 1, dtype=torch.float32)
            a.addmm_(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16),
                     out_dtype=torch.float32)
            _OUT_DTYPE = True
        except (TypeError, RuntimeError):
            _OUT_DTYPE = False
    return _OUT_DTYPE


def fused_linear_cross_entropy(hidden: Any, weight: Any, labels: Any, *, chunk_tokens: int = 2048,
                               compute_dtype: Any = None) -> Any:
    """Mean token cross-entropy of `hidden @ weight.T` (hidden [N, H], weight [V, H], labels [N]) without
    materializing the full logits; -100 labels are ignored."""
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _fused_linear_cross_entropy_function()
    dtype = compute_dtype or hidden.dtype
    return _FUNCTION.apply(hidden, weight, labels, chunk_tokens, dtype)


def make_fused_causal_lm_loss(chunk_tokens: int | None = None):
    """A loss_fn for HF causal LMs with `.model` (the decoder) and `.lm_head`: decoder forward, then the fused
    chunked head + cross-entropy. Under autocast the head runs in the autocast dtype."""

    def fused_causal_lm_loss(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        import torch

        decoder = model.get_decoder()
        head = model.get_output_embeddings()
        kwargs = {"input_ids": batch["input_ids"], "use_cache": False}
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        hidden = decoder(**kwargs).last_hidden_state
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        labels = batch["labels"][:, 1:].reshape(-1)
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        vocab = head.weight.shape[0]
        # keep one fp32 chunk of logits at ~256 MiB
        chunk = chunk_tokens or max(256, (256 * 2**20) // (4 * vocab))
        loss = fused_linear_cross_entropy(hidden, head.weight, labels, chunk_tokens=chunk, compute_dtype=dtype)
        return loss, {}

    return fused_causal_lm_loss


def supports_fused_loss(model: Any) -> bool:
    """Whether the model exposes a decoder and a bias-free linear head (what the fused loss needs)."""
    try:
        head = model.get_output_embeddings()
        model.get_decoder()
    except (AttributeError, NotImplementedError):
        return False
    return head is not None and getattr(head, "bias", None) is None and hasattr(head, "weight") and \
        getattr(model.config, "final_logit_softcapping", None) is None and \
        float(getattr(model.config, "logit_scale", 1.0) or 1.0) == 1.0
