"""advise --task infer answers in vLLM's own flags: --gpu-memory-utilization, --max-model-len, --max-num-seqs."""

from __future__ import annotations

import json

from clusteropt_cli.core.advise.api import advise, resolve_target
from clusteropt_cli.core.advise.memory import kv_cache_bytes, weight_bytes
from clusteropt_cli.core.advise.plan import InferPlan
from clusteropt_cli.modelspec import load_model_spec


def test_capacity_in_vllm_terms():
    target, _ = resolve_target("h100-sxm")
    spec = load_model_spec("llama-3.1-8b")
    plan = InferPlan(batch=8, prompt_len=1024, gen_len=256, continuous_batching=True)  # as copt advise builds it
    result = advise(spec, target, plan)
    v = result["vllm"]
    assert v["max_model_len"] == 1280 and v["gpu_memory_utilization"] == 0.9
    # vLLM's own sizing and paging, not copt's engine (whose concurrency its --max-batch-size, 256 by default, caps)
    assert v["max_num_seqs"] > result["time"]["max_concurrent_seqs"] == 256
    assert result["kv_cache"]["engine"] == "copt" and result["kv_cache"]["kv_concurrent_seqs"] > 256
    # N sequences of max_model_len tokens fit in the memory share next to the weights, N + 1 would not
    room = 0.9 * target.memory_bytes - weight_bytes(spec, plan.weights)
    per_seq = kv_cache_bytes(spec, plan.with_(batch=1))
    assert v["max_num_seqs"] * per_seq <= room < (v["max_num_seqs"] + 1) * per_seq * 1.25
    assert v["args"] == "--gpu-memory-utilization 0.9 --max-model-len 1280 --max-num-seqs " + str(v["max_num_seqs"])
    tp = advise(spec, resolve_target("h100-sxm", gpus=2)[0], plan.with_(tp=2))["vllm"]
    assert "--tensor-parallel-size 2" in tp["args"] and tp["max_num_seqs"] > v["max_num_seqs"]


def test_nothing_fits_says_so(copt):
    r = copt("advise", "--task", "infer", "--model", "llama-3.1-70b", "--gpu", "rtx4090", "--prompt-len", "4096",
             "--gen-len", "1024")
    assert "vLLM:" in r.stdout and "will refuse to start" in r.stdout
    r = copt("advise", "--task", "infer", "--model", "llama-3.1-8b", "--gpu", "h100-sxm", "--json")
    doc = json.loads(r.stdout)
    assert doc["time"]["max_concurrent_seqs"] == min(256, doc["kv_cache"]["kv_concurrent_seqs"])
    assert doc["vllm"]["max_num_seqs"] > 256
