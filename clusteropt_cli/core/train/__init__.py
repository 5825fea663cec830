"""Training: the loop shared by `copt train` and `copt distill`, data helpers, engines, launchers.

Entry points (import from here):
    run_training(options, model, dataset, output_dir, *, loss_fn=None, tokenizer=None, callbacks=()) -> TrainResult
    build_text_dataset(path, tokenizer, seq_len) -> PackedDataset; read_texts, pack_token_ids, collate, DataCursor
    train_from_settings(settings, *, overwrite=False, callbacks=(), log=None) -> TrainResult  (copt train)
    TrainCallback (on_start/on_step/on_log/on_end), TrainResult, read_metrics
Submodules import torch lazily; importing this package is cheap.
"""

from __future__ import annotations

from clusteropt_cli.core.train.data import (
    IGNORE_INDEX,
    DataCursor,
    PackedDataset,
    build_text_dataset,
    collate,
    pack_token_ids,
    read_texts,
)
from clusteropt_cli.core.train.loop import TrainCallback, TrainResult, run_training
from clusteropt_cli.core.train.metrics import read_metrics
from clusteropt_cli.core.train.run import train_from_settings

__all__ = ["IGNORE_INDEX", "DataCursor", "PackedDataset", "TrainCallback", "TrainResult", "build_text_dataset",
           "collate", "pack_token_ids", "read_metrics", "read_texts", "run_training",
           "train_from_settings"]
