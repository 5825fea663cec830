"""The AutoGPTQ/AutoAWQ checkpoint formats: GPTQModel (maintained), and auto-gptq/autoawq when they import.

GPTQModel writes both formats (GPTQ: method gptq, format gptq; AWQ: method awq, format gemm) and transformers
loads them through its GPTQ/AWQ quantizers. auto-gptq and autoawq are archived; they are used only if they
import in this environment (plan() refuses them with a pointer to gptqmodel otherwise).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path

from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

# what importing GPTQModel sets where the user had not: CUDA's device order (PCI_BUS_ID renumbers mixed GPUs) and
# its tokenizer helper's Hugging Face cache under /tmp (HF_HOME and the rest); copt puts them back as they were
_GPTQMODEL_IMPORT_SETS = ("CUDA_DEVICE_ORDER", "HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_MODULES_CACHE")


def _gptqmodel():
    # GPTQModel sizes its CPU thread pools at import; a 2-core host needs at least 2 workers for its loader pool.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, min(12, ((os.cpu_count() or 1) + 1) // 2))))
    from clusteropt_cli.deps import require

    before = {key: os.environ.get(key) for key in _GPTQMODEL_IMPORT_SETS}
    try:
        return require("gptqmodel", "gptq")
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def quantize(settings: QuantizeRecipe, tokenizer, texts: list[str] | None, output_dir: Path,
             progress=None, verbose: bool = False) -> dict:
    """Quantize settings.model with the chosen legacy-format backend into output_dir."""
    texts = list(texts or [])
    if progress is not None:
        progress(f"{settings.method}: calibrating ({settings.backend})", 0, 0)
    if settings.backend == "gptqmodel":
        return _quantize_gptqmodel(settings, texts, output_dir)
    if settings.backend == "auto-gptq":
        return _quantize_auto_gptq(settings, tokenizer, texts, output_dir)
    if settings.backend == "autoawq":
        return _quantize_autoawq(settings, tokenizer, texts, output_dir)
    raise ValueError(f"unknown backend {settings.backend}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _truncate(tokenizer, texts: list[str], seq_len: int) -> tuple[list[list[int]], int]:
    ids = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=seq_len)["input_ids"] for t in texts]
    ids = [x for x in ids if len(x) >= 2]
    return ids, sum(len(x) for x in ids)


def _quantize_gptqmodel(settings: QuantizeRecipe, texts: list[str], output_dir: Path) -> dict:
    gptqmodel = _gptqmodel()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    ids, tokens = _truncate(tokenizer, texts, settings.seq_len)
    fmt = "gemm" if settings.method == "awq" else "gptq"
    config = gptqmodel.QuantizeConfig(bits=settings.weight_bits, group_size=settings.group_size,
                                      sym=settings.symmetric, desc_act=False, method=settings.method, format=fmt)
    model = gptqmodel.GPTQModel.load(settings.model, config)
    calibration = [{"input_ids": x, "attention_mask": [1] * len(x)} for x in ids]
    backend = gptqmodel.BACKEND.AUTO
    if settings.method == "awq" and not _has_cuda():
        backend = gptqmodel.BACKEND.TORCH_AWQ  # the AWQ GEMM kernel needs CUDA; the torch kernel runs on CPU
    model.quantize(calibration, batch_size=1, calibration_data_min_length=2, backend=backend)
    model.save(str(output_dir))
    (output_dir / "quant_log.csv").unlink(missing_ok=True)
    warnings = []
    if settings.ignore != ["lm_head"]:
        warnings.append("--ignore: gptqmodel keeps lm_head (and embeddings) in full precision; other names "
                        "are not applied by this backend")
    return {"calib_samples": len(ids), "calib_tokens": tokens, "warnings": warnings}


def _quantize_auto_gptq(settings: QuantizeRecipe, tokenizer, texts: list[str], output_dir: Path) -> dict:
    import torch
    from auto_gptq import AutoGPTQForCausalLM, BaseQuantizeConfig

    ids, tokens = _truncate(tokenizer, texts, settings.seq_len)
    config = BaseQuantizeConfig(bits=settings.weight_bits, group_size=settings.group_size, sym=settings.symmetric,
                                desc_act=False)
    model = AutoGPTQForCausalLM.from_pretrained(settings.model, config)
    examples = [{"input_ids": torch.tensor([x]), "attention_mask": torch.ones(1, len(x), dtype=torch.long)}
                for x in ids]
    model.quantize(examples)
    model.save_quantized(str(output_dir), use_safetensors=True)
    return {"calib_samples": len(ids), "calib_tokens": tokens}


def _quantize_autoawq(settings: QuantizeRecipe, tokenizer, texts: list[str], output_dir: Path) -> dict:
    from awq import AutoAWQForCausalLM

    ids, tokens = _truncate(tokenizer, texts, settings.seq_len)
    model = AutoAWQForCausalLM.from_pretrained(settings.model)
    config = {"zero_point": not settings.symmetric, "q_group_size": settings.group_size,
              "w_bit": settings.weight_bits, "version": "GEMM"}
    model.quantize(tokenizer, quant_config=config, calib_data=[tokenizer.decode(x) for x in ids],
                   max_calib_samples=len(ids), max_calib_seq_len=settings.seq_len)
    model.save_quantized(str(output_dir))
    return {"calib_samples": len(ids), "calib_tokens": tokens}


def reload(output_dir: Path, settings: QuantizeRecipe, device: str):
    """Load the checkpoint with transformers (its GPTQ/AWQ quantizers use GPTQModel's kernels)."""
    if settings.backend == "gptqmodel":
        _gptqmodel()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(output_dir, device_map=device)


def version(backend: str) -> str:
    dist = {"gptqmodel": "gptqmodel", "auto-gptq": "auto-gptq", "autoawq": "autoawq"}[backend]
    try:
        return f"{backend} {dist_version(dist)}"
    except PackageNotFoundError:
        return backend
