"""The `evaluate` metric modules under `metrics/`: they load offline from their folder, compute hand-checked values,
accumulate batches, refuse inconsistent logs, and agree with the numbers `osprey bench` reports."""

import socket
from pathlib import Path

import evaluate
import pytest

from osprey.measuring.bench_report import summarize

METRICS = Path(__file__).resolve().parents[1] / "metrics"
# Two requests: steps that accepted 2, 0 and 5 of 5 drafts, then one step accepting 1 of 3.
ACCEPTED, DRAFTED = [[2, 0, 5], [1]], [[5, 5, 5], [3]]


@pytest.fixture(scope="module")
def metrics():
    return {
        name: evaluate.load(str(METRICS / name)) for name in ("acceptance_length", "position_acceptance", "speedup")
    }


def test_acceptance_length_by_hand(metrics):
    acceptance_length = metrics["acceptance_length"]
    # Request taus: (3 + 1 + 6) / 3 and 2 / 1; their mean is 8/3. Pooled over the 4 steps: 12 / 4.
    result = acceptance_length.compute(accepted_per_step=ACCEPTED)
    assert result == {"acceptance_length": pytest.approx(8 / 3), "num_requests": 2, "num_steps": 4}
    assert acceptance_length.compute(accepted_per_step=ACCEPTED, average="step")["acceptance_length"] == 3.0
    without_bonus = acceptance_length.compute(accepted_per_step=ACCEPTED, bonus_token=False)["acceptance_length"]
    assert without_bonus == pytest.approx(5 / 3)
    # A request without verification steps has no τ and is left out; plain decoding (nothing accepted) has τ = 1.
    assert acceptance_length.compute(accepted_per_step=[[0, 0], []]) == {
        "acceptance_length": 1.0,
        "num_requests": 1,
        "num_steps": 2,
    }
    acceptance_length.add_batch(accepted_per_step=ACCEPTED[:1])
    acceptance_length.add(accepted_per_step=ACCEPTED[1])
    assert acceptance_length.compute()["acceptance_length"] == pytest.approx(8 / 3)
    with pytest.raises(ValueError, match="negative"):
        acceptance_length.compute(accepted_per_step=[[1, -1]])


def test_position_acceptance_by_hand(metrics):
    result = metrics["position_acceptance"].compute(accepted_per_step=ACCEPTED, drafted_per_step=DRAFTED)
    # Positions 1-3 are reached by all 4 steps (accepted by 3, 2, 1); positions 4-5 by the 3 five-token steps.
    assert result == {"position_acceptance": pytest.approx([3 / 4, 2 / 4, 1 / 4, 1 / 3, 1 / 3]), "num_steps": 4}
    with pytest.raises(ValueError, match="one entry per verification step"):
        metrics["position_acceptance"].compute(accepted_per_step=[[1, 2]], drafted_per_step=[[5]])
    with pytest.raises(ValueError, match="more drafts than it proposed"):
        metrics["position_acceptance"].compute(accepted_per_step=[[4]], drafted_per_step=[[3]])


def test_speedup_by_hand(metrics):
    # Throughputs: 20 tokens in 3 s against 20 in 6 s; per request 3x and 1.5x.
    result = metrics["speedup"].compute(
        time_s=[1.0, 2.0], new_tokens=[10, 10], baseline_time_s=[3.0, 3.0], baseline_new_tokens=[10, 10]
    )
    assert result == {"speedup": pytest.approx(2.0), "mean_request_speedup": pytest.approx(2.25)}
    # Unequal lengths (sampling): 30 tokens / 2 s against 10 tokens / 2 s.
    result = metrics["speedup"].compute(time_s=[2.0], new_tokens=[30], baseline_time_s=[2.0], baseline_new_tokens=[10])
    assert result["speedup"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="positive"):
        metrics["speedup"].compute(time_s=[0.0], new_tokens=[1], baseline_time_s=[1.0], baseline_new_tokens=[1])


def _row(method, prompt_id, accepted, drafted, seconds, tokens):
    return {
        "method": method,
        "suite": "s",
        "category": "c",
        "prompt_id": prompt_id,
        "new_tokens": tokens,
        "wall_time_s": seconds,
        "tau": sum(a + 1 for a in accepted) / len(accepted),
        "accepted_per_step": accepted,
        "drafted_per_step": drafted,
        "output_sha256": prompt_id,
        "time_split_s": {"prefill": 0.1, "verify": seconds / 2, "draft": seconds / 4, "other": seconds / 4 - 0.1},
    }


def test_metrics_agree_with_the_benchmark_records(metrics):
    target_rows = [_row("target", "1", [0] * 9, [0] * 9, 3.0, 10), _row("target", "2", [0] * 4, [0] * 4, 3.0, 5)]
    osprey_rows = [_row("osprey", "1", ACCEPTED[0], DRAFTED[0], 1.0, 10), _row("osprey", "2", [1, 2], [3, 3], 2.0, 5)]
    results = {
        "settings": {"do_sample": False},
        "methods": {"target": "target", "osprey": "drafter:x"},
        "prompts": {"s": {"c": ["1", "2"]}},
        "requests": target_rows + osprey_rows,
    }
    record = next(r for r in summarize(results) if r["method"] == "osprey" and r["category"] == "c")
    accepted = [row["accepted_per_step"] for row in osprey_rows]
    drafted = [row["drafted_per_step"] for row in osprey_rows]
    assert record["tau"] == pytest.approx(
        metrics["acceptance_length"].compute(accepted_per_step=accepted)["acceptance_length"]
    )
    position = metrics["position_acceptance"].compute(accepted_per_step=accepted, drafted_per_step=drafted)
    assert record["position_acceptance"] == pytest.approx(position["position_acceptance"])
    speedup = metrics["speedup"].compute(
        time_s=[row["wall_time_s"] for row in osprey_rows],
        new_tokens=[row["new_tokens"] for row in osprey_rows],
        baseline_time_s=[row["wall_time_s"] for row in target_rows],
        baseline_new_tokens=[row["new_tokens"] for row in target_rows],
    )
    assert record["speedup"] == pytest.approx(speedup["speedup"])


def test_metrics_load_offline_from_their_folder(monkeypatch):
    """With the Hub switched off and every network connection refused, the folder alone is enough."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise OSError("network access attempted while loading a local metric")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    metric = evaluate.load(str(METRICS / "acceptance_length"))
    assert metric.compute(accepted_per_step=ACCEPTED)["acceptance_length"] == pytest.approx(8 / 3)
