"""Each method's best draft settings for a replication bench, measured on held-out prompts, never the bench's: of
every category of the given suites, the prompt that `--per-category BENCH+1` adds to the bench's `--per-category
BENCH` (subsets are seeded and nested, so none of them is a bench prompt), or a JSONL file (`--prompts-file`).

Every candidate decodes the held-out prompts beside the target alone, in one process, methods interleaved per prompt
(greedy):
- each drafter NAME=DIR as chains (`--num-draft-tokens` x `--confidence-threshold`), with `--draft-topk` > 1 as
  trees (depths `--num-draft-tokens` x `--tree-size`), and with `--prompt-lookup` > 0 as those trees (or chains) with
  a prompt-lookup branch: the bench's methods NAME, NAME-tree and NAME-tree-lookup (NAME-lookup without trees);
- SpS with `--sps MODEL` (chains, the same grid): the bench's `sps`;
- PLD with `--pld` lookup lengths: the bench's `pld`.
For each bench method, the candidate with the best overall tokens/s is recorded in the output JSON's `chosen`, which
`osprey bench --method-settings` reads. The runs resume from OUTPUT's `.runs.json`.

    python benchmarks/replication/tune_methods.py --target qwen2.5-coder-1.5b-instruct --dtype bfloat16 \\
        --drafter osprey=DIR --drafter scratch=DIR2 --sps qwen2.5-coder-0.5b-instruct --pld 2,4,8 \\
        --prompts spec_bench --prompts mt_bench --prompts humaneval --prompts mmath --bench-per-category 2 \\
        --output benchmarks/results/tuned-methods.json
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from osprey.measuring.bench import run_benchmark
from osprey.measuring.bench_suites import held_out_prompts, load_suite
from osprey.measuring.methods import DRAFTER_KINDS, DRAFTER_METHODS, BenchMethod, BenchSettings, load_method
from osprey.models.zoo import load_causal_lm, load_tokenizer


def candidates(args) -> list[tuple[str, str, str, dict]]:
    """(bench method, candidate name, spec, own settings) of every candidate of the grid."""
    lengths = [int(n) for n in args.num_draft_tokens.split(",")]
    thresholds = [float(t) for t in args.confidence_threshold.split(",")]
    sizes = [int(n) for n in args.tree_size.split(",")]
    lookups = [int(n) for n in args.prompt_lookup.split(",") if int(n) > 0]
    chains = [dict(num_draft_tokens=n, confidence_threshold=t) for n in lengths for t in thresholds]
    trees = [
        dict(num_draft_tokens=n, confidence_threshold=0.0, draft_topk=args.draft_topk, tree_size=size)
        for n in lengths
        for size in (sizes if args.draft_topk > 1 else [])
    ]
    shapes = trees or [dict(num_draft_tokens=n, confidence_threshold=0.0) for n in lengths]  # under the lookup branch
    with_lookup = [own | dict(prompt_lookup_num_tokens=n) for n in lookups for own in shapes]
    found = []
    for spec in args.drafter:
        name, _, location = spec.partition("=")
        for tree, lookup, grid in ((False, False, chains), (True, False, trees), (bool(trees), True, with_lookup)):
            spec_kind, suffix, *_ = DRAFTER_METHODS["standalone", tree, lookup]  # named as the bench names them
            found += [(name + suffix, spec_kind, location, own) for own in grid]
    if args.sps:
        found += [("sps", "sps", args.sps, own) for own in chains]
    found += [("pld", "pld", "", dict(prompt_lookup_num_tokens=int(n))) for n in filter(None, args.pld.split(","))]
    named = []
    for method, kind, location, own in found:
        label = "-".join(f"{key}{value}" for key, value in own.items())
        named.append((method, f"{method}@{label}", f"{kind}:{location}".rstrip(":"), own))
    return named


def merge_candidates(earlier: dict, fresh: dict) -> dict:
    """The candidates of a tuning file after an invocation measured `fresh`: a method measured now keeps only its
    fresh candidates, every other method its earlier ones."""
    tuned_now = {row["method"] for row in fresh.values()}
    return {name: row for name, row in earlier.items() if row["method"] not in tuned_now} | fresh


def choose(candidates: dict) -> dict:
    """{bench method: the settings of its candidate with the best overall tokens/s}."""
    chosen = {}
    for method in dict.fromkeys(row["method"] for row in candidates.values()):
        best = max((row for row in candidates.values() if row["method"] == method), key=lambda row: row["tokens_per_s"])
        chosen[method] = best["settings"]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR", help="repeatable")
    parser.add_argument("--sps", metavar="MODEL", help="a same-tokenizer assistant (SpS)")
    parser.add_argument("--pld", default="", help="comma-separated PLD lookup lengths (empty: no PLD)")
    parser.add_argument("--prompts", action="append", default=[], metavar="SUITE", help="suites of the bench")
    parser.add_argument("--bench-per-category", type=int, default=2, help="the bench's --per-category")
    parser.add_argument("--prompts-file", help="held-out prompts as a JSONL file instead of the suites")
    parser.add_argument("--data-dir")
    parser.add_argument("--seed", type=int, default=0, help="the bench's --seed")
    parser.add_argument("--num-draft-tokens", default="2,4,6", help="chain lengths and tree depths")
    parser.add_argument("--confidence-threshold", default="0,0.3", help="chains' early-stop thresholds")
    parser.add_argument("--draft-topk", type=int, default=3, help="trees' branching (1: chains only)")
    parser.add_argument("--tree-size", default="4,8", help="trees' sizes")
    parser.add_argument("--prompt-lookup", default="0", help="prompt-lookup branch lengths for the drafters (0: none)")
    parser.add_argument("--drafter-quantization", choices=["none", "int8"], default="none")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    if not args.drafter and not args.sps and not args.pld:
        parser.error("nothing to tune: pass --drafter NAME=DIR, --sps MODEL or --pld LENGTHS")
    if any("=" not in spec for spec in args.drafter):
        parser.error("name every drafter as in the bench: --drafter NAME=DIR")
    if args.prompts_file:
        prompts, source = [replace(p, suite="held_out") for p in load_suite(args.prompts_file)], args.prompts_file
    elif args.prompts:
        prompts = held_out_prompts(args.prompts, args.bench_per_category, args.seed, args.data_dir)
        source = (
            f"of each category of {', '.join(args.prompts)}, prompt {args.bench_per_category + 1} of seed {args.seed}"
        )
    else:
        parser.error("pass the bench's suites (--prompts) or --prompts-file")

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_causal_lm(args.target, dtype=dtype).eval(), load_tokenizer(args.target)
    grid = candidates(args)
    loaded = {}  # one model per drafter folder or assistant, shared by its candidates
    methods = [BenchMethod("target", "target")]
    for _, name, spec, own in grid:
        kind, _, location = spec.partition(":")
        base = f"drafter:{location}" if kind in DRAFTER_KINDS else spec
        if base not in loaded:
            loaded[base] = load_method(name, base, tokenizer, dtype, "cpu", args.drafter_quantization)
        _, tree, lookup = DRAFTER_KINDS.get(kind, ("standalone", False, False))
        methods.append(replace(loaded[base], name=name, spec=spec, tree=tree, lookup=lookup, overrides=own))
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens, seed=args.seed, drafter_quantization=args.drafter_quantization
    )
    runs_path = Path(args.output).with_suffix(".runs.json")
    run = run_benchmark(target, tokenizer, methods, prompts, settings, output_path=runs_path, target_name=args.target)
    overall = {r["method"]: r for r in run["records"] if r["category"] == "overall"}
    keys = ("tau", "tokens_per_s", "speedup", "same_output_as_target")
    results = {"target": {key: overall["target"][key] for key in keys}, "candidates": {}}
    for method, name, _, own in grid:
        results["candidates"][name] = {"method": method, "settings": own} | {key: overall[name][key] for key in keys}
    output = Path(args.output)
    if output.exists():  # methods an earlier invocation tuned (other drafters) keep their candidates
        results["candidates"] = merge_candidates(
            json.loads(output.read_text()).get("candidates", {}), results["candidates"]
        )
    results["chosen"] = choose(results["candidates"])
    results["held_out_prompts"] = f"{source} ({len(prompts)} prompts)"
    results["settings"] = vars(args) | {"threads": torch.get_num_threads()}
    output.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["chosen"], indent=1))


if __name__ == "__main__":
    main()
