"""The device-side grammar mask of copt serve's constrained decoding equals xgrammar's own kernel, row by row."""

from __future__ import annotations

import pytest

xgr = pytest.importorskip("xgrammar")


class _Fixed:
    def __init__(self, words):
        self.words = words

    def fill_next_token_bitmask(self, out, index):
        out[index] = self.words


@pytest.mark.parametrize("vocab", [1000, 1024, 49155])
def test_mask_equals_xgrammar_kernel_on_chosen_rows(vocab):
    import torch

    from clusteropt_cli.core.serve.structured import apply_grammar_masks

    gen = torch.Generator().manual_seed(vocab)
    words = [torch.randint(-(2**31), 2**31 - 1, ((vocab + 31) // 32,), dtype=torch.int32, generator=gen)
             for _ in range(3)]
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    apply_grammar_masks(logits, [0, 2, 4], [_Fixed(w) for w in words])
    full = torch.full((5, (vocab + 31) // 32), -1, dtype=torch.int32)  # rows 1 and 3: everything allowed
    for row, w in zip([0, 2, 4], words, strict=True):
        full[row] = w
    xgr.apply_token_bitmask_inplace(expected, full)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()
    every = torch.randn(3, vocab, generator=gen)  # all rows constrained: the in-place path
    expected = every.clone()
    apply_grammar_masks(every, [0, 1, 2], [_Fixed(w) for w in words])
    xgr.apply_token_bitmask_inplace(expected, torch.stack(words))
    assert torch.equal(every, expected)
