"""Distillation throughput on a real feature cache and drafter under a few trainer settings, in one run.

    python benchmarks/distill_batching.py --feature-cache DIR --drafter DIR --config YAML \
        --variant "as configured" --variant "by length:train_sampling_strategy=group_by_length" \
        [--steps 50] [--warmup-steps 4] --output benchmarks/results/distill-batching.json

Each variant (`NAME[:FLAG=VALUE,...]`, the flags overriding the config's settings) trains `osprey distill`'s
trainer from the same drafter in its own process (`benchmarks/throughput_worker.py real-distill`) for `--warmup-steps`
untimed steps (`torch.compile`, allocations) and `--steps` timed ones. Throughput counts the tokens the batches hold,
not the padding the trainer computes beside them, so variants that batch differently compare fairly; the JSON also
gives each variant's share of padded positions and its ratio to the first variant.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "throughput_worker.py"


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, flags = text.partition(":")
    flags = [flag.strip() for flag in flags.split(",") if flag.strip()]
    for flag in flags:
        if "=" not in flag:
            raise SystemExit(f"--variant {text!r}: {flag!r} is not FLAG=VALUE (e.g. torch_compile=true)")
    return name, flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feature-cache", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--config", required=True, help="YAML every variant starts from")
    parser.add_argument("--variant", action="append", required=True, help="NAME[:FLAG=VALUE,...]; first: base")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    variants = [parse_variant(text) for text in args.variant]
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    results = []
    for name, flags in variants:
        command = [sys.executable, str(WORKER), "real-distill", args.feature_cache, args.drafter, args.config]
        command += [str(args.steps), str(args.warmup_steps), *flags]
        print(f"{name}: {' '.join(command)}", file=sys.stderr)
        output = subprocess.run(command, env=environment, check=True, capture_output=True, text=True).stdout
        result = {"variant": name, **json.loads(output.strip().splitlines()[-1])}
        result["ratio"] = round(result["tokens_per_s"] / (results or [result])[0]["tokens_per_s"], 3)
        print(json.dumps({key: result[key] for key in ("variant", "tokens_per_s", "padding_share", "ratio")}))
        results.append(result)
    record = {
        "command": shlex.join(["python", "benchmarks/distill_batching.py", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS")},
        "results": results,
    }
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
