#!/usr/bin/env python3
"""Where a streamed request's time goes between a load tester and copt serve's engine, level by level.

Reads what one run left: the API processes' traces (COPT_API_TRACE), the engine-core's trace (COPT_ENGINE_TRACE) and
the clients' per-request records (`copt profile endpoint --save-requests`, guidellm's benchmarks report). All times
are put on one clock (each trace pairs time.perf_counter() with time.time()). For each client level: the clients'
TTFT, the API process's (the HTTP request reaching the app to its first event leaving), the engine's, and the
segments between — each a median over the level's requests:

  client → app        a request's send to its arrival in the app (the i-th send paired with the i-th arrival)
  app → submit        body, parsing, tokenization; split (traces that carry the stamps) into
    app → body          the body read
    body → parsed       the request parsed and checked
    parsed → encoded    the prompt's token ids ready (the batched tokenizer: queued, then its batch)
    encoded → submit    the engine request built and handed over
  submit → engine     the engine core taking the request in
  engine TTFT         arrival in the engine to its first token
  engine → API        the first token reaching the API process
  API → event out     the stream's first event handed to the HTTP server
  event → client      that event reaching the client (the i-th first event paired with the i-th first token)

and the API event loop's lag (how late a 10 ms sleep wakes) while the level ran, and the prompt encoder's batches
that started in it (texts per batch, the batch's time on the tokenizer, its first text's wait before it).

    python3 bench/serve_timeline.py --api-trace DIR/api-trace-*.json --engine-trace DIR/engine-trace-*.json \\
        [--requests profile-requests.jsonl] [--guidellm guidellm-c64.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _load(path: Path) -> dict:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".requests"):
        name = name.removesuffix(suffix)
    return name


def _to_unix(trace: dict):
    wall, mono = trace["clock"]
    return lambda t: None if t is None else t - mono + wall


def client_levels(requests: list[Path], guidellm: list[Path]) -> list[dict]:
    """[{name, sends: [(sent, ttft)]}] from --save-requests lines and guidellm reports (Unix times)."""
    levels: dict[str, list] = {}
    import gzip

    for path in requests:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for line in text.splitlines():
            row = json.loads(line)
            if row.get("ok") and row.get("ttft_s") is not None:
                levels.setdefault(f"{_name(path)} {row['level']}", []).append((row["sent_at"], row["ttft_s"]))
    for path in guidellm:
        for bench in _load(path).get("benchmarks", []):
            rows = []
            for r in bench.get("requests", {}).get("successful", []):
                start = (r.get("info") or {}).get("timings", {}).get("request_start")
                if start is not None and r.get("time_to_first_token_ms") is not None:
                    rows.append((start, r["time_to_first_token_ms"] / 1e3))
            if rows:
                levels[_name(path)] = rows
    return [{"name": name, "sends": sorted(rows)} for name, rows in levels.items()]


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def timeline(level: dict, api: list[tuple], engine: dict[str, tuple], lag: list[tuple[float, float]],
             batches: list[tuple] = ()) -> dict:
    """The segments of one client level (every time in Unix seconds). `api` rows: the API trace's request rows
    (entered, submitted, first in, first out, result in, last out, id[, body, parsed, encoded]); `batches`: the
    prompt encoder's (queued, started, ended, texts)."""
    sends = level["sends"]
    start, end = sends[0][0], max(s + t for s, t in sends)
    # a request reaches the app after its send (one clock up to microseconds), and before the level's last
    # first token: the level before and after it (warm-up requests, another tester) stay out
    last_entry = min(sends[-1][0] + 1.0, end)
    mine = sorted((r for r in api if r[0] is not None and start - 1e-3 <= r[0] <= last_entry), key=lambda r: r[0])
    out: dict = {"name": level["name"], "requests": len(sends), "api_requests": len(mine),
                 "client_ttft": statistics.median(t for _, t in sends)}

    def seg(key: str, values: list[float]) -> None:
        out[key] = statistics.median(values) if values else None

    seg("api_ttft", [r[3] - r[0] for r in mine if r[3] is not None])
    seg("client_to_app", [r[0] - s[0] for s, r in zip(sends, mine, strict=False)])
    seg("app_to_submit", [r[1] - r[0] for r in mine if r[1] is not None])
    stamped = [r for r in mine if len(r) > 9 and None not in (r[1], r[7], r[8], r[9])]
    seg("app_to_body", [r[7] - r[0] for r in stamped])
    seg("body_to_parsed", [r[8] - r[7] for r in stamped])
    seg("parsed_to_encoded", [r[9] - r[8] for r in stamped])
    seg("encoded_to_submit", [r[1] - r[9] for r in stamped])
    matched = [(r, engine[r[6]]) for r in mine if r[6] in engine]
    seg("submit_to_engine", [e[0] - r[1] for r, e in matched if r[1] is not None])
    seg("engine_ttft", [e[1] - e[0] for _, e in matched if e[1] is not None])
    seg("engine_to_api", [r[2] - e[1] for r, e in matched if r[2] is not None and e[1] is not None])
    seg("api_to_event", [r[3] - r[2] for r in mine if r[2] is not None and r[3] is not None])
    firsts = sorted(s + t for s, t in sends)
    seg("event_to_client", [c - r for c, r in zip(firsts, sorted(r[3] for r in mine if r[3] is not None),
                                                  strict=False)])
    seg("finish_to_api", [r[4] - e[2] for r, e in matched if r[4] is not None])
    seg("api_result_to_last_event", [r[5] - r[4] for r in mine if r[4] is not None])
    lags = [v for t, v in lag if start <= t <= end]
    out["loop_lag_p50"], out["loop_lag_p90"], out["loop_lag_p99"] = (_p(lags, q) for q in (0.5, 0.9, 0.99))
    mine_batches = [b for b in batches if start <= b[1] <= end]
    out["encoder_batches"] = len(mine_batches)
    out["encoder_texts_p50"] = statistics.median(b[3] for b in mine_batches) if mine_batches else None
    seg("encoder_batch", [b[2] - b[1] for b in mine_batches])
    seg("encoder_wait", [b[1] - b[0] for b in mine_batches])
    return out


COLUMNS = ("client_ttft", "api_ttft", "client_to_app", "app_to_submit", "app_to_body", "body_to_parsed",
           "parsed_to_encoded", "encoded_to_submit", "submit_to_engine", "engine_ttft", "engine_to_api",
           "api_to_event", "event_to_client", "finish_to_api", "api_result_to_last_event", "loop_lag_p50",
           "loop_lag_p90", "loop_lag_p99", "encoder_batch", "encoder_wait")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-trace", type=Path, nargs="+", required=True)
    parser.add_argument("--engine-trace", type=Path, nargs="+", required=True)
    parser.add_argument("--requests", type=Path, nargs="*", default=[], help="copt profile endpoint --save-requests")
    parser.add_argument("--guidellm", type=Path, nargs="*", default=[], help="guidellm benchmarks reports")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    api: list[tuple] = []
    lag: list[tuple[float, float]] = []
    batches: list[tuple] = []
    for path in args.api_trace:
        trace = _load(path)
        unix = _to_unix(trace)
        api += [(*(unix(t) for t in r[:6]), r[6], *(unix(t) for t in r[7:10])) for r in trace["requests"]]
        lag += [(unix(t), v) for t, v in trace["lag"]]
        batches += [(unix(q), unix(a), unix(b), n) for q, a, b, n in trace.get("encoder_batches", [])]
    engine: dict[str, tuple] = {}
    for path in args.engine_trace:
        trace = _load(path)
        unix = _to_unix(trace)
        engine.update({r[5]: (unix(r[0]), unix(r[1]), unix(r[2])) for r in trace["requests"] if len(r) > 5})
    rows = [timeline(level, api, engine, lag, batches) for level in client_levels(args.requests, args.guidellm)]
    print("medians in ms: " + ", ".join(COLUMNS))
    for row in rows:
        print(f"{row['name']} ({row['requests']} requests, {row['api_requests']} in the API trace, "
              f"{row['encoder_batches']} prompt-encoder batches of {row['encoder_texts_p50'] or '-'} texts p50)")
        print("   " + "  ".join(f"{c} {_ms(row[c])}" for c in COLUMNS))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
