"""The wire format between the API-server processes and the engine-core process of the split server
(`copt serve --api-server-count N`): msgpack messages over ZeroMQ, as vLLM's EngineCoreClient does.

API process → engine core (one DEALER per API process, identity = its index, into the core's ROUTER):
    ["submit", call_id, [request, ...], [share, ...]]   share: index of an earlier request of the same call with
                                                       the same prompt (n > 1 choices share its prefill), or None
    ["abort", [request_id, ...]]
    ["stats", call_id]
Engine core → API process (one PUSH per API process into the API's PULL; the supervisor pushes "dead" too):
    ["out", [[request_id, new_ids, logprobs | None, final | None], ...]]   one message per engine step phase (or
                                                                           per batch when the sender is behind)
    ["ack", call_id, None | error]      error: {"kind": "bad"|"queue_full"|"stopped"|"dead", "message", "param"}
    ["stats", call_id, {EngineStats fields}]
    ["dead", message]                  the engine died: every in-flight request fails, /health answers 503
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from clusteropt_cli.core.serve.requests import GenerationRequest, GenerationResult

_REQUEST_FIELDS = tuple(f.name for f in fields(GenerationRequest) if f.name != "grammar")


def pack(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False)  # int keys: logit_bias


def request_to_wire(request: GenerationRequest, request_id: str, grammar_spec: Any = None) -> dict[str, Any]:
    wire = {name: getattr(request, name) for name in _REQUEST_FIELDS}
    wire["request_id"] = request_id
    wire["grammar"] = grammar_spec
    return wire


def request_from_wire(wire: dict[str, Any]) -> tuple[GenerationRequest, Any]:
    """The request (without its grammar) and the grammar's spec (None: unconstrained)."""
    spec = wire.pop("grammar", None)
    known = {k: v for k, v in wire.items() if k in _REQUEST_FIELDS}
    if known.get("logit_bias") is not None:
        known["logit_bias"] = {int(k): float(v) for k, v in known["logit_bias"].items()}
    return GenerationRequest(**known), spec


def _entry(e: Any) -> Any:
    if e is None:
        return None
    tok, lp, top = e
    return (tok, lp, [tuple(x) for x in top])


def result_to_wire(result: GenerationResult) -> dict[str, Any]:
    return {"finish_reason": result.finish_reason, "text": result.text, "stop_reason": result.stop_reason,
            "ttft_s": result.ttft_s, "latency_s": result.latency_s, "spec_drafted": result.spec_drafted,
            "spec_accepted": result.spec_accepted, "error": result.error, "output_ids": result.output_ids,
            "logprobs": result.logprobs, "prompt_logprobs": result.prompt_logprobs,
            "prompt_ranks": result.prompt_ranks}


def result_from_wire(wire: dict[str, Any], request_id: str, prompt_ids: list[int]) -> GenerationResult:
    logprobs = wire.get("logprobs")
    prompt_lp = wire.get("prompt_logprobs")
    return GenerationResult(
        request_id=request_id, prompt_ids=prompt_ids, output_ids=list(wire.get("output_ids") or []),
        finish_reason=wire["finish_reason"], text=wire.get("text"), stop_reason=wire.get("stop_reason"),
        ttft_s=wire.get("ttft_s"), latency_s=wire.get("latency_s") or 0.0, spec_drafted=wire.get("spec_drafted", 0),
        spec_accepted=wire.get("spec_accepted", 0), error=wire.get("error"),
        logprobs=[_entry(e) for e in logprobs] if logprobs is not None else None,
        prompt_logprobs=[_entry(e) for e in prompt_lp] if prompt_lp is not None else None,
        prompt_ranks=wire.get("prompt_ranks"))


def logprob_entry(e: Any) -> Any:
    return _entry(e)


def stats_to_wire(stats: Any) -> dict[str, Any]:
    """The engine's stats (read while the engine thread updates them: retried when a dict changes size)."""
    for _ in range(10):
        try:
            return {f.name: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else v)
                    for f in fields(stats)
                    if isinstance((v := getattr(stats, f.name)), (int, float, str, dict, list, tuple, type(None)))}
        except RuntimeError:  # dictionary changed size during iteration
            continue
    return {}


def stats_from_wire(wire: dict[str, Any]) -> Any:
    from clusteropt_cli.core.serve.engine import EngineStats

    names = {f.name for f in fields(EngineStats)}
    return EngineStats(**{k: v for k, v in wire.items() if k in names})
