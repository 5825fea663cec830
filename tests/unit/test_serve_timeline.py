"""bench/serve_timeline.py: the clients', API process's and engine's records of one load on one clock, each level's
TTFT split into its segments (medians), requests of other levels left out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def test_segments_of_a_level_on_one_clock(tmp_path):
    from serve_timeline import client_levels, timeline

    wall0 = 1_800_000_000.0  # every time already in Unix seconds (main() converts each trace with its clock pair)
    rows, api, engine = [], [], {}
    for i in range(5):
        sent = wall0 + i * 0.1
        entered = sent + 0.004  # 4 ms to the app, 10 to submit, 1 to the engine, 30 there, 2 back, 1 out, 3 to client
        submitted, arrival = entered + 0.010, entered + 0.011
        first = arrival + 0.030
        first_in, first_out = first + 0.002, first + 0.003
        rows.append({"level": "c2", "sent_at": sent, "ok": True, "ttft_s": first_out + 0.003 - sent})
        rid = f"0-{i}"
        body, parsed, encoded = entered + 0.001, entered + 0.002, entered + 0.009  # 1 + 1 + 7 (tokenizer) + 1
        api.append((entered, submitted, first_in, first_out, first + 0.5, first + 0.501, rid, body, parsed, encoded))
        engine[rid] = (arrival, first, first + 0.499)
    rows.append({"level": "c2", "sent_at": wall0, "ok": False, "ttft_s": None})  # failed: not counted
    api.append((wall0 - 5.0, wall0 - 4.99, None, None, None, None, "warm-up"))  # before the level: left out
    path = tmp_path / "p.requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (level,) = client_levels([path], [])
    assert level["name"] == "p c2" and len(level["sends"]) == 5
    batches = [(wall0 + 0.006, wall0 + 0.008, wall0 + 0.013, 3), (wall0 + 0.2, wall0 + 0.201, wall0 + 0.206, 1),
               (wall0 - 5.0, wall0 - 4.99, wall0 - 4.98, 9)]  # the last before the level: left out
    out = timeline(level, api, engine, [(wall0 + 0.05, 0.002), (wall0 - 9, 1.0)], batches)
    expected = {"client_ttft": 0.051, "api_ttft": 0.044, "client_to_app": 0.004, "app_to_submit": 0.010,
                "submit_to_engine": 0.001, "engine_ttft": 0.030, "engine_to_api": 0.002, "api_to_event": 0.001,
                "event_to_client": 0.003, "finish_to_api": 0.001, "api_result_to_last_event": 0.001,
                "loop_lag_p50": 0.002, "app_to_body": 0.001, "body_to_parsed": 0.001, "parsed_to_encoded": 0.007,
                "encoded_to_submit": 0.001, "encoder_batch": 0.005, "encoder_wait": 0.0015}
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, abs=1e-6), key
    assert out["api_requests"] == 5
    assert out["encoder_batches"] == 2 and out["encoder_texts_p50"] == 2
