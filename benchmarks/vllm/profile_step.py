"""Where a decode step's time goes in vLLM's in-process engine on a CPU: vLLM alone, the Osprey drafter at K = 3 and at
K = 0, and ngram (the control that runs no drafter model), each at 1 and at 8 concurrent requests, greedy.

    .venv-vllm/bin/python benchmarks/vllm/profile_step.py --target TARGET_DIR --drafter EXPORTED_DIR \\
        --output benchmarks/results/vllm-step-profile-qwen2.5-coder-1.5b-instruct.json

Run with vLLM's Python (it imports nothing of osprey). TARGET_DIR is the target's folder
(`osprey.models.zoo.resolve_model_path`), EXPORTED_DIR the drafter exported by `osprey export --format vllm`. Each
setting starts its own engine in a subprocess (one process per engine, so no engine inherits another's state; a
rerun resumes from `--work-dir`), vLLM's single-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `osprey tune`'s),
eager, bfloat16, prefix cache off, `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (the vLLM bench's binding).

Per concurrency N, three passes over N requests added together (`ignore_eos`, so they decode in lockstep):

1. Buckets. Wrappers around vLLM's functions (`BUCKETS`: the target's and the drafter's forwards, the samplers, the
   proposer, attention metadata, the scheduler, host copies, the CPU stand-ins for Triton kernels, ...) add each call's
   wall time to its bucket, less the time of wrapped calls inside it, so the buckets of a step never overlap; what is
   left of the step's wall time is "other python". Only steady decode steps count: N requests scheduled, none new,
   none with a prompt chunk. At one request the pass runs `--rounds-at-1` requests one after the other.
2. torch.profiler (CPU activities, no shapes, no stacks) over `--profile-steps` steady steps of one more round: the
   top functions by self time (aten ops, and each wrapper as a `record_function` scope named after its bucket).
3. A sampling thread reads the engine thread's Python stack every 5 ms over the same kind of window: the top Python
   functions by self time (the innermost frame of each sample), and the top vLLM functions (the innermost frame in
   vLLM's source). Samples wait for the GIL, so time inside a C call that holds it lands on the next Python frame.

Per-step milliseconds are totals over the counted steps divided by their number (each step runs one target forward).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

# osprey-k3-top-tokens: K = 3 served as the export's speculative_config.json says (`use_local_argmax_reduction`:
# greedy drafts from the drafter's own vocabulary); osprey-k3 without it, as vLLM serves an EAGLE-3 drafter by default.
SETTINGS = ("vllm", "osprey-k3", "osprey-k3-top-tokens", "osprey-k0", "ngram")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
# Chat prompts of the kinds the vLLM bench sends (code, explanation, maths, translation), so ngram finds what it
# usually finds in an answer; eight, one per request at the largest concurrency.
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain the difference between a process and a thread in an operating system.",
    "Write a JavaScript function that debounces another function, and show how to use it.",
    "A train travels 120 km in 1.5 hours. What is its average speed in m/s? Show your steps.",
    "Translate into French: 'The meeting has been moved to Thursday afternoon because of the holiday.'",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "List five tips for writing readable Python code, each with a short example.",
    "Implement binary search in C and explain its time complexity.",
]
# bucket -> the functions it times: (where, attribute). `where` names an object the child resolves at run time.
BUCKETS = {
    "target forward": [("target", "forward")],
    "target logits (LM head)": [("target", "compute_logits")],
    "drafter forward": [("drafter_model", "forward"), ("drafter_model", "combine_hidden_states")],
    "drafter logits and draft sampling": [("drafter", "_sample_draft_tokens")],
    "ngram lookup": [("ngram", "propose")],
    "rejection sampler": [("runner", "rejection_sampler.forward")],
    "sampler and logits processing": [("runner", "sampler.forward")],
    "proposer bookkeeping": [
        ("runner", "propose_draft_token_ids"),
        ("drafter", "propose"),
        ("drafter", "prepare_inputs"),
        ("drafter", "prepare_inputs_padded"),
        ("drafter", "prepare_next_token_ids_cpu"),
        ("drafter", "prepare_next_token_ids_padded"),
    ],
    "attention metadata": [
        ("runner", "_build_attention_metadata"),
        ("drafter", "build_per_group_and_layer_attn_metadata"),
        ("builders", "build"),
    ],
    "runner input prep": [
        ("runner", "_update_states"),
        ("runner", "_prepare_inputs"),
        ("runner", "_preprocess"),
        ("runner", "_get_slot_mappings"),
    ],
    "runner bookkeeping": [
        ("runner", "_bookkeeping_sync"),
        ("runner", "_update_states_after_model_execute"),
    ],
    "host syncs and copies": [
        ("runner", "_to_list"),
        ("runner", "_copy_draft_token_ids_to_cpu"),
        ("runner", "_get_draft_token_ids_cpu"),
        ("runner", "_copy_valid_sampled_token_count"),
        ("runner", "_get_valid_sampled_token_count"),
        ("runner", "take_draft_token_ids"),
        ("runner", "_sync_device"),
    ],
    "Triton kernel stand-ins": [("kernel_override", "_launch"), ("kernel_override", "__call__")],
    "scheduler": [("scheduler", "schedule"), ("scheduler", "update_from_output")],
    "output processing": [("output_processor", "process_outputs")],
}
OTHER = "other python"


def speculative_config(setting: str, drafter: str) -> dict | None:
    if setting == "vllm":
        return None
    if setting == "ngram":
        return dict(NGRAM)
    schedule = [[1, 256, 0 if setting == "osprey-k0" else 3]]
    # K = 0 only exists through the per-batch-size schedule (docs/serving.md, "Draft length per batch size").
    config = {
        "method": "eagle3",
        "model": drafter,
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": schedule,
    }
    if setting == "osprey-k3-top-tokens":
        config["use_local_argmax_reduction"] = True
    return config


class Buckets:
    """Exclusive wall time per bucket: a call's time less that of the wrapped calls inside it."""

    def __init__(self):
        self.totals = defaultdict(float)
        self.calls = Counter()
        self.stack = []
        self.scopes = False  # also a record_function scope per call, for torch.profiler
        self.schedules = []  # what each Scheduler.schedule call scheduled

    def wrap(self, bucket: str, function, name: str):
        import torch

        def timed(*args, **kwargs):
            self.stack.append(0.0)
            start = time.perf_counter()
            try:
                if self.scopes:
                    with torch.profiler.record_function(f"[{bucket}] {name}"):
                        return function(*args, **kwargs)
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self.stack.pop()
                self.totals[bucket] += elapsed - inner
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1] += elapsed

        timed.__wrapped__ = function
        return timed

    def take(self) -> tuple[dict, Counter]:
        totals, calls = dict(self.totals), Counter(self.calls)
        self.totals.clear()
        self.calls.clear()
        return totals, calls


def install(llm, buckets: Buckets) -> list[str]:
    """Wraps every function of `BUCKETS` that this engine has; returns those it has not (e.g. no drafter)."""
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.attention.backend import AttentionMetadataBuilder

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    drafter = getattr(runner, "drafter", None)
    is_ngram = type(drafter).__name__ == "NgramProposer"

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    objects = {
        "target": runner.model,
        "runner": runner,
        "drafter": None if drafter is None or is_ngram else drafter,
        "drafter_model": None if drafter is None or is_ngram else getattr(drafter, "model", None),
        "ngram": drafter if is_ngram else None,
        "scheduler": core.scheduler,
        "output_processor": llm.llm_engine.output_processor,
        # Class attributes: every builder and kernel stand-in, whichever object holds it.
        "builders": [cls for cls in set(subclasses(AttentionMetadataBuilder)) if "build" in vars(cls)],
        "kernel_override": [KernelOverride],
    }
    missing = []
    for bucket, functions in BUCKETS.items():
        for where, attribute in functions:
            holders = objects[where]
            holders = holders if isinstance(holders, list) else [holders]
            for holder in holders:
                *path, name = attribute.split(".")
                owner = holder
                for part in path:
                    owner = getattr(owner, part, None) if owner is not None else None
                function = getattr(owner, name, None) if owner is not None else None
                if function is None:
                    missing.append(f"{where}.{attribute}")
                    continue
                label = f"{type(owner).__name__ if not isinstance(owner, type) else owner.__name__}.{name}"
                setattr(owner, name, buckets.wrap(bucket, function, label))
    if "scheduler" in objects:
        schedule = core.scheduler.schedule

        def recorded(*args, **kwargs):
            output = schedule(*args, **kwargs)
            buckets.schedules.append(
                {
                    "requests": len(output.num_scheduled_tokens),
                    "new": len(output.scheduled_new_reqs),
                    "tokens": output.total_num_scheduled_tokens,
                    "drafts": sum(len(d) for d in output.scheduled_spec_decode_tokens.values()),
                    "prompt_chunks": sum(
                        1
                        for request, tokens in output.num_scheduled_tokens.items()
                        if tokens > 1 + len(output.scheduled_spec_decode_tokens.get(request, ()))
                    ),
                }
            )
            return output

        core.scheduler.schedule = recorded
    return missing


def encode_prompts(llm) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def run_round(llm, prompts, params, name, step_hook=None) -> list[dict]:
    """Adds the prompts together and steps the engine until all finish; one record per step."""
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{index}", {"prompt_token_ids": prompt}, params)
    steps, number = [], 0
    while engine.has_unfinished_requests():
        if step_hook and step_hook(number) == "stop":
            # The window is over: the rest of the round would only cost time.
            engine.abort_request([f"{name}-{index}" for index in range(len(prompts))])
            return steps
        start = time.perf_counter()
        engine.step()
        steps.append({"wall": time.perf_counter() - start})
        number += 1
    if step_hook:
        step_hook(number)
    return steps


def steady(schedule: dict, concurrency: int) -> bool:
    return schedule["requests"] == concurrency and schedule["new"] == 0 and schedule["prompt_chunks"] == 0


def bucket_pass(llm, buckets, prompts, concurrency, rounds, max_tokens) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=True)
    kept = []
    for number in range(rounds):
        chosen = [prompts[(number * concurrency + i) % len(prompts)] for i in range(concurrency)]
        buckets.schedules.clear()
        records = []

        def hook(step, records=records):
            if step > 0:
                totals, calls = buckets.take()
                records.append({"buckets": totals, "calls": calls})
            else:
                buckets.take()

        steps = run_round(llm, chosen, params, f"b{concurrency}-{number}", hook)
        for step, record, schedule in zip(steps, records, buckets.schedules):
            if steady(schedule, concurrency):
                kept.append({**step, **record, "schedule": schedule})
    count = len(kept)
    walls = [s["wall"] for s in kept]
    wall = sum(walls)
    per_bucket = defaultdict(float)
    calls = Counter()
    for step in kept:
        for bucket, seconds in step["buckets"].items():
            per_bucket[bucket] += seconds
        calls.update(step["calls"])
    breakdown = {bucket: 1000 * per_bucket.get(bucket, 0.0) / count for bucket in BUCKETS}
    breakdown[OTHER] = 1000 * (wall - sum(per_bucket.values())) / count
    return {
        "steps": count,
        "ms_per_step": 1000 * wall / count,
        "tokens_per_step": sum(s["schedule"]["tokens"] for s in kept) / count,
        "drafts_per_step": sum(s["schedule"]["drafts"] for s in kept) / count,
        "step_ms_min_median_max": [round(1000 * v, 2) for v in (min(walls), statistics.median(walls), max(walls))],
        # Medians resist the steps that another process's load stretches; they need not add up to the median step.
        "breakdown_median_ms_per_step": {
            bucket: round(1000 * statistics.median([s["buckets"].get(bucket, 0.0) for s in kept]), 3)
            for bucket in BUCKETS
        }
        | {OTHER: round(1000 * statistics.median([s["wall"] - sum(s["buckets"].values()) for s in kept]), 3)},
        "load_average": os.getloadavg(),
        "breakdown_ms_per_step": {k: round(v, 3) for k, v in breakdown.items()},
        "calls_per_step": {name: round(n / count, 2) for name, n in sorted(calls.items())},
    }


def window_round(llm, buckets, prompts, concurrency, window, start_step, begin, end) -> dict:
    """One round of `concurrency` requests; `begin()` before step `start_step`, `end()` after `window` steps."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True, detokenize=True)
    buckets.schedules.clear()
    marks = {}

    def hook(step):
        if step == start_step:
            begin()
            marks["start"] = time.perf_counter()
        elif step == start_step + window:
            marks["end"] = time.perf_counter()
            end()
            return "stop"
        return None

    run_round(llm, prompts[:concurrency], params, f"w{concurrency}-{start_step}", hook)
    inside = buckets.schedules[start_step : start_step + window]
    return {
        "steps": len(inside),
        "steady_steps": sum(steady(s, concurrency) for s in inside),
        "seconds": marks["end"] - marks["start"],
    }


def torch_profile(llm, buckets, prompts, concurrency, window) -> dict:
    import torch

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)

    def begin():
        buckets.scopes = True
        profiler.start()

    def end():
        profiler.stop()
        buckets.scopes = False

    info = window_round(llm, buckets, prompts, concurrency, window, 3, begin, end)
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    steps = info["steps"]
    info["ms_per_step_under_profiler"] = round(1000 * info.pop("seconds") / steps, 2)
    info["top_self_ms_per_step"] = [
        {
            "name": e.key,
            "self_ms": round(e.self_cpu_time_total / 1000 / steps, 3),
            "total_ms": round(e.cpu_time_total / 1000 / steps, 3),
            "calls": round(e.count / steps, 2),
        }
        for e in events[:15]
    ]
    return info


def sample_profile(llm, buckets, prompts, concurrency, window, interval=0.005) -> dict:
    """A thread samples the engine thread's Python stack every `interval` s (py-spy needs ptrace, which not every
    machine grants): each sample counts for its innermost frame and for its innermost frame inside vLLM."""
    frames = sys._current_frames
    engine_thread = threading.get_ident()
    leaf, in_vllm, state = Counter(), Counter(), {"run": False}

    def name(frame) -> str:
        code = frame.f_code
        path = code.co_filename
        short = path.split("site-packages/")[-1]
        return f"{short}:{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}"

    def sample():
        while state["run"]:
            frame = frames().get(engine_thread)
            if frame is not None:
                leaf[name(frame)] += 1
                while frame is not None and "/vllm/" not in frame.f_code.co_filename:
                    frame = frame.f_back
                in_vllm[name(frame) if frame is not None else "(outside vLLM)"] += 1
            time.sleep(interval)

    def begin():
        state["run"] = True
        state["thread"] = threading.Thread(target=sample, daemon=True)
        state["thread"].start()

    def end():
        state["run"] = False
        state["thread"].join()

    info = window_round(llm, buckets, prompts, concurrency, window, 3, begin, end)
    steps, seconds, total = info["steps"], info.pop("seconds"), sum(leaf.values())
    info["samples"] = total

    def top(counter):
        return [
            {"function": key, "ms_per_step": round(1000 * seconds * n / total / steps, 3), "share": round(n / total, 4)}
            for key, n in counter.most_common(15)
        ]

    info["top_self_ms_per_step"] = top(leaf)
    info["top_vllm_frame_ms_per_step"] = top(in_vllm)
    return info


def draft_argmax_check(drafter: str | None, repeats: int = 50) -> dict:
    """What the greedy draft token costs per draft step, in milliseconds, on random weights of the drafter's shapes:
    vLLM's path for a drafter with a reduced vocabulary (`Eagle3LlamaForCausalLM.compute_logits` scatters the draft
    logits into a target-vocabulary row of -inf, then `SpecDecodeBaseProposer._greedy_sample` takes its argmax) against
    an argmax over the draft logits mapped through `d2t` (what a `get_top_tokens` would return)."""
    import torch

    config = json.loads((Path(drafter) / "config.json").read_text()) if drafter else {}
    hidden, draft_vocab = config.get("hidden_size", 896), config.get("draft_vocab_size", 32000)
    vocab = config.get("vocab_size", 151936)
    head = torch.randn(draft_vocab, hidden, dtype=torch.bfloat16) / hidden**0.5
    d2t = torch.randint(0, vocab - draft_vocab, (draft_vocab,)).sort().values
    targets = torch.arange(draft_vocab) + d2t

    def scattered(states):
        logits = states @ head.t()
        full = logits.new_full((logits.shape[0], vocab), float("-inf"))
        full[:, targets] = logits
        return full.argmax(dim=-1)

    def local(states):
        index = (states @ head.t()).argmax(dim=-1)
        return index + d2t[index]

    def timed(function, states) -> float:
        function(states)
        start = time.perf_counter()
        for _ in range(repeats):
            function(states)
        return 1000 * (time.perf_counter() - start) / repeats

    result = {"hidden_size": hidden, "draft_vocab_size": draft_vocab, "vocab_size": vocab, "ms_per_draft_step": {}}
    for batch in (1, 8):
        states = torch.randn(batch, hidden, dtype=torch.bfloat16)
        assert torch.equal(scattered(states), local(states))
        result["ms_per_draft_step"][str(batch)] = {
            "scatter_into_target_vocab_then_argmax": round(timed(scattered, states), 3),
            "argmax_over_draft_vocab_then_d2t": round(timed(local, states), 3),
        }
    return result


def child(args) -> None:
    os.environ.update(ENGINE_ENV)
    import vllm
    from osprey_vllm.metrics import acceptance_length, counters_between, spec_decode_counters
    from vllm import LLM, SamplingParams

    config = speculative_config(args.setting, args.drafter)
    started = time.perf_counter()
    llm = LLM(
        model=args.target,
        dtype="bfloat16",
        max_model_len=2048,
        max_num_seqs=max(args.concurrency),
        enforce_eager=True,
        gpu_memory_utilization=0.6,
        seed=0,
        disable_log_stats=False,
        speculative_config=config,
        enable_prefix_caching=False,
    )
    engine_seconds = time.perf_counter() - started
    prompts = encode_prompts(llm)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    buckets = Buckets()
    missing = install(llm, buckets)
    result = {
        "setting": args.setting,
        "speculative_config": config,
        "vllm_version": vllm.__version__,
        "engine_seconds": round(engine_seconds, 1),
        "env": {name: os.environ.get(name) for name in [*ENGINE_ENV, "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"]},
        "prompt_tokens": [len(p) for p in prompts],
        "not_wrapped": sorted(set(missing)),
        "by_concurrency": {},
    }
    for concurrency in args.concurrency:
        before = spec_decode_counters(llm)
        rounds = args.rounds_at_1 if concurrency == 1 else 1
        record = bucket_pass(llm, buckets, prompts, concurrency, rounds, args.max_tokens)
        record["tau"] = acceptance_length(counters_between(before, spec_decode_counters(llm)))
        window = args.profile_steps
        record["torch_profiler"] = torch_profile(llm, buckets, prompts, concurrency, window)
        record["python_sampler"] = sample_profile(llm, buckets, prompts, concurrency, window)
        result["by_concurrency"][str(concurrency)] = record
        print(f"{args.setting} at {concurrency}: {record['ms_per_step']:.1f} ms/step", flush=True)
    Path(args.result).write_text(json.dumps(result, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the target's folder")
    parser.add_argument("--drafter", help="the Osprey drafter exported with `osprey export --format vllm`")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request in the bucket pass")
    parser.add_argument("--rounds-at-1", type=int, default=3, help="requests, one after the other, at concurrency 1")
    parser.add_argument("--profile-steps", type=int, default=10, help="steady steps under torch.profiler / py-spy")
    parser.add_argument("--work-dir", default="/tmp/osprey-profile-step")
    parser.add_argument("--output", help="the summary JSON")
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.setting:
        child(args)
        return 0
    if not args.output:
        parser.error("--output is required")
    if any(s.startswith("osprey") for s in args.settings) and not args.drafter:
        parser.error("the osprey settings need --drafter")
    args.drafter = args.drafter and str(Path(args.drafter).resolve())
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for setting in args.settings:
        result = work / f"{setting}.json"
        if not result.exists():
            command = [sys.executable, __file__, "--setting", setting, "--result", str(result)]
            command += ["--target", args.target, "--work-dir", str(work), "--max-tokens", str(args.max_tokens)]
            command += ["--rounds-at-1", str(args.rounds_at_1), "--profile-steps", str(args.profile_steps)]
            command += ["--concurrency", *map(str, args.concurrency)]
            command += ["--drafter", args.drafter] if args.drafter else []
            print(f"[profile_step] {setting}", flush=True)
            subprocess.run(command, check=True)
        results[setting] = json.loads(result.read_text())
    check = work / "draft-argmax-check.json"
    if not check.exists():
        check.write_text(json.dumps(draft_argmax_check(args.drafter), indent=1) + "\n")
    summary = {
        "what": "ms per steady decode step in vLLM's in-process engine, split by the vLLM function that spends it",
        "target": args.target,
        "drafter": args.drafter,
        "device": f"{os.cpu_count()} CPU cores",
        "settings": "bfloat16, eager, greedy, ignore_eos, prefix cache off, in-process engine",
        "command": " ".join(["python", "benchmarks/vllm/profile_step.py", *(argv or sys.argv[1:])]),
        "results": results,
        "draft_argmax_check": json.loads(check.read_text()),
    }
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    for setting, result in results.items():
        for concurrency, record in result["by_concurrency"].items():
            parts = ", ".join(f"{k} {v:.1f}" for k, v in record["breakdown_ms_per_step"].items() if v >= 0.5)
            print(f"{setting} @{concurrency}: {record['ms_per_step']:.1f} ms/step ({record['steps']} steps): {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
