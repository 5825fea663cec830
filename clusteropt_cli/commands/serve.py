"""copt serve: an OpenAI-compatible server (embedded continuous-batching engine, or vLLM)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from clusteropt_cli import console
from clusteropt_cli.errors import BadInputError
from clusteropt_cli.options import DryRunOpt, JsonOpt, OverridesArg, RecipeOpt, model_and_overrides

ModelArg = Annotated[
    str | None,
    typer.Argument(help="Local Hugging Face model directory (bf16, or a checkpoint from 'copt quantize').",
                   show_default=False),
]


def serve(
    model: ModelArg = None,
    overrides: OverridesArg = None,
    engine: Annotated[str | None, typer.Option("--engine", help="auto | copt | vllm (copt: copt's own engine, "
                                                                "formerly 'transformers').")] = None,
    vllm_version: Annotated[str | None, typer.Option("--vllm-version",
                                                     help="vLLM version (X.Y) to build the command for (default: "
                                                          "the installed one; for --dry-run without vLLM).")] = None,
    host: Annotated[str | None, typer.Option("--host", help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port (default 8000).")] = None,
    api_key: Annotated[str | None, typer.Option("--api-key", help="Require 'Authorization: Bearer KEY' (default: "
                                                                 "$COPT_API_KEY, else $VLLM_API_KEY).")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name",
                                                          help="Model id clients send (default: MODEL).")] = None,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Tokenizer directory (default: MODEL's "
                                                                     "own).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="auto | bf16 | fp16 | fp32.")] = None,
    max_batch_tokens: Annotated[int | None, typer.Option("--max-batch-tokens", "--max-num-batched-tokens",
                                                         help="Tokens per step (chunked-prefill budget).")] = None,
    max_batch_size: Annotated[int | None, typer.Option("--max-batch-size", "--max-num-seqs",
                                                       help="Sequences run at once at most (default 256).")] = None,
    kv_cache_blocks: Annotated[int | None, typer.Option("--kv-cache-blocks",
                                                        help="KV-cache size in blocks of --block-size tokens.")] = None,
    kv_cache_memory: Annotated[float | None, typer.Option("--kv-cache-memory", help="KV-cache size in GiB.")] = None,
    kv_cache_memory_bytes: Annotated[str | None, typer.Option("--kv-cache-memory-bytes",
                                                              help="KV-cache size in bytes (vLLM's flag; 8G, 512M "
                                                                   "suffixes too).")] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        "--gpu-memory-utilization", help="Fraction of the GPU's memory the server may use (vLLM default 0.9).")]
    = None,
    block_size: Annotated[int | None, typer.Option("--block-size", help="Tokens per KV-cache block.")] = None,
    max_queue: Annotated[int | None, typer.Option("--max-queue", help="Waiting requests before 429.")] = None,
    max_model_len: Annotated[int | None, typer.Option(
        "--max-model-len", help="Context length served (copt engine default: the model's full context while "
        "one sequence of it fits the KV cache; said on stderr).")] = None,
    draft_model: Annotated[str | None, typer.Option("--draft-model", help="Draft model dir for speculation.")] = None,
    num_speculative_tokens: Annotated[int | None, typer.Option("--num-speculative-tokens",
                                                               help="Draft tokens per step.")] = None,
    prompt_lookup: Annotated[int | None, typer.Option("--prompt-lookup",
                                                      help="Prompt-lookup (n-gram) drafting with n-grams up to N.")]
    = None,
    speculative_max_batch: Annotated[int | None, typer.Option("--speculative-max-batch",
                                                              help="Speculate only while at most N run.")] = None,
    cuda_graphs: Annotated[bool | None, typer.Option("--cuda-graphs/--no-cuda-graphs", hidden=True,
                                                     help="Decode steps as CUDA graphs (default: on GPU).")] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager",
                                                help="Run every step eagerly: no CUDA graphs (decode or prefill) and "
                                                     "no torch.compile (as vLLM's flag; for debugging).")] = False,
    compile_: Annotated[bool | None, typer.Option("--compile/--no-compile", hidden=True,
                                                  help="torch.compile the decoder layers for decode steps "
                                                       "(default: on with CUDA graphs).")] = None,
    compile_mode: Annotated[str | None, typer.Option("--compile-mode",
                                                     help="auto | default | max-autotune-no-cudagraphs: "
                                                          "autotuned Triton GEMV/GEMM templates (slower start) for "
                                                          "batch-1 steps (auto, on CUDA), none (default) or every "
                                                          "batch.")] = None,
    async_scheduling: Annotated[bool | None, typer.Option("--async-scheduling/--no-async-scheduling", hidden=True,
                                                          help="Launch the next greedy decode step before handling "
                                                               "the current one's tokens (default: on; vLLM: its "
                                                               "own default).")] = None,
    decode_attention: Annotated[str | None, typer.Option("--decode-attention", hidden=True,
                                                         help="auto | sdpa | flex | math | paged: attention of the "
                                                              "compiled decode steps.")] = None,
    tensor_parallel: Annotated[int | None, typer.Option("--tensor-parallel", "--tensor-parallel-size",
                                                                help="vLLM: GPUs per replica.")] = None,
    pipeline_parallel: Annotated[int | None, typer.Option("--pipeline-parallel", "--pipeline-parallel-size",
                                                                  help="vLLM: pipeline stages.")]
    = None,
    quantization: Annotated[str | None, typer.Option("--quantization", help="vLLM --quantization.")] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option("--kv-cache-dtype", help="auto | fp8 (KV blocks in "
                                                                                "float8: half the memory).")] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", "--prefix-caching/--no-prefix-caching",
        help="Share the KV blocks of common prompt prefixes between requests (default: on).")] = None,
    kv_layout: Annotated[str | None, typer.Option("--kv-layout", hidden=True,
                                                  help="auto | paged | slots: the copt engine's KV-cache layout.")]
    = None,
    api_server_count: Annotated[int | None, typer.Option(
        "--api-server-count", help="API-server processes in front of a separate engine-core process (ZeroMQ; "
        "vLLM's flag). 0: HTTP and the engine in one process. Default: 1 on a GPU, 0 on a CPU.")] = None,
    grace_period: Annotated[float | None, typer.Option("--grace-period",
                                                       help="Seconds to finish in-flight requests on SIGTERM.")]
    = None,
    max_request_bytes: Annotated[int | None, typer.Option("--max-request-bytes",
                                                          help="Largest request body (413 beyond; default 16 MiB).")]
    = None,
    max_prompt_chars: Annotated[int | None, typer.Option("--max-prompt-chars",
                                                         help="Most prompt characters tokenized (413 beyond; "
                                                              "default 64 per token of context).")] = None,
    trust_request_chat_template: Annotated[bool | None, typer.Option(
        "--trust-request-chat-template", help="Render chat templates sent by clients (default: refused, 400).")]
    = None,
    metrics_public: Annotated[bool | None, typer.Option("--metrics-public",
                                                        help="Serve /metrics without the API key.")] = None,
    read_timeout: Annotated[float | None, typer.Option("--read-timeout",
                                                       help="Seconds a connection may take to send a request "
                                                            "(head, or between body pieces; the whole body: this "
                                                            "plus 1 s per 16 KiB); default 30.")] = None,
    write_timeout: Annotated[float | None, typer.Option("--write-timeout",
                                                        help="Seconds a client may leave its response unread "
                                                             "before the connection is cut and its requests "
                                                             "cancelled; default 30.")] = None,
    max_connections: Annotated[int | None, typer.Option("--max-connections",
                                                        help="Open connections at most (default: the open-file "
                                                             "limit less 64).")] = None,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
    recipe: RecipeOpt = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API with continuous batching and speculative decoding."""
    from clusteropt_cli.recipe.load import load_settings

    model, overrides = model_and_overrides(model, overrides)
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory is not None:
            raise BadInputError("Give --kv-cache-memory (GiB) or --kv-cache-memory-bytes, not both.",
                                hint="Keep one of the two.")
        kv_cache_memory = _parse_bytes(kv_cache_memory_bytes) / 2**30
    if enforce_eager:
        if cuda_graphs or compile_:
            raise BadInputError("--enforce-eager turns CUDA graphs and torch.compile off; it cannot be given with "
                                "--cuda-graphs or --compile.", hint="Keep one of them.")
        cuda_graphs = compile_ = False
    settings = load_settings("serve", recipe, overrides, dict(
        model=model, engine=engine, vllm_version=vllm_version, host=host, port=port, api_key=api_key,
        served_model_name=served_model_name, tokenizer=tokenizer, dtype=dtype, max_batch_tokens=max_batch_tokens,
        max_batch_size=max_batch_size, kv_cache_blocks=kv_cache_blocks, kv_cache_memory=kv_cache_memory,
        gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        max_queue=max_queue, max_model_len=max_model_len, draft_model=draft_model,
        num_speculative_tokens=num_speculative_tokens, prompt_lookup=prompt_lookup,
        speculative_max_batch=speculative_max_batch, cuda_graphs=cuda_graphs, compile=compile_,
        compile_mode=compile_mode, async_scheduling=async_scheduling, decode_attention=decode_attention,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        enable_prefix_caching=enable_prefix_caching, kv_layout=kv_layout,
        grace_period=grace_period, api_server_count=api_server_count,
        max_request_bytes=max_request_bytes, max_prompt_chars=max_prompt_chars,
        trust_request_chat_template=trust_request_chat_template, metrics_public=metrics_public,
        read_timeout=read_timeout, write_timeout=write_timeout, max_connections=max_connections),
        flags={"model": "MODEL"})

    from clusteropt_cli.core.serve.launch import is_loopback, resolve_api_key

    key, key_source = resolve_api_key(settings)  # before anything loads: an empty or non-ASCII key is refused
    if key_source in ("COPT_API_KEY", "VLLM_API_KEY"):
        settings = settings.model_copy(update={"api_key": key})
        os.environ.setdefault("VLLM_API_KEY", key)  # --engine vllm reads it there (not in its argv)
    if key is None and not is_loopback(settings.host):
        console.warn(f"binding {settings.host} without an API key: anyone who can reach this address can use the "
                     "server. Pass --api-key (or set COPT_API_KEY).")

    from clusteropt_cli.core.serve.vllm import (
        choose_engine,
        format_command,
        installed_vllm_version,
        plan_vllm_command,
        run_vllm,
        vllm_available,
    )

    chosen = choose_engine(settings.engine)
    if chosen == "vllm":
        plan = plan_vllm_command(settings)
        for warning in plan.warnings:
            console.warn(warning)
        if dry_run and key_source == "COPT_API_KEY" and "--api-key" not in plan.argv:
            console.warn("the API key comes from $COPT_API_KEY and is not in this command: export VLLM_API_KEY "
                         "with it before running the command, or vLLM serves without a key.")
        if dry_run:
            if json_out:
                console.print_json({"engine": "vllm", "vllm_version": plan.version,
                                    "vllm_version_source": plan.version_source, "command": plan.argv,
                                    "warnings": plan.warnings}, "copt.serve/1")
            else:
                console.log(f"command for vLLM {plan.version} ({plan.version_source})")
                console.out.print(format_command(plan.argv), highlight=False, markup=False)
            return
        if not vllm_available():
            raise BadInputError("--engine vllm needs vLLM, which is not installed here.",
                                hint="pip install vllm (on a CUDA machine), or use --engine copt; "
                                     "--dry-run prints the vllm command.")
        installed = installed_vllm_version()
        if plan.version_source == "--vllm-version" and installed and installed != plan.version:
            from clusteropt_cli.core.serve.vllm import parse_version

            if parse_version(installed) != parse_version(plan.version):
                raise BadInputError(f"--vllm-version {plan.version}, but vLLM {installed} is installed here.",
                                    hint="Drop --vllm-version to build the command for the installed vLLM.")
        console.log(f"running (vLLM {plan.version}): {format_command(plan.argv)}")
        raise typer.Exit(run_vllm(plan.argv))

    from clusteropt_cli.core.serve.launch import check_settings, resolve_api_server_count, serve_transformers

    settings = resolve_api_server_count(settings, warn=console.warn)
    check_settings(settings)
    if dry_run:
        plan = {"engine": "copt", "settings": settings}
        if json_out:
            console.print_json(plan, "copt.serve/1")
        else:
            console.out.print(console.kv_table("copt serve (dry run)", [
                ("engine", "copt"), ("model", settings.model), ("bind", f"{settings.host}:{settings.port}"),
                ("max batch", settings.max_batch_size),
                ("processes", f"{settings.api_server_count} API server(s) + engine core" if settings.api_server_count
                 else "one (HTTP and engine)"), ("speculation", settings.draft_model or (
                    f"prompt lookup n={settings.prompt_lookup}" if settings.prompt_lookup else "off"))]))
        return

    def ready(url: str, info: dict) -> None:
        if json_out:
            console.print_json({"url": url, **info}, "copt.serve/1")
        else:
            console.out.print(f"Serving {info['model']} at {url}/v1 (OpenAI-compatible; Ctrl-C or SIGTERM stops)",
                              highlight=False, markup=False)
            cache = (f"paged KV cache of {info['kv_cache_blocks']:,} blocks × {info['kv_block_size']} tokens "
                     f"({console.human_bytes(info['kv_cache_bytes'])}), up to {info['kv_cache_slots']} sequences of "
                     f"≤ {info['max_model_len']:,} tokens" if info.get("kv_layout") == "paged" else
                     f"{info['kv_cache_slots']} slots × {info['max_model_len']} tokens KV cache "
                     f"({console.human_bytes(info['kv_cache_bytes'])})")
            console.log(f"engine: {info['device']}, {cache}, "
                        f"{info['cuda_graphs']} decode and {info.get('prefill_graphs', 0)} prefill CUDA graphs, "
                        f"{info.get('merged_projections', 0)} merged projection "
                        f"groups (q/k/v, gate/up), decode attention {info.get('decode_attention', 'sdpa')}, "
                        f"speculation: {info['speculation']}")
            if info.get("api_server_count"):
                console.log(f"{info['api_server_count']} API-server process(es) (pids "
                            f"{', '.join(map(str, info['api_server_pids']))}) in front of the engine-core process "
                            f"(pid {info['engine_core_pid']})")
            if info.get("attention"):
                console.log(f"attention: {info['attention']}")
            fp8 = info.get("fp8_linears") or {}
            if fp8.get("count"):
                console.log(f"FP8 W8A8: {fp8['count']} linear layers, "
                            + ("torch._scaled_mm FP8 GEMMs" if fp8["kernel"] == "scaled_mm"
                               else "emulated in fp32 (no FP8 tensor cores on this device)"))

    console.log(f"loading {settings.model} ...")
    code = serve_transformers(settings, on_ready=ready)
    raise typer.Exit(code)


def _parse_bytes(text: str) -> int:
    """'8589934592', '8G', '8GiB', '512M', '1.5g' → bytes (binary units, as vLLM's human-readable sizes)."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}.get(raw[-1:], 1)
    try:
        value = float(raw[:-1] if scale > 1 else raw) * scale
    except ValueError:
        value = -1
    if value <= 0:
        raise BadInputError(f"--kv-cache-memory-bytes '{text}' is not a size.", hint="Pass e.g. 8G or 8589934592.")
    return int(value)
