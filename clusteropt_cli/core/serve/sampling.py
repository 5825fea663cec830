"""Model sampling defaults and the host transfer of the tokens chosen on the device (the choice itself:
device_sampling)."""

from __future__ import annotations

from typing import Any

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty")  # vLLM's ModelConfig.get_diff_sampling_param


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults a model ships in generation_config.json, as vLLM applies them (`--generation-config
    auto`): the values that differ from transformers' GenerationConfig defaults, whatever `do_sample` says. A
    request that omits one of these gets the model's value (else 1.0 / 1.0 / off)."""
    from pathlib import Path

    if not (Path(model_dir) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except (OSError, ValueError):
        return {}
    return {key: diff[key] for key in SAMPLING_DEFAULT_KEYS if diff.get(key) is not None}



def to_host(ids) -> list[int]:
    """Device ids → Python ints. On CUDA the wait happens with the GIL released (pinned copy + event), so the
    server's event loop keeps running while the GPU finishes the step."""
    import torch

    if ids.device.type != "cuda":
        return ids.tolist()
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()
