"""copt distill logits on the fixture teacher/student: KD beats CE at equal budget, every loss works, the
vocabulary check refuses a mismatched student."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

# Same data, steps and lr for every run; only the loss settings differ.
BUDGET = dict(max_steps=20, lr=3e-3, schedule="constant", micro_batch=8, seq_len=64, precision="fp32",
              warmup_steps=0, seed=0)


def run(fixtures, tmp_path, name, budget=BUDGET, eval_text=True, **loss_settings):
    from clusteropt_cli.core.distill.logits import distill_logits
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    torch.set_num_threads(2)
    settings = DistillRecipe(mode="logits", teacher=str(fixtures.teacher), student=str(fixtures.student),
                             data=str(fixtures.train_text), **{**budget, **loss_settings})
    return distill_logits(settings, output_dir=tmp_path / name, eval_text=fixtures.eval_text if eval_text else None)


def test_distillation_lowers_kl_more_than_cross_entropy(fixtures, tmp_path):
    kd = run(fixtures, tmp_path, "kd", loss="forward-kl", temperature=1.0, alpha=1.0)
    ce = run(fixtures, tmp_path, "ce", alpha=0.0)
    assert kd.eval_kl_before == pytest.approx(ce.eval_kl_before)  # same student, same held-out text
    before = kd.eval_kl_before
    assert before > 1.0  # the fixture student is far from the teacher to begin with
    # clearly lower than before, and clearly lower than CE-only training with the same budget
    assert kd.eval_kl_after < 0.85 * before, (before, kd.eval_kl_after)
    assert kd.eval_kl_after < ce.eval_kl_after - 0.15, (kd.eval_kl_after, ce.eval_kl_after)
    # the student was saved in HF format with copt train's metrics next to it
    rows = [json.loads(line) for line in (tmp_path / "kd" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == BUDGET["max_steps"] and "kd_loss" in rows[0] and "ce_loss" not in rows[0]
    ce_rows = [json.loads(line) for line in (tmp_path / "ce" / "metrics.jsonl").read_text().splitlines()]
    assert "ce_loss" in ce_rows[0] and "kd_loss" not in ce_rows[0]
    assert (tmp_path / "kd" / "model.safetensors").exists() and (tmp_path / "kd" / "tokenizer.json").exists()


@pytest.mark.parametrize("loss_settings", [
    dict(loss="reverse-kl", temperature=1.0, alpha=1.0),
    dict(loss="jsd", temperature=2.0, alpha=0.8),
    dict(loss="forward-kl", temperature=1.0, alpha=0.9, top_k=32),
], ids=["reverse-kl", "jsd-T2-mixed", "forward-kl-top32-mixed"])
def test_each_loss_option_lowers_its_divergence(fixtures, tmp_path, loss_settings):
    """Each loss, trained briefly, lowers the held-out divergence it optimises (at its temperature and top-k)."""
    from clusteropt_cli.core.distill.logits import load_causal_lm, mean_kl_to_teacher
    from clusteropt_cli.core.train import build_text_dataset

    budget = {**BUDGET, "max_steps": 8, "seq_len": 32}
    run(fixtures, tmp_path, "out", budget=budget, eval_text=False, **loss_settings)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["kd_loss"] >= 0 for r in rows)
    teacher = load_causal_lm(fixtures.teacher, "fp32")
    blocks = build_text_dataset(fixtures.eval_text, load_tokenizer(fixtures.teacher), 32).blocks[:16]
    measure = dict(loss=loss_settings["loss"], temperature=loss_settings["temperature"],
                   top_k=loss_settings.get("top_k"))
    before = mean_kl_to_teacher(load_causal_lm(fixtures.student, "fp32"), teacher, blocks, **measure)
    after = mean_kl_to_teacher(load_causal_lm(tmp_path / "out", "fp32"), teacher, blocks, **measure)
    assert after < 0.97 * before, (before, after)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_vocabulary_mismatch_is_refused_by_the_cli(fixtures, tmp_path, copt):
    # a student whose vocabulary is smaller than the teacher's: refused before any model is loaded
    config = json.loads((fixtures.student / "config.json").read_text())
    config["vocab_size"] = 512
    (tmp_path / "narrow.json").write_text(json.dumps(config))
    result = copt("distill", "logits", "--teacher", str(fixtures.teacher), "--student", str(tmp_path / "narrow.json"),
                  "--data", str(fixtures.train_text), "--output", str(tmp_path / "never"))
    assert result.returncode == 2, result.stderr
    assert "vocab_size 1024" in result.stderr and "512" in result.stderr and "hint:" in result.stderr
    assert not (tmp_path / "never").exists()
    assert result.stdout == ""


def test_cli_json_output_and_refuses_existing_output(fixtures, tmp_path, copt):
    out = tmp_path / "student"
    args = ["distill", "logits", "--teacher", str(fixtures.teacher), "--student", str(fixtures.student),
            "--data", str(fixtures.train_text), "--output", str(out), "--steps", "3", "--seq-len", "32",
            "--micro-batch", "4", "--loss", "jsd", "--top-k", "16", "--temperature", "2", "--alpha", "0.7",
            "--precision", "fp32", "--json"]
    result = copt(*args)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["loss"] == "jsd" and doc["top_k"] == 16 and doc["steps"] == 3
    assert doc["train"]["tokens"] == 3 * 4 * 32 and doc["train"]["peak_mem_bytes"] > 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 1024
    again = copt(*args)
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_save_and_resume_through_the_train_loop(fixtures, tmp_path):
    from clusteropt_cli.errors import BadInputError

    budget = {**BUDGET, "max_steps": 4, "seq_len": 32, "micro_batch": 4, "save_every": 2}
    first = run(fixtures, tmp_path, "out", budget=budget, eval_text=False, alpha=0.5)
    assert first.steps == 4 and (tmp_path / "out" / "checkpoints" / "step-2").is_dir()
    with pytest.raises(BadInputError) as info:  # an existing output is never clobbered silently
        run(fixtures, tmp_path, "out", budget=budget, eval_text=False, alpha=0.5)
    assert "--resume" in info.value.hint
    resumed = run(fixtures, tmp_path, "out", budget={**budget, "resume": True}, eval_text=False, alpha=0.5)
    assert resumed.train["resumed_from"] == 2 and resumed.train["start_step"] == 2 and resumed.steps == 2
    result = json.loads((tmp_path / "out" / "distill_result.json").read_text())
    assert result["train"]["resumed_from"] == 2
