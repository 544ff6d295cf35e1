"""Picks the default draft-tree shape for CPU targets by measurement on a held-out prompt set (the demo's six
prompts, which no bench suite holds), never on the bench prompts.

Every (draft_topk, tree_size) of the grid decodes the held-out prompts beside the chain, in one process, methods
interleaved per prompt (greedy, so every output must equal the target's); the shape with the best overall tokens/s
is recorded as `chosen` in the results JSON.

    python benchmarks/trees/tune_defaults.py --target smollm2-135m-instruct \
        --output benchmarks/results/tree-defaults/smollm2.json
"""

import argparse
import json
from pathlib import Path

import torch

from osprey.bench import BenchMethod, BenchSettings, run_benchmark
from osprey.demo import DEMO_DRAFTER_DIR, DEMO_PROMPTS
from osprey.pack import load_drafter
from osprey.zoo import load_causal_lm, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument(
        "--drafter", default=str(DEMO_DRAFTER_DIR), help="drafter directory, packed or not (default: osprey demo's)"
    )
    parser.add_argument("--draft-topk", default="2,3", help="comma-separated grid")
    parser.add_argument("--tree-size", default="4,6,8,12", help="comma-separated grid")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="tree depth and chain length")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    target, tokenizer = load_causal_lm(args.target, dtype=torch.float32).eval(), load_tokenizer(args.target)
    drafter = load_drafter(args.drafter)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens)
    shapes = [(int(k), int(n)) for k in args.draft_topk.split(",") for n in args.tree_size.split(",")]
    methods = [BenchMethod("target", "target"), BenchMethod("chain", f"drafter:{args.drafter}", drafter=drafter)] + [
        BenchMethod(
            f"tree-k{k}-n{n}", f"drafter-tree:{args.drafter}:k{k}n{n}", drafter=drafter, tree=True, tree_shape=(k, n)
        )
        for k, n in shapes
    ]
    run = run_benchmark(
        target,
        tokenizer,
        methods,
        DEMO_PROMPTS,
        settings,
        output_path=Path(args.output).with_suffix(".runs.json"),
        target_name=args.target,
    )
    results = {"target": None, "chain": None, "trees": {}}
    for record in (r for r in run["records"] if r["category"] == "overall"):
        row = {key: record[key] for key in ("tau", "tokens_per_s", "speedup", "time_split", "same_output_as_target")}
        if record["method"] == "target":
            results["target"] = row
        elif record["method"] == "chain":
            results["chain"] = row
        else:
            k, n = next(shape for shape in shapes if record["method"] == f"tree-k{shape[0]}-n{shape[1]}")
            results["trees"][record["method"]] = {"draft_topk": k, "tree_size": n} | row
    best = max(results["trees"].values(), key=lambda row: row["tokens_per_s"])
    results["chosen"] = {"draft_topk": best["draft_topk"], "tree_size": best["tree_size"]}
    results["held_out_prompts"] = "osprey.demo.DEMO_PROMPTS (6 prompts, none in spec_bench / mt_bench)"
    results["settings"] = {
        "target": args.target,
        "drafter": args.drafter,
        "num_draft_tokens": args.num_draft_tokens,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["chosen"]))


if __name__ == "__main__":
    main()
