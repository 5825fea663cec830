"""Chain-of-thought trace distillation, step 1: the teacher writes `<think>…</think>` traces for prompts.

Prompts file (.jsonl, one object a line):
    {"id": "q1", "prompt": "What is 2+3?", "answer": "5", "match": "numeric"}
`prompt` is required; `id` defaults to a hash of the prompt; `answer` (string or number) and `match`
(exact | numeric | regex; default: the --match setting) are used by --verify.

Traces file (.jsonl, one sample a line; TRACE_FIELDS below, documented in docs/distill.md):
    {"prompt_id", "prompt", "sample", "completion", "reasoning", "answer", "expected", "match", "verified",
     "num_tokens", "finish_reason", "teacher"}
`completion` is the assistant message exactly as trained on by `copt distill sft` (the reasoning inside
<think>…</think>, then the final answer).

Resumability: `<output>.progress.jsonl` records every prompt whose samples are finished (with its counts), written
after that prompt's traces are flushed to the output. A rerun skips those prompts and drops any trace lines of
prompts that never reached the progress file (a run stopped mid-batch).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from clusteropt_cli.core.textfiles import jsonl_rows, string_field
from clusteropt_cli.errors import BadInputError

MatchMode = Literal["exact", "numeric", "regex", "math"]
MATCH_MODES: tuple[str, ...] = ("exact", "numeric", "regex", "math")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TRACE_FIELDS = ("prompt_id", "prompt", "sample", "completion", "reasoning", "answer", "expected", "match",
                "verified", "num_tokens", "finish_reason", "teacher")
PROGRESS_VERSION = 1


# ---- prompts -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptRecord:
    """One line of the prompts file."""

    id: str
    prompt: str
    answer: str | None = None
    match: MatchMode | None = None


def prompt_id(text: str) -> str:
    """A stable id for a prompt without an `id` field."""
    return "p-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def read_prompts(path: str | Path, *, flag: str = "--prompts") -> list[PromptRecord]:
    """Parse and validate the prompts file; every problem is reported at once, each with its line number."""
    path = Path(path)
    records: list[PromptRecord] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for number, row in jsonl_rows(path, flag, 'Pass a .jsonl file with one {"prompt": ...} a line.', problems):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            problems.append(f"line {number}: needs a non-empty string 'prompt'")
            continue
        unknown = set(row) - {"id", "prompt", "answer", "match"}
        if unknown:
            problems.append(f"line {number}: unknown field(s) {', '.join(sorted(unknown))}")
        answer = row.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            problems.append(f"line {number}: 'answer' must be a string or a number")
            answer = None
        match = row.get("match")
        if match is not None and match not in MATCH_MODES:
            problems.append(f"line {number}: 'match' must be one of {', '.join(MATCH_MODES)}")
            match = None
        if match == "regex" and isinstance(answer, str):
            try:
                re.compile(answer)
            except re.error as exc:
                problems.append(f"line {number}: 'answer' is not a valid regex ({exc})")
        pid = str(row["id"]) if row.get("id") is not None else prompt_id(row["prompt"])
        if pid in seen:
            problems.append(f"line {number}: id {pid!r} repeats line {seen[pid]}")
        seen[pid] = number
        records.append(PromptRecord(pid, row["prompt"], None if answer is None else str(answer), match))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise BadInputError(f"{flag} {path} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in shown),
                            hint='Each line: {"id": "q1", "prompt": "...", "answer": "42", "match": "numeric"}')
    if not records:
        raise BadInputError(f"{flag} {path} has no prompts.", hint="Add lines like {\"prompt\": \"...\"}.")
    return records


# ---- answers -----------------------------------------------------------------------------------------------

def split_reasoning(completion: str) -> tuple[str | None, str | None]:
    """(reasoning, final answer text) of a completion; the answer is what follows the last </think>.

    A completion that opens <think> but never closes it has no answer (None): R1-style rejection treats it as
    wrong. A completion without any think tags (generated with --no-think) is all answer.
    """
    if THINK_CLOSE not in completion:
        return (None, None) if THINK_OPEN in completion else (None, completion.strip())
    head, _, tail = completion.rpartition(THINK_CLOSE)
    reasoning = head.split(THINK_OPEN, 1)[1] if THINK_OPEN in head else head
    return reasoning.strip(), tail.strip()


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, nested braces included (\\boxed{\\frac{1}{2}} → \\frac{1}{2})."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None

_ANSWER_LINE = re.compile(r"(?i)(?:final answer|answer)\s*(?:is|:)\s*(.+)")


def extract_answer(answer_text: str | None) -> str | None:
    """The final answer inside the answer text: the last \\boxed{...}, else an 'Answer: X' line, else the text."""
    if answer_text is None:
        return None
    boxed = _last_boxed(answer_text)
    if boxed is not None:
        return boxed.strip()
    lines = _ANSWER_LINE.findall(answer_text)
    if lines:
        return lines[-1].strip().rstrip(".").strip()
    return answer_text.strip()


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")


def parse_number(text: str) -> float | None:
    """The last number in the text (1,234.5 / -3 / 2e-3 / 3/4 / 50%), or None."""
    found = _NUMBER.findall(text.replace("−", "-"))
    if not found:
        return None
    token = found[-1].replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return float(Fraction(num) / Fraction(den)) if float(den) != 0 else None
        return float(token)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_text(text: str) -> str:
    """Whitespace collapsed, outer whitespace and a trailing period removed (for exact matching)."""
    return " ".join(text.split()).rstrip(".").strip()


def answers_match(answer: str | None, expected: str, mode: MatchMode) -> bool:
    """Does the extracted answer match the expected one?

    exact: equal after normalize_text; numeric: the last number in the answer equals the expected number
    (relative tolerance 1e-6); regex: `re.fullmatch(expected, answer)` on the stripped answer; math: the two are
    the same mathematical object by Math-Verify (LaTeX or plain expressions: fractions, radicals, intervals,
    percentages, thousands separators, equations x = 5).
    """
    if answer is None:
        return False
    if mode == "math":
        return math_equal(answer, expected)
    if mode == "exact":
        return normalize_text(answer) == normalize_text(expected)
    if mode == "numeric":
        got, want = parse_number(answer), parse_number(expected)
        if got is None or want is None:
            return False
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if mode == "regex":
        return re.fullmatch(expected, answer.strip(), flags=re.DOTALL) is not None
    raise ValueError(f"unknown match mode {mode!r}")


def _as_latex(text: str) -> str:
    """Math-Verify finds LaTeX inside $...$, \\(...\\), \\[...\\] or \\boxed{}; a bare answer gets $...$."""
    text = text.strip()
    if any(mark in text for mark in ("$", "\\boxed", "\\(", "\\[")):
        return text
    return f"${text}$"


def math_equal(answer: str, expected: str) -> bool:
    """Math-Verify's verdict: parse both (LaTeX and plain expressions), compare symbolically and numerically."""
    import threading

    from clusteropt_cli.deps import require

    require("math_verify", "distill")
    from math_verify import parse, verify

    # its timeouts use SIGALRM, which only the main thread can set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(expected), parsing_timeout=timeout)
    pred = parse(_as_latex(answer), parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def default_match_mode(expected: str) -> MatchMode:
    """numeric when the expected answer is a number, else exact."""
    try:
        float(expected.replace(",", ""))
        return "numeric"
    except ValueError:
        return "exact"


# ---- trace records -----------------------------------------------------------------------------------------

@dataclass
class Generation:
    """What the generation backend returns for one sample."""

    text: str
    num_tokens: int
    finish_reason: str  # "stop" (eos / stop token) or "length"


@dataclass
class TraceRecord:
    """One line of the traces file."""

    prompt_id: str
    prompt: str
    sample: int
    completion: str
    reasoning: str | None
    answer: str | None
    expected: str | None
    match: str | None
    verified: bool | None  # None: no expected answer, or --verify off and nothing to check
    num_tokens: int
    finish_reason: str
    teacher: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def make_trace(prompt: PromptRecord, sample: int, generation: Generation, *, think_prefix: str, teacher: str,
               default_match: MatchMode | None) -> TraceRecord:
    """Turn one generation into a trace: prepend the forced thinking prefix, split out the answer, check it."""
    completion = think_prefix + generation.text
    reasoning, answer_text = split_reasoning(completion)
    answer = extract_answer(answer_text)
    mode: str | None = None
    verified: bool | None = None
    if prompt.answer is not None:
        mode = prompt.match or default_match or default_match_mode(prompt.answer)
        # Math-Verify finds the answer itself (the last \boxed{}, nested braces included) in the answer text
        checked = answer_text if mode == "math" else answer
        verified = answers_match(checked, prompt.answer, mode)  # type: ignore[arg-type]
    return TraceRecord(prompt.id, prompt.prompt, sample, completion, reasoning, answer, prompt.answer, mode,
                       verified, generation.num_tokens, generation.finish_reason, teacher)


def read_traces(path: str | Path, *, flag: str = "--traces") -> list[dict[str, Any]]:
    """Parse a traces file, checking each line has the fields `sft` needs."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    for number, row in jsonl_rows(path, flag, "Write it with 'copt distill traces' (one trace object a line)."):
        if string_field(row, "prompt") is None or string_field(row, "completion") is None:
            raise BadInputError(f"{flag} {path}:{number} needs string 'prompt' and 'completion' fields.",
                                hint="Each line must be one trace object (copt distill traces).")
        rows.append(row)
    if not rows:
        raise BadInputError(f"{flag} {path} has no traces.", hint="Generate some with 'copt distill traces'.")
    return rows


# ---- resumable generation ----------------------------------------------------------------------------------

@dataclass
class SamplingSettings:
    """How the teacher samples."""

    samples: int = 4
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0


@dataclass
class TraceStats:
    """Totals over the whole traces file (this run plus the runs it resumed)."""

    prompts: int = 0
    prompts_done_before: int = 0
    prompts_generated: int = 0
    samples_total: int = 0
    samples_kept: int = 0
    kept_fraction: float = 0.0
    mean_tokens_all: float = 0.0
    mean_tokens_kept: float = 0.0
    verified_correct: int = 0
    output: str = ""
    tokens_generated: int = 0
    generation_s: float = 0.0
    output_tokens_per_s: float = 0.0
    thinking: str = ""  # how the teacher was asked to reason (generate.thinking_mode)
    per_prompt: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.jsonl")


def _settings_key(teacher: str, sampling: SamplingSettings, verify: bool, think_prefix: str,
                  template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    key = {"version": PROGRESS_VERSION, "teacher": teacher, "samples": sampling.samples,
           "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
           "top_k": sampling.top_k, "verify": verify, "think_prefix": think_prefix}
    if template_kwargs:  # only when set: progress files written before the switch existed still resume
        key["chat_template_kwargs"] = dict(template_kwargs)
    return key


def _json_lines(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The JSON lines of a progress file and whether its last record is torn (a run killed while writing it: left
    out); any other line that is not a JSON object is refused."""
    text = path.read_text(encoding="utf-8", errors="replace")
    raw = [line for line in text.splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(raw, 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number < len(raw):
            raise BadInputError(f"{path} line {number} is not a progress record copt wrote.",
                                hint="Pass --overwrite to start over, or restore the file.")
    return rows, len(rows) != len(raw) or not text.endswith("\n")


def _prompt_id(line: str) -> Any:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row.get("prompt_id") if isinstance(row, dict) else None


def check_traces_output(output: Path) -> None:
    """An existing --output is resumed or (with --overwrite) replaced only when `copt distill traces` wrote it (its
    progress file beside it): any other file is the user's, and copt neither appends to nor deletes it."""
    if output.is_dir():
        raise BadInputError(f"--output {output} is a directory.", hint="Pass a file path such as traces.jsonl.")
    if os.path.lexists(output) and not progress_path(output).is_file():
        raise BadInputError(f"--output {output} exists but was not written by 'copt distill traces' "
                            f"(no {progress_path(output).name} beside it); copt neither appends to nor replaces it.",
                            hint="Choose another --output, or move that file away yourself.")


def _load_progress(output: Path, key: dict[str, Any], prompt_ids: set[str]) -> dict[str, dict[str, int]]:
    """Prompts already done (id → counts). Repairs the output when a run stopped between a batch and its record:
    only the trailing trace lines of that batch (prompts of this run not recorded as done) and a torn last line go;
    any other line is the user's, and the run stops instead of deleting it."""
    progress = progress_path(output)
    if not output.exists():
        if os.path.lexists(progress):  # an earlier run's, whose traces file is gone: only a progress file copt wrote
            _check_progress_file(progress)
            progress.unlink()
        return {}
    check_traces_output(output)
    lines, torn = _json_lines(progress)
    header = lines[0] if lines else {}
    if header.get("settings") != key:
        diff = sorted(k for k in key if (header.get("settings") or {}).get(k) != key[k])
        raise BadInputError(f"--output {output} was written with other settings ({', '.join(diff)} differ); "
                            "resuming would mix them.", hint="Rerun with the same settings, or pass --overwrite.")
    if torn:  # keep the whole records, so the next ones append after a complete line
        from clusteropt_cli.core.io import atomic_write_text

        atomic_write_text(progress, "".join(json.dumps(row) + "\n" for row in lines))
    done = {row["prompt_id"]: row for row in lines[1:]}
    text = output.read_text(encoding="utf-8")
    numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    ids = [_prompt_id(line) for _, line in numbered]
    last_done = max((i for i, pid in enumerate(ids) if pid in done), default=-1)
    kept_lines = [line for _, line in numbered[:last_done + 1]]
    for i in range(last_done + 1, len(numbered)):
        torn_tail = i == len(numbered) - 1 and not text.endswith("\n") and ids[i] is None
        if torn_tail or ids[i] in prompt_ids:
            continue  # the unfinished batch of a stopped run
        raise BadInputError(f"--output {output} line {numbered[i][0]} is not a trace of this run's unfinished "
                            "prompts; resuming would drop it.",
                            hint="Move lines you added to another file, or pass --overwrite to start over.")
    stray = [numbered[i][0] for i in range(last_done + 1) if ids[i] not in done]
    if stray:
        raise BadInputError(f"--output {output} line {stray[0]} is not a trace of a prompt the progress file records "
                            "as done; resuming would drop it.",
                            hint="Move lines you added to another file, or pass --overwrite to start over.")
    if len(kept_lines) != len(numbered):
        from clusteropt_cli.core.io import atomic_write_text

        atomic_write_text(output, "".join(line + "\n" for line in kept_lines))
    return done


def _check_progress_file(progress: Path) -> None:
    """A file at the progress path that copt did not write (its first line a settings record) is not removed."""
    try:
        with progress.open(encoding="utf-8", errors="replace") as handle:
            first = json.loads(handle.readline() or "null")
    except (OSError, ValueError):
        first = None
    if not (isinstance(first, dict) and isinstance(first.get("settings"), dict)):
        raise BadInputError(f"{progress} is where 'copt distill traces' keeps its progress for this --output, and it "
                            "holds a file copt did not write; copt neither uses nor deletes it.",
                            hint="Choose another --output, or move that file away yourself.")


GenerateFn = Callable[[list[str], SamplingSettings], list[list[Generation]]]


def run_traces(
    prompts: list[PromptRecord],
    output: Path,
    generate: GenerateFn,
    format_prompt: Callable[[str], str],
    *,
    teacher: str,
    sampling: SamplingSettings,
    verify: bool = False,
    default_match: MatchMode | None = None,
    think_prefix: str = THINK_OPEN + "\n",
    template_kwargs: dict[str, Any] | None = None,
    batch_prompts: int = 32,
    overwrite: bool = False,
    on_batch: Callable[[int, int], None] | None = None,
) -> TraceStats:
    """Generate `sampling.samples` traces per prompt not done yet, append them to `output`, return the stats.

    `generate(formatted_prompts, sampling)` returns, for each prompt, `sampling.samples` generations (the
    serve engine batches all of them through continuous batching). `format_prompt` renders the chat template
    with the generation prompt (and `template_kwargs`, e.g. the template's enable_thinking switch, recorded in
    the progress key); `think_prefix` is appended to it so the teacher starts inside its reasoning.
    With `verify`, only samples whose answer matches the prompt's `answer` are written (prompts without an
    answer keep nothing). `on_batch(done, total)` reports progress.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    key = _settings_key(teacher, sampling, verify, think_prefix, template_kwargs)
    if not overwrite:
        started_here = not os.path.lexists(output)
        done = _load_progress(output, key, {p.id for p in prompts})  # refusals here created nothing to remove
        try:
            return _generate_traces(prompts, output, generate, format_prompt, key, done,
                                    teacher=teacher, sampling=sampling, verify=verify, default_match=default_match,
                                    think_prefix=think_prefix, batch_prompts=batch_prompts, on_batch=on_batch)
        except BaseException:
            if started_here:
                _remove_if_nothing_done(output)
            raise
    check_traces_output(output)
    if os.path.lexists(progress_path(output)):
        _check_progress_file(progress_path(output))
    # --overwrite: the earlier traces stay aside until this run completes, and come back if it fails
    pairs = [(path, path.with_name(f".{path.name}.replaced")) for path in (output, progress_path(output))]
    for path, aside in pairs:
        if os.path.lexists(path):
            os.replace(path, aside)
    try:
        stats = _generate_traces(prompts, output, generate, format_prompt, key, {}, teacher=teacher,
                                 sampling=sampling, verify=verify, default_match=default_match,
                                 think_prefix=think_prefix, batch_prompts=batch_prompts, on_batch=on_batch)
    except BaseException:
        for path, aside in pairs:
            if os.path.lexists(aside):
                os.replace(aside, path)
            else:
                path.unlink(missing_ok=True)
        raise
    for _, aside in pairs:
        Path(aside).unlink(missing_ok=True)
    return stats


def _remove_if_nothing_done(output: Path) -> None:
    """A run that created the traces file and failed before its first prompt was recorded leaves nothing behind
    (an empty output and a progress file of its settings alone)."""
    progress = progress_path(output)
    try:
        records = [line for line in progress.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError:
        records = []
    if len(records) <= 1:
        output.unlink(missing_ok=True)
        progress.unlink(missing_ok=True)


def _generate_traces(prompts: list[PromptRecord], output: Path, generate: GenerateFn,
                     format_prompt: Callable[[str], str], key: dict[str, Any], done: dict[str, dict[str, int]], *,
                     teacher: str, sampling: SamplingSettings, verify: bool, default_match: MatchMode | None,
                     think_prefix: str, batch_prompts: int,
                     on_batch: Callable[[int, int], None] | None) -> TraceStats:
    """run_traces' generation loop over the prompts not in `done`, appending to `output` and its progress file."""
    import time

    progress = progress_path(output)
    if not progress.exists():
        progress.write_text(json.dumps({"settings": key}) + "\n")
    todo = [p for p in prompts if p.id not in done]
    stats = TraceStats(prompts=len(prompts), prompts_done_before=sum(1 for p in prompts if p.id in done),
                       output=str(output))
    started = time.perf_counter()
    with output.open("a", encoding="utf-8") as out, progress.open("a", encoding="utf-8") as prog:
        for start in range(0, len(todo), batch_prompts):
            batch = todo[start : start + batch_prompts]
            generations = generate([format_prompt(p.prompt) + think_prefix for p in batch], sampling)
            if len(generations) != len(batch):
                raise RuntimeError(f"generation returned {len(generations)} results for {len(batch)} prompts")
            records: list[tuple[PromptRecord, list[TraceRecord]]] = []
            for prompt, samples in zip(batch, generations, strict=True):
                traces = [make_trace(prompt, i, g, think_prefix=think_prefix, teacher=teacher,
                                     default_match=default_match) for i, g in enumerate(samples)]
                records.append((prompt, traces))
            for _, traces in records:
                for trace in traces:
                    stats.tokens_generated += trace.num_tokens
                    if not verify or trace.verified:
                        out.write(trace.to_json() + "\n")
            out.flush()
            os.fsync(out.fileno())
            for prompt, traces in records:
                kept = [t for t in traces if not verify or t.verified]
                prog.write(json.dumps({
                    "prompt_id": prompt.id, "samples": len(traces), "kept": len(kept),
                    "correct": sum(1 for t in traces if t.verified),
                    "tokens_all": sum(t.num_tokens for t in traces), "tokens_kept": sum(t.num_tokens for t in kept),
                }) + "\n")
            prog.flush()
            os.fsync(prog.fileno())
            stats.prompts_generated += len(batch)
            if on_batch is not None:
                on_batch(stats.prompts_generated, len(todo))
    stats.generation_s = time.perf_counter() - started
    stats.output_tokens_per_s = stats.tokens_generated / stats.generation_s if stats.generation_s > 0 else 0.0
    _fill_totals(stats, progress)
    return stats


def _fill_totals(stats: TraceStats, progress: Path) -> None:
    rows = _json_lines(progress)[0][1:]
    stats.per_prompt = {r["prompt_id"]: {k: r[k] for k in ("samples", "kept", "correct")} for r in rows}
    stats.samples_total = sum(r["samples"] for r in rows)
    stats.samples_kept = sum(r["kept"] for r in rows)
    stats.verified_correct = sum(r["correct"] for r in rows)
    stats.kept_fraction = stats.samples_kept / stats.samples_total if stats.samples_total else 0.0
    stats.mean_tokens_all = sum(r["tokens_all"] for r in rows) / stats.samples_total if stats.samples_total else 0.0
    stats.mean_tokens_kept = sum(r["tokens_kept"] for r in rows) / stats.samples_kept if stats.samples_kept else 0.0


def iter_kept(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Traces to train on: all lines except those explicitly marked verified=false."""
    return [r for r in rows if r.get("verified") is not False]
