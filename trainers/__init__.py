"""Osprey's trainers, in TRL's shape: stage 2 (target-agnostic pretraining) and stage 4 (distillation with
training-time test), their feature cache and their corpora.

Names are imported on first use, so that the `osprey` CLI stays quick to start (TRL and datasets load slowly).
"""

import importlib

_EXPORTS = {
    "OspreyPretrainConfig": "pretrain",
    "OspreyPretrainer": "pretrain",
    "OspreyDistillConfig": "distill",
    "OspreyDistillTrainer": "distill",
    "DistillDataCollator": "distill",
    "ttt_loss": "distill",
    "soft_cross_entropy": "losses",
    "linear_soft_cross_entropy": "losses",
    "head_for_loss": "losses",
    "token_cross_entropy": "losses",
    "FeatureCacheDataset": "feature_cache",
    "TargetHead": "feature_cache",
    "build_feature_cache": "feature_cache",
    "DatasetArguments": "data",
    "load_text_dataset": "data",
    "prepare_general": "data",
    "prepare_sharegpt": "data",
    "tokenize_dataset": "tokenization",
    "tokenize_example": "tokenization",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
