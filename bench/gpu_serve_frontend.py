#!/usr/bin/env python3
"""copt serve's HTTP front end against the in-process engine, same run (H200, Llama-3.2-1B shape, random weights).

Run from the repo root:  python3 bench/gpu_serve_frontend.py --out $OUT/frontend.json        (≤ 10 minutes)
                         python3 bench/gpu_serve_frontend.py --smoke --out /tmp/f.json        (CPU: checks the script)

Workload: 256 requests, prompts of 256 random tokens, 128 output tokens each (ignore_eos); greedy (temperature 0)
and sampled (temperature 1.0, top_p 0.95, seeded). Every run sends prompts of its own (new random tokens per mode
and repeat, the same ones in every case): with one prompt set for all runs, the prefix cache would serve the prompts
of every run after the first (sampled runs, measured after the greedy ones, looked faster than them).

Cases:
  engine        the Engine in-process (Engine.generate over all requests at once): output tok/s, TTFT p50 in the
                engine — the ceiling
  http_apiN     `copt serve --api-server-count N`, 256 concurrent streaming clients: output tok/s at the clients,
                TTFT and time-per-output-token percentiles (client-side). N = 0 is the single-process server (HTTP
                and the engine share one process); N ≥ 1 runs N API-server processes in front of an engine-core
                process (ZeroMQ + msgpack). --api-server-counts picks the Ns (default 0,1,2).
The clients run in --client-procs processes (default 4) so that the load generator is not the bottleneck.
Printed: tok/s, the ratio HTTP / in-process engine per sampling mode, TTFT p50, and how many CPU cores each server
process kept busy during the load (psutil: a process near 1.0 is saturated on its GIL); the JSON has everything.
uvloop and httptools are used by the server when installed (uvicorn's "auto"); the JSON records whether they are.

Diagnostics: --trace DIR writes the engine's step trace (COPT_ENGINE_TRACE: every step's span, batch and tokens,
every request's arrival, first token and finish) for the in-process engine and the engine core; --py-spy DIR
samples the engine-core and API-server processes' threads with py-spy during the last load of each mode (py-spy
installed and allowed to attach). The clients' request start times are perf_counter seconds on the same clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    free_gpu,
    free_port,
    http_request,
    log,
    make_model_dir,
    per_token_tpot,
    percentiles,
    require_serve_speed_packages,
    wait_healthy,
)

MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.95}}
CFG = {"requests": 256, "prompt_len": 256, "out_tokens": 128, "max_model_len": 512, "kv_gib": 16.0,
       "max_batch_tokens": 4096}


def prompts_for(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, min(vocab, 128000) - 10) for _ in range(length)] for _ in range(n)]


def run_prompts(vocab: int, mode: str, run: int) -> list[list[int]]:
    """The prompts of one run (`run` -1: the warm-up): new for every mode and repeat — no run is served from the
    prefix cache of another —, the same in every case, so the engine and the servers see the same work."""
    return prompts_for(vocab, CFG["requests"], CFG["prompt_len"], seed=1 + 100 * list(MODES).index(mode) + run + 1)


# ---- in-process ----------------------------------------------------------------------------------------
def bench_engine(model_dir: Path, vocab: int, repeats: int) -> dict:
    from clusteropt_cli.core.serve.engine import Engine, GenerationRequest
    from clusteropt_cli.recipe.schema.serve import ServeRecipe

    t0 = time.perf_counter()
    # the settings the server cases get from their command line (start_server), through the same path
    engine = Engine.from_settings(ServeRecipe(model=str(model_dir), max_batch_size=CFG["requests"],
                                              max_model_len=CFG["max_model_len"], kv_cache_memory=CFG["kv_gib"],
                                              max_batch_tokens=CFG["max_batch_tokens"], max_queue=4096))
    engine.start()
    out: dict = {"startup_s": round(time.perf_counter() - t0, 1), "graphs": engine.stats.graphs_captured}
    from clusteropt_cli.core.serve.requests import frozen_startup_heap

    # the start-up heap out of the garbage collector's full collections, as `copt serve` keeps it (without, a full
    # collection stopped one run in three for ~0.9 s on the H200 host)
    heap = frozen_startup_heap()
    heap.__enter__()
    try:
        for mode, params in MODES.items():
            def requests(run: int, params=params, mode=mode) -> list:
                seeded = {"seed": 1000 * run + 1} if params.get("temperature") else {}
                return [GenerationRequest(prompt_ids=p, max_new_tokens=CFG["out_tokens"], ignore_eos=True,
                                          **params, **{k: v + i for k, v in seeded.items()})
                        for i, p in enumerate(run_prompts(vocab, mode, run))]

            engine.generate(requests(-1)[:16])  # warm-up
            runs = []
            for r in range(repeats):
                reqs = requests(r)
                t = time.perf_counter()
                results = engine.generate(reqs)
                wall = time.perf_counter() - t
                tokens = sum(x.num_output_tokens for x in results)
                runs.append({"output_tokens_per_s": tokens / wall, "wall_s": wall,
                             "ttft_s": percentiles([x.ttft_s for x in results if x.ttft_s is not None])})
            median = sorted(runs, key=lambda x: x["output_tokens_per_s"])[len(runs) // 2]
            out[mode] = {**median, "runs_tok_s": [round(x["output_tokens_per_s"]) for x in runs]}  # in run order
            log(f"engine {mode}: {out[mode]['output_tokens_per_s']:,.0f} tok/s")
    finally:
        heap.__exit__(None, None, None)
        engine.stop()
        del engine
        free_gpu()
    return out


# ---- through HTTP --------------------------------------------------------------------------------------
def _client_proc(url: str, prompts: list[list[int]], max_tokens: int, params: dict, start_at: float) -> dict:
    """One load-generator process: its share of the streaming clients, started at the same wall-clock time."""
    import httpx

    async def run() -> dict:
        limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            t0 = time.time()
            reqs = [http_request(client, url, p, max_tokens, True,
                                 {**params, **({"seed": 7 + i} if params.get("temperature") else {})})
                    for i, p in enumerate(prompts)]
            out = await asyncio.gather(*reqs)
            return {"start": t0, "end": time.time(), "results": out}

    return asyncio.run(run())


def http_load(url: str, prompts: list[list[int]], max_tokens: int, params: dict, procs: int,
              pool: ProcessPoolExecutor) -> dict:
    shares = [prompts[i::procs] for i in range(procs)]
    start_at = time.time() + 1.0
    parts = list(pool.map(_client_proc, [url] * procs, shares, [max_tokens] * procs, [params] * procs,
                          [start_at] * procs))
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    results = [r for p in parts for r in p["results"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_s": percentiles([r["times"][0] for r in results if r["times"]]),
            "tpot_s": percentiles([t for t in map(per_token_tpot, results) if t is not None]),
            # per request: start (perf_counter, the engine trace's clock), first and last text chunk after it, tokens
            "per_request": [[round(r["start"], 4), round(r["times"][0], 4) if r["times"] else None,
                             round(r["times"][-1], 4) if r["times"] else None, r["tokens"]] for r in results]}


def server_processes(root: int) -> dict:
    """`copt serve`'s processes (psutil) by role: the supervisor, multiprocessing's resource tracker, and the
    spawned children in start order — the engine core first, then the API servers (multiprocess.serve_split).
    Empty without psutil (copt's dependency, but a GPU host running the tree from PYTHONPATH may lack it)."""
    try:
        import psutil
    except ImportError:
        log("psutil not installed: no per-process CPU figures")
        return {}
    top = psutil.Process(root)
    roles, spawned = {top: "copt serve"}, 0
    for child in sorted(top.children(recursive=True), key=lambda c: c.pid):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" in cmdline:
            roles[child] = "resource tracker"
        elif "spawn_main" in cmdline:
            roles[child] = "engine core" if spawned == 0 else f"api server {spawned - 1}"
            spawned += 1
        else:
            roles[child] = f"child {child.pid}"
    return roles


def cpu_seconds(processes: dict) -> dict[str, float]:
    """User + system CPU seconds each process (by role) has used so far; gone processes left out."""
    import psutil

    out = {}
    for process, role in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        out[role] = times.user + times.system
    return out


def py_spy(pid: int, path: Path, seconds: float) -> subprocess.Popen | None:
    """py-spy sampling one process's threads (idle ones too) for `seconds`, raw collapsed stacks into `path`."""
    import shutil

    exe = shutil.which("py-spy")
    if exe is None:
        log("py-spy not installed: no stack samples")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate",
                             "400", "--threads", "--idle", "--nonblocking", "--format", "raw", "--output", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def start_server(model_dir: Path, port: int, api_servers: int, max_batch: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    cmd = [sys.executable, "-m", "clusteropt_cli", "serve", str(model_dir), "--port", str(port),
           "--max-batch-size", str(max_batch), "--max-model-len", str(CFG["max_model_len"]), "--kv-cache-memory",
           str(CFG["kv_gib"]), "--max-batch-tokens", str(CFG["max_batch_tokens"]), "--served-model-name",
           "llama-1b-shape", "--max-queue", "4096", "--api-server-count", str(api_servers)]
    log("starting: " + " ".join(cmd))
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def bench_http(model_dir: Path, vocab: int, api_servers: int, procs: int, repeats: int,
               spy_dir: Path | None = None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(model_dir, port, api_servers, CFG["requests"])
    out: dict = {"api_server_count": api_servers}
    try:
        out["startup_s"] = round(wait_healthy(url, proc, timeout=300), 1)
        import multiprocessing

        # spawned, not forked: this process holds a CUDA context and threads from the engine case
        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            warm = run_prompts(vocab, "greedy", -1)[:32]
            http_load(url, warm, 16, {}, procs, pool)  # warm-up (and the client processes' imports)
            # the server's processes: `copt serve` itself, then (split server) the engine core it starts first and
            # the API servers (their multiprocessing resource tracker too)
            processes = server_processes(proc.pid)
            out["server_processes"] = sorted(processes.values())

            def measured_load(mode: str, repeat: int) -> dict:
                spies = []
                if spy_dir is not None and repeat == repeats - 1:
                    spies = [(role, py_spy(p.pid, spy_dir / f"api{api_servers}-{mode}-{role.replace(' ', '-')}.txt",
                                           3.0)) for p, role in processes.items()
                             if role == "engine core" or role.startswith("api server") or
                             (role == "copt serve" and api_servers == 0)]
                before = cpu_seconds(processes)
                run = http_load(url, run_prompts(vocab, mode, repeat), CFG["out_tokens"], MODES[mode], procs, pool)
                after = cpu_seconds(processes)
                for role, spy in spies:
                    if spy is not None:
                        try:
                            spy.wait(30)
                        except subprocess.TimeoutExpired:
                            spy.kill()
                        err = spy.stderr.read() if spy.stderr else ""
                        if spy.returncode:
                            log(f"py-spy ({role}) failed: {err[-300:]}")
                # CPU cores each process kept busy over the clients' window (the call also waits for their common
                # start); a Python process whose threads share the GIL saturates near 1
                run["server_cpu_cores"] = {role: round((after[role] - before[role]) / run["wall_s"], 2)
                                           for role in after if role in before}
                return run

            for mode in MODES:
                try:
                    runs = [measured_load(mode, r) for r in range(repeats)]
                    median = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]
                    out[mode] = {**median, "runs_tok_s": [round(r["output_tokens_per_s"]) for r in runs]}  # run order
                    log(f"http api-server-count {api_servers} {mode}: {out[mode]['output_tokens_per_s']:,.0f} tok/s, "
                        f"TTFT p50 {out[mode]['ttft_s']['p50']:.3f} s; server CPU cores busy "
                        f"{ {k: v for k, v in out[mode]['server_cpu_cores'].items() if v or 'child' not in k} }")
                except Exception as exc:  # noqa: BLE001 - recorded, the next mode runs
                    out[mode] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["exit_status"] = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit_status"] = "killed"
        tail = proc.stderr.read()[-2000:] if proc.stderr else ""
        if out["exit_status"] != 0 and tail:
            log("server stderr tail:\n" + tail)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--api-server-counts", default="0,1,2",
                        help="comma-separated --api-server-count values to serve with (0: single process)")
    parser.add_argument("--client-procs", type=int, default=4, help="load-generator processes")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case (median reported)")
    parser.add_argument("--skip", default="", help="comma-separated: engine, http")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few requests (checks the script on CPU)")
    parser.add_argument("--trace", type=Path, help="folder for the engine's step traces (COPT_ENGINE_TRACE)")
    parser.add_argument("--py-spy", type=Path, dest="py_spy", help="folder for py-spy samples of the server")
    args = parser.parse_args()
    require_serve_speed_packages(parser)
    if args.trace:
        os.environ["COPT_ENGINE_TRACE"] = str(args.trace.resolve())
    counts = [int(c) for c in args.api_server_counts.split(",") if c.strip()]
    skip = set(filter(None, args.skip.split(",")))
    import importlib.util

    import torch

    if args.smoke:
        CFG.update(requests=8, prompt_len=16, out_tokens=8, max_model_len=64, kv_gib=0.02, max_batch_tokens=256)
        args.repeats, args.client_procs = 1, min(args.client_procs, 2)
    results: dict = {"bench": "gpu_serve_frontend", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "config": dict(CFG), "modes": MODES, "client_procs": args.client_procs,
                     "uvloop": importlib.util.find_spec("uvloop") is not None,
                     "httptools": importlib.util.find_spec("httptools") is not None}
    tmp = Path(tempfile.mkdtemp(prefix="copt-frontend-bench-"))
    model_dir = tmp / "llama-1b-shape"
    made = make_model_dir(model_dir, small=args.smoke)
    vocab = made["vocab"]
    del made
    free_gpu()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every case: a run stopped part-way keeps what it measured
        args.out.write_text(json.dumps(results, indent=2, default=str))

    if "engine" not in skip:
        try:
            results["engine"] = bench_engine(model_dir, vocab, args.repeats)
        except Exception as exc:  # noqa: BLE001
            results["engine"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        save()
    if "http" not in skip:
        for n in counts:
            try:
                results[f"http_api{n}"] = bench_http(model_dir, vocab, n, args.client_procs, args.repeats,
                                                     args.py_spy)
            except Exception as exc:  # noqa: BLE001
                results[f"http_api{n}"] = {"error": f"{type(exc).__name__}: {exc}",
                                           "traceback": traceback.format_exc()}
            save()

    print(f"\ncopt serve front end vs in-process engine — {results['gpu']}, {results['date']}, "
          f"{CFG['requests']} clients, prompts {CFG['prompt_len']}, {CFG['out_tokens']} output tokens")
    print(f"{'case':<14}" + "".join(f"{m + ' tok/s':>16}{'÷ engine':>10}{'TTFT p50 s':>12}" for m in MODES))
    engine = results.get("engine", {})
    for case in ["engine"] + [f"http_api{n}" for n in counts]:
        row = results.get(case, {})
        cells = ""
        for m in MODES:
            r = row.get(m, {})
            tok = r.get("output_tokens_per_s")
            base = engine.get(m, {}).get("output_tokens_per_s")
            ttft = (r.get("ttft_s") or {}).get("p50")
            cells += (f"{tok:>16,.0f}" if tok else f"{'-':>16}") + (f"{tok / base:>10.2f}" if tok and base else
                                                                  f"{'-':>10}")
            cells += f"{ttft:>12.3f}" if ttft is not None else f"{'-':>12}"
        print(f"{case:<14}{cells}")
        if "error" in row:
            print(f"  {case} error: {row['error']}")
    print(f"uvloop: {results['uvloop']}, httptools: {results['httptools']}; results: {args.out}")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
