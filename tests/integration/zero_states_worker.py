"""Run under torchrun with 2 CPU processes (gloo): copt train's DeepSpeed engine (train's config generator, its
optimizer, its loss) for two steps of ZeRO stage N, then write each rank's model-state bytes as DeepSpeed holds them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 zero_states_worker.py STAGES OUT_DIR

STAGES: one stage or several, comma-separated ("1,2,3"): each stage builds its own model and engine in turn on the
one process group (one launch instead of one per stage: the launch and the imports are most of the time), and writes
OUT_DIR/stage{N}/rank{R}.json.

Counted per rank (unique storages): the 16-bit weights the rank holds (ZeRO-1/2: the full flat bit16 groups;
ZeRO-3: its parameter partitions ds_tensor), the fp32 master partition and the Adam moments of its optimizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# a Llama whose every matrix is above stage3_param_persistence_threshold (1e5 elements): ZeRO-3 partitions them
CONFIG = dict(model_type="llama", hidden_size=384, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
              intermediate_size=1024, vocab_size=1024, tie_word_embeddings=False, max_position_embeddings=256)


def _bytes(tensors) -> int:  # noqa: ANN001
    """Bytes of the unique storages behind `tensors` (ZeRO-3's partitions are views into flat buffers)."""
    storages = {}
    for t in tensors:
        if t.numel():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def main(stages: list[int], out_dir: Path) -> None:
    from clusteropt_cli.core.train.distributed import barrier, setup_distributed, teardown_distributed

    ctx = setup_distributed(2)
    for stage in stages:
        measure(stage, ctx, out_dir / f"stage{stage}")
        barrier(ctx)
    # as copt train ends: both ranks done, then the process group torn down (left to interpreter exit, ZeRO-3's gloo
    # threads sometimes aborted a rank: "terminate called without an active exception")
    teardown_distributed(ctx)


def measure(stage: int, ctx, out_dir: Path) -> None:  # noqa: ANN001
    import gc

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from clusteropt_cli.core.train.deepspeed_config import deepspeed_config
    from clusteropt_cli.core.train.engines import DeepSpeedEngine
    from clusteropt_cli.core.train.loop import default_loss_fn
    from clusteropt_cli.recipe.schema.train import TrainRecipe

    options = TrainRecipe(model="llama", zero=stage, precision="bf16", micro_batch=2, seq_len=32, gpus=2,
                          max_steps=2)
    cfg = dict(CONFIG)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ds_config = deepspeed_config(options, ctx.world_size)
    engine = DeepSpeedEngine(options, model, default_loss_fn(options, model, "deepspeed"), ctx, 2, ds_config)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in range(2):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=g)
        engine.micro_step({"input_ids": ids, "labels": ids}, True)
    opt = engine.engine.optimizer
    adam = [t for state in opt.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    if stage == 3:
        weights = _bytes(p.ds_tensor for p in model.parameters())
        masters = _bytes(opt.fp32_partitioned_groups_flat)
    else:
        weights = _bytes(opt.bit16_groups_flat)
        masters = _bytes(opt.single_partition_of_fp32_groups)
    result = {"rank": ctx.rank, "stage": stage, "weights": weights, "optimizer": masters + _bytes(adam),
              "adam_moments": _bytes(adam), "fp32_masters": masters,
              "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
              "reduce_bucket_size": ds_config["zero_optimization"]["reduce_bucket_size"],
              "engine_reduce_bucket_size": engine.engine.zero_reduce_bucket_size()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    # the next stage starts from nothing of this one: its engine (and ZeRO-3's hooks on this model) released
    engine.engine.destroy()
    del engine, opt, model, adam
    gc.collect()


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1].split(",")], Path(sys.argv[2]))
