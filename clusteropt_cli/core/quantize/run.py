"""copt quantize, the work: validate up front → load → quantize → save atomically → reload, score, report."""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clusteropt_cli.core.io import atomic_output_dir, check_output
from clusteropt_cli.core.quantize.calib import read_calibration_texts, read_eval_text
from clusteropt_cli.errors import BadInputError, MissingDependencyError, RecipeError
from clusteropt_cli.recipe.schema.quantize import QuantizeRecipe

REPORT_NAME = "copt_quant_report.json"
REPORT_VERSION = 1
# Module (import name) and pip extra for each backend.
BACKEND_MODULES = {"llmcompressor": ("llmcompressor", "quantize"), "gptqmodel": ("gptqmodel", "gptq"),
                   "auto-gptq": ("auto_gptq", None), "autoawq": ("awq", None)}


@dataclass
class Plan:
    """Everything validated before any model is loaded."""

    settings: QuantizeRecipe
    model_dir: Path
    output: Path
    calib_texts: list[str] | None
    eval_text: str | None
    warnings: list[str] = field(default_factory=list)
    ignore_after_load: bool = False  # --ignore is checked against the loaded model (its meta build failed)


@dataclass
class QuantizeReport:
    """What copt_quant_report.json holds (and what --json prints)."""

    report_version: int
    model: str
    output: str
    method: str
    backend: str
    backend_version: str
    bits: int
    group_size: int | None
    symmetric: bool
    scheme: str
    ignore: list[str]
    size_before_bytes: int
    size_after_bytes: int
    compression_ratio: float
    quantize_time_s: float
    total_time_s: float
    calib_file: str | None
    calib_samples: int
    calib_tokens: int
    seq_len: int
    eval_file: str | None
    eval_tokens: int | None
    eval_block_len: int | None
    ppl_before: float | None
    ppl_after: float | None
    ppl_rtn: float | None
    ppl_increase: float | None
    ppl_rtn_increase: float | None
    # closeness to the original on the --eval text: mean KL(original ‖ quantized) in nats per token and the
    # fraction of positions with the same argmax, over the first kl_tokens positions (≤ 1 GiB of log-probs)
    kl_divergence: float | None
    top1_agreement: float | None
    kl_tokens: int | None
    sample_generation: str
    device: str
    warnings: list[str]
    observer: str | None = None  # how integer weight scales were chosen (awq/gptq/rtn on llmcompressor)
    awq_duo_scaling: bool | str | None = None
    awq_clip: dict | None = None  # llm-awq's clipping search: layers clipped, mean clip ratio, sample tokens
    servable_by_vllm: dict | None = None  # {"servable": bool, "reason": str} (core/quantize/servable.py)
    schema_version: str = "copt.quantize/1"  # what every --json document names (README's output contract)


def default_output(settings: QuantizeRecipe) -> Path:
    """./<model>-<method>-w<bits>[g<group>] (the weight format in the name).

    Run from inside the model directory (`copt quantize .`), the output goes beside the model instead: copt never
    writes into its input.
    """
    model = Path(settings.model).expanduser().resolve()
    tag = f"w{settings.weight_bits}"
    if settings.method in ("awq", "gptq", "rtn"):
        tag += "" if settings.group_size == -1 else f"g{settings.group_size}"
    here = Path.cwd().resolve()
    parent = model.parent if here == model or model in here.parents else here
    return parent / f"{model.name or 'model'}-{settings.method}-{tag}"


def _dividing_group_size(widths: list[int]) -> int:
    """The largest of the usual group sizes (128, 64, 32, 16, 8) that divides every width (8 if none does)."""
    return next((g for g in (128, 64, 32, 16, 8) if all(w % g == 0 for w in widths)), 8)


def _linear_in_features(config: dict) -> dict[str, int]:
    """Input widths of the Linear layers a Llama-style decoder quantizes (from config.json, no weights)."""
    text = config.get("text_config") or config
    hidden = text.get("hidden_size")
    widths = {"hidden_size (q/k/v/gate/up_proj inputs)": hidden}
    if text.get("intermediate_size"):
        widths["intermediate_size (down_proj input)"] = text["intermediate_size"]
    heads, head_dim = text.get("num_attention_heads"), text.get("head_dim")
    if heads and head_dim:
        widths["num_attention_heads*head_dim (o_proj input)"] = heads * head_dim
    return {k: v for k, v in widths.items() if isinstance(v, int)}


def plan(settings: QuantizeRecipe, overwrite: bool = False, recipe: str | None = None) -> Plan:
    """Validate every input up front; raise one error naming the flag to change. No heavy imports, but for a given
    --ignore: its entries are matched against the model's modules, built on the meta device (no weights)."""
    warnings: list[str] = []
    from clusteropt_cli.modelspec import refuse_config_file

    refuse_config_file(settings.model, "MODEL")
    model_dir = Path(settings.model).expanduser()
    if not model_dir.is_dir():
        raise BadInputError(f"MODEL {model_dir}: no such directory.",
                            hint="Pass a local Hugging Face model directory (with config.json); copt never "
                                 "downloads weights.")
    if not (model_dir / "config.json").is_file():
        raise BadInputError(f"MODEL {model_dir} has no config.json.",
                            hint="Pass a Hugging Face model directory saved with save_pretrained.")
    from clusteropt_cli.modelspec import PICKLE_WEIGHTS, check_loadable_model, read_config_json

    config = read_config_json(model_dir / "config.json", "MODEL")
    if not any(model_dir.glob("*.safetensors")) and not any(p for g in PICKLE_WEIGHTS for p in model_dir.glob(g)):
        raise BadInputError(f"MODEL {model_dir} has no weights (*.safetensors).",
                            hint="Pass a directory that holds the model's weights.")
    check_loadable_model(model_dir, config, "MODEL", tokenizer=True)
    quantization = config.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise BadInputError(f"MODEL {model_dir}: config.json's quantization_config is a {type(quantization).__name__}, "
                            "not an object.", hint="Restore config.json from the model's source.")
    if config.get("text_config") is not None and not isinstance(config["text_config"], dict):
        raise BadInputError(f"MODEL {model_dir}: config.json's text_config is not an object.",
                            hint="Restore config.json from the model's source.")
    if (quantization or {}).get("quant_method"):
        raise BadInputError(f"MODEL {model_dir} is already quantized ({quantization['quant_method']}).",
                            hint="Quantize the full-precision checkpoint instead.")

    if settings.method in ("awq", "gptq", "rtn") and settings.group_size != -1:
        widths = _linear_in_features(config)
        bad = {k: v for k, v in widths.items() if v % settings.group_size}
        if bad:
            raise RecipeError("--group-size does not divide the layer widths:",
                              problems=[f"group_size {settings.group_size}: {k} = {v}" for k, v in bad.items()],
                              hint=f"Choose a group size that divides them (e.g. "
                                   f"{_dividing_group_size(list(widths.values()))}), or -1 for per-channel.")
    if settings.method in ("fp8", "int8") and settings.group_size != 128:
        warnings.append(f"--group-size is ignored for {settings.method} (weights get one scale per output channel)")
    if settings.method in ("fp8", "int8") and not settings.symmetric:
        warnings.append(f"--asymmetric is ignored for {settings.method} (the format is symmetric)")

    output = Path(settings.output).expanduser() if settings.output else default_output(settings)
    check_output(output, {"MODEL": model_dir, "--calib": settings.calib, "--eval": settings.eval,
                           "--recipe": recipe}, overwrite=overwrite)

    calib_texts = None
    if settings.needs_calibration:
        if not settings.calib:
            raise BadInputError(f"--calib is required for {settings.method} (it calibrates on sample text).",
                                hint="Pass --calib FILE: .txt (one sample a line) or .jsonl with a 'text' field, "
                                     "text like what the model will see.")
        calib_texts = read_calibration_texts(settings.calib, settings.num_samples)
        if len(calib_texts) < settings.num_samples:
            warnings.append(f"--calib has {len(calib_texts)} samples, fewer than --num-samples "
                            f"{settings.num_samples}; using all of them")
    elif settings.calib:
        warnings.append(f"--calib is not used by {settings.method} (no calibration)")
    eval_text = read_eval_text(settings.eval) if settings.eval else None

    module, extra = BACKEND_MODULES[settings.backend]
    if importlib.util.find_spec(module) is None:
        if extra is None:
            raise MissingDependencyError(
                f"--backend {settings.backend}: '{module}' is not installed (the project is archived and does not "
                "support current torch/transformers).",
                hint="Use --backend gptqmodel (pip install 'clusteropt-cli[gptq]'): it writes the same "
                     f"{'GPTQ' if settings.backend == 'auto-gptq' else 'AWQ'} checkpoint format.")
        raise MissingDependencyError(f"--backend {settings.backend}: '{module}' is not installed.",
                                     hint=f"pip install 'clusteropt-cli[{extra}]'")
    warnings.extend(_hardware_warnings(settings))
    from clusteropt_cli.core.quantize.servable import vllm_servability

    servable = vllm_servability(settings)
    if not servable.servable:
        warnings.append(f"vLLM will not serve this checkpoint: {servable.reason}")
    ignore_after_load = False
    if "ignore" in settings.model_fields_set:  # given (flag or recipe key), not the default lm_head
        from clusteropt_cli.core.quantize.ignore import check_ignore, meta_modules

        try:
            modules = meta_modules(model_dir)
        except Exception:  # noqa: BLE001 - a model that cannot be built without weights: checked once loaded
            ignore_after_load = True
        else:
            check_ignore(settings.ignore, modules)
    return Plan(settings, model_dir, output, calib_texts, eval_text, warnings, ignore_after_load)


def _hardware_warnings(settings: QuantizeRecipe) -> list[str]:
    if settings.method != "fp8":
        return []
    from clusteropt_cli.hardware import detect_gpus

    try:
        gpus = detect_gpus()
    except Exception:  # noqa: BLE001 - detection is best effort
        gpus = []
    ccs = [getattr(g, "compute_capability", None) for g in gpus]
    ccs = [tuple(c) if isinstance(c, (tuple, list)) else c for c in ccs if c]
    if not gpus:
        return ["no GPU found: the FP8 checkpoint is written, but FP8 matmuls need a GPU of compute capability "
                ">= 8.9 (Ada/Hopper); on CPU transformers dequantizes it"]
    old = [c for c in ccs if isinstance(c, tuple) and c < (8, 9)]
    if old:
        return [f"this GPU (compute capability {old[0][0]}.{old[0][1]}) cannot run FP8 matmuls natively "
                "(needs >= 8.9, Ada/Hopper); the checkpoint is written for a GPU that can"]
    return []


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _load(model_dir: Path, device: str = "cpu"):
    from clusteropt_cli.core.models import pretrained_causal_lm

    model = pretrained_causal_lm(model_dir, dtype="auto")
    return model.to(device)


def _score(model, blocks, device: str, keep_bytes: int = 0, reference: list | None = None):
    """The model's Perplexity over the blocks (keeping a reference's log-probs, or compared with one)."""
    from clusteropt_cli.core.quantize.evaluate import perplexity

    model.to(device)
    try:
        return perplexity(model, blocks, keep_bytes=keep_bytes, reference=reference)
    finally:
        model.to("cpu") if device != "cpu" else None


def run(plan_: Plan, progress=None, verbose: bool = False) -> QuantizeReport:
    """Quantize per the plan; the output directory appears only when everything (reload included) succeeded."""
    from transformers import AutoTokenizer

    from clusteropt_cli.core.quantize import backends
    from clusteropt_cli.core.quantize.evaluate import REFERENCE_BYTES, eval_blocks, generate_smoke, weights_bytes
    from clusteropt_cli.core.quantize.servable import vllm_servability

    s = plan_.settings
    started = time.perf_counter()
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    device = _device()
    step = _stepper(progress)
    step("loading model")
    tokenizer = AutoTokenizer.from_pretrained(plan_.model_dir)
    blocks = None
    ppl_before = ppl_after = ppl_rtn = None
    original = after = None
    model = _load(plan_.model_dir)
    if plan_.ignore_after_load:
        from clusteropt_cli.core.quantize.ignore import check_ignore

        check_ignore(s.ignore, model.named_modules())
    if plan_.eval_text is not None:
        step("scoring the original model")
        blocks = eval_blocks(tokenizer, plan_.eval_text, min(s.seq_len, _max_positions(model)), s.eval_tokens)
        # the original's next-token distributions over the first blocks (≤ 1 GiB): KL and top-1 of the result
        original = _score(model, blocks, device, keep_bytes=REFERENCE_BYTES)
        ppl_before = original.ppl

    # the output's size, for a full disk's message: the weights at the new width (fp32/16-bit sources alike)
    source_bits = 32 if "float32" in str(getattr(model, "dtype", "")) else 16
    estimate = weights_bytes(plan_.model_dir) * s.weight_bits // source_bits
    with atomic_output_dir(plan_.output, overwrite=True, command="quantize", needed_bytes=estimate) as tmp:
        t0 = time.perf_counter()
        facts = backends.quantize(model, tokenizer, s, plan_.calib_texts, tmp, progress=progress, verbose=verbose)
        quantize_time = time.perf_counter() - t0
        del model
        tokenizer.save_pretrained(tmp)
        step("reloading the checkpoint")
        reloaded = backends.reload(tmp, s, device)
        sample = generate_smoke(reloaded, tokenizer)
        if blocks is not None:
            step("scoring the quantized model")
            after = _score(reloaded, blocks, device, reference=original.logprobs)
            ppl_after = after.ppl
            original.logprobs = None
        del reloaded
        if s.compare_rtn and blocks is not None:
            ppl_rtn = _rtn_perplexity(plan_, tokenizer, blocks, device, ppl_after, progress, verbose, step)
        report = QuantizeReport(
            report_version=REPORT_VERSION, model=str(plan_.model_dir.resolve()), output=str(plan_.output.resolve()),
            method=s.method, backend=s.backend, backend_version=backends.version(s.backend), bits=s.weight_bits,
            group_size=None if s.method in ("fp8", "int8") else s.group_size,
            symmetric=True if s.method in ("fp8", "int8") else s.symmetric, scheme=backends.scheme_name(s),
            ignore=list(s.ignore), size_before_bytes=weights_bytes(plan_.model_dir),
            size_after_bytes=weights_bytes(tmp), compression_ratio=0.0,
            quantize_time_s=round(quantize_time, 3), total_time_s=0.0, calib_file=s.calib,
            calib_samples=facts.get("calib_samples", 0), calib_tokens=facts.get("calib_tokens", 0),
            seq_len=s.seq_len, eval_file=s.eval, eval_tokens=None if blocks is None else int(blocks[:, 1:].numel()),
            eval_block_len=None if blocks is None else int(blocks.shape[1]), ppl_before=ppl_before,
            ppl_after=ppl_after, ppl_rtn=ppl_rtn,
            ppl_increase=None if ppl_after is None else ppl_after - ppl_before,
            ppl_rtn_increase=None if ppl_rtn is None else ppl_rtn - ppl_before,
            kl_divergence=None if after is None else after.kl, top1_agreement=None if after is None else after.top1,
            kl_tokens=None if after is None else after.kl_tokens,
            sample_generation=sample, device=device, warnings=list(plan_.warnings) + facts.get("warnings", []),
            observer=s.weight_observer,
            awq_duo_scaling=s.awq_duo_scaling if s.llmcompressor_awq else None,
            awq_clip=facts.get("awq_clip"), servable_by_vllm=vllm_servability(s).as_dict())
        report.compression_ratio = round(report.size_before_bytes / max(report.size_after_bytes, 1), 3)
        report.total_time_s = round(time.perf_counter() - started, 3)
        (tmp / REPORT_NAME).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _rtn_perplexity(plan_: Plan, tokenizer, blocks, device, ppl_after, progress, verbose, step) -> float | None:
    """Perplexity of round-to-nearest at the same format (fp8 and rtn are round-to-nearest already)."""
    from clusteropt_cli.core.quantize import backends

    s = plan_.settings
    if s.method in ("rtn", "fp8"):
        return ppl_after
    step("scoring round-to-nearest at the same bits (--compare-rtn)")
    model = _load(plan_.model_dir)
    backends.quantize_rtn_in_memory(model, tokenizer, s, progress=progress, verbose=verbose)
    return _score(model, blocks, device).ppl


def _max_positions(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)


def _stepper(progress):
    def step(name: str) -> None:
        if progress is not None:
            progress(name, 0, 0)
    return step
