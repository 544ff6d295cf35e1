"""The draft length per batch size (`osprey.serving.vllm_schedule`): the rule that turns measured costs and acceptance
into vLLM's `num_speculative_tokens_per_batch_size`, without vLLM."""

import json

import pytest

from osprey.serving.vllm_schedule import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SCHEDULE,
    best_num_draft_tokens,
    check_schedule,
    compress_schedule,
    conditional_acceptance,
    derive_schedule,
    expected_tokens_per_step,
    interpolate,
    read_speculative_config,
    speculative_config,
)


def test_conditional_acceptance_and_expected_tokens():
    # 100 drafts: position 0 accepted in 60, positions 0-1 in 30, all three in 15.
    rates = conditional_acceptance([60, 30, 15], 100)
    assert rates == [0.6, 0.5, 0.5]
    assert expected_tokens_per_step(rates, 0) == 1.0
    assert expected_tokens_per_step(rates, 3) == pytest.approx(1 + 0.6 + 0.3 + 0.15)
    assert conditional_acceptance([5, 0, 0], 10) == [0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="non-increasing"):
        conditional_acceptance([30, 60], 100)
    with pytest.raises(ValueError, match="No drafts"):
        conditional_acceptance([0, 0], 0)


def test_interpolate_is_piecewise_linear_and_extends():
    points = {1: 0.1, 4: 0.1, 8: 0.3}
    assert interpolate(points, 2) == pytest.approx(0.1)
    assert interpolate(points, 6) == pytest.approx(0.2)
    assert interpolate(points, 12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="measure closer"):
        interpolate({4: 0.1, 8: 0.3}, 1)


def compute_bound(tokens: float) -> float:
    """A device whose step costs a fixed 0.02 s plus 0.01 s per token: verifying drafts is never free."""
    return 0.02 + 0.01 * tokens


def test_speculation_stops_where_verification_costs_more_than_it_saves():
    target = {t: compute_bound(t) for t in (1, 2, 4, 8, 16, 32, 64)}
    drafter = {1: 0.002, 8: 0.004}
    rates = [0.6, 0.5, 0.5]
    best = best_num_draft_tokens(8, target, drafter, rates)
    # Batch 1: 1.6 tokens in 0.042 s (K=1) against 1 in 0.032 s (K=0); batch 8: 12.8 in 0.184 s against 8 in 0.104 s.
    assert best[0] == 1 and best[-1] == 0 and best == sorted(best, reverse=True)
    schedule = derive_schedule(8, target, drafter, rates)
    assert schedule[0][0] == 1 and schedule[-1] == [schedule[-1][0], 256, 0]
    assert check_schedule(schedule, 3) == schedule


def test_a_memory_bound_target_drafts_at_every_batch_size():
    flat = {1: 0.1, 64: 0.1}  # a step costs the same whatever it verifies
    assert derive_schedule(8, flat, {1: 0.001, 8: 0.001}, [0.7, 0.6, 0.5]) == [[1, 256, 3]]
    # and a drafter that never hits is never run for drafts
    assert derive_schedule(8, flat, {1: 0.001, 8: 0.001}, [0.0, 0.0, 0.0]) == [[1, 256, 0]]


def test_max_k_caps_the_draft_length():
    flat = {1: 0.1, 64: 0.1}
    assert derive_schedule(4, flat, {1: 0.001}, [0.9, 0.9, 0.9], max_k=2, last_end=4) == [[1, 4, 2]]
    with pytest.raises(ValueError, match="max_k"):
        derive_schedule(4, flat, {1: 0.001}, [0.9], max_k=2)


def test_compress_schedule():
    assert compress_schedule([3, 3, 1, 0, 0], last_end=256) == [[1, 2, 3], [3, 3, 1], [4, 256, 0]]
    assert compress_schedule([2]) == [[1, 1, 2]]


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([], "non-empty"),
        ([[2, 4, 1]], "from batch size 1"),
        ([[1, 4, 1], [4, 8, 0]], "without gaps or overlaps"),
        ([[1, 4, 5]], "raise num_speculative_tokens"),
        ([[1, 4]], "three integers"),
    ],
)
def test_check_schedule_names_the_fix(schedule, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, 3)


def test_speculative_config_round_trip(tmp_path):
    config = speculative_config(tmp_path / "drafter-vllm")
    assert config["method"] == "eagle3" and config["num_speculative_tokens"] == DEFAULT_NUM_SPECULATIVE_TOKENS
    assert config["num_speculative_tokens_per_batch_size"] == DEFAULT_SCHEDULE
    (tmp_path / "speculative_config.json").write_text(json.dumps(config))
    assert read_speculative_config(tmp_path) == config
    with pytest.raises(ValueError, match="osprey tune"):
        read_speculative_config(tmp_path / "missing")
