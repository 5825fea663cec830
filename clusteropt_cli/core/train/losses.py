"""Loss functions for causal LMs, with the signature the training loop expects: `loss_fn(model, batch) ->
(loss, metrics)`.

`fused_causal_lm_loss` computes the LM head and the cross-entropy chunk by chunk and produces the gradients
in the same pass, so the [tokens, vocab] logits are never held in fp32 (on a 128k vocabulary at 8 × 2048 tokens
that is 8 GiB per copy) and the head's matmul is not recomputed in backward.
"""

from __future__ import annotations

from typing import Any

from clusteropt_cli.core.train.attention import check_unpadded
from clusteropt_cli.core.train.data import IGNORE_INDEX

LossFn = Any  # Callable[[torch.nn.Module, dict[str, Tensor]], tuple[Tensor, dict[str, float]]]


def hf_causal_lm_loss(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
    """The model's own loss (`model(input_ids, labels=labels).loss`): works for every HF causal LM and engine."""
    kwargs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "use_cache": False}
    check_unpadded(model, batch)
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    return model(**kwargs).loss, {}


def _ce_and_grad(logits, labels, ok):  # noqa: ANN001, ANN202 - tensors
    """Summed CE of one chunk of logits and d(sum CE)/d logits (softmax - onehot, zero on ignored rows), in the
    logits' dtype. Elementwise only: on CUDA it is compiled into a few fused kernels."""
    import torch

    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    safe = torch.where(ok, labels, torch.zeros_like(labels))
    target = x.gather(1, safe[:, None]).squeeze(1)
    loss = ((lse - target) * ok).sum()
    probs = torch.exp(x - lse[:, None])
    grad = probs.scatter_add(1, safe[:, None], -torch.ones_like(lse)[:, None]) * ok[:, None]
    return loss, grad.to(logits.dtype)


_KERNELS: dict[str, Any] = {}
LAST_CHUNK_BUFFER_BYTES = 0  # logits + fp32 copy of the largest chunk of the last call (CPU memory accounting)


def _ce_kernel(device_type: str):
    """`_ce_and_grad`, compiled on CUDA (falls back to eager if compilation is unavailable)."""
    if device_type not in _KERNELS:
        kernel = _ce_and_grad
        if device_type == "cuda":
            try:
                import torch

                kernel = torch.compile(_ce_and_grad, dynamic=False)
            except Exception:  # noqa: BLE001 - eager still computes the same thing
                kernel = _ce_and_grad
        _KERNELS[device_type] = kernel
    return _KERNELS[device_type]


def _fused_linear_cross_entropy_function():
    import torch

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """mean CE of (hidden @ weight.T) against labels; gradients computed chunk by chunk in forward."""

        @staticmethod
        def forward(ctx, hidden, weight, labels, chunk_tokens: int, compute_dtype):  # noqa: ANN001
            # every dtype below is explicit: autocast must not recast the fp32 gradient accumulator
            with torch.autocast(hidden.device.type, enabled=False):
                return FusedLinearCrossEntropy._forward(ctx, hidden, weight, labels, chunk_tokens, compute_dtype)

        @staticmethod
        def _forward(ctx, hidden, weight, labels, chunk_tokens: int, compute_dtype):  # noqa: ANN001
            n_tokens = hidden.shape[0]
            valid = labels != IGNORE_INDEX
            n_valid = valid.sum().clamp(min=1)
            w = weight.to(compute_dtype)
            grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
            loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
            kernel = _ce_kernel(hidden.device.type)
            fp32_out = compute_dtype != torch.float32 and _has_out_dtype(hidden.device)
            for start in range(0, n_tokens, chunk_tokens):
                h = hidden[start : start + chunk_tokens].to(compute_dtype)
                logits = h @ w.t()
                global LAST_CHUNK_BUFFER_BYTES
                LAST_CHUNK_BUFFER_BYTES = max(LAST_CHUNK_BUFFER_BYTES, logits.numel() * (
                    logits.element_size() + (4 if logits.dtype != torch.float32 else 0)))
                try:
                    chunk_loss, grad = kernel(logits, labels[start : start + chunk_tokens],
                                              valid[start : start + chunk_tokens])
                except Exception:  # noqa: BLE001 - a compile failure: use (and keep) the eager kernel
                    if kernel is _ce_and_grad:
                        raise
                    kernel = _KERNELS[hidden.device.type] = _ce_and_grad
                    chunk_loss, grad = kernel(logits, labels[start : start + chunk_tokens],
                                              valid[start : start + chunk_tokens])
                loss_sum += chunk_loss
                del logits
                if grad_hidden is not None:
                    grad_hidden[start : start + chunk_tokens] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    if fp32_out:  # bf16 inputs, fp32 accumulation in the GEMM itself
                        grad_weight = torch.addmm(grad_weight, grad.t(), h, out_dtype=torch.float32)
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
_OUT_DTYPE: dict[str, bool] = {}


def _has_out_dtype(device: Any) -> bool:
    """Whether torch.addmm takes out_dtype (bf16 × bf16 → fp32) on this device (CUDA in recent torch)."""
    key = device.type
    if key not in _OUT_DTYPE:
        import torch

        try:
            a = torch.zeros(1, 1, dtype=torch.float32, device=device)
            b = torch.zeros(1, 1, dtype=torch.bfloat16, device=device)
            torch.addmm(a, b, b, out_dtype=torch.float32)
            _OUT_DTYPE[key] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


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
        check_unpadded(model, batch)
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        hidden = decoder(**kwargs).last_hidden_state
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        labels = batch["labels"][:, 1:].reshape(-1)
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) \
            else hidden.dtype
        vocab = head.weight.shape[0]
        # one chunk of fp32 logits ≈ 1 GiB (2048 tokens of a 128k vocabulary)
        chunk = chunk_tokens or max(256, 2**30 // (4 * vocab))
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
