"""Per-token cost of constrained decoding (copt serve's response_format / tools): the xgrammar matcher filling its
token bitmask on the host, and that bitmask applied to the logits rows on the device (H2D copy + unpack + masked
fill), for a batch of constrained rows walking a JSON schema.

    python3 bench/grammar_mask.py --tokenizer <hf tokenizer dir or id> [--vocab N] [--batch 1 8 64] --out r.json

Runs on CPU or CUDA (--device). Prints ms per step and µs per constrained row for each batch size."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: the tokenizer's length)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from clusteropt_cli.core.serve.structured import GrammarCompiler, apply_grammar_masks, response_format_grammar

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab or len(tok)
    compiler = GrammarCompiler(tok, vocab, {tok.eos_token_id} if tok.eos_token_id is not None else set())
    t0 = time.perf_counter()
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, compiler)
    compile_s = time.perf_counter() - t0
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for batch in args.batch:
        matchers = [grammar.matcher() for _ in range(batch)]
        logits = torch.randn(batch, vocab, generator=gen).to(device)
        fill, total, accept = [], [], []
        for _ in range(args.steps):
            work = logits.clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            apply_grammar_masks(work, list(range(batch)), matchers)
            chosen = work.argmax(-1).tolist()  # greedy: a token every matcher accepts
            t1 = time.perf_counter()
            for m, t in zip(matchers, chosen, strict=True):
                if not m.accept_token(t) or m.is_terminated():  # a finished object: start the next one
                    m.reset()
            accept.append(time.perf_counter() - t1)
            total.append(t1 - t0)
            # the host half alone
            import xgrammar as xgr

            bm = xgr.allocate_token_bitmask(batch, vocab)
            t2 = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bm, i)
            fill.append(time.perf_counter() - t2)
        row = {"batch": batch, "vocab": vocab, "device": str(device),
               "mask_fill_ms": 1e3 * statistics.median(fill), "mask_apply_ms": 1e3 * statistics.median(total),
               "accept_ms": 1e3 * statistics.median(accept),
               "us_per_row": 1e6 * (statistics.median(total) + statistics.median(accept)) / batch}
        rows.append(row)
    print(f"{'batch':>5} {'vocab':>7} {'fill ms':>8} {'fill+apply+argmax ms':>21} {'accept ms':>9} {'µs/row':>8}"
          f"  ({device})")
    for r in rows:
        print(f"{r['batch']:>5} {r['vocab']:>7} {r['mask_fill_ms']:>8.3f} {r['mask_apply_ms']:>21.3f} "
              f"{r['accept_ms']:>9.3f} {r['us_per_row']:>8.1f}")
    result = {"compile_s": compile_s, "rows": rows, "threads": torch.get_num_threads(),
              "omp": os.environ.get("OMP_NUM_THREADS")}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    print(f"schema compile {compile_s * 1e3:.0f} ms; written {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
