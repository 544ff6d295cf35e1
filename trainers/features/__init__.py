"""The target's features, computed once: the feature cache that distillation reads instead of running the target on
every batch (`osprey features`, `python -m trainers.features.feature_cache`), and the target head kept beside it.

May import `osprey`, `trainers.corpora` and `trainers.devices`; never the trainers (`pretrain`, `distill`) nor
`adapt`, which build on it.
"""
