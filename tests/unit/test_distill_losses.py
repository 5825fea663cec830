"""Distillation losses against hand-computed values (3-token vocabulary)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from clusteropt_cli.core.distill.losses import (  # noqa: E402
    DistillLossConfig,
    distillation_loss,
    per_token_divergence,
    teacher_topk,
)

P = [0.7, 0.2, 0.1]  # teacher
Q = [0.4, 0.4, 0.2]  # student
FWD = 0.7 * math.log(0.7 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.2)
REV = 0.4 * math.log(0.4 / 0.7) + 0.4 * math.log(0.4 / 0.2) + 0.2 * math.log(0.2 / 0.1)
M = [(a + b) / 2 for a, b in zip(P, Q, strict=True)]
JSD = 0.5 * sum(a * math.log(a / m) for a, m in zip(P, M, strict=True)) + \
    0.5 * sum(b * math.log(b / m) for b, m in zip(Q, M, strict=True))


def logits(probs: list[float], temperature: float = 1.0):
    """Logits whose softmax at `temperature` is `probs`."""
    return torch.log(torch.tensor(probs, dtype=torch.float64)) * temperature


@pytest.mark.parametrize(("loss", "expected"), [("forward-kl", FWD), ("reverse-kl", REV), ("jsd", JSD)])
def test_divergences_match_hand_values(loss, expected):
    got = per_token_divergence(logits(Q), logits(P), loss=loss).item()
    assert got == pytest.approx(expected, rel=1e-6)
    assert per_token_divergence(logits(P), logits(P), loss=loss).item() == pytest.approx(0.0, abs=1e-7)


def test_forward_and_reverse_differ_and_jsd_bounded():
    assert FWD != pytest.approx(REV)
    assert 0 < JSD < math.log(2)


def test_temperature_softens_both_sides():
    # logits built for T=2 give P and Q after dividing by 2: the divergence at T=2 equals the one above
    got = per_token_divergence(logits(Q, 2.0), logits(P, 2.0), loss="forward-kl", temperature=2.0).item()
    assert got == pytest.approx(FWD, rel=1e-6)
    # the same logits at T=1 are sharper distributions (P², Q² renormalised): a different value
    p2 = [x * x for x in P]
    q2 = [x * x for x in Q]
    p2 = [x / sum(p2) for x in p2]
    q2 = [x / sum(q2) for x in q2]
    sharp = sum(a * math.log(a / b) for a, b in zip(p2, q2, strict=True))
    assert per_token_divergence(logits(Q, 2.0), logits(P, 2.0), loss="forward-kl").item() == pytest.approx(sharp)


@pytest.mark.parametrize("loss", ["forward-kl", "reverse-kl", "jsd"])
def test_top1_buckets_teacher_mass(loss):
    # top-1: buckets [token 0, rest]; teacher [0.7, 0.3], student [0.4, 0.6]
    p, q = [0.7, 0.3], [0.4, 0.6]
    if loss == "forward-kl":
        expected = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    elif loss == "reverse-kl":
        expected = sum(b * math.log(b / a) for a, b in zip(p, q, strict=True))
    else:
        m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
        expected = 0.5 * sum(a * math.log(a / c) for a, c in zip(p, m, strict=True)) + \
            0.5 * sum(b * math.log(b / c) for b, c in zip(q, m, strict=True))
    got = per_token_divergence(logits(Q), logits(P), loss=loss, top_k=1).item()
    assert got == pytest.approx(expected, rel=1e-5)


def test_topk_covering_vocab_is_exact_and_precomputed_matches():
    full = per_token_divergence(logits(Q), logits(P), loss="forward-kl").item()
    top3 = per_token_divergence(logits(Q), logits(P), loss="forward-kl", top_k=3).item()
    assert top3 == pytest.approx(full, rel=1e-5)
    values, indices = teacher_topk(logits(P), 2)
    assert indices.tolist() == [0, 1]
    assert values.exp().tolist() == pytest.approx([0.7, 0.2])
    pre = per_token_divergence(logits(Q), None, loss="forward-kl", teacher_topk_values=values,
                               teacher_topk_indices=indices).item()
    assert pre == pytest.approx(per_token_divergence(logits(Q), logits(P), loss="forward-kl", top_k=2).item())
    # top-2 here: buckets [0.7, 0.2, 0.1] vs [0.4, 0.4, 0.2] — the tail is exactly token 2
    assert pre == pytest.approx(FWD, rel=1e-5)


def _batch(vocab_probs_student, vocab_probs_teacher, temperature=1.0):
    """(batch=1, seq=2, vocab=3) logits; position 0 predicts label[1]; position 1 has no next token."""
    s = torch.stack([logits(vocab_probs_student, temperature), logits([1 / 3] * 3)]).unsqueeze(0)
    t = torch.stack([logits(vocab_probs_teacher, temperature), logits([1 / 3] * 3)]).unsqueeze(0)
    return s, t


def test_alpha_mix_temperature_squared_and_masking():
    s, t = _batch(Q, P, temperature=2.0)
    labels = torch.tensor([[0, 1]])  # position 0 → token 1 (student prob at T=1 is Q² renormalised)
    q_t1 = [x * x / sum(y * y for y in Q) for x in Q]
    ce = -math.log(q_t1[1])
    kd = 4.0 * FWD  # T² · KL at T=2
    cfg = DistillLossConfig(loss="forward-kl", temperature=2.0, alpha=0.25)
    total, parts = distillation_loss(s, t, labels, cfg)
    assert parts["ce_loss"] == pytest.approx(ce, rel=1e-5)
    assert parts["kd_loss"] == pytest.approx(kd, rel=1e-5)
    assert total.item() == pytest.approx(0.25 * kd + 0.75 * ce, rel=1e-5)
    only_ce, parts_ce = distillation_loss(s, t, labels, DistillLossConfig(alpha=0.0, temperature=2.0))
    assert "kd_loss" not in parts_ce and only_ce.item() == pytest.approx(ce, rel=1e-5)
    # a masked label drops its position from both terms
    masked, parts_masked = distillation_loss(s, t, torch.tensor([[0, -100]]), cfg)
    assert masked.item() == pytest.approx(0.0, abs=1e-7)


def test_gradient_flows_to_student_only():
    s, t = _batch(Q, P)
    s.requires_grad_(True)
    t.requires_grad_(True)
    total, _ = distillation_loss(s, t.detach(), torch.tensor([[0, 1]]), DistillLossConfig(alpha=1.0, temperature=1.0))
    total.backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    # d KL(p||q)/d logits_q = q - p at the distilled position
    assert s.grad[0, 0].tolist() == pytest.approx([q - p for p, q in zip(P, Q, strict=True)], abs=1e-6)


def _tiny_llama(hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=2 * hidden,
                                        max_position_embeddings=64, tie_word_embeddings=False))


@pytest.mark.parametrize("cfg", [
    DistillLossConfig("forward-kl", 2.0, 0.5, None), DistillLossConfig("reverse-kl", 1.0, 1.0, None),
    DistillLossConfig("jsd", 1.5, 0.7, 8), DistillLossConfig("forward-kl", 1.0, 0.0, None),
], ids=["fkl-mixed", "rkl", "jsd-top8", "ce-only"])
def test_chunked_loss_matches_full_logits_loss_and_gradients(cfg):
    pytest.importorskip("transformers")
    from clusteropt_cli.core.distill.logits import make_distill_loss_fn

    teacher, student = _tiny_llama(32, 2, 0), _tiny_llama(16, 1, 1)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt part without loss
    batch = {"input_ids": ids, "labels": labels}
    full_loss, full_parts = make_distill_loss_fn(teacher, cfg, chunk_tokens=0)(student, batch)
    full_loss.backward()
    full_grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad()
    chunk_loss, chunk_parts = make_distill_loss_fn(teacher, cfg, chunk_tokens=7)(student, batch)  # 30 rows: 7,7,..,2
    chunk_loss.backward()
    assert chunk_loss.item() == pytest.approx(full_loss.item(), rel=1e-5)
    assert chunk_parts == pytest.approx(full_parts, rel=1e-5)
    for full, p in zip(full_grads, student.parameters(), strict=True):
        torch.testing.assert_close(p.grad, full, rtol=1e-4, atol=1e-6)
