"""Rebuild gpu_serve_models.py's results file of this run from its testers' reports (the run's own results file did
not come back; its guidellm and `copt profile endpoint` reports did), with the script's own readers.

    python3 rebuild-results.py REPORTS_DIR OUT.json COMMIT

REPORTS_DIR holds guidellm-qwen7b-c{64,256}[-greedy].json (gunzipped) and profile-endpoint-qwen7b[-greedy].json.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import gpu_serve_models as g  # noqa: E402

from clusteropt_cli.core.profile.external import external_report  # noqa: E402

LEVEL_KEYS = ("requests", "completed", "errors", "duration_s", "output_tokens_per_s", "ttft_s", "tpot_s",
              "prefix_cache_hit_rate", "send_lag_s", "client_loop_lag_s")


def main() -> None:
    src, out, commit = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    res = {"config": {"prompt_len": g.CFG["prompt_len"], "out_tokens": g.CFG["out_tokens"]},
           "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-07", "commit": commit,
           "note": "rebuilt from the run's guidellm and profile endpoint reports (the run's own results file did "
                   "not come back); guidellm's prefix-cache hit rates and the host probe were not kept"}
    for mode, key in (("sampled", "guidellm"), ("greedy", "guidellm_greedy")):
        suffix = "" if mode == "sampled" else "-greedy"
        runs = {}
        for n in (64, 256):
            report = src / f"guidellm-qwen7b-c{n}{suffix}.json"
            data = json.loads(report.read_text())
            prof = external_report(data, "guidellm")
            lv = prof.levels[-1]
            runs[f"c{n}"] = dict(concurrency=lv.concurrency, requests=lv.requests, completed=lv.completed,
                                 errors=lv.errors, duration_s=lv.duration_s,
                                 output_tokens_per_s=lv.output_tokens_per_s, ttft_s=lv.ttft_s, tpot_s=lv.tpot_s,
                                 e2e_s=lv.e2e_s, workload=prof.workload, report_file=report.name,
                                 **g.guidellm_rounds(data, n))
        res[key] = {"qwen7b": runs}
    for mode, key in (("sampled", "profile_endpoint"), ("greedy", "profile_endpoint_greedy")):
        suffix = "" if mode == "sampled" else "-greedy"
        data = json.loads((src / f"profile-endpoint-qwen7b{suffix}.json").read_text())
        sampling = "--temperature 1.0 --top-p 0.95" if mode == "sampled" else "--temperature 0.0"
        entry = {"temperature": 1.0 if mode == "sampled" else 0.0,
                 "command": "python3 -m clusteropt_cli profile endpoint --url URL --model DIR --concurrency 64,256 "
                            f"--duration 10.0 --prompt-len 256 --gen-len 128 {sampling} --tokenizer DIR-tokenizer"}
        for lv in data.get("levels", []):
            entry[f"c{lv['concurrency']}"] = {k: lv.get(k) for k in LEVEL_KEYS}
        res[key] = {"qwen7b": entry}
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
