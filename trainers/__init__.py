"""Osprey's trainers, in TRL's shape: stage 2 (target-agnostic pretraining) and stage 4 (distillation with
training-time test), with what they read and what chains them.

- `corpora/`: training text: any dataset the trainers read, the offline corpora, tokenization, the target's answers.
- `features/`: the target's features, cached once for distillation.
- the trainers themselves, here: `pretrain`, `distill` (`python -m trainers.distill`, `accelerate launch -m
  trainers.distill`), their losses (`losses`) and precision and devices (`devices`).
- `adapt`: `osprey adapt`, the stages from a backbone to a measured drafter for a user's target, chained and resumable.
- `cli`: the training commands of `osprey` (`data`, `pretrain`, `features`, `distill`, `regenerate`).

Each builds only on those listed above it (and on `osprey`). Names are imported on first use, so that the `osprey`
CLI stays quick to start (TRL and datasets load slowly).
"""

import importlib

_EXPORTS = {
    "OspreyPretrainConfig": "pretrain",
    "OspreyPretrainer": "pretrain",
    "OspreyDistillConfig": "distill",
    "OspreyDistillTrainer": "distill",
    "DistillDataCollator": "distill",
    "ttt_loss": "ttt",
    "soft_cross_entropy": "losses",
    "linear_soft_cross_entropy": "losses",
    "head_for_loss": "losses",
    "token_cross_entropy": "losses",
    "FeatureCacheDataset": "features.feature_cache",
    "TargetHead": "features.feature_cache",
    "build_feature_cache": "features.feature_cache",
    "DatasetArguments": "corpora.loading",
    "load_text_dataset": "corpora.loading",
    "prepare_general": "corpora.general",
    "prepare_sharegpt": "corpora.sharegpt",
    "tokenize_dataset": "corpora.tokenization",
    "tokenize_example": "corpora.tokenization",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
