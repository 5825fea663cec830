"""copt distill onpolicy (TRL's DistillationTrainer) on the fixture teacher/student, against off-policy
`distill logits` with the same steps, learning rate, batch and divergence (forward KL)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

STEPS, LR, BATCH, SEQ_LEN, NEW_TOKENS = 20, 3e-3, 8, 64, 32


def _prompts(text_path, count):
    return [line[:48] for line in text_path.read_text().splitlines() if len(line.strip()) > 24][:count]


def test_input_errors_exit_2_before_loading(copt, fixtures, tmp_path):
    base = ("distill", "onpolicy", "--teacher", str(fixtures.teacher), "--student", str(fixtures.student),
            "--output", str(tmp_path / "out"))
    r = copt(*base)
    assert r.returncode == 2 and "--prompts is required" in r.stderr
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    r = copt(*base, "--prompts", str(prompts), "zero=2")
    assert r.returncode == 2 and "--zero 2" in r.stderr
    r = copt(*base, "--prompts", str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "out").exists()


def test_onpolicy_against_off_policy_logits_at_equal_steps(copt, fixtures, tmp_path):
    from clusteropt_cli.core.distill.logits import distill_logits, load_causal_lm
    from clusteropt_cli.core.distill.onpolicy import on_policy_kl
    from clusteropt_cli.core.distill.vocab import load_tokenizer
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    train_prompts = tmp_path / "prompts.txt"
    train_prompts.write_text("\n".join(_prompts(fixtures.train_text, 256)) + "\n")
    eval_prompts = tmp_path / "eval_prompts.txt"
    held_out = _prompts(fixtures.eval_text, 24)
    eval_prompts.write_text("\n".join(held_out) + "\n")
    r = copt("distill", "onpolicy", "--teacher", str(fixtures.teacher), "--student", str(fixtures.student),
             "--prompts", str(train_prompts), "--output", str(tmp_path / "on"), "--steps", str(STEPS), "--lr", str(LR),
             "--micro-batch", str(BATCH), "--seq-len", str(SEQ_LEN), "--beta", "0", "--max-new-tokens",
             str(NEW_TOKENS), "--eval-data", str(fixtures.eval_text), "--eval-prompts", str(eval_prompts),
             "--precision", "fp32", "schedule=constant", "--json", env={"OMP_NUM_THREADS": "2"}, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    on = json.loads(r.stdout)
    assert on["steps"] == STEPS and len(on["losses"]) == STEPS and on["trl_version"].startswith("1.")
    assert (tmp_path / "on" / "model.safetensors").exists() and (tmp_path / "on" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "on" / "distill_result.json").read_text())["steps"] == STEPS

    torch.set_num_threads(2)
    off = distill_logits(DistillRecipe(mode="logits", teacher=str(fixtures.teacher), student=str(fixtures.student),
                                       data=str(fixtures.train_text), max_steps=STEPS, lr=LR, schedule="constant",
                                       micro_batch=BATCH, seq_len=SEQ_LEN, precision="fp32", warmup_steps=0, seed=0,
                                       loss="forward-kl", temperature=1.0, alpha=1.0),
                         output_dir=tmp_path / "off", eval_text=fixtures.eval_text)
    teacher, tokenizer = load_causal_lm(fixtures.teacher, "fp32"), load_tokenizer(fixtures.teacher)
    off_policy_after = on_policy_kl(load_causal_lm(tmp_path / "off", "fp32"), teacher, tokenizer, held_out,
                                    max_new_tokens=NEW_TOKENS, seed=0)
    print(f"\nheld-out text KL: before {on['eval_kl_before']:.3f}, onpolicy {on['eval_kl_after']:.3f}, "
          f"logits {off.eval_kl_after:.3f}; KL on the student's own samples: before "
          f"{on['on_policy_kl_before']:.3f}, onpolicy {on['on_policy_kl_after']:.3f}, logits {off_policy_after:.3f}")
    assert on["eval_kl_before"] == pytest.approx(off.eval_kl_before, rel=1e-4)  # same student, same blocks
    # both methods move the student towards the teacher ...
    assert on["eval_kl_after"] < 0.85 * on["eval_kl_before"] and off.eval_kl_after < 0.85 * off.eval_kl_before
    assert on["on_policy_kl_after"] < 0.85 * on["on_policy_kl_before"]
    # ... and on the tokens the student actually produces, on-policy training gets closer in the same steps
    assert on["on_policy_kl_after"] < off_policy_after
