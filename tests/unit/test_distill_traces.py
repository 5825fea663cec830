"""Trace schema, answer extraction, verification and resumability with controlled generations."""

from __future__ import annotations

import json

import pytest

from clusteropt_cli.core.distill.traces import (
    TRACE_FIELDS,
    Generation,
    PromptRecord,
    SamplingSettings,
    answers_match,
    extract_answer,
    make_trace,
    parse_number,
    progress_path,
    read_prompts,
    run_traces,
    split_reasoning,
)
from clusteropt_cli.errors import BadInputError


def test_split_and_extract():
    assert split_reasoning("<think>\n2 and 3 make 5\n</think>\nThe answer is 5.") == ("2 and 3 make 5",
                                                                                       "The answer is 5.")
    assert split_reasoning("<think>never closed") == (None, None)
    assert split_reasoning(" no tags at all ") == (None, "no tags at all")
    assert extract_answer("so \\boxed{12} and then \\boxed{42}") == "42"
    assert extract_answer("Some words.\nFinal answer: 7.") == "7"
    assert extract_answer("  blue  ") == "blue"
    assert extract_answer(None) is None


@pytest.mark.parametrize(("text", "value"), [("1,234.5", 1234.5), ("x = -3", -3.0), ("3/4", 0.75), ("2e-3", 0.002),
                                             ("no digits", None), ("first 1 then 9", 9.0), (".5", 0.5)])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(("answer", "expected", "mode", "ok"), [
    ("5", "5", "numeric", True), ("5.0000000001", "5", "numeric", True), ("it is 1,000", "1000", "numeric", True),
    ("6", "5", "numeric", False), ("five", "5", "numeric", False), (None, "5", "numeric", False),
    ("Paris", "Paris", "exact", True), ("  Paris. ", "Paris", "exact", True), ("paris", "Paris", "exact", False),
    ("Paris, France", "Paris", "exact", False),
    ("x = 12", r"x\s*=\s*1[0-9]", "regex", True), ("x = 22", r"x\s*=\s*1[0-9]", "regex", False),
    ("ab", "a", "regex", False),  # fullmatch, not search
])
def test_answers_match(answer, expected, mode, ok):
    assert answers_match(answer, expected, mode) is ok


# the routine answers a reasoning model writes, against the reference a dataset stores
MATH_CASES = [
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5"),
    (r"\dfrac{3}{4}", "3/4"),
    (r"x \in \left[1, 2\right)", "[1, 2)"),
    (r"1{,}000", "1000"),
    (r"50\%", "0.5"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
    (r"x = 5", "5"),
]


@pytest.mark.parametrize(("answer", "expected"), MATH_CASES)
def test_math_matching_through_math_verify(answer, expected):
    pytest.importorskip("math_verify")
    assert answers_match(answer, expected, "math")


def test_numeric_and_exact_fail_the_routine_math_answers():
    """Why --match math exists: the other modes miss most of these."""
    misses = [a for a, e in MATH_CASES if not (answers_match(extract_answer(a), e, "numeric")
                                               or answers_match(extract_answer(a), e, "exact"))]
    assert len(misses) >= 5


@pytest.mark.parametrize(("answer", "expected"), [
    (r"\boxed{\frac{1}{3}}", "0.5"), ("[1, 2]", "[1, 2)"), (r"2\sqrt{2}", r"2\sqrt{3}"), ("100", "1000"),
    (r"\frac{4}{3}", "3/4"), ("no answer here", "7"), ("", "7"),
])
def test_math_matching_rejects_wrong_answers(answer, expected):
    pytest.importorskip("math_verify")
    assert not answers_match(answer, expected, "math")


def test_math_mode_in_a_trace_reads_nested_boxes():
    pytest.importorskip("math_verify")
    prompt = PromptRecord("q", "half of one?", "0.5", "math")
    trace = make_trace(prompt, 0, Generation(r"halve it</think> so \boxed{\frac{1}{2}}", 9, "stop"),
                       think_prefix="<think>\n", teacher="t", default_match=None)
    assert trace.verified is True and trace.answer == r"\frac{1}{2}" and trace.match == "math"


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_prompts_reports_every_problem(tmp_path):
    bad = write_prompts(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"nope": 1}, {"prompt": "x", "match": "fuzzy"},
                                               {"prompt": "y", "match": "regex", "answer": "("},
                                               {"prompt": "ok"}])
    with pytest.raises(BadInputError) as info:
        read_prompts(bad)
    text = info.value.message
    for needle in ("line 2", "line 3", "line 4", "line 5", "repeats line 1"):
        assert needle in text
    good = read_prompts(write_prompts(tmp_path / "g.jsonl", [{"id": 7, "prompt": "a", "answer": 3}, {"prompt": "b"}]))
    assert good[0] == PromptRecord("7", "a", "3", None)
    assert good[1].id.startswith("p-") and good[1].answer is None


class ScriptedTeacher:
    """A generation backend whose outputs we control: answer = the prompt's scripted replies, in order."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies = replies
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Generation]]:
        self.calls.append(prompts)
        out = []
        for formatted in prompts:
            key = formatted.split("|")[0]
            texts = self.replies[key][: sampling.samples]
            out.append([Generation(t, len(t.split()), "stop") for t in texts])
        return out


PROMPTS = [PromptRecord("a", "2+3", "5"), PromptRecord("b", "capital of France", "Paris", "exact"),
           PromptRecord("c", "a number between 10 and 19", r"1\d", "regex"), PromptRecord("d", "free text")]
REPLIES = {
    "2+3": ["add them\n</think>\n5", "hmm\n</think>\n6", "still thinking"],
    "capital of France": ["it is Paris\n</think>\nParis", "</think>\nLyon", "</think>\nParis."],
    "a number between 10 and 19": ["</think>\n14", "</think>\n41", "</think>\n\\boxed{19}"],
    "free text": ["</think>\nanything", "</think>\nelse", "</think>\nmore"],
}


def run(tmp_path, teacher, prompts=PROMPTS, **kw):
    return run_traces(prompts, tmp_path / "traces.jsonl", teacher, lambda p: p + "|", teacher="fake",
                      sampling=SamplingSettings(samples=3), batch_prompts=2, **kw)


def test_traces_schema_and_verify_filter(tmp_path):
    teacher = ScriptedTeacher(REPLIES)
    stats = run(tmp_path, teacher, verify=True)
    rows = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert all(tuple(r) == TRACE_FIELDS for r in rows)
    kept = {(r["prompt_id"], r["sample"]) for r in rows}
    # a: only "5"; b: "Paris" and "Paris." (exact after normalisation); c: 14 and boxed 19; d: no answer → nothing
    assert kept == {("a", 0), ("b", 0), ("b", 2), ("c", 0), ("c", 2)}
    assert all(r["verified"] is True for r in rows)
    first = next(r for r in rows if r["prompt_id"] == "a")
    assert first["completion"] == "<think>\nadd them\n</think>\n5"
    assert first["reasoning"] == "add them" and first["answer"] == "5" and first["match"] == "numeric"
    assert stats.samples_total == 12 and stats.samples_kept == 5
    assert stats.kept_fraction == pytest.approx(5 / 12)
    assert stats.prompts_generated == 4 and len(teacher.calls) == 2  # batches of 2 prompts


def test_without_verify_everything_is_kept_and_marked(tmp_path):
    stats = run(tmp_path, ScriptedTeacher(REPLIES), verify=False)
    rows = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and stats.samples_kept == 12
    marks = {(r["prompt_id"], r["sample"]): r["verified"] for r in rows}
    assert marks[("a", 1)] is False and marks[("a", 2)] is False  # wrong, and never closed its thinking
    assert marks[("d", 0)] is None


def test_rerun_skips_done_prompts_and_repairs_partial_batches(tmp_path):
    teacher = ScriptedTeacher(REPLIES)
    run(tmp_path, teacher, prompts=PROMPTS[:2], verify=True)
    out = tmp_path / "traces.jsonl"
    before = out.read_text()
    # simulate a crash: a trace line written for prompt c but c never recorded as done
    out.write_text(before + json.dumps({"prompt_id": "c", "prompt": "x", "completion": "y"}) + "\n")
    teacher2 = ScriptedTeacher(REPLIES)
    stats = run(tmp_path, teacher2, verify=True)
    assert stats.prompts_done_before == 2 and stats.prompts_generated == 2
    assert [p.split("|")[0] for call in teacher2.calls for p in call] == ["a number between 10 and 19", "free text"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows].count("c") == 2  # the stray line is gone, the two verified ones remain
    assert stats.samples_total == 12 and stats.samples_kept == 5  # totals cover both runs
    # a third run has nothing to do
    teacher3 = ScriptedTeacher(REPLIES)
    assert run(tmp_path, teacher3, verify=True).prompts_generated == 0 and teacher3.calls == []


def test_rerun_after_a_kill_mid_line_resumes(tmp_path):
    """A run killed while writing leaves a torn last line in the traces or the progress file: the rerun drops it
    and redoes that prompt; a damaged line before the last is refused, not guessed at."""
    run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:2], verify=True)
    out, progress = tmp_path / "traces.jsonl", progress_path(tmp_path / "traces.jsonl")
    done_b = progress.read_text().splitlines()[-1]
    progress.write_text("\n".join(progress.read_text().splitlines()[:-1]) + "\n" + done_b[: len(done_b) // 2])
    out.write_text(out.read_text() + '{"prompt_id": "c", "prom')
    teacher = ScriptedTeacher(REPLIES)
    stats = run(tmp_path, teacher, verify=True)
    assert stats.prompts_done_before == 1 and stats.prompts_generated == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    assert sorted({r["prompt_id"] for r in rows}) == ["a", "b", "c"]
    assert stats.samples_total == 12 and stats.samples_kept == 5
    lines = progress.read_text().splitlines()
    progress.write_text("\n".join([lines[0], "not json", *lines[1:]]) + "\n")
    with pytest.raises(BadInputError, match="line 2 is not a progress record"):
        run(tmp_path, ScriptedTeacher(REPLIES), verify=True)


def test_rerun_with_other_settings_or_foreign_file_is_refused(tmp_path):
    run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:1], verify=True)
    with pytest.raises(BadInputError, match="verify"):
        run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:1], verify=False)
    stats = run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:1], verify=False, overwrite=True)
    assert stats.prompts_generated == 1
    # a file copt did not write (no progress file beside it) is neither resumed nor replaced, --overwrite or not
    progress_path(tmp_path / "traces.jsonl").unlink()
    mine = (tmp_path / "traces.jsonl").read_text()
    for overwrite in (False, True):
        with pytest.raises(BadInputError, match="not written by") as info:
            run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:1], verify=True, overwrite=overwrite)
        assert "move that file away" in info.value.hint
        assert (tmp_path / "traces.jsonl").read_text() == mine


def test_overwrite_keeps_the_earlier_traces_until_the_new_run_completes(tmp_path):
    """--overwrite that fails (teacher error, Ctrl-C) leaves the earlier traces and progress as they were."""
    run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:2], verify=True)
    out, progress = tmp_path / "traces.jsonl", progress_path(tmp_path / "traces.jsonl")
    before = out.read_text(), progress.read_text()

    class FailsOnSecondBatch(ScriptedTeacher):
        def __call__(self, prompts, sampling):
            if self.calls:
                raise KeyboardInterrupt
            return super().__call__(prompts, sampling)

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, FailsOnSecondBatch(REPLIES), verify=False, overwrite=True)
    assert (out.read_text(), progress.read_text()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces.jsonl", progress.name]
    stats = run(tmp_path, ScriptedTeacher(REPLIES), verify=False, overwrite=True)
    assert stats.prompts_done_before == 0 and stats.prompts_generated == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces.jsonl", progress.name]
    assert out.read_text() != before[0]


def test_a_run_that_fails_before_its_first_prompt_leaves_no_files(tmp_path):
    class Fails(ScriptedTeacher):
        def __call__(self, prompts, sampling):
            raise RuntimeError("the teacher failed")

    with pytest.raises(RuntimeError):
        run(tmp_path, Fails(REPLIES))
    assert list(tmp_path.iterdir()) == []
    # after a recorded prompt, the files stay (the next run resumes them)
    class FailsSecond(ScriptedTeacher):
        def __call__(self, prompts, sampling):
            if self.calls:
                raise RuntimeError("the teacher failed")
            return super().__call__(prompts, sampling)

    with pytest.raises(RuntimeError):
        run(tmp_path, FailsSecond(REPLIES))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces.jsonl", "traces.jsonl.progress.jsonl"]


def test_a_rerun_never_drops_lines_it_did_not_write(tmp_path):
    """Lines a user added to the traces file (ids of no prompt of this run) stop the rerun instead of being
    deleted; a file at the progress path that copt did not write (here the prompts themselves) is neither used nor
    removed."""
    run(tmp_path, ScriptedTeacher(REPLIES), prompts=PROMPTS[:2], verify=True)
    out = tmp_path / "traces.jsonl"
    mine = out.read_text() + json.dumps({"prompt_id": "mine-1", "note": "kept by hand"}) + "\n"
    out.write_text(mine)
    with pytest.raises(BadInputError, match="line .* is not a trace of this run's unfinished prompts"):
        run(tmp_path, ScriptedTeacher(REPLIES), verify=True)
    assert out.read_text() == mine
    fresh = tmp_path / "fresh.jsonl"
    users = progress_path(fresh)
    users.write_text(json.dumps({"prompt": "my own prompts"}) + "\n")
    with pytest.raises(BadInputError, match="copt did not write"):
        run_traces(PROMPTS[:1], fresh, ScriptedTeacher(REPLIES), lambda p: p, teacher="t",
                   sampling=SamplingSettings(samples=1, max_new_tokens=8))
    assert users.read_text() == json.dumps({"prompt": "my own prompts"}) + "\n" and not fresh.exists()
