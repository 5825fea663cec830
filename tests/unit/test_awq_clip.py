"""llm-awq's clipping search (core/quantize/awq_clip.py) on hand-made weights."""

from __future__ import annotations

import pytest


def _args(bits: int = 3, group: int = 32, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", strategy="group", group_size=group, symmetric=symmetric)


def _group_errors(weight, inputs, limit, args):
    """Per (channel, group) mean squared error of the group's share of the output after clamp + quantize."""
    import torch

    from clusteropt_cli.core.quantize.awq_clip import _fake_quantize

    out, inp = weight.shape
    g = args.group_size
    w = weight.view(out, inp // g, g)
    x = inputs.view(-1, inp // g, g)
    q = _fake_quantize(torch.clamp(w, -limit, limit), args)
    return (torch.einsum("tgk,cgk->ctg", x, q) - torch.einsum("tgk,cgk->ctg", x, w)).pow(2).mean(1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_search_never_loses_to_no_clipping_and_clips_outlier_groups(symmetric):
    import torch

    from clusteropt_cli.core.quantize.awq_clip import search_clip

    torch.manual_seed(0)
    args = _args(symmetric=symmetric)
    weight = torch.randn(64, 128) * 0.02
    weight[::4, 5] = 0.5  # one outlier weight in the first group of every fourth channel
    inputs = torch.randn(256, 128)
    limit = search_clip(weight, inputs, args)
    assert limit.shape == (64, 4, 1)
    full = weight.view(64, 4, 32).abs().amax(-1, keepdim=True)
    assert torch.all(limit <= full + 1e-7) and torch.all(limit >= 0.55 * full - 1e-7)
    chosen = _group_errors(weight, inputs, limit, args)
    unclipped = _group_errors(weight, inputs, full, args)
    assert torch.all(chosen <= unclipped * (1 + 1e-5))
    plain_rows = [i for i in range(64) if i % 4]  # Gaussian groups at 3 bits: clipping pays (~25 % here)
    assert chosen[plain_rows].sum() < 0.9 * unclipped[plain_rows].sum()
    # the search is driven by the output error: the same weights with that input channel silent clip the
    # outlier (it costs nothing), with that channel loud they keep it
    loud = inputs.clone()
    loud[:, 5] *= 50
    silent = inputs.clone()
    silent[:, 5] = 0
    assert search_clip(weight, silent, args)[0, 0, 0] < search_clip(weight, loud, args)[0, 0, 0]


def test_clip_module_rewrites_weights_and_qparams_consistently():
    import torch
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from clusteropt_cli.core.quantize.awq_clip import clip_module

    torch.manual_seed(0)
    args = _args(bits=4, group=32, symmetric=False)
    linear = torch.nn.Linear(128, 16, bias=False)
    linear.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = linear.weight.detach().view(16, 4, 32)
    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    linear.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    linear.weight_zero_point = torch.nn.Parameter(zero.to(torch.int8), requires_grad=False)
    before = linear.weight.detach().clone()
    ratio = clip_module(linear, torch.randn(128, 128))
    assert 0.55 <= ratio <= 1
    after = linear.weight.detach().view(16, 4, 32)
    assert torch.all(after.abs() <= before.view(16, 4, 32).abs() + 1e-7)  # clamped, never grown
    expected_scale, expected_zero = calculate_qparams(after.amin(-1), after.amax(-1), args)
    assert torch.allclose(linear.weight_scale, expected_scale)
    assert torch.equal(linear.weight_zero_point, expected_zero.to(torch.int8))
