"""The feature cache: training on it is training on the live target; a killed build resumes; its batches and
its refusal of a target whose logits are not its head."""

from functools import partial

import pytest
import torch
from conftest import make_tiny_target
from test_trainers import TAPS, mixed_length_dataset, token_dataset

from modeling_osprey.target_features import extract_target_features
from trainers import (
    FeatureCacheDataset,
    build_feature_cache,
)


def test_killed_feature_cache_build_resumes_after_its_last_shard(tmp_path):
    target = make_tiny_target("llama")
    dataset = token_dataset(12, 16, seed=2)
    # About 16.5 kB per sequence: a shard every 3 sequences, so a kill at sequence 9 leaves shards of 0-2 and 3-5.
    build = partial(
        build_feature_cache,
        target,
        layer_ids=TAPS,
        batch_size=2,
        dtype=torch.float32,
        shard_bytes=40_000,
        sort_window=2,
    )
    uninterrupted = FeatureCacheDataset(build({"train": dataset}, tmp_path / "reference"))

    def killed_after(count):
        for number, example in enumerate(dataset):
            if number == count:
                raise KeyboardInterrupt
            yield example

    with pytest.raises(KeyboardInterrupt):
        build({"train": killed_after(9)}, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    calls = []
    target.register_forward_hook(lambda module, args, output: calls.append(1))
    resumed = FeatureCacheDataset(build({"train": dataset}, tmp_path / "cache"))
    assert len(uninterrupted.shard_paths) == 4 and len(calls) == 3  # sequences 6-11 only, in batches of 2
    assert len(resumed) == len(uninterrupted) == 12
    for item in range(12):
        for name, tensor in uninterrupted[item].items():
            assert torch.equal(resumed[item][name], tensor), (item, name)


def test_feature_cache_batches_similar_lengths_and_stores_the_dataset_order(tmp_path):
    target = make_tiny_target("qwen2")
    lengths = [int(n) for n in torch.randint(4, 40, (12,), generator=torch.Generator().manual_seed(3))]
    dataset = mixed_length_dataset(lengths)
    input_ids = dataset["input_ids"]
    shapes = []
    target.register_forward_hook(
        lambda module, args, kwargs, output: shapes.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    build = partial(build_feature_cache, target, layer_ids=TAPS, batch_size=3, dtype=torch.float32)
    in_order = FeatureCacheDataset(build({"train": dataset}, tmp_path / "in-order", sort_window=3))
    padded_in_order = sum(rows * length for rows, length in shapes)
    shapes.clear()
    sorted_cache = FeatureCacheDataset(build({"train": dataset}, tmp_path / "sorted", sort_window=6))
    # Each window of 6 is batched shortest first: its batches pad to the 3rd and the 6th length of the window.
    windows = [sorted(lengths[start : start + 6]) for start in (0, 6)]
    assert shapes == [(3, window[k]) for window in windows for k in (2, 5)]
    assert sum(rows * length for rows, length in shapes) < padded_in_order
    for item in range(12):  # stored in the dataset's order, with the features a forward of the sequence alone gives
        assert sorted_cache[item]["input_ids"].tolist() == input_ids[item]
        for name, tensor in in_order[item].items():
            torch.testing.assert_close(sorted_cache[item][name], tensor, rtol=1e-4, atol=1e-3, msg=name)
    features, logits = extract_target_features(target, torch.tensor([input_ids[5]]), TAPS)
    torch.testing.assert_close(sorted_cache[5]["target_hidden_states"], features[0], rtol=1e-4, atol=1e-3)
    assert sorted_cache[5]["target_argmax"].tolist() == logits[0].argmax(-1).tolist()


def test_feature_cache_refuses_a_target_whose_logits_are_not_its_head(tmp_path):
    target = make_tiny_target("llama")
    target.lm_head.register_forward_hook(lambda module, args, output: output * 2)  # an unrecorded logit scale
    with pytest.raises(ValueError, match="logit scale"):
        build_feature_cache(target, {"train": token_dataset(2, 8)}, tmp_path / "cache", TAPS)
    assert list(tmp_path.iterdir()) == []  # nothing half-built is left behind
