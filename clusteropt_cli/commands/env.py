"""copt env: what copt sees on this machine."""

from __future__ import annotations

from clusteropt_cli.options import JsonOpt


def env(json_output: JsonOpt = False) -> None:
    """Report Python, torch, CUDA, GPUs (memory, compute capability, BF16/FP8) and installed backends."""
    from clusteropt_cli import console
    from clusteropt_cli.core.env import collect_env

    report = collect_env()
    if json_output:
        console.print_json(report, "copt.env/1")
        return
    rows = [
        ("copt", report.copt), ("python", report.python), ("platform", report.platform),
        ("cpus", report.cpu_count), ("memory", console.human_bytes(report.memory_bytes)),
        ("host loop", f"{report.host_loop_ms:g} ms (copt advise --host-loop-ms)"),
        ("torch", report.torch or "not installed"), ("cuda available", report.cuda_available),
        ("cuda", report.cuda_version or "-"), ("cudnn", report.cudnn_version or "-"),
        ("nccl", report.nccl_version or "-"),
    ]
    rows += [(k, v) for k, v in report.env_vars.items()]
    console.out.print(console.kv_table("Environment", rows))
    if report.gpus:
        console.out.print(console.grid(
            "GPUs", ["#", "name", "memory", "compute capability", "bf16", "fp8", "catalog"],
            [[g["index"], g["name"], console.human_bytes(g["memory_bytes"]),
              ".".join(map(str, g["compute_capability"])), "yes" if g["supports_bf16"] else "no",
              "yes" if g["supports_fp8"] else "no", g["catalog"] or "-"] for g in report.gpus],
        ))
    else:
        console.out.print("GPUs: none visible (CPU only)")
    rows = []
    for extra, dists in report.backends.items():
        for dist, version in dists.items():
            rows.append([extra, dist, version or console.markup("[dim]not installed[/dim]")])
    console.out.print(console.grid("Backends", ["extra", "package", "version"], rows))
