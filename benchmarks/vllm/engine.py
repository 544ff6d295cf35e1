"""One timed vLLM engine for `benchmarks/vllm/bench.py`, run in vLLM's own environment (it imports nothing of osprey).

    .venv-vllm/bin/python benchmarks/vllm/engine.py JOB.json

JOB names the target, vLLM's `speculative_config` (null: the target alone), the prompts as token ids, the number of
new tokens and the phases to time, each a concurrency: 1 decodes the prompts one request at a time; N > 1 submits them
all to an engine that runs at most N at once (`max_num_seqs`). Greedy, stopping at the target's end of turn or after
`max_tokens`. After one untimed warm-up request, each phase records its wall time, its new tokens, vLLM's spec-decode
counters over the phase and every output; all goes to JOB.result.json. With `"profile": true` the engine runs in this
process and each phase also records the time spent in the target's forward passes and in the drafter's (calls, tokens
and seconds), read with timers wrapped around both models inside vLLM's worker.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; 8 requests of ~1k tokens need far less


def install_timers(worker) -> bool:
    """Wraps the target's and the drafter's `forward` with wall-clock timers (calls, input tokens, seconds)."""
    runner = worker.model_runner
    models = {"target": runner.model}
    if getattr(runner, "drafter", None) is not None and hasattr(runner.drafter, "model"):
        models["drafter"] = runner.drafter.model
    worker._osprey_timers = {name: {"calls": 0, "tokens": 0, "seconds": 0.0} for name in models}
    for name, model in models.items():
        timer, forward = worker._osprey_timers[name], model.forward

        def timed(*args, _forward=forward, _timer=timer, **kwargs):
            start = time.perf_counter()
            output = _forward(*args, **kwargs)
            _timer["seconds"] += time.perf_counter() - start
            _timer["calls"] += 1
            ids = kwargs.get("input_ids", args[0] if args else None)
            _timer["tokens"] += 0 if ids is None else int(ids.shape[0])
            return output

        model.forward = timed
    return True


def read_timers(worker) -> dict:
    timers = {name: dict(timer) for name, timer in worker._osprey_timers.items()}
    for timer in worker._osprey_timers.values():
        timer.update(calls=0, tokens=0, seconds=0.0)
    return timers


def main(job_path: str) -> None:
    job_path = Path(job_path)
    job = json.loads(job_path.read_text())
    if job.get("profile"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: timers can be read back
    from osprey_vllm.metrics import acceptance_length, counters_between, spec_decode_counters
    from vllm import LLM, SamplingParams

    concurrencies = [phase["concurrency"] for phase in job["phases"]]
    started = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=max(concurrencies),
        enforce_eager=job.get("enforce_eager", False),
        # On CPU this is the share of the machine's memory vLLM may claim at start; the bench's own process holds some.
        gpu_memory_utilization=0.6,
        seed=0,
        disable_log_stats=False,
        speculative_config=job.get("speculative_config"),
    )
    engine_seconds = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up, untimed
    if job.get("profile"):
        llm.collective_rpc(install_timers)
    phases = []
    for phase in job["phases"]:
        before = spec_decode_counters(llm)
        start = time.perf_counter()
        if phase["concurrency"] == 1:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        else:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counters = counters_between(before, spec_decode_counters(llm))
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        new_tokens = sum(map(len, token_ids))
        phases.append(
            {
                "concurrency": phase["concurrency"],
                "seconds": seconds,
                "new_tokens": new_tokens,
                "tokens_per_s": new_tokens / seconds,
                "tau": acceptance_length(counters),
                "spec_decode": counters,
                "outputs": token_ids,
            }
        )
        if job.get("profile"):
            (phases[-1]["forward_time"],) = llm.collective_rpc(read_timers)
        print(f"concurrency {phase['concurrency']}: {new_tokens} tokens in {seconds:.1f} s", flush=True)
    result = {"engine_seconds": engine_seconds, "threads": os.environ.get("OMP_NUM_THREADS"), "phases": phases}
    job_path.with_suffix(".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
