"""Training throughput of the current trainers against the trainers of an older commit, in one run on this machine.

    python benchmarks/training_throughput.py [--baseline-commit 175b08b] [--rounds 2] [--steps 2]

The script checks the baseline commit out as a detached git worktree in a temporary directory and runs every
measurement in a fresh subprocess, with `PYTHONPATH` pointing at the worktree (baseline) or at this repository
(current); baseline and current runs alternate, so that both see the same load on a shared machine. Each run is a real
`Trainer.train()` of `--steps` optimizer steps after one warm-up step (untimed: it includes `torch.compile`), on random
tokens and random target features of the shapes below, with each version's own trainer and the settings its
replication config uses:

- distill-qwen2.5-coder-1.5b: the Qwen replication's drafter (2 blocks at hidden 576, 32k draft vocabulary, a 151,936
  token target vocabulary, 3 taps of a 1536-wide target), 2 x 1,024 tokens per micro-batch, 2 micro-batches per
  step, TTT 5 (benchmarks/replication/distill-common.yaml);
- distill-smollm2-135m: the pilot's drafter (8k draft vocabulary, 49,152-token vocabulary, taps of a 576-wide target);
- pretrain-smollm2-2l: stage 2, SmolLM2-135M pruned to 2 blocks, 4 x 1,024 tokens, 2 micro-batches per step
  (trainers/configs/pretrain-smollm2-2l.yaml);
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
RESULTS = REPO / "benchmarks" / "results" / "training-throughput.json"
QWEN_VOCAB, SMOLLM_VOCAB = 151936, 49152
DISTILL_CONFIGS = {
    # name: drafter shape (OspreyConfig overrides), sequences per micro-batch, tokens per sequence
    "distill-qwen2.5-coder-1.5b": {
        "drafter": {"vocab_size": QWEN_VOCAB, "draft_vocab_size": 32000, "target_hidden_size": 1536,
                    "target_layer_ids": [1, 13, 24]},
        "batch_size": 2, "seq_len": 1024, "accumulation": 2, "ttt_steps": 5,
    },
    "distill-smollm2-135m": {
        "drafter": {"vocab_size": SMOLLM_VOCAB, "draft_vocab_size": 8192, "target_hidden_size": 576,
                    "target_layer_ids": [1, 14, 26]},
        "batch_size": 2, "seq_len": 1024, "accumulation": 2, "ttt_steps": 5,
    },
}  # fmt: skip
PRETRAIN_CONFIG = {"batch_size": 4, "seq_len": 1024, "accumulation": 2}
SMOLLM2_2L = {
    "vocab_size": SMOLLM_VOCAB, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
    "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True, "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
}  # fmt: skip
SMOLLM2_135M = "smollm2-135m-instruct"


# ------------------------------------------------------------------------------------------------------ workers
# Each runs in its own process against whichever `trainers` / `modeling_osprey` PYTHONPATH points at, and prints one
# JSON line. They use only the API both versions share.


class _StepTimer:
    def __init__(self):
        import transformers

        class Callback(transformers.TrainerCallback):
            def on_step_begin(cb, args, state, control, **kwargs):
                self.begin = (time.perf_counter(), time.process_time())

            def on_step_end(cb, args, state, control, **kwargs):
                self.steps.append((time.perf_counter() - self.begin[0], time.process_time() - self.begin[1]))

        self.steps: list[tuple[float, float]] = []
        self.callback = Callback()

    def result(self, tokens_per_step: int) -> dict:
        timed = self.steps[1:]  # the first step warms up (allocations, torch.compile)
        wall, cpu = sum(step[0] for step in timed), sum(step[1] for step in timed)
        return {"tokens_per_s": tokens_per_step * len(timed) / wall, "cpu_s_per_1k_tokens": 1000 * cpu /
                (tokens_per_step * len(timed)), "step_wall_s": [round(step[0], 2) for step in self.steps]}  # fmt: skip


def zoo_dir(name: str) -> Path:
    """Where `osprey fetch` caches a zoo model (`$OSPREY_HOME`, default ~/.cache/osprey), in any version."""
    return Path(os.environ.get("OSPREY_HOME", "~/.cache/osprey")).expanduser() / "models" / name


def distill_worker(name: str, steps: int) -> dict:
    import torch

    from modeling_osprey import OspreyConfig, OspreyForDrafting
    from trainers.distill import OspreyDistillConfig, OspreyDistillTrainer
    from trainers.feature_cache import FeatureCacheDataset, TargetHead

    spec = DISTILL_CONFIGS[name]
    torch.manual_seed(0)
    drafter = OspreyForDrafting(OspreyConfig(**spec["drafter"]))
    taps, width, vocab = len(spec["drafter"]["target_layer_ids"]), spec["drafter"]["target_hidden_size"], \
        spec["drafter"]["vocab_size"]  # fmt: skip

    class RandomFeatures(FeatureCacheDataset):
        """Random sequences with the fields of a feature cache, held in memory."""

        def __init__(self, num_sequences: int):
            generator = torch.Generator().manual_seed(1)
            length = spec["seq_len"]
            self.items = [{
                "input_ids": torch.randint(0, vocab, (length,), generator=generator, dtype=torch.int32),
                "loss_mask": torch.ones(length, dtype=torch.uint8),
                "target_hidden_states": torch.randn(length, taps * width, generator=generator).bfloat16(),
                "target_last_hidden_state": torch.randn(length, width, generator=generator).bfloat16(),
                "target_argmax": torch.randint(0, vocab, (length,), generator=generator, dtype=torch.int32),
            } for _ in range(num_sequences)]  # fmt: skip

        def __len__(self):
            return len(self.items)

        def __getitem__(self, item):
            return self.items[item]

        def check_drafter(self, drafter_config):
            pass

        def target_head(self):
            weight = torch.randn(vocab, width, generator=torch.Generator().manual_seed(2)).bfloat16()
            return TargetHead(weight.mul_(width**-0.5))

    tokens_per_step = spec["batch_size"] * spec["seq_len"] * spec["accumulation"]
    dataset = RandomFeatures(spec["batch_size"] * spec["accumulation"] * (steps + 1))
    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = OspreyDistillConfig(
            output_dir=output_dir, per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=spec["accumulation"], max_steps=steps + 1, ttt_steps=spec["ttt_steps"],
            learning_rate=3e-4, lr_scheduler_type="cosine", max_grad_norm=0.5, save_strategy="no", report_to="none",
            disable_tqdm=True, logging_steps=1000, seed=0, bf16=True, use_cpu=True,
        )  # fmt: skip
        trainer = OspreyDistillTrainer(drafter, config, train_dataset=dataset, callbacks=[timer.callback])
        trainer.train()
    return timer.result(tokens_per_step)


def pretrain_worker(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trainers.pretrain import OspreyPretrainConfig, OspreyPretrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_2L))
    tokenizer = AutoTokenizer.from_pretrained(zoo_dir(SMOLLM2_135M))
    spec = PRETRAIN_CONFIG
    num_rows = spec["batch_size"] * spec["accumulation"] * (steps + 1)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, SMOLLM_VOCAB, (num_rows, spec["seq_len"]), generator=generator).tolist()
    dataset = Dataset.from_dict({"input_ids": rows})
    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = OspreyPretrainConfig(
            output_dir=output_dir, per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=spec["accumulation"], max_steps=steps + 1, max_length=spec["seq_len"],
            learning_rate=3e-4, save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1000, seed=0,
            dataloader_drop_last=True,
        )  # fmt: skip
        trainer = OspreyPretrainer(
            model, config, train_dataset=dataset, processing_class=tokenizer, callbacks=[timer.callback]
        )
        trainer.train()
    return timer.result(spec["batch_size"] * spec["seq_len"] * spec["accumulation"])


def features_worker(num_sequences: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainers.feature_cache import build_feature_cache

    directory = zoo_dir(SMOLLM2_135M)
    if (directory / "model.safetensors").is_file():
        target, source = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16), "zoo weights"
    else:
        config = AutoConfig.from_pretrained(directory) if directory.is_dir() else None
        target, source = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), "random weights"
    target.eval()
    seq_len = 1024
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, target.config.vocab_size, (num_sequences, seq_len), generator=generator)
    with torch.inference_mode():
        target(rows[:1], use_cache=False)  # warm-up
        start = time.perf_counter()
        for row in rows:
            target(row[None], use_cache=False)
        forward_rate = num_sequences * seq_len / (time.perf_counter() - start)
    dataset = Dataset.from_dict({"input_ids": rows.tolist(), "loss_mask": [[1] * seq_len] * num_sequences})
    with tempfile.TemporaryDirectory() as output_dir:
        start = time.perf_counter()
        build_feature_cache(target, {"train": dataset}, Path(output_dir) / "cache", [1, 14, 26], batch_size=1)
        rate = num_sequences * seq_len / (time.perf_counter() - start)
        split_bytes = sum(path.stat().st_size for path in (Path(output_dir) / "cache" / "train").iterdir())
    return {"tokens_per_s": rate, "target_forward_tokens_per_s": forward_rate, "target": f"{SMOLLM2_135M} ({source})",
            "bytes_per_token": split_bytes / (num_sequences * seq_len)}  # fmt: skip


def matmul_worker(shapes: list[list[int]]) -> dict:
    """bfloat16 GFLOP/s of `torch.matmul` at each (m, k, n)."""
    import torch

    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        torch.matmul(a, b)
        repeats, start = 0, time.perf_counter()
        while repeats < 3 or time.perf_counter() - start < 1.0:
            torch.matmul(a, b)
            repeats += 1
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9
    return rates


# ------------------------------------------------------------------------------------------------- model FLOPs


def distill_gemms(name: str) -> list[tuple[int, int, int, float]]:
    """(m, k, n, how many times per TTT step) of the drafter's forward GEMMs per micro-batch."""
    spec = DISTILL_CONFIGS[name]
    shape = spec["drafter"]
    tokens = spec["batch_size"] * (spec["seq_len"] - 1)
    hidden, inter, heads, kv, head_dim = 576, 1536, 9, 3, 64
    qkv = (heads + 2 * kv) * head_dim
    return [
        (tokens, len(shape["target_layer_ids"]) * shape["target_hidden_size"], hidden, 1 / spec["ttt_steps"]),  # fc
        (tokens, 2 * hidden, qkv, 1), (tokens, hidden, qkv, 1),  # block 0 (fusion) and block 1 q/k/v
        (tokens, hidden, hidden, 2), (tokens, hidden, inter, 4), (tokens, inter, hidden, 2),  # o_proj, MLPs
        (tokens, hidden, shape["draft_vocab_size"], 1),  # the head
    ]


def pretrain_gemms() -> list[tuple[int, int, int, float]]:
    tokens = PRETRAIN_CONFIG["batch_size"] * PRETRAIN_CONFIG["seq_len"]
    hidden, inter, qkv = 576, 1536, (9 + 6) * 64
    return [(tokens, hidden, qkv, 2), (tokens, hidden, hidden, 2), (tokens, hidden, inter, 4),
            (tokens, inter, hidden, 2), (tokens, hidden, SMOLLM_VOCAB, 1)]  # fmt: skip


def flops_per_token(gemms, tokens_per_micro_batch: int, steps: int = 1) -> float:
    """Matmul FLOPs of forward + backward (3x forward) per input token; attention scores excluded (< 3%)."""
    return 3 * steps * sum(2 * m * k * n * times for m, k, n, times in gemms) / tokens_per_micro_batch


def matmul_limit(gemms, rates: dict) -> float:
    flops = [2 * m * k * n * times for m, k, n, times in gemms]
    seconds = sum(f / rates[f"{m}x{k}x{n}"] for f, (m, k, n, _) in zip(flops, gemms))
    return sum(flops) / seconds


# ------------------------------------------------------------------------------------------------------ driver


THREADS = "1"  # per process: on a shared 2-core machine two threads wait on each other at every op (measured 2x CPU)


def run_worker(pythonpath: Path, *args: str, timeout: int = 3600) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": THREADS}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
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
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        workers = {"distill": lambda: distill_worker(rest[0], int(rest[1])), "pretrain": lambda: pretrain_worker(
            int(rest[0])), "features": lambda: features_worker(int(rest[0])),
            "matmul": lambda: matmul_worker(json.loads(rest[0]))}  # fmt: skip
        print(json.dumps(workers[kind]()))
        return 0

    globals()["THREADS"] = args.threads
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.baseline_commit], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    records, started = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="osprey-baseline-") as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline), commit],
                       capture_output=True, check=True)  # fmt: skip
        try:
            for name in args.configs:
                if name == "features":
                    result = run_worker(REPO, "features", "8")
                    records.append({"stage": "features", "config": "smollm2-135m-instruct, 8 x 1,024 tokens, bf16",
                                    **result, "load_average": os.getloadavg()})  # fmt: skip
                    print(json.dumps(records[-1]), flush=True)
                    continue
                kind = "pretrain" if name.startswith("pretrain") else "distill"
                worker_args = [kind, name, str(args.steps)] if kind == "distill" else [kind, str(args.steps)]
                runs = {"baseline": [], "current": []}
                for round_index in range(args.rounds):
                    order = ("baseline", "current") if round_index % 2 == 0 else ("current", "baseline")
                    for version in order:
                        result = run_worker(baseline if version == "baseline" else REPO, *worker_args)
                        result["load_average"] = os.getloadavg()[0]
                        runs[version].append(result)
                        print(name, version, json.dumps(result), flush=True)
                gemms = distill_gemms(name) if kind == "distill" else pretrain_gemms()
                rates = run_worker(REPO, "matmul", json.dumps(sorted({(m, k, n) for m, k, n, _ in gemms})))
                if kind == "distill":
                    spec = DISTILL_CONFIGS[name]
                    flops = flops_per_token(gemms, spec["batch_size"] * spec["seq_len"], spec["ttt_steps"])
                else:
                    flops = flops_per_token(gemms, PRETRAIN_CONFIG["batch_size"] * PRETRAIN_CONFIG["seq_len"])
                current = sum(run["tokens_per_s"] for run in runs["current"]) / args.rounds
                baseline_rate = sum(run["tokens_per_s"] for run in runs["baseline"]) / args.rounds
                limit = matmul_limit(gemms, rates)
                goal = 5.0 if kind == "distill" else 2.0
                record = {
                    "stage": kind, "config": name, "tokens_per_s": round(current, 1),
                    "baseline_tokens_per_s": round(baseline_rate, 1), "speedup": round(current / baseline_rate, 2),
                    "model_gflops_per_token": round(flops / 1e9, 3),
                    "model_gflops_per_s": round(current * flops / 1e9, 1),
                    "matmul_limit_gflops_per_s": round(limit, 1),
                    "matmul_limit_tokens_per_s": round(limit * 1e9 / flops, 1),
                    "fraction_of_matmul_limit": round(current * flops / 1e9 / limit, 3),
                    "goal": f">= {goal:g}x baseline, or >= 60% of the matmul limit where {goal:g}x exceeds it",
                    "goal_met_by": ("speedup" if current >= goal * baseline_rate else
                                    "fraction_of_matmul_limit" if current * flops / 1e9 >= 0.6 * limit else "none"),
                    "matmul_gflops_per_s_by_shape": {shape: round(rate, 1) for shape, rate in rates.items()},
                    "runs": runs,
                }  # fmt: skip
                records.append(record)
                print(json.dumps({key: value for key, value in record.items() if key != "runs"}), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    output = {
        "command": "python benchmarks/training_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "current_commit": head, "baseline_commit": commit, "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other jobs",
        "threads_per_process": args.threads,
        "records": records,
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
