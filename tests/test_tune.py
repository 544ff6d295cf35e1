"""`osprey tune --engine vllm` without vLLM: the engine job it sends, how it reads the engine's steps back, and its
errors. (The engine itself, `osprey/serving/vllm_engine.py`, runs in vLLM's environment;
`osprey.serving.vllm_schedule`'s rule is
tested in test_vllm_schedule.py.)"""

import pytest

from osprey.serving import tune
from osprey.serving.tune import COST_ROUNDS, batch_sizes, measurements, tune_job


def test_batch_sizes_double_up_to_the_largest():
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(6) == [1, 2, 4, 6]
    assert batch_sizes(1) == [1]
    with pytest.raises(ValueError, match="--max-batch-size"):
        batch_sizes(0)


def test_the_job_measures_every_batch_size_at_every_k_then_the_acceptance(tmp_path):
    settings = {"num_draft_tokens": 2, "max_batch_size": 4, "max_new_tokens": 16, "dtype": "float32"}
    job = tune_job("target", str(tmp_path), [[1, 2], [3]], settings)
    costs = [(p["concurrency"], p["num_speculative_tokens"]) for p in job["phases"] if not p.get("acceptance")]
    assert costs == [(b, k) for k in range(3) for b in (1, 2, 4)] * COST_ROUNDS
    assert all(p["ignore_eos"] and p["num_prompts"] == p["concurrency"] for p in job["phases"][:-1])
    assert job["phases"][-1] == {"concurrency": 1, "num_prompts": 2, "num_speculative_tokens": 2, "acceptance": True}
    assert len(job["prompts"]) == 4 and job["in_process"] and job["timers"]
    # vLLM reads its per-step lookup only with a schedule; the phases overwrite it.
    assert job["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 4, 2]]


def step(tokens, wall, drafter_calls=1, drafter_seconds=0.01):
    return {"target_tokens": tokens, "wall": wall, "drafter_calls": drafter_calls, "drafter_seconds": drafter_seconds}


def test_measurements_keep_steady_steps_and_take_the_drafter_out():
    result = {
        "phases": [
            # a prefill of 40 tokens and a step after one request finished are not steady at batch 2, K = 1
            {"concurrency": 2, "num_speculative_tokens": 1, "steps": [step(40, 0.5), step(4, 0.11), step(4, 0.13)]},
            {"concurrency": 2, "num_speculative_tokens": 0, "steps": [step(2, 0.09), step(1, 0.05)]},
            {
                "concurrency": 1,
                "num_speculative_tokens": 2,
                "acceptance": True,
                "tau": 1.5,
                "spec_decode": {"num_drafts": 10, "num_accepted_tokens_per_pos": [4, 1]},
            },
        ]
    }
    measured = measurements(result, 1)
    assert measured["target_step_seconds"] == {2: pytest.approx(0.08), 4: pytest.approx(0.11)}
    assert measured["drafter_step_seconds"] == {2: pytest.approx(0.01)}
    assert measured["acceptance"] == [0.4, 0.25]
    assert measured["unsteady_costs"] == []
    # a busier spell during the 2-token steps than during the 4-token ones is reported
    result["phases"][1]["steps"] = [step(2, 0.3)]
    assert measurements(result, 1)["unsteady_costs"] == ["0.29 s at 2 tokens, 0.11 s at 4"]


def test_a_missing_vllm_environment_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("OSPREY_VLLM_PYTHON", str(tmp_path / "python"))
    with pytest.raises(ValueError, match="OSPREY_VLLM_PYTHON"):
        tune.find_vllm_python()
