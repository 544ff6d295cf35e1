"""Pairs of vLLM engines, vLLM alone then the Osprey drafter, run one after the other on the bench's prompts: the two
checks behind the reading of the vLLM bench (docs/serving.md, "The prefix cache" and the one-request ratios).

    python benchmarks/vllm/engine_pairs.py prefix-cache --target qwen2.5-coder-1.5b-instruct --drafter DIR \\
        --output benchmarks/results/vllm-prefix-cache.json
    python benchmarks/vllm/engine_pairs.py one-request --target qwen2.5-coder-1.5b-instruct --drafter DIR \\
        --output benchmarks/results/vllm-one-request-engines.json

`prefix-cache`: the bench's first 16 prompts sent twice at 8 concurrent requests in one engine with vLLM's prefix cache
on (its default), by vLLM alone and by the drafter at K = 0 for every batch size (its KV-cache forward each step, no
drafts), both with `VLLM_CPU_NUM_OF_RESERVED_CPU=0`: what a resent prompt costs each. `one-request`: the bench's
first 12 prompts at one request at a time, no prefix cache, vLLM alone and the drafter at K = 3, in three engine
settings (the bench's multi-process engine with both cores computing, the in-process engine `osprey tune` measures
in, vLLM's default binding with one core reserved). Jobs are `bench.job_of`'s, so the engines, prompts (the
replication's 25, one per category, seed 0) and decoding are the bench's; engine results are kept in `--work-dir`.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from bench import encode, job_of, run_engine

from osprey.measuring.bench_suites import load_suite, select_subset
from osprey.models import zoo
from osprey.serving.export import VLLM, export_drafter
from osprey.serving.tune import find_vllm_python

SUITES = ["spec_bench", "mt_bench", "humaneval", "mmath"]


def settings(args, reserved_cpus: int | None) -> argparse.Namespace:
    """What `bench.job_of` reads: bfloat16, 64 new tokens, and vLLM's CPU binding."""
    return argparse.Namespace(
        dtype="bfloat16",
        max_new_tokens=64,
        omp_threads_bind=None,
        reserved_cpus=reserved_cpus,
        work_dir=args.work_dir,
        vllm_python=args.vllm_python,
    )


def phases_of(result: dict) -> list[dict]:
    return [
        {
            "concurrency": p["concurrency"],
            "new_tokens": p["new_tokens"],
            "seconds": round(p["seconds"], 2),
            "tokens_per_s": round(p["tokens_per_s"], 2),
            "tau": p["tau"] and round(p["tau"], 3),
        }
        for p in result["phases"]
    ]


def prefix_cache(args, target_dir: str, prompt_ids: list, drafter: dict) -> dict:
    k0 = {**drafter, "num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 256, 0]]}
    runs = {}
    for slug, name, config in (("vllm", "vllm alone", None), ("osprey", "osprey, K = 0 at every batch size", k0)):
        job = job_of(settings(args, 0), target_dir, config, prompt_ids[:16], [8, 8], prefix_caching=True)
        runs[name] = {"phases": phases_of(run_engine(settings(args, 0), f"prefix-cache-{slug}", job))}
    return {
        "what": "the bench's first 16 prompts sent twice at 8 concurrent requests in one engine, prefix cache on",
        "prompt_tokens": sum(len(p) for p in prompt_ids[:16]),
        "runs": runs,
    }


def one_request(args, target_dir: str, prompt_ids: list, drafter: dict) -> dict:
    k3 = {**drafter, "num_speculative_tokens": 3}
    engines = {
        "multi-process engine, VLLM_CPU_NUM_OF_RESERVED_CPU=0 (the bench's)": (0, {}),
        "in-process engine (osprey tune's)": (None, {"in_process": True}),
        "multi-process engine, vLLM's default binding (one core reserved, compute on the other)": (None, {}),
    }
    runs = {}
    for number, (label, (reserved, extra)) in enumerate(engines.items()):
        pair = {}
        for slug, name, config in (("vllm", "vllm alone", None), ("osprey", "osprey, K = 3", k3)):
            job = job_of(settings(args, reserved), target_dir, config, prompt_ids[:12], [1], **extra)
            (phase,) = phases_of(run_engine(settings(args, reserved), f"one-request-{number}-{slug}", job))
            pair[name] = phase
        pair["speedup"] = round(pair["osprey, K = 3"]["tokens_per_s"] / pair["vllm alone"]["tokens_per_s"], 3)
        runs[label] = pair
    return {
        "what": "the bench's first 12 prompts at one request at a time, no prefix cache, in three engine settings",
        "prompt_tokens": sum(len(p) for p in prompt_ids[:12]),
        "runs": runs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["prefix-cache", "one-request"])
    parser.add_argument("--target", required=True, help="zoo name or local directory of the target")
    parser.add_argument("--drafter", required=True, metavar="DIR", help="the Osprey drafter, in Osprey's format")
    parser.add_argument("--vllm-python", help="vLLM's Python (default: $OSPREY_VLLM_PYTHON, else .venv-vllm)")
    parser.add_argument("--work-dir", default=os.environ.get("RUNS", "/work/runs") + "/vllm-engine-pairs")
    parser.add_argument("--output", required=True, help="results JSON")
    args = parser.parse_args(argv)
    try:
        args.vllm_python = args.vllm_python or str(find_vllm_python())
    except ValueError as error:
        raise SystemExit(str(error)) from None
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    exported = Path(args.work_dir) / "osprey-vllm"
    if not (exported / "config.json").exists():
        export_drafter(args.drafter, VLLM, exported, target=args.target)
    drafter = {"method": "eagle3", "model": str(exported.resolve())}
    target_dir = str(zoo.resolve_model_path(args.target))
    prompts = [p for suite in SUITES for p in select_subset(load_suite(suite), 1, 0)]
    prompt_ids = encode(prompts, zoo.load_tokenizer(args.target))
    check = {"prefix-cache": prefix_cache, "one-request": one_request}[args.check]
    summary = {
        "check": args.check,
        "target": args.target,
        "device": f"{os.cpu_count()} CPU cores",
        "settings": "bfloat16, eager, greedy, 64 new tokens at most, vLLM's multi-process engine unless named",
        "command": f"python benchmarks/vllm/engine_pairs.py {args.check} --target {args.target} --drafter DIR",
        **check(args, target_dir, prompt_ids, drafter),
    }
    Path(args.output).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
