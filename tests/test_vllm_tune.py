"""`osprey tune`'s engine in vLLM (one engine, in `.venv-vllm` or `OSPREY_VLLM_PYTHON`; skipped without it, except in
CI): the per-step draft length it sets is the one vLLM drafts, K = 0 still runs one drafter forward per step (vLLM
keeps it to fill the drafter's KV cache; docs/serving.md, "Draft length per batch size"), the output is the same at
every K, and its measurements give a schedule vLLM accepts."""

import os

import pytest
from test_vllm import PROMPTS, export, random_drafter, save_target

from osprey.serving.tune import COST_ROUNDS, find_vllm_python, measurements, run_engine, tune_job
from osprey.serving.vllm_schedule import check_schedule, derive_schedule


@pytest.fixture(scope="module")
def vllm_python():
    try:
        return find_vllm_python()
    except ValueError as error:
        if os.environ.get("CI"):
            pytest.fail(str(error))
        pytest.skip(str(error))


def test_tune_engine_sets_k_per_step_and_k_zero_still_runs_the_drafter(vllm_python, tmp_path):
    target_dir = tmp_path / "target"
    save_target("qwen2", target_dir)
    drafter_dir = export(random_drafter("qwen2"), tmp_path, target_dir)
    settings = {"num_draft_tokens": 2, "max_batch_size": 2, "max_new_tokens": 16, "dtype": "float32"}
    job = tune_job(str(target_dir), str(drafter_dir), PROMPTS[:2], settings)
    job.update(skip_tokenizer_init=True, ignore_eos=True, max_model_len=256)
    result = run_engine(job, tmp_path / "tune.json", vllm_python, env={"VLLM_CPU_KVCACHE_SPACE": "1"})

    cost_phases = [phase for phase in result["phases"] if not phase.get("acceptance")]
    assert [(p["concurrency"], p["num_speculative_tokens"]) for p in cost_phases] == [
        (b, k) for k in range(3) for b in (1, 2)
    ] * COST_ROUNDS
    for phase in cost_phases:
        size, k = phase["concurrency"], phase["num_speculative_tokens"]
        steady = [step for step in phase["steps"] if step["target_tokens"] == size * (1 + k)]
        assert len(steady) >= 3, phase["steps"]
        # K drafter forwards per step, and one at K = 0: vLLM's proposer runs its first forward before it checks K.
        assert {step["drafter_calls"] for step in steady} == {max(k, 1)}
    # Verification keeps the output the target's alone at every K (float32, greedy).
    outputs = {(p["concurrency"], p["num_speculative_tokens"]): p["outputs"] for p in cost_phases}
    assert outputs[(2, 0)] == outputs[(2, 1)] == outputs[(2, 2)]
    assert outputs[(1, 0)] == outputs[(1, 2)] == outputs[(2, 0)][:1]

    measured = measurements(result, 2)
    assert sorted(measured["target_step_seconds"]) == [1, 2, 3, 4, 6]
    assert len(measured["acceptance"]) == 2
    schedule = derive_schedule(
        2, measured["target_step_seconds"], measured["drafter_step_seconds"], measured["acceptance"]
    )
    assert check_schedule(schedule, 2) == schedule
