"""Recipe for copt serve."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from clusteropt_cli.core.serve.kv_budget import DEFAULT_MAX_BATCH_SIZE
from clusteropt_cli.recipe.schema.base import Prediction, Strict, raise_problems


def api_key_problems(key: str, source: str) -> list[str]:
    """Why `key` cannot be the server's API key: empty (an unset shell variable) or not printable ASCII (an HTTP
    header carries it)."""
    if key == "":
        return [f"{source}: the API key is empty (an unset shell variable?); give a key, or leave it out to serve "
                "without one"]
    if not key.isascii() or not key.isprintable() or key != key.strip():
        return [f"{source}: the API key must be printable ASCII without surrounding spaces (clients send it in an "
                "HTTP header)"]
    return []


# copt's HTTP server's own limits: vLLM's server (engine vllm) has no counterpart copt could pass them to
COPT_SERVER_KEYS = ("max_request_bytes", "max_prompt_chars", "metrics_public", "read_timeout", "write_timeout",
                    "max_connections")


class ServeRecipe(Strict):
    """copt serve."""

    task: Literal["serve"] = "serve"
    model: str
    engine: Literal["auto", "copt", "vllm"] = Field(
        "auto", description="copt (copt's own engine; 'transformers' is accepted as its former name), vllm, or auto "
        "(vllm when installed with a CUDA GPU, else copt).")
    vllm_version: str | None = Field(
        None, description="engine vllm: the vLLM version (X.Y) to build the command for; default: the installed "
        "one (for dry runs where vLLM is absent: the newest release copt knows).")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: the model directory), as "
                                  "vLLM's --tokenizer.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    max_batch_tokens: PositiveInt | None = Field(None, description="Tokens per step (chunked prefill budget).")
    max_batch_size: PositiveInt = Field(DEFAULT_MAX_BATCH_SIZE, description="Sequences decoded together at most "
                                        "(vLLM --max-num-seqs; forwarded to vLLM only when set).")
    kv_cache_blocks: PositiveInt | None = None
    kv_cache_memory: float | None = Field(None, gt=0, description="GiB for the KV cache.")
    kv_cache_dtype: Literal["auto", "bf16", "fp8", "int8"] = Field(
        "auto", description="KV-cache element type: auto (the model's), fp8 (float8 e4m3 blocks, half the memory; "
        "copt engine: paged cache), int8 (vLLM only).")
    block_size: PositiveInt = Field(16, le=1024, description="Tokens per KV-cache block (vLLM's default 16; "
                                    "forwarded to vLLM only when set).")
    enable_prefix_caching: bool = Field(
        True, description="Automatic prefix caching: full KV blocks are shared copy-free by requests with the same "
        "token prefix (vLLM's --enable-prefix-caching; forwarded to vLLM only when set).")
    kv_layout: Literal["auto", "paged", "slots"] = Field(
        "auto", description="copt engine: paged (a block pool shared by all sequences) or slots (one max_model_len "
        "slot per sequence); auto = paged unless a layer keeps a sliding-window ring.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Fraction of the GPU's total memory this server may use (weights, activations "
        "and KV cache), as vLLM's --gpu-memory-utilization; copt's engine sizes its KV cache to fit the same "
        "budget. Default: vLLM's 0.9; copt's engine 85% of the memory free after loading.")
    max_queue: PositiveInt = 1024
    max_model_len: PositiveInt | None = None
    draft_model: str | None = None
    num_speculative_tokens: PositiveInt = 4
    prompt_lookup: PositiveInt | None = Field(None, description="n-gram size for prompt-lookup drafting.")
    speculative_max_batch: PositiveInt = Field(4, description="Speculate only while at most this many run.")
    cuda_graphs: bool | None = Field(None, description="Capture decode steps as CUDA graphs (default: on GPU).")
    compile: bool | None = Field(None, description="torch.compile the decoder layers for decode steps, once for all "
                                                   "layers (default: on with CUDA graphs).")
    compile_mode: Literal["auto", "default", "max-autotune-no-cudagraphs"] = Field(
        "auto", description="torch.compile mode of the decode layers: max-autotune-no-cudagraphs benchmarks "
                            "Triton GEMM/GEMV templates against cuBLAS at start-up (slower start; copt captures "
                            "the CUDA graphs itself); auto (the default) does so for batch-1 steps on CUDA only, "
                            "default never. copt engine only.")
    async_scheduling: bool | None = Field(
        None, description="Launch the next greedy decode step before handling the current one's tokens (stretches "
        "of pure greedy decoding). None = on for the copt engine (H200, 1B: batch-1 decode 1.70 -> 1.40 "
        "ms/token in the same run), vLLM's own default for engine vllm (true/false pass --async-scheduling / "
        "--no-async-scheduling).")
    decode_attention: Literal["auto", "sdpa", "flex", "math", "paged"] = Field(
        "auto", description="Attention of the compiled decode steps: masked SDPA, FlexAttention, or plain tensor ops "
        "(math) that the compiler fuses, or paged (a Triton kernel reading the paged cache's blocks in place). "
        "auto = math where the decode layers are compiled (H200, 1B, batch-1: "
        "1.23 ms/token against 1.42 with sdpa), sdpa otherwise. flex/math: copt engine, compiled decode "
        "layers.")
    tensor_parallel: PositiveInt = 1
    pipeline_parallel: PositiveInt = 1
    quantization: str | None = Field(None, description="vLLM --quantization (awq, gptq, fp8, compressed-tensors).")
    api_server_count: int | None = Field(
        None, ge=0, le=64, description="API-server processes (HTTP, tokenization, detokenization, SSE) in front of a "
        "separate engine-core process, talking over ZeroMQ (vLLM's --api-server-count); 0: one process runs both. "
        "None: 1 when the copt engine runs on a GPU, 0 on a CPU. engine vllm: forwarded when set.")
    grace_period: float = Field(30.0, ge=0, description="Seconds to finish in-flight requests on SIGTERM.")
    max_request_bytes: PositiveInt = Field(16 * 2**20, description="Largest request body accepted (413 beyond).")
    max_prompt_chars: PositiveInt | None = Field(
        None, description="Most characters of a prompt (or of a chat's messages) tokenized; 413 beyond. None = 64 "
        "per token of max_model_len (at least 65,536).")
    trust_request_chat_template: bool = Field(
        False, description="Render chat templates that requests send (chat_template / chat_template_kwargs); off: "
        "400, only the model's own template is used.")
    metrics_public: bool = Field(False, description="Serve /metrics without the API key.")
    read_timeout: float = Field(30.0, gt=0, description="Seconds a connection may take to send a request head, "
                                                       "and between two pieces of a body (the whole body: this plus "
                                                       "a second per 16 KiB); then it is closed.")
    write_timeout: float = Field(30.0, gt=0, description="Seconds a client may leave its response unread (the "
                                                         "server's sends blocked); then the connection is cut and "
                                                         "its requests cancelled.")
    max_connections: PositiveInt | None = Field(
        None, description="Open connections at most; more are closed at once. None = the open-file limit less 64.")
    prediction: Prediction | None = None

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_alias(cls, value: object) -> object:
        return "copt" if value == "transformers" else value

    @field_validator("vllm_version", mode="before")
    @classmethod
    def _version_text(cls, value: object) -> object:
        if isinstance(value, (int, float)):
            raise ValueError("write the version as text, e.g. vllm_version='0.11' (YAML reads 0.10 as 0.1)")
        return value

    @model_validator(mode="after")
    def _check_serve(self) -> ServeRecipe:
        problems = []
        if self.api_key is not None:
            problems.extend(api_key_problems(self.api_key, "api_key"))
        if self.kv_cache_blocks is not None and self.kv_cache_memory is not None:
            problems.append("kv_cache_blocks: give `kv_cache_blocks` or `kv_cache_memory`, not both")
        if self.draft_model and self.prompt_lookup:
            problems.append("draft_model: choose a draft model or `prompt_lookup`, not both")
        no_compiled_layers = self.engine == "vllm" or self.compile is False
        if self.compile_mode not in ("auto", "default") and no_compiled_layers:
            problems.append("compile_mode: applies to the copt engine's compiled decode layers "
                            "(not with `engine` vllm, nor with compilation off)")
        if self.decode_attention in ("flex", "math") and no_compiled_layers:
            problems.append("decode_attention: flex and math apply to the copt engine's compiled decode "
                            "layers (not with `engine` vllm, nor with compilation off)")
        if self.kv_layout != "auto" and self.engine == "vllm":
            problems.append("kv_layout: chooses the copt engine's KV cache (vLLM's is always paged)")
        if self.engine == "vllm":
            problems.extend(f"{key}: a limit of copt's own HTTP server; `engine` vllm runs vLLM's server, which does "
                            "not take it" for key in COPT_SERVER_KEYS if key in self.model_fields_set)
        if self.vllm_version is not None:
            from clusteropt_cli.core.serve.vllm import parse_version

            try:
                parse_version(self.vllm_version)
            except ValueError as exc:
                problems.append(f"vllm_version: {exc}")
        raise_problems(problems)
        return self
