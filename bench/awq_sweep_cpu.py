"""AWQ's sensitivity to its scale search on the CPU fixture: perplexity increase of the trained test teacher
(Llama, 1.05 M parameters) after AWQ with duo_scaling True (llm-compressor's default) / False / "both" and 8, 32,
128 calibration windows of 128 tokens, at W3 g64 and W4 g128 symmetric, against RTN at the same width.

    OMP_NUM_THREADS=1 python3 bench/awq_sweep_cpu.py --out bench/results/awq_sweep_cpu.json     (~3 minutes)
    python3 bench/awq_sweep_cpu.py --observers --out bench/results/awq_observer_sweep_cpu.json   (~2 minutes)
    python3 bench/awq_sweep_cpu.py --clip --out bench/results/awq_clip_sweep_cpu.json            (~2 minutes)

--observers instead sweeps the recipe's `observer` (how integer weight scales are chosen: minmax, mse,
imatrix_mse) for rtn, awq (duo_scaling true) and gptq at 8 and 32 samples. --clip sweeps the recipe's
`awq_clip` (llm-awq's clipping search after the scales) × observer (minmax, mse) at 8 and 32 samples, with rtn and
gptq as references, at W3 g64, W4 g128 and W4 g64.

Everything as `copt quantize` runs it; duo_scaling is the recipe's `awq_duo_scaling`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/awq_sweep_cpu.json"))
    parser.add_argument("--observers", action="store_true", help="sweep the weight observer instead")
    parser.add_argument("--clip", action="store_true", help="sweep awq_clip × observer instead")
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from clusteropt_cli.core.quantize import plan, run
    from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe
    from tests.fixture_models import build_fixtures

    torch.set_num_threads(1)
    fx = build_fixtures()
    work = Path(tempfile.mkdtemp(prefix="copt-awq-sweep-"))
    tok = AutoTokenizer.from_pretrained(fx.teacher)
    ids = tok(fx.train_text.read_text())["input_ids"]
    windows = [ids[i : i + 128] for i in range(0, len(ids) - 128, 128)]
    random.Random(0).shuffle(windows)
    calib = work / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": tok.decode(w)}) + "\n" for w in windows[:128]))
    results: dict = {"bench": "awq_sweep_cpu", "date": time.strftime("%Y-%m-%d"), "model": "fixture teacher",
                     "eval_tokens": 8192, "calib_seq_len": 128, "cases": []}
    if args.clip:
        results["bench"] = "awq_clip_sweep_cpu"
        for bits, group in [(3, 64), (4, 128), (4, 64)]:
            common = dict(model=str(fx.teacher), bits=bits, group_size=group, calib=str(calib), seq_len=128,
                          eval=str(fx.eval_text), eval_tokens=8192)
            variants = [("rtn", {}, 8), ("gptq", {}, 32)] + [
                ("awq", {"awq_clip": clip, "observer": observer}, samples)
                for clip in (True, False) for observer in ("minmax", "mse") for samples in (8, 32)]
            for method, extra, samples in variants:
                report = run(plan(QuantizeRecipe(output=str(work / "o"), method=method, num_samples=samples,
                                                 **extra, **common), overwrite=True))
                results["cases"].append({"bits": bits, "group_size": group, "method": method, **extra,
                                         "samples": samples, "ppl_before": report.ppl_before,
                                         "increase": report.ppl_increase, "awq_clip_facts": report.awq_clip})
                print(f"W{bits} g{group} {method} {extra} samples={samples}: {report.ppl_increase:+.3f}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"results: {args.out}")
        return
    if args.observers:
        results["bench"] = "awq_observer_sweep_cpu"
        for bits, group in [(3, 64), (4, 128)]:
            common = dict(model=str(fx.teacher), bits=bits, group_size=group, calib=str(calib), seq_len=128,
                          eval=str(fx.eval_text), eval_tokens=8192)
            for method in ("rtn", "awq", "gptq"):
                for observer in ("minmax", "mse") if method == "rtn" else ("minmax", "mse", "imatrix_mse"):
                    for samples in (8,) if method == "rtn" else (8, 32):
                        report = run(plan(QuantizeRecipe(output=str(work / "o"), method=method, observer=observer,
                                                         num_samples=samples, **common), overwrite=True))
                        results["cases"].append({"bits": bits, "group_size": group, "method": method,
                                                 "observer": observer, "samples": samples,
                                                 "ppl_before": report.ppl_before, "increase": report.ppl_increase})
                        print(f"W{bits} g{group} {method} observer={observer} samples={samples}: "
                              f"{report.ppl_increase:+.3f}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"results: {args.out}")
        return
    for bits, group in [(3, 64), (4, 128)]:
        common = dict(model=str(fx.teacher), bits=bits, group_size=group, calib=str(calib), seq_len=128,
                      eval=str(fx.eval_text), eval_tokens=8192)
        rtn = run(plan(QuantizeRecipe(output=str(work / "rtn"), method="rtn", **common), overwrite=True))
        print(f"W{bits} g{group} rtn {rtn.ppl_increase:+.3f}", flush=True)
        for duo in (True, False, "both"):
            for samples in (8, 32, 128):
                t0 = time.perf_counter()
                report = run(plan(QuantizeRecipe(output=str(work / "awq"), method="awq", num_samples=samples,
                                                 awq_duo_scaling=duo, **common), overwrite=True))
                row = {"bits": bits, "group_size": group, "duo_scaling": duo, "samples": samples,
                       "ppl_before": report.ppl_before, "awq_increase": report.ppl_increase,
                       "rtn_increase": rtn.ppl_increase, "awq_beats_rtn": report.ppl_increase < rtn.ppl_increase,
                       "wall_s": time.perf_counter() - t0}
                results["cases"].append(row)
                print(f"W{bits} g{group} awq duo_scaling={duo} samples={samples}: {report.ppl_increase:+.3f} "
                      f"(rtn {rtn.ppl_increase:+.3f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
