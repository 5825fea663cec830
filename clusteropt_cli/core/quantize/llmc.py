"""The default backend: llm-compressor's oneshot (+ compressed-tensors checkpoints that vLLM and transformers load).

awq  = AWQModifier (activation-aware scales) + QuantizationModifier (int weights, groups), then llm-awq's
       weight-clipping search (awq_clip.py; recipe key awq_clip)
gptq = GPTQModifier (inverse-Hessian error compensation)
rtn  = QuantizationModifier alone (round-to-nearest, same bits and groups: the baseline)
fp8  = QuantizationModifier(scheme=FP8_DYNAMIC): e4m3 per-channel weights, dynamic per-token activations
int8 = SmoothQuantModifier + GPTQModifier(scheme=W8A8): int8 per-channel weights, dynamic per-token activations
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

ProgressFn = Callable[[str, int, int], None]

SMOOTHQUANT_STRENGTH = 0.8  # llm-compressor's W8A8 example value


def scheme_name(settings: QuantizeRecipe) -> str:
    """A short, human-readable description of the weight/activation format."""
    if settings.method == "fp8":
        return "FP8_DYNAMIC (W8A8 e4m3: per-channel weights, dynamic per-token activations)"
    if settings.method == "int8":
        return "W8A8 int8 (per-channel weights, dynamic per-token activations; SmoothQuant)"
    group = "per-channel" if settings.group_size == -1 else f"g{settings.group_size}"
    return f"W{settings.weight_bits}A16 int {group} {'sym' if settings.symmetric else 'asym'}"


def weight_config_groups(bits: int, group_size: int, symmetric: bool, observer: str | None = None) -> dict:
    """compressed-tensors config_groups for integer weight-only quantization at any bits/group size (observer:
    how the scales are chosen; None = min/max)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if group_size == -1 else "group"
    weights = QuantizationArgs(num_bits=bits, type="int", strategy=strategy, symmetric=symmetric, dynamic=False,
                               group_size=None if group_size == -1 else group_size,
                               **({"observer": observer} if observer and observer != "minmax" else {}))
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def build_recipe(method: str, settings: QuantizeRecipe) -> list:
    """The llm-compressor modifiers for a method (method may differ from settings.method for the RTN baseline)."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    ignore = list(settings.ignore)
    if method == "fp8":
        return [QuantizationModifier(targets=["Linear"], scheme="FP8_DYNAMIC", ignore=ignore)]
    if method == "int8":
        return [SmoothQuantModifier(smoothing_strength=SMOOTHQUANT_STRENGTH),
                GPTQModifier(targets=["Linear"], scheme="W8A8", ignore=ignore)]
    # the user's observer for the user's method; the --compare-rtn baseline stays plain min/max round-to-nearest
    observer = settings.weight_observer if method == settings.method else None
    groups = weight_config_groups(settings.weight_bits, settings.group_size, settings.symmetric, observer)
    if method == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if method == "int8-rtn":  # the --compare-rtn baseline for int8: W8A8 without smoothing or GPTQ
        return [QuantizationModifier(targets=["Linear"], scheme="W8A8", ignore=ignore)]
    if method == "gptq":
        return [GPTQModifier(config_groups=groups, ignore=ignore)]
    if method == "awq":
        return [AWQModifier(duo_scaling=settings.awq_duo_scaling),
                QuantizationModifier(config_groups=groups, ignore=ignore)]
    raise ValueError(f"unknown method {method}")


def quiet_library_logs(verbose: bool = False) -> None:
    """llm-compressor logs to stdout through loguru; send its logs to stderr (errors only unless verbose)."""
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="INFO" if verbose else "ERROR",
               format="{time:HH:mm:ss} | llmcompressor | {level} - {message}")


@contextlib.contextmanager
def cpu_awq_guard() -> Iterator[None]:
    """AWQ pins cached activations for faster host→device copies; pin_memory() raises without an accelerator.

    Only when no accelerator is present, pinning is skipped (the tensors stay in ordinary CPU memory).
    """
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def decoder_layers(model) -> list:
    """The decoder blocks (the ModuleList whose length is num_hidden_layers), for progress reporting."""
    import torch

    n = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return list(module)
    return []


@contextlib.contextmanager
def layer_progress(model, progress: ProgressFn | None, stage: str) -> Iterator[None]:
    """Report 'stage, layer i of N' as calibration reaches each decoder block (forward hooks)."""
    layers = decoder_layers(model)
    if progress is None or not layers:
        yield
        return
    reached = {"max": 0}

    def hook_for(index: int):
        def hook(_module, _args, _output):
            if index + 1 > reached["max"]:
                reached["max"] = index + 1
                progress(stage, index + 1, len(layers))
        return hook

    handles = [layer.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
    progress(stage, 0, len(layers))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def calibration_dataset(tokenizer, texts: list[str], seq_len: int):
    """Tokenized calibration samples (one per text, truncated to seq_len) as a datasets.Dataset."""
    from datasets import Dataset

    ids = [tokenizer(t, add_special_tokens=False, truncation=True, max_length=seq_len)["input_ids"] for t in texts]
    ids = [x for x in ids if len(x) >= 2]
    if not ids:
        from clusteropt_cli.errors import BadInputError

        raise BadInputError(f"--calib: none of its {len(texts)} samples has 2 tokens or more (with --seq-len "
                            f"{seq_len}): nothing to calibrate on.",
                            hint="Pass calibration text of whole sentences (hundreds of tokens each works best).")
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}), ids


def run_oneshot(model, tokenizer, method: str, settings: QuantizeRecipe, texts: list[str] | None,
                output_dir: Path | None, progress: ProgressFn | None = None, verbose: bool = False) -> dict:
    """Quantize `model` in place with llm-compressor; save a compressed checkpoint to output_dir when given.

    Returns facts for the report: calibration samples and tokens actually used.
    """
    from llmcompressor import oneshot

    quiet_library_logs(verbose)
    recipe = build_recipe(method, settings)
    kwargs: dict = {}
    used, tokens = 0, 0
    if method in ("awq", "gptq", "int8"):
        dataset, ids = calibration_dataset(tokenizer, texts or [], settings.seq_len)
        used, tokens = len(ids), sum(len(x) for x in ids)
        kwargs = dict(dataset=dataset, num_calibration_samples=used, max_seq_length=settings.seq_len,
                      shuffle_calibration_samples=False, batch_size=1)
    clip = method == settings.method and settings.clip_search  # not for the --compare-rtn baseline
    guard = cpu_awq_guard() if method == "awq" else contextlib.nullcontext()
    with guard, layer_progress(model, progress, f"{method}: calibrating" if kwargs else f"{method}: quantizing"):
        oneshot(model=model, processor=tokenizer, recipe=recipe, save_compressed=True,
                output_dir=str(output_dir) if output_dir and not clip else None, **kwargs)
    facts: dict = {"calib_samples": used, "calib_tokens": tokens}
    if clip:  # llm-awq's clipping search on top of llm-compressor's scales, then the same compressed save
        from clusteropt_cli.core.quantize.awq_clip import apply_awq_clip

        facts["awq_clip"] = apply_awq_clip(model, ids, progress)
        if output_dir:
            model.save_pretrained(str(output_dir), save_compressed=True)
            tokenizer.save_pretrained(str(output_dir))
    return facts


def version() -> str:
    from importlib.metadata import version as dist_version

    return f"llmcompressor {dist_version('llmcompressor')}, compressed-tensors {dist_version('compressed-tensors')}"
