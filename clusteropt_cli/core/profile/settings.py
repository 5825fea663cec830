"""Validated settings of `copt profile model` and `copt profile endpoint`.

`validate()` collects every problem at once, each naming its flag, and raises one BadInputError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clusteropt_cli.errors import BadInputError

GiB = 1024**3


def _raise_problems(problems: list[str], hint: str) -> None:
    if problems:
        text = "Invalid profile options:\n" + "\n".join(f"  - {p}" for p in problems)
        raise BadInputError(text, hint=hint)


MAX_CONCURRENCY = 65_536  # concurrent clients one profile level opens


def shown_url(url: str) -> str:
    """`url` as messages and reports show it: a password in it (http://user:secret@host) replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


@dataclass
class ModelProfileSettings:
    """What `copt profile model` measures: one inference request shape or one training step."""

    model: str
    mode: Literal["infer", "train"] = "infer"
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # inference
    batch: int = 1
    prompt_len: int = 128
    gen_len: int = 32
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # training
    micro_batch: int = 1
    seq_len: int = 512
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    activation_checkpointing: bool = False
    optimizer: Literal["adamw", "sgd"] = "adamw"
    loss_impl: Literal["auto", "fused", "hf"] = "auto"  # as copt train: fused chunked head + CE when it applies
    compile: bool = False  # torch.compile the decoder (as copt train does on CUDA by default)
    attn: Literal["sdpa", "eager"] = "sdpa"
    # measurement
    warmup: int = 2
    repeats: int = 5
    trace: Path | None = None
    memory_budget_bytes: int | None = None
    seed: int = 0

    def validate(self) -> None:
        problems = []
        for flag, value in (("--batch", self.batch), ("--prompt-len", self.prompt_len),
                            ("--gen-len", self.gen_len), ("--micro-batch", self.micro_batch),
                            ("--seq-len", self.seq_len), ("--repeats", self.repeats)):
            if value < 1:
                problems.append(f"{flag} must be at least 1 (got {value})")
        if self.mode == "train" and self.seq_len < 2:
            problems.append(f"--seq-len must be at least 2 for a training step (got {self.seq_len})")
        if self.warmup < 0:
            problems.append(f"--warmup must be 0 or more (got {self.warmup})")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            problems.append("--memory-budget must be a positive number of GiB")
        if self.trace is not None and self.trace.suffix != ".json":
            problems.append(f"--trace {self.trace}: the Chrome/Perfetto trace is JSON; name the file *.json")
        _raise_problems(problems, "copt profile model --help lists the options and their ranges")


@dataclass
class EndpointSettings:
    """What `copt profile endpoint` sends: a concurrency sweep or Poisson arrivals at given rates."""

    url: str
    model: str
    concurrency: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    num_requests: int | None = None  # per level
    duration_s: float | None = None  # per level
    prompt_len: int = 128
    gen_len: int = 64
    dataset: Path | None = None
    tokenizer: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 60.0
    warmup: int = 1
    api_key: str | None = None
    ignore_eos: bool | None = None  # None: send vLLM's ignore_eos, drop it if the server rejects it
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy; > 0 = sampled requests (the OpenAI default is 1)
    top_p: float | None = None  # sent when set (the OpenAI parameter)
    top_k: int | None = None  # sent when set (vLLM's and copt serve's extra parameter; 0 or -1: off)
    client_processes: int | None = None  # per concurrency level; None: client_processes_for() picks

    def validate(self) -> None:
        import math

        from clusteropt_cli.core.profile.stats import non_finite_problems

        problems = []
        numbers = {"--temperature": self.temperature, "--top-p": self.top_p, "--duration": self.duration_s,
                   "--request-timeout": self.request_timeout_s, "--slo-ttft-ms": self.slo_ttft_ms,
                   "--slo-tpot-ms": self.slo_tpot_ms,
                   "--rate": next((r for r in self.rate if not math.isfinite(r)), None)}
        problems += non_finite_problems(numbers)
        if problems:
            _raise_problems(problems, "copt profile endpoint --help lists the options")
        if self.client_processes is not None and self.client_processes < 1:
            problems.append(f"--client-processes must be at least 1 (got {self.client_processes})")
        if self.temperature < 0:
            problems.append(f"--temperature must not be negative (got {self.temperature})")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and self.top_k < -1:
            problems.append(f"--top-k must be -1, 0 (both: off) or a positive count (got {self.top_k})")
        if not self.url.startswith(("http://", "https://")):
            problems.append(f"--url {shown_url(self.url)!r} must start with http:// or https://")
        else:
            from urllib.parse import urlsplit

            try:
                parts = urlsplit(self.url)
                port = parts.port  # raises on a port out of range or not a number
                if not parts.hostname:
                    problems.append(f"--url {shown_url(self.url)!r} names no host")
                elif not _valid_numeric_host(parts.hostname):
                    problems.append(f"--url {shown_url(self.url)!r}: {parts.hostname} is not an IPv4 address")
                elif port == 0:
                    problems.append(f"--url {shown_url(self.url)!r}: port 0 is not a server's port")
            except ValueError as exc:
                problems.append(f"--url {shown_url(self.url)!r} is not a valid URL ({exc})")
        if not self.model:
            problems.append("--model must name the served model (GET /v1/models lists them)")
        if self.concurrency and self.rate:
            problems.append("--concurrency and --rate: give a concurrency sweep or request rates, not both")
        if any(c < 1 for c in self.concurrency):
            problems.append(f"--concurrency values must be at least 1 (got {self.concurrency})")
        if any(c > MAX_CONCURRENCY for c in self.concurrency):  # 10^8 clients were accepted, then the kernel's OOM kill
            problems.append(f"--concurrency values must be at most {MAX_CONCURRENCY:,} clients (got "
                            f"{max(self.concurrency):,})")
        if any(r <= 0 for r in self.rate):
            problems.append(f"--rate values must be positive requests/s (got {self.rate})")
        if self.num_requests is not None and self.num_requests < 1:
            problems.append(f"--num-requests must be at least 1 (got {self.num_requests})")
        if self.duration_s is not None and self.duration_s <= 0:
            problems.append(f"--duration must be positive seconds (got {self.duration_s})")
        for flag, value in (("--prompt-len", self.prompt_len), ("--gen-len", self.gen_len)):
            if value < 1:
                problems.append(f"{flag} must be at least 1 token (got {value})")
        if self.dataset is not None and not self.dataset.is_file():
            problems.append(f"--dataset {self.dataset}: no such file (a .jsonl with a 'prompt' or 'text' field)")
        if self.tokenizer is not None:
            from clusteropt_cli.modelspec import tokenizer_dir_problem

            problems += [p for p in [tokenizer_dir_problem(self.tokenizer)] if p]
        if self.request_timeout_s <= 0:
            problems.append("--request-timeout must be positive seconds")
        if self.warmup < 0:
            problems.append("--warmup must be 0 or more")
        for flag, value in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms)):
            if value is not None and value <= 0:
                problems.append(f"{flag} must be positive milliseconds")
        _raise_problems(problems, "copt profile endpoint --help lists the options")
        if not self.concurrency and not self.rate:
            self.concurrency = [1]

    def client_processes_for(self, concurrency: int) -> int:
        """Processes that send a concurrency level: --client-processes (at most one per stream), else one per 64
        streams, at most half the host's cores and 8. One Python event loop parses every streamed token of its
        streams: a fast server's decode bursts (a small model at 256 streams: ~80,000 tokens/s) put it behind
        the stream, and its requests then measure the client's backlog as TTFT."""
        import os

        if self.client_processes is not None:
            return max(1, min(self.client_processes, concurrency))
        return max(1, min(concurrency // 64, (os.cpu_count() or 2) // 2, 8))

    def requests_for(self, concurrency: int | None) -> int | None:
        """Requests per level: --num-requests; else, without --duration, 4 per concurrent slot (at least 8),
        or 32 per rate level."""
        if self.num_requests is not None:
            return self.num_requests
        if self.duration_s is not None:
            return None
        return max(8, 4 * concurrency) if concurrency else 32


def _valid_numeric_host(host: str) -> bool:
    """A host of digits and dots must be a dotted IPv4 address (256.1.1.1 is neither an address nor a name)."""
    import ipaddress

    if not host.replace(".", "").isdigit():
        return True
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True
