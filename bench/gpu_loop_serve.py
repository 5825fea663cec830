"""The closed loop for serving on the H200 (issue 9), which is also `copt profile endpoint` against `copt serve`
(issue 6): advise → emit a serve recipe with its prediction → serve it → profile the endpoint and check the
prediction (`--expect`), with the throughput/latency plot.

    python3 bench/gpu_loop_serve.py --out $OUT/loop_serve
    python3 bench/gpu_loop_serve.py --out $OUT/loop_serve_sampled --temperature 1.0   # sampled requests

Model: the Llama-3.2-1B shape with random bf16 weights and a word-level tokenizer (bench/gpu_serve.py's
make_model_dir), so prompts are exactly --prompt-len tokens. Every step is the real CLI in a subprocess; its output
goes to <out>/loop_serve.log. Writes: loop_serve_recipe.yaml, endpoint.json (copt.profile/1), endpoint.png,
expect.json (predicted vs measured), serve.log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import require_serve_speed_packages  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def copt(args: list[str], log: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `copt ARGS` (as `python -m clusteropt_cli`), append its output to the log."""
    cmd = [sys.executable, "-m", "clusteropt_cli", *args]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "COLUMNS": "160"})
    with log.open("a") as fh:
        fh.write(f"$ copt {' '.join(args)}\n[rc={proc.returncode}, {time.time() - started:.1f} s]\n")
        fh.write(proc.stdout + proc.stderr + "\n")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/copt-loop-llama-1b"))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the requests, predicted by advise and sent by profile endpoint "
                             "(0 = greedy; 0.7-1.0 = what clients send by default)")
    parser.add_argument("--small", action="store_true", help="tiny model on CPU: checks the script only")
    args = parser.parse_args()
    require_serve_speed_packages(parser)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "loop_serve.log"
    log.write_text("")
    gpu = "cpu" if args.small else "h200"

    if not (args.model_dir / "config.json").exists():
        from common import make_model_dir

        make_model_dir(args.model_dir, small=args.small)
    recipe = args.out / "loop_serve_recipe.yaml"
    proc = copt(["advise", "--model", str(args.model_dir), "--gpu", gpu, "--task", "infer", "--symptom",
                 "low-throughput", "--batch", "1", "--prompt-len", str(args.prompt_len), "--gen-len",
                 str(args.gen_len), "--temperature", str(args.temperature), "--emit-recipe", str(recipe),
                 "--overwrite"], log)
    if proc.returncode != 0:
        sys.exit(f"advise failed: {proc.stderr[-2000:]}")
    print(proc.stdout[-1500:])

    from common import wait_healthy

    url = f"http://127.0.0.1:{args.port}"
    serve_log = (args.out / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "clusteropt_cli", "serve", "--recipe", str(recipe),
                               "--port", str(args.port)], stdout=serve_log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        ready_s = wait_healthy(url, server, timeout=300)
        print(f"copt serve healthy after {ready_s:.1f} s")
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
            name = json.load(resp)["data"][0]["id"]
        endpoint = args.out / "endpoint.json"
        proc = copt(["profile", "endpoint", "--url", url, "--model", name, "--concurrency", args.concurrency,
                     "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
                     "--temperature", str(args.temperature), "--tokenizer",
                     str(args.model_dir), "--plot", str(args.out / "endpoint.png"), "--report", str(endpoint),
                     "--expect", str(recipe), "--tolerance", str(args.tolerance), "--overwrite", "--json"], log)
        (args.out / "expect.json").write_text(proc.stdout or "{}")
        print(f"profile endpoint --expect rc={proc.returncode} (6 = a figure missed the tolerance)")
        print(proc.stderr[-3000:])
        try:
            doc = json.loads(proc.stdout)
            for check in (doc.get("expect") or doc.get("comparison") or {}).get("checks", []):
                print(check)
        except json.JSONDecodeError:
            pass
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        serve_log.close()
        print(f"copt serve exit code after SIGTERM: {server.returncode}")


if __name__ == "__main__":
    main()
