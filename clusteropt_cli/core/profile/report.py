"""The profile report: what `copt profile` writes and `copt advise --from-profile` / `--expect` read.

Versioned (`schema_version`); fields are added, never renamed, within a major version. Metric names and units:
seconds (`*_s`), bytes (`*_bytes`), tokens per second (`tokens_per_s`, `output_tokens_per_s`), fractions 0–1
(`mfu`, `mbu`, `*_frac`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "copt.profile/1"

Bottleneck = Literal[
    "compute-bound", "memory-bandwidth-bound", "overhead-bound", "communication-bound", "memory-capacity-bound",
    "unknown",
]
# symptom ids that `copt advise --symptom` accepts
SYMPTOMS = ("oom", "high-ttft", "low-throughput", "slow-tpot", "comm-bound", "low-mfu")
# the task each symptom belongs to (oom and low-throughput: both)
SYMPTOM_TASK = {"high-ttft": "infer", "slow-tpot": "infer", "comm-bound": "train", "low-mfu": "train"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class Spread(_Model):
    """Repeated measurements of one figure."""

    median: float
    p10: float | None = None
    p90: float | None = None
    min: float | None = None
    max: float | None = None
    n: int = 1


class HardwareInfo(_Model):
    device: Literal["cuda", "cpu", "remote"]  # remote: an endpoint measured over HTTP
    name: str | None = None  # e.g. "NVIDIA H200"
    catalog: str | None = None  # hardware.CATALOG key when known
    count: int = 1
    memory_bytes: int | None = None  # per device
    # the host's time for copt's reference Python loop (core/hostspeed.py), where the profile ran on the host it
    # measures (a model profile, an endpoint on this machine); advise --from-profile prices copt serve's host work by it
    host_loop_s: float | None = None


class Verdict(_Model):
    bottleneck: Bottleneck
    evidence: list[str] = Field(default_factory=list)
    symptoms: list[str] = Field(default_factory=list)  # ids from SYMPTOMS


class OpTime(_Model):
    name: str
    self_time_s: float
    fraction: float
    calls: int | None = None


class EndpointLevel(_Model):
    """One load level of `profile endpoint` (a concurrency or a request rate)."""

    concurrency: int | None = None
    rate: float | None = None
    # how a rate level's sends were spaced: Poisson (copt's --rate, guidellm's poisson profile, vllm bench serve's
    # default burstiness) or evenly (guidellm's constant profile); None: Poisson, or not a rate level
    arrivals: Literal["poisson", "constant"] | None = None
    requests: int
    completed: int
    errors: dict[str, int] = Field(default_factory=dict)
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    goodput: float | None = None  # requests/s meeting the SLOs
    ttft_s: dict[str, float] = Field(default_factory=dict)  # p50/p90/p99/mean
    itl_s: dict[str, float] = Field(default_factory=dict)
    tpot_s: dict[str, float] = Field(default_factory=dict)
    e2e_s: dict[str, float] = Field(default_factory=dict)
    # completed requests whose stream had more text events than tokens (a proxy splitting tokens): their TTFT,
    # TPOT and tokens count, their gaps between events are left out of itl_s
    rechunked: int = 0
    # prompt tokens the server found in its prefix cache over those looked up during the level (its /metrics
    # counters, vLLM's names); None when the server does not export them
    prefix_cache_hit_rate: float | None = None
    # a rate level's: how late the client sent its requests after their Poisson times (p50/p90/p99/mean, seconds)
    send_lag_s: dict[str, float] | None = None
    # how late the client's event loop woke while the level ran (p50/p90/p99/mean, seconds; copt's own client,
    # every client process together): what the client's own backlog added to the TTFT and ITL it measured
    client_loop_lag_s: dict[str, float] | None = None


class ProfileReport(_Model):
    schema_version: str = SCHEMA_VERSION
    kind: Literal["model", "endpoint"]
    mode: Literal["train", "infer", "endpoint"]
    created_at: str
    copt_version: str
    hardware: HardwareInfo
    model: dict[str, Any] = Field(default_factory=dict)  # path/name, params, layers, hidden, vocab, dtype
    workload: dict[str, Any] = Field(default_factory=dict)  # micro_batch, seq_len, precision, batch, ...
    metrics: dict[str, float | None] = Field(default_factory=dict)  # medians: step_time_s, tokens_per_s, ...
    spread: dict[str, Spread] = Field(default_factory=dict)
    levels: list[EndpointLevel] = Field(default_factory=list)
    top_ops: list[OpTime] = Field(default_factory=list)
    verdict: Verdict
    trace_file: str | None = None


MAX_PROFILE_BYTES = 512 << 20  # a guidellm report with every request's record stays well under this


def load_profile(path: str) -> ProfileReport:
    """Read and validate a profile JSON (copt's, or a guidellm / `vllm bench serve` report, read as an endpoint
    profile); errors name the file and the fields."""
    import json
    from pathlib import Path

    from pydantic import ValidationError

    from clusteropt_cli.core.textfiles import check_regular_file
    from clusteropt_cli.errors import BadInputError
    from clusteropt_cli.recipe.load import format_validation_error

    p = Path(path)
    hint = "Pass the --json output of copt profile (or a guidellm / vllm bench serve report)."
    check_regular_file(p, "--from-profile", hint)
    size = p.stat().st_size
    if size > MAX_PROFILE_BYTES:
        raise BadInputError(f"Profile {p} is {size:,} bytes; a profile report is at most {MAX_PROFILE_BYTES:,}.",
                            hint=hint)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise BadInputError(f"Cannot read profile {p}: {exc.strerror}", hint="Write one with 'copt profile'.") from exc
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, a number too long, nested too deep
        raise BadInputError(f"Profile {p} is not JSON copt reads: {str(exc)[:200]}",
                            hint="Pass the --json output of copt profile.") from None
    from clusteropt_cli.core.profile.external import detect_tool, external_report

    tool = detect_tool(data)
    if tool is not None and "schema_version" not in data:
        try:
            return external_report(data, tool)
        except BadInputError:
            raise
        except (TypeError, AttributeError, KeyError, ValueError, OverflowError, IndexError) as exc:
            raise BadInputError(f"{p} looks like a {tool} report but a field has an unexpected type or value "
                                f"({type(exc).__name__}: {str(exc)[:160]}).",
                                hint=f"Pass the report as {tool} wrote it.") from None
    version = str(data.get("schema_version", "")) if isinstance(data, dict) else ""
    if not version:
        raise BadInputError(
            f"{p} is not a profile copt reads: no schema_version ({SCHEMA_VERSION}), and not a guidellm report "
            "(benchmarks with metrics) or a `vllm bench serve` result (output_throughput, TTFT).",
            hint="Pass the JSON of 'copt profile model|endpoint --json' (or its --report file), guidellm's "
                 "'--output kind=json' report, or the file 'vllm bench serve --save-result' writes.")
    if not version.startswith("copt.profile/1"):
        raise BadInputError(f"Profile {p} has schema_version {version!r}; this copt reads {SCHEMA_VERSION}.",
                            hint="Profile again with this copt ('copt profile model|endpoint').")
    try:
        return ProfileReport.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(format_validation_error(exc))
        raise BadInputError(f"Profile {p} does not match {SCHEMA_VERSION}: {problems}") from None
