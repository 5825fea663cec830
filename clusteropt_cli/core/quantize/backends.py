"""Backend dispatch: quantize a loaded model into a directory, reload it, name the backend's version."""

from __future__ import annotations

from pathlib import Path

from clusteropt_cli.core.quantize import llmc
from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

scheme_name = llmc.scheme_name


def quantize(model, tokenizer, settings: QuantizeRecipe, texts: list[str] | None, output_dir: Path,
             progress=None, verbose: bool = False) -> dict:
    """Quantize and save into output_dir; returns facts for the report (calib samples/tokens, warnings)."""
    from clusteropt_cli.deps import require

    if settings.backend == "llmcompressor":
        require("llmcompressor", "quantize")
        return llmc.run_oneshot(model, tokenizer, settings.method, settings, texts, output_dir, progress, verbose)
    from clusteropt_cli.core.quantize import legacy

    return legacy.quantize(settings, tokenizer, texts, output_dir, progress, verbose)


def quantize_rtn_in_memory(model, tokenizer, settings: QuantizeRecipe, progress=None, verbose: bool = False) -> None:
    """Round-to-nearest at the same format, in memory (the --compare-rtn baseline; always llm-compressor)."""
    from clusteropt_cli.deps import require

    require("llmcompressor", "quantize")
    method = "int8-rtn" if settings.method == "int8" else "rtn"
    llmc.run_oneshot(model, tokenizer, method, settings, None, None, progress, verbose)


def reload(output_dir: Path, settings: QuantizeRecipe, device: str):
    """Load the written checkpoint the way a user would (transformers), on `device`."""
    if settings.backend != "llmcompressor":
        from clusteropt_cli.core.quantize import legacy

        return legacy.reload(output_dir, settings, device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(output_dir, device_map=device)


def version(backend: str) -> str:
    if backend == "llmcompressor":
        return llmc.version()
    from clusteropt_cli.core.quantize import legacy

    return legacy.version(backend)
