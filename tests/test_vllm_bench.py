"""`benchmarks/vllm/bench.py`'s interleaved rounds: each ratio pairs a method with vLLM alone of the same round, the
record keeps the median and the range, and a win or a loss is claimed only where every round agrees."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "vllm"))
from bench import records_of  # noqa: E402


def _phase(concurrency: int, tokens_per_s: float, outputs) -> dict:
    return {
        "concurrency": concurrency,
        "tokens_per_s": tokens_per_s,
        "tau": 1.5,
        "outputs": outputs,
        "new_tokens": 64,
        "seconds": 64 / tokens_per_s,
        "spec_decode": {"num_accepted_tokens_per_pos": [3, 1]},
    }


def _round(alone: float, osprey: float, osprey_outputs=([1, 2],)) -> dict:
    return {
        "vllm": {"phases": [_phase(1, alone, [[1, 2]])]},
        "osprey": {"phases": [_phase(1, osprey, list(osprey_outputs))], "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}},
    }


def test_each_round_pairs_with_its_own_baseline_and_the_median_round_is_reported():
    # vLLM alone drifts from 8 to 12 tokens/s across rounds; the ratios within each round are 1.5, 1.3, 0.92.
    rounds = [_round(8.0, 12.0), _round(10.0, 13.0, ([1, 3],)), _round(12.0, 11.0)]
    osprey = next(r for r in records_of(rounds, {"osprey": 3}) if r["method"] == "osprey")
    assert osprey["speedup_rounds"] == [1.5, 1.3, 11.0 / 12.0]
    assert osprey["speedup"] == osprey["speedup_median"] == 1.3 and osprey["rounds"] == 3
    assert (osprey["speedup_min"], osprey["speedup_max"]) == (11.0 / 12.0, 1.5)
    assert osprey["verdict"] == "within spread"  # one round below 1.0: no win is claimed
    assert osprey["tokens_per_s"] == 13.0 and osprey["outputs_identical_to_vllm"] == "0/1"  # the median round's
    assert osprey["cpu_settings"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_a_win_or_a_loss_needs_every_round():
    faster = records_of([_round(10.0, 12.0), _round(9.0, 10.0)], {})
    slower = records_of([_round(10.0, 9.0), _round(9.0, 8.0)], {})
    assert [r["verdict"] for r in faster] == [None, "faster"]
    assert [r["verdict"] for r in slower] == [None, "slower"]
