"""Picks the default drafting shape for CPU targets by measurement on a held-out prompt set, never on the bench
prompts: by default the demo's six prompts (which no bench suite holds), or `--prompts FILE` (e.g.
`benchmarks/trees/heldout-sharegpt.jsonl`: eight first turns of the regenerated ShareGPT test split, which no drafter
trained on and no bench or demo uses).

Every shape of the grid (draft_topk x tree_size x prompt-lookup branch; draft_topk 1 is the chain, with or without
the branch) decodes the held-out prompts beside the target alone, in one process, methods interleaved per prompt
(greedy); the shape with the best overall tokens/s is recorded as `chosen` in the results JSON.

    python benchmarks/trees/tune_defaults.py --target smollm2-135m-instruct \
        --drafter benchmarks/checkpoints/pilot-smollm2-135m-instruct \
        --output benchmarks/results/tree-defaults/smollm2.json
    python benchmarks/trees/tune_defaults.py --target qwen2.5-coder-1.5b-instruct --drafter DIR --dtype bfloat16 \
        --prompts benchmarks/trees/heldout-sharegpt.jsonl --draft-topk 1,3 --tree-size 4,8 --prompt-lookup 0,8 \
        --output benchmarks/results/tree-defaults/qwen2.5-coder-1.5b-instruct.json
"""

import argparse
import json
from pathlib import Path

import torch

from osprey.measuring.bench import run_benchmark
from osprey.measuring.bench_suites import load_suite
from osprey.measuring.demo import DEMO_PROMPTS, DEMO_TARGET, DEMOS
from osprey.measuring.methods import BenchMethod, BenchSettings
from osprey.models.pack import DRAFTER_QUANTIZATIONS, load_drafter
from osprey.models.zoo import load_causal_lm, load_tokenizer


def method_name(k: int, n: int, lookup: int) -> str:
    shape = "chain" if k == 1 else f"tree-k{k}-n{n}"
    return shape + (f"-lookup{lookup}" if lookup else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEMO_TARGET, help="default: osprey demo's")
    parser.add_argument(
        "--drafter",
        default=str(DEMOS[DEMO_TARGET].drafter_dir),
        help="drafter directory, packed or not (default: the one osprey demo ships for its default target)",
    )
    parser.add_argument(
        "--prompts", help="held-out prompts, a JSONL file (default: osprey.measuring.demo.DEMO_PROMPTS)"
    )
    parser.add_argument("--draft-topk", default="2,3", help="comma-separated grid (1: chains)")
    parser.add_argument("--tree-size", default="4,6,8,12", help="comma-separated grid")
    parser.add_argument("--prompt-lookup", default="0", help="comma-separated grid of prompt-lookup branch lengths")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="tree depth and chain length")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--drafter-quantization", choices=DRAFTER_QUANTIZATIONS, default="none", help="as `osprey demo`'s flag"
    )
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_causal_lm(args.target, dtype=dtype).eval(), load_tokenizer(args.target)
    drafter = load_drafter(args.drafter, dtype, quantization=args.drafter_quantization)
    prompts = load_suite(args.prompts) if args.prompts else DEMO_PROMPTS
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        drafter_quantization=args.drafter_quantization,
    )
    topks, sizes = [int(k) for k in args.draft_topk.split(",")], [int(n) for n in args.tree_size.split(",")]
    lookups = [int(length) for length in args.prompt_lookup.split(",")]
    shapes = [(k, n if k > 1 else None, lookup) for k in topks for n in (sizes if k > 1 else [0]) for lookup in lookups]
    if (1, None, 0) not in shapes:
        shapes.insert(0, (1, None, 0))  # the plain chain, the reference every shape is read against
    methods = [BenchMethod("target", "target")] + [
        BenchMethod(
            method_name(k, n, lookup),
            f"drafter:{args.drafter}:{method_name(k, n, lookup)}",
            drafter=drafter,
            tree=k > 1,
            lookup=lookup > 0,
            overrides=(dict(draft_topk=k, tree_size=n) if k > 1 else {})
            | (dict(prompt_lookup_num_tokens=lookup) if lookup else {}),
        )
        for k, n, lookup in shapes
    ]
    run = run_benchmark(
        target,
        tokenizer,
        methods,
        prompts,
        settings,
        output_path=Path(args.output).with_suffix(".runs.json"),
        target_name=args.target,
    )
    results = {"target": None, "shapes": {}}
    for record in (r for r in run["records"] if r["category"] == "overall"):
        row = {key: record[key] for key in ("tau", "tokens_per_s", "speedup", "time_split", "same_output_as_target")}
        if record["method"] == "target":
            results["target"] = row
            continue
        k, n, lookup = next(shape for shape in shapes if method_name(*shape) == record["method"])
        results["shapes"][record["method"]] = {"draft_topk": k, "tree_size": n, "prompt_lookup_num_tokens": lookup}
        results["shapes"][record["method"]] |= row
    best = max(results["shapes"].values(), key=lambda row: row["tokens_per_s"])
    results["chosen"] = {key: best[key] for key in ("draft_topk", "tree_size", "prompt_lookup_num_tokens")}
    results["held_out_prompts"] = (
        f"{args.prompts} ({len(prompts)} prompts)"
        if args.prompts
        else "osprey.measuring.demo.DEMO_PROMPTS (6 prompts, none in spec_bench / mt_bench)"
    )
    results["settings"] = {
        "target": args.target,
        "drafter": args.drafter,
        "dtype": args.dtype,
        "drafter_quantization": args.drafter_quantization,
        "num_draft_tokens": args.num_draft_tokens,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["chosen"]))


if __name__ == "__main__":
    main()
