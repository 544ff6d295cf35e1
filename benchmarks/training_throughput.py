"""Training throughput of the current trainers against the trainers of an older commit, in one run on this machine.

    python benchmarks/training_throughput.py [--baseline-commit 175b08b] [--rounds 2] [--steps 2]

The script checks the baseline commit out as a detached git worktree in a temporary directory and runs every
measurement in a fresh subprocess, with `PYTHONPATH` pointing at the worktree (baseline) or at this repository
(current); baseline and current runs alternate, so that both see the same load on a shared machine. Each run is a real
`Trainer.train()` of `--steps` optimizer steps after one warm-up step (untimed: it includes `torch.compile`), on random
tokens and random target features of the shapes below, with each version's own trainer and the settings its
replication config uses (the current trainers with `torch_compile`, dynamic shapes, as the shipped configs set it):

- distill-qwen2.5-coder-1.5b: the Qwen replication's drafter (2 blocks at hidden 576, 32k draft vocabulary, a 151,936
  token target vocabulary, 3 taps of a 1536-wide target), 2 x 1,024 tokens per micro-batch, 2 micro-batches per
  step, TTT 5 (benchmarks/replication/distill-common.yaml);
- distill-smollm2-135m: the pilot's drafter (8k draft vocabulary, 49,152-token vocabulary, taps of a 576-wide target);
- pretrain-smollm2-2l: stage 2, SmolLM2-135M pruned to 2 blocks, 4 x 1,024 tokens, 2 micro-batches per step, in the
  precision each checkout's own trainers/configs/pretrain-smollm2-2l.yaml sets (float32 at 175b08b, bf16 autocast
  since session 11; each run's JSON says which);
- features: `build_feature_cache` (current code) against the target's own forward-only rate on the same tokens, with
  the zoo's SmolLM2-135M-Instruct when it is cached (else a random model of its config; the JSON says which).

The matmul limit is plain `torch.matmul` in bfloat16 at each config's own GEMM shapes, measured in the same run (the
FLOP-weighted harmonic mean of the shapes' rates, i.e. the time the model's GEMMs would take at those rates);
`model_gflops_per_s` counts the matmul FLOPs of forward and backward (3x the forward's) per trained token.
Writes benchmarks/results/training-throughput.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTILL_CONFIGS = ("distill-qwen2.5-coder-1.5b", "distill-smollm2-135m")  # shapes: benchmarks/throughput_worker.py
RESULTS = REPO / "benchmarks" / "results" / "training-throughput.json"
# ------------------------------------------------------------------------------------------------- model FLOPs


def distill_gemms(spec: dict) -> list[tuple[int, int, int, float]]:
    """(m, k, n, how many times per TTT step) of the drafter's forward GEMMs per micro-batch."""
    shape = spec["drafter"]
    tokens = spec["batch_size"] * (spec["seq_len"] - 1)
    hidden, inter, heads, kv, head_dim = 576, 1536, 9, 3, 64
    qkv = (heads + 2 * kv) * head_dim
    return [
        (tokens, len(shape["target_layer_ids"]) * shape["target_hidden_size"], hidden, 1 / spec["ttt_steps"]),  # fc
        (tokens, 2 * hidden, qkv, 1),
        (tokens, hidden, qkv, 1),  # block 0 (fusion) and block 1 q/k/v
        (tokens, hidden, hidden, 2),
        (tokens, hidden, inter, 4),
        (tokens, inter, hidden, 2),  # o_proj, MLPs
        (tokens, hidden, shape["draft_vocab_size"], 1),  # the head
    ]


def pretrain_gemms(spec: dict, vocab_size: int) -> list[tuple[int, int, int, float]]:
    tokens = spec["batch_size"] * spec["seq_len"]
    hidden, inter, qkv = 576, 1536, (9 + 6) * 64
    return [
        (tokens, hidden, qkv, 2),
        (tokens, hidden, hidden, 2),
        (tokens, hidden, inter, 4),
        (tokens, inter, hidden, 2),
        (tokens, hidden, vocab_size, 1),
    ]


def flops_per_token(gemms, tokens_per_micro_batch: int, steps: int = 1) -> float:
    """Matmul FLOPs of forward + backward (3x forward) per input token; attention scores excluded (< 3%)."""
    return 3 * steps * sum(2 * m * k * n * times for m, k, n, times in gemms) / tokens_per_micro_batch


def judged(tokens_per_s: float, baseline_tokens_per_s: float, limit_tokens_per_s: float, goal: float) -> dict:
    """Issue 16's goal for one config: `goal` x the baseline's tokens/s, or, only where that exceeds the matmul limit
    (then impossible), >= 60% of the limit. `goal_share_of_limit` says how much of the limit the speed-up goal takes."""
    goal_rate = goal * baseline_tokens_per_s
    met_by = "none"
    if tokens_per_s >= goal_rate:
        met_by = "speedup"
    elif goal_rate > limit_tokens_per_s and tokens_per_s >= 0.6 * limit_tokens_per_s:
        met_by = "fraction_of_matmul_limit"
    return {
        "goal": f">= {goal:g}x baseline, or >= 60% of the matmul limit where {goal:g}x exceeds it",
        "goal_share_of_limit": round(goal_rate / limit_tokens_per_s, 3),
        "goal_met_by": met_by,
    }


def matmul_limit(gemms, rates: dict) -> float:
    flops = [2 * m * k * n * times for m, k, n, times in gemms]
    seconds = sum(f / rates[f"{m}x{k}x{n}"] for f, (m, k, n, _) in zip(flops, gemms))
    return sum(flops) / seconds


# ------------------------------------------------------------------------------------------------------ driver


THREADS = "1"  # per process: on a shared 2-core machine two threads wait on each other at every op (measured 2x CPU)


# The current trainers run with `torch_compile` (dynamic shapes), as trainers/configs and benchmarks/replication set
# it; the baseline commit's as they ran then.
CURRENT_SETTINGS = ("compile",)
WORKER = REPO / "benchmarks" / "throughput_worker.py"  # run by path: it imports whichever trainers PYTHONPATH names


def run_worker(pythonpath: Path, *args: str, timeout: int = 3600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": THREADS}
    command = [
        sys.executable,
        "-c",
        "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
        str(WORKER),
        *args,
    ]
    with tempfile.TemporaryDirectory() as cwd:  # nothing of this checkout on sys.path but PYTHONPATH
        result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"worker {args} under {pythonpath} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-commit", default="175b08b")
    parser.add_argument("--rounds", type=int, default=2, help="Alternating baseline/current runs per config.")
    parser.add_argument("--steps", type=int, default=2, help="Timed optimizer steps per run (after one warm-up).")
    parser.add_argument("--configs", nargs="*", default=[*DISTILL_CONFIGS, "pretrain-smollm2-2l", "features"])
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--threads", default=THREADS, help="OMP_NUM_THREADS of every measured process.")
    args = parser.parse_args(argv)
    globals()["THREADS"] = args.threads
    configs = run_worker(REPO, "configs")
    if {"pretrain-smollm2-2l", "features"} & set(args.configs):
        # stage 2 reads its tokenizer, feature extraction its target, from the zoo's cache (both versions' workers)
        from osprey.models.zoo import fetch

        fetch("smollm2-135m-instruct")

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.baseline_commit], capture_output=True, text=True, check=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    changed = subprocess.run(  # the measured trainers are the working tree's: say when it differs from HEAD
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "trainers"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    head += " with uncommitted changes to trainers/" if changed else ""
    records, started = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="osprey-baseline-") as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), commit],
            capture_output=True,
            check=True,
        )
        try:
            for name in args.configs:
                if name == "features":
                    result = run_worker(REPO, "features", "8")
                    records.append(
                        {
                            "stage": "features",
                            "config": "smollm2-135m-instruct, 8 x 1,024 tokens, bf16",
                            **result,
                            "load_average": os.getloadavg(),
                        }
                    )
                    print(json.dumps(records[-1]), flush=True)
                    continue
                kind = "pretrain" if name.startswith("pretrain") else "distill"
                worker_args = [kind, name, str(args.steps)] if kind == "distill" else [kind, str(args.steps)]
                runs = {"baseline": [], "current": []}
                for round_index in range(args.rounds):
                    order = ("baseline", "current") if round_index % 2 == 0 else ("current", "baseline")
                    for version in order:
                        if version == "baseline":
                            result = run_worker(baseline, *worker_args)
                        else:  # the current trainers as the shipped configs run them
                            result = run_worker(REPO, *worker_args, *CURRENT_SETTINGS)
                        result["load_average"] = os.getloadavg()[0]
                        runs[version].append(result)
                        print(name, version, json.dumps(result), flush=True)
                if kind == "distill":
                    gemms = distill_gemms(configs["distill"][name])
                else:
                    gemms = pretrain_gemms(configs["pretrain"], configs["pretrain_model"]["vocab_size"])
                rates = run_worker(REPO, "matmul", json.dumps(sorted({(m, k, n) for m, k, n, _ in gemms})))
                if kind == "distill":
                    spec = configs["distill"][name]
                    flops = flops_per_token(gemms, spec["batch_size"] * spec["seq_len"], spec["ttt_steps"])
                else:
                    spec = configs["pretrain"]
                    flops = flops_per_token(gemms, spec["batch_size"] * spec["seq_len"])
                current = sum(run["tokens_per_s"] for run in runs["current"]) / args.rounds
                baseline_rate = sum(run["tokens_per_s"] for run in runs["baseline"]) / args.rounds
                limit = matmul_limit(gemms, rates)
                goal = 5.0 if kind == "distill" else 2.0
                record = {
                    "stage": kind,
                    "config": name,
                    "tokens_per_s": round(current, 1),
                    "baseline_tokens_per_s": round(baseline_rate, 1),
                    "speedup": round(current / baseline_rate, 2),
                    "model_gflops_per_token": round(flops / 1e9, 3),
                    "model_gflops_per_s": round(current * flops / 1e9, 1),
                    "matmul_limit_gflops_per_s": round(limit, 1),
                    "matmul_limit_tokens_per_s": round(limit * 1e9 / flops, 1),
                    "fraction_of_matmul_limit": round(current * flops / 1e9 / limit, 3),
                    **judged(current, baseline_rate, limit * 1e9 / flops, goal),
                    "matmul_gflops_per_s_by_shape": {shape: round(rate, 1) for shape, rate in rates.items()},
                    "runs": runs,
                }
                records.append(record)
                print(json.dumps({key: value for key, value in record.items() if key != "runs"}), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    output = {
        "command": "python benchmarks/training_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "current_commit": head,
        "baseline_commit": commit,
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other jobs",
        "threads_per_process": args.threads,
        "current_settings": "torch_compile with dynamic shapes (the shipped configs); the baseline as it ran",
        "records": records,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
