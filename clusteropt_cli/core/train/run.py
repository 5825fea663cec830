"""`copt train` as one importable call: validate, load the tokenizer, data and model, train, save.

    from clusteropt_cli.core.train import train_from_settings
    result = train_from_settings(settings, overwrite=False, callbacks=[my_progress], log=print)

`settings` is a TrainRecipe. Under a launcher every rank calls it (the parent prepared the output directory);
in one process it prepares the output itself (copt's output rule, --overwrite moves the old output aside).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clusteropt_cli.recipe.schema.train import TrainRecipe


def check_host_memory_for_ranks(settings: Any, config: dict[str, Any], processes: int) -> None:
    """Refuse (exit 5) before any work when `processes` ranks on this machine, each building the model whole in
    fp32 on the host (everything but ZeRO-3), need more than the host memory available now."""
    if settings.zero == 3:
        return
    from clusteropt_cli.core.models import check_host_memory

    check_host_memory([(f"--model {settings.model}", config, 4)], copies=processes,
                      hint="Train a smaller model, use a machine with more host memory, or --zero 3 (built "
                           "partitioned).")


def device_type() -> str:
    """'cuda' when torch sees a GPU, else 'cpu'."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_from_settings(settings: TrainRecipe, *, overwrite: bool = False, callbacks: Sequence[Any] = (),
                        log: Callable[[str], None] | None = None) -> Any:
    """One process of a training run (the only one, or one rank under a launcher): load, train, save. Returns
    run_training's TrainResult (rank 0 also writes it to train_result.json in settings.output)."""
    from clusteropt_cli.core.io import replacing_output_dir
    from clusteropt_cli.core.train.data import build_text_dataset
    from clusteropt_cli.core.train.engines import zero3_model_init
    from clusteropt_cli.core.train.launch import is_launched_child
    from clusteropt_cli.core.train.loop import run_training
    from clusteropt_cli.core.train.model import load_model, load_tokenizer
    from clusteropt_cli.core.train.validate import check_hardware, check_offload_resources, validate_train

    launched = is_launched_child()  # under a launcher the parent prepared the output
    rank = int(os.environ.get("RANK", "0"))
    with replacing_output_dir(Path(settings.output), overwrite=overwrite, resume=bool(settings.resume),
                              command="train", enabled=not launched):
        source = validate_train(settings, check_output=False)
        check_hardware(settings, device_type())
        check_offload_resources(settings, source.config)
        tokenizer = load_tokenizer(source)
        dataset = build_text_dataset(settings.data, tokenizer, settings.seq_len, settings.text_field)
        # ZeRO-3: built partitioned under deepspeed.zero.Init (kept alive for the run; see zero3_model_init)
        zero3 = zero3_model_init(settings, settings.gpus * settings.nodes, device_type()) \
            if settings.zero == 3 else None
        # a single-node launching parent checked its ranks together; other nodes' ranks check their own copy
        if not launched or settings.nodes > 1:
            check_host_memory_for_ranks(settings, source.config, processes=1)
        model = load_model(source, seed=settings.seed)
        if rank == 0 and log is not None:
            count = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
            log(f"data: {len(dataset)} blocks of {settings.seq_len} tokens; model: "
                f"{count / 1e6:.2f}M parameters ({source.kind}" + (", partitioned by ZeRO-3 as built)" if zero3
                                                                   else ")"))
        result = run_training(settings, model, dataset, settings.output, tokenizer=tokenizer, callbacks=callbacks)
        del zero3
        return result
