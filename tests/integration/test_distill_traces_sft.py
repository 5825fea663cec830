"""copt distill traces (through copt serve's engine) and copt distill sft on the fixture teacher and student."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.core.distill.traces import TRACE_FIELDS

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Write a function that returns the mean of a list.", "What does the csv module do?",
    "Explain functools.partial.", "Sort a list of tuples by their second item.", "How do I read a JSON file?",
    "What is a dataclass?", "Make a string title case.", "Parse command line arguments.",
    "Merge two dictionaries.", "What is an enum?", "Split text into words.", "Format a float with 2 decimals.",
    "Find the median of numbers.", "Quote a shell argument.", "Compute a standard deviation.",
    "Tokenize a shell command line.",
]


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def traces_settings(fixtures, prompts, **kw):
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    return DistillRecipe(mode="traces", teacher=str(fixtures.teacher), prompts=prompts, **kw)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def teacher_traces(fixtures, tmp_path_factory):
    """16 prompts × 2 samples of teacher traces (sampled, T=0.8), generated once for the module."""
    from clusteropt_cli.core.distill.generate import distill_traces

    root = tmp_path_factory.mktemp("traces")
    prompts = write_prompts(root / "prompts.jsonl", [{"id": f"q{i}", "prompt": q} for i, q in enumerate(QUESTIONS)])
    out = root / "traces.jsonl"
    stats = distill_traces(traces_settings(fixtures, prompts, samples=2, max_new_tokens=40, sample_temperature=0.8,
                                           seed=3), output=out)
    return out, stats


def test_traces_file_follows_the_schema(teacher_traces):
    out, stats = teacher_traces
    rows = read_jsonl(out)
    assert len(rows) == 32 == stats.samples_total == stats.samples_kept
    assert all(tuple(r) == TRACE_FIELDS for r in rows)
    assert {(r["prompt_id"], r["sample"]) for r in rows} == {(f"q{i}", k) for i in range(16) for k in range(2)}
    for r in rows:
        assert r["completion"].startswith("<think>\n")
        assert 1 <= r["num_tokens"] <= 40 and r["finish_reason"] in ("stop", "length")
        assert r["expected"] is None and r["verified"] is None
    # sampling: two samples of one prompt differ
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r["completion"])
    assert sum(a != b for a, b in by_prompt.values()) >= 12
    assert stats.mean_tokens_all == pytest.approx(sum(r["num_tokens"] for r in rows) / 32)


def test_verify_keeps_only_matching_answers_end_to_end(fixtures, tmp_path):
    """Greedy answers of the real teacher are learnt first; prompts whose `answer` is (or is not) that text then
    show --verify keeping exactly the matching samples."""
    from clusteropt_cli.core.distill.generate import distill_traces

    prompts = [{"id": "a", "prompt": "def"}, {"id": "b", "prompt": "import"}, {"id": "c", "prompt": "class"}]
    greedy = dict(samples=1, max_new_tokens=6, sample_temperature=0.0, think=False)
    probe = tmp_path / "probe.jsonl"
    distill_traces(traces_settings(fixtures, write_prompts(tmp_path / "p0.jsonl", prompts), **greedy), output=probe)
    answers = {r["prompt_id"]: r["answer"] for r in read_jsonl(probe)}
    assert all(isinstance(a, str) for a in answers.values())
    import re

    prompts[0]["answer"], prompts[0]["match"] = answers["a"], "exact"  # right
    prompts[1]["answer"], prompts[1]["match"] = answers["b"] + " wrong", "exact"  # wrong
    prompts[2]["answer"], prompts[2]["match"] = re.escape(answers["c"][:2]) + ".*", "regex"  # right by regex
    out = tmp_path / "verified.jsonl"
    stats = distill_traces(traces_settings(fixtures, write_prompts(tmp_path / "p1.jsonl", prompts), verify=True,
                                           **greedy), output=out)
    rows = read_jsonl(out)
    assert [r["prompt_id"] for r in rows] == ["a", "c"]
    assert all(r["verified"] is True for r in rows)
    assert stats.samples_total == 3 and stats.samples_kept == 2 and stats.verified_correct == 2


def test_traces_cli_resumes_and_skips_done_prompts(fixtures, tmp_path, copt):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, [{"id": "x", "prompt": "Sort a list."}, {"id": "y", "prompt": "Read a file."}])
    out = tmp_path / "traces.jsonl"
    args = ["distill", "traces", "--teacher", str(fixtures.teacher), "--prompts", str(prompts), "--output", str(out),
            "--samples", "2", "--max-new-tokens", "8", "--json"]
    first = copt(*args)
    assert first.returncode == 0, first.stderr
    stats = json.loads(first.stdout)
    assert stats["prompts_generated"] == 2 and stats["samples_total"] == 4 and stats["kept_fraction"] == 1.0
    before = out.read_text()
    write_prompts(prompts, [{"id": "x", "prompt": "Sort a list."}, {"id": "y", "prompt": "Read a file."},
                            {"id": "z", "prompt": "Merge dicts."}])
    # the rerun (in-process: the same code the command calls, without a second interpreter start)
    from dataclasses import asdict

    from clusteropt_cli.core.distill.generate import distill_traces

    again = distill_traces(traces_settings(fixtures, str(prompts), samples=2, max_new_tokens=8), output=out)
    stats = asdict(again)
    assert stats["prompts_done_before"] == 2 and stats["prompts_generated"] == 1 and stats["samples_total"] == 6
    after = out.read_text()
    assert after.startswith(before)  # earlier traces untouched
    assert [r["prompt_id"] for r in read_jsonl(out)] == ["x", "x", "y", "y", "z", "z"]


def test_sft_lowers_the_students_loss_on_held_out_traces(fixtures, teacher_traces, tmp_path):
    from clusteropt_cli.core.distill.sft import distill_sft
    from clusteropt_cli.recipe.schema.distill import DistillRecipe

    out, _ = teacher_traces
    rows = read_jsonl(out)
    held_out = {"q12", "q13", "q14", "q15"}
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt_id"] not in held_out))
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows if r["prompt_id"] in held_out))
    settings = DistillRecipe(mode="sft", student=str(fixtures.student), traces=str(train_file),
                             eval_traces=str(eval_file), max_steps=16, lr=3e-3, schedule="constant", micro_batch=8,
                             seq_len=96, precision="fp32", seed=0)
    result = distill_sft(settings, output_dir=tmp_path / "student")
    assert result.examples == 24 and result.dropped == 0
    assert result.eval_loss_after < result.eval_loss_before - 0.2, (result.eval_loss_before, result.eval_loss_after)
    metrics = read_jsonl(tmp_path / "student" / "metrics.jsonl")
    assert len(metrics) == 16 and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (tmp_path / "student" / "model.safetensors").exists()


def test_a_prompt_beyond_the_teachers_context_is_refused_before_tokenizing(fixtures, monkeypatch):
    """A prompt that cannot fit the context (at least chars / longest vocabulary entry tokens) exits 2 without
    being tokenized (a 200 MB prompt took 8.5 GB to tokenize before the context check)."""
    from clusteropt_cli.core.distill.generate import SamplingSettings, TeacherGenerator
    from clusteropt_cli.errors import BadInputError

    generator = TeacherGenerator(fixtures.teacher, device="cpu")
    longest = max(len(t) for t in generator.tokenizer.get_vocab())
    context = json.loads((fixtures.teacher / "config.json").read_text())["max_position_embeddings"]
    prompt = "x" * (longest * context + 1)

    def never(*_args, **_kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(type(generator.tokenizer), "__call__", never)
    with pytest.raises(BadInputError, match="at least") as info:
        generator([prompt], SamplingSettings(max_new_tokens=8))
    assert info.value.exit_code == 2
