"""One timed vLLM engine, run as a script in vLLM's own environment (it imports nothing of osprey, whose transformers
pin conflicts with vLLM's), for `osprey tune` and `benchmarks/vllm/bench.py`:

    VLLM_PYTHON osprey/serving/vllm_engine.py JOB.json

JOB names the target, vLLM's `speculative_config` (null: the target alone), the prompts as token ids, the new tokens
per request and the phases, each with a concurrency N: the phase's prompts go through the engine with at most N in
flight (a finished request lets the next one in), greedy, stopping at the target's end of turn (`"ignore_eos"`, of the
job or a phase: never) or after `max_tokens` (a phase may set its own, and `num_prompts`: the first that many). After
one untimed warm-up request, each phase records its wall time, its new tokens, vLLM's spec-decode counters over the
phase and every output; all goes to JOB.result.json with the vLLM version and the CPU settings of the environment.

`"in_process": true` runs the engine core and the worker in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; the
default is vLLM's own multi-process engine, what a server runs). In-process, a phase may set `num_speculative_tokens`,
the draft length of every step whatever the batch (the engine must start with a
`num_speculative_tokens_per_batch_size`, so that vLLM reads its per-step lookup), and `"timers": true` wraps both
models' forwards in wall-clock timers and records each engine step: the tokens of the target's forward, its seconds,
the drafter's calls and seconds, the step's wall time. `"skip_tokenizer_init": true` serves a target saved without a
tokenizer (outputs are token ids either way). `"prefix_caching": false` turns vLLM's prefix cache off, so that every
phase computes its prompts again (on by default, as vLLM serves).
"""

import json
import os
import sys
import time
from pathlib import Path

# GiB: a few requests of ~1k tokens need far less; vLLM's CPU default claims more than a small machine spares.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
SETTINGS = (
    "OMP_NUM_THREADS",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)


def install_timers(worker) -> bool:
    """Wraps the target's and the drafter's `forward` with timers appending (input tokens, seconds) per call."""
    runner = worker.model_runner
    models = {"target": runner.model}
    if getattr(runner, "drafter", None) is not None and hasattr(runner.drafter, "model"):
        models["drafter"] = runner.drafter.model
    worker._osprey_calls = {name: [] for name in models}
    for name, model in models.items():
        calls, forward = worker._osprey_calls[name], model.forward

        def timed(*args, _forward=forward, _calls=calls, **kwargs):
            start = time.perf_counter()
            output = _forward(*args, **kwargs)
            ids = kwargs.get("input_ids", args[0] if args else None)
            _calls.append((0 if ids is None else int(ids.shape[0]), time.perf_counter() - start))
            return output

        model.forward = timed
    return True


def take_calls(worker) -> dict:
    calls = {name: list(values) for name, values in worker._osprey_calls.items()}
    for values in worker._osprey_calls.values():
        values.clear()
    return calls


def set_num_speculative_tokens(llm, num_tokens: int) -> None:
    """Every step from now on drafts `num_tokens` (in-process engines started with a batch-size schedule only)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    if scheduler.dynamic_sd_lookup is None:
        raise SystemExit("a phase's num_speculative_tokens needs num_speculative_tokens_per_batch_size in the config")
    scheduler.dynamic_sd_lookup[:] = [num_tokens] * len(scheduler.dynamic_sd_lookup)


def run_phase(llm, name: str, prompts: list, params, concurrency: int, timers: bool) -> tuple[list, list]:
    """Each prompt's new token ids, with at most `concurrency` requests in the engine; and, with timers, each step."""
    engine = llm.llm_engine
    waiting, outputs, in_flight, steps = list(enumerate(prompts)), [None] * len(prompts), 0, []
    while waiting or engine.has_unfinished_requests():
        while waiting and in_flight < concurrency:
            index, prompt = waiting.pop(0)
            engine.add_request(f"{name}-{index}", {"prompt_token_ids": prompt}, params)
            in_flight += 1
        start = time.perf_counter()
        finished = [output for output in engine.step() if output.finished]
        wall = time.perf_counter() - start
        for output in finished:
            outputs[int(output.request_id.split("-")[1])] = list(output.outputs[0].token_ids)
            in_flight -= 1
        if timers:
            (calls,) = llm.collective_rpc(take_calls)
            drafter = calls.get("drafter", [])
            steps.append(
                {
                    "target_tokens": sum(tokens for tokens, _ in calls["target"]),
                    "target_seconds": sum(seconds for _, seconds in calls["target"]),
                    "drafter_calls": len(drafter),
                    "drafter_seconds": sum(seconds for _, seconds in drafter),
                    "wall": wall,
                }
            )
    return outputs, steps


def main(job_path: str) -> None:
    job_path = Path(job_path)
    job = json.loads(job_path.read_text())
    if job.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: timers, the scheduler's lookup
    import vllm
    from osprey_vllm.metrics import acceptance_length, counters_between, spec_decode_counters
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=max(phase["concurrency"] for phase in job["phases"]),
        enforce_eager=job.get("enforce_eager", False),
        # On CPU this is the share of the machine's memory vLLM may claim at start; the caller's process holds some.
        gpu_memory_utilization=0.6,
        seed=0,
        disable_log_stats=False,
        speculative_config=job.get("speculative_config"),
        skip_tokenizer_init=job.get("skip_tokenizer_init", False),
        enable_prefix_caching=job.get("prefix_caching", True),
    )
    engine_seconds = time.perf_counter() - started
    prompts = job["prompts"]
    detokenize = not job.get("skip_tokenizer_init", False)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, detokenize=detokenize)
    llm.generate([{"prompt_token_ids": prompts[0]}], warm_up, use_tqdm=False)
    timers = bool(job.get("timers"))
    if timers:
        llm.collective_rpc(install_timers)
    phases = []
    for number, phase in enumerate(job["phases"]):
        if phase.get("num_speculative_tokens") is not None:
            set_num_speculative_tokens(llm, phase["num_speculative_tokens"])
        params = SamplingParams(
            temperature=0.0,
            detokenize=detokenize,
            max_tokens=phase.get("max_tokens", job["max_tokens"]),
            ignore_eos=phase.get("ignore_eos", job.get("ignore_eos", False)),
        )
        phase_prompts = prompts[: phase.get("num_prompts", len(prompts))]
        before = spec_decode_counters(llm)
        start = time.perf_counter()
        outputs, steps = run_phase(llm, f"p{number}", phase_prompts, params, phase["concurrency"], timers)
        seconds = time.perf_counter() - start
        counters = counters_between(before, spec_decode_counters(llm))
        new_tokens = sum(map(len, outputs))
        phases.append(
            {
                **phase,
                "seconds": seconds,
                "new_tokens": new_tokens,
                "tokens_per_s": new_tokens / seconds,
                "tau": acceptance_length(counters),
                "spec_decode": counters,
                "outputs": outputs,
                **({"steps": steps} if timers else {}),
            }
        )
        print(
            f"phase {number} (concurrency {phase['concurrency']}): {new_tokens} tokens in {seconds:.1f} s", flush=True
        )
    result = {
        "vllm_version": vllm.__version__,
        "engine_seconds": engine_seconds,
        "env": {name: os.environ.get(name) for name in SETTINGS},
        "phases": phases,
    }
    job_path.with_suffix(".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
