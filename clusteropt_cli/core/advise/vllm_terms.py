"""The inference capacity answer in vLLM's own flags: --gpu-memory-utilization, --max-model-len, --max-num-seqs."""

from __future__ import annotations

from typing import Any

from clusteropt_cli.core.advise import calibration as cal

VLLM_DEFAULT_MAX_NUM_SEQS = 1024  # vLLM's default on GPUs with >= 70 GiB (V1 engine)


def vllm_capacity(workload: dict[str, Any], max_concurrent_seqs: int | None) -> dict[str, Any] | None:
    """The flags for a vLLM server of this workload: the KV cache (at vLLM's default memory share) holds
    `max_num_seqs` sequences of `max_model_len` tokens next to the weights; None without a memory budget."""
    if max_concurrent_seqs is None:
        return None
    max_model_len = int(workload["prompt_len"]) + int(workload["gen_len"])
    flags = {"gpu_memory_utilization": cal.SERVING_MEMORY_UTILIZATION, "max_model_len": max_model_len,
             "max_num_seqs": int(max_concurrent_seqs)}
    if int(workload.get("tp") or 1) > 1:
        flags["tensor_parallel_size"] = int(workload["tp"])
    if int(workload.get("block_size") or 16) != 16:
        flags["block_size"] = int(workload["block_size"])
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    if workload.get("prefix_caching") is False:
        args += " --no-enable-prefix-caching"
    if max_concurrent_seqs < 1:
        note = (f"no sequence of {max_model_len} tokens fits next to the weights at "
                f"{cal.SERVING_MEMORY_UTILIZATION:.0%} of GPU memory: vLLM will refuse to start")
    else:
        note = (f"the KV cache holds {max_concurrent_seqs} sequences of {max_model_len} tokens (vLLM's start-up log: "
                f"'Maximum concurrency for {max_model_len} tokens per request'); more concurrent requests queue "
                "or are preempted")
        if int(workload.get("shared_prefix_len") or 0) >= int(workload.get("block_size") or 16) \
                and workload.get("prefix_caching") is not False:
            note += (f" (with the {workload['shared_prefix_len']}-token shared prefix cached once; vLLM's start-up "
                     "figure assumes nothing is shared)")
        if max_concurrent_seqs > VLLM_DEFAULT_MAX_NUM_SEQS:
            note += f"; vLLM's default --max-num-seqs {VLLM_DEFAULT_MAX_NUM_SEQS} would cap it below that"
    return {**flags, "args": args, "note": note}
