"""Which blocks of Qwen2.5-Coder-0.5B-Instruct to keep as a same-tokenizer drafter backbone (issue 17 §1): for each
number of blocks N and each `osprey prune` strategy, the cost of one draft step against one decoding step of the
target, and held-out next-token perplexity per language group of the `multilingual` corpus, against the parent's.

The pruned models are measured as pruned (before stage 2): perplexity here ranks block choices, it does not predict
the trained backbone's. Timings are single-threaded (`torch.set_num_threads(1)`), bf16, one new token after a
prefilled cache of `--context` tokens, median of `--steps` steps, in CPU time of the process (the machine is shared:
wall time mostly measured how long other processes held the cores); every model is timed once per round, in turn,
and the table reports the median over `--rounds` rounds.

    osprey data multilingual && OMP_NUM_THREADS=1 .venv/bin/python benchmarks/replication/backbone_choice.py \
        --output benchmarks/results/backbone-choice-qwen2.5-coder-0.5b.json
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from transformers import DynamicCache

from osprey.ground import corpus_dir
from osprey.models.zoo import load_causal_lm, load_tokenizer
from osprey.stages.prune import prune


@torch.no_grad()
def step_ms(model, context: int, steps: int, vocab_size: int, head_rows: int | None = None) -> float:
    """Median CPU milliseconds (of this single-threaded process: time spent waiting for a core while other processes
    run is not counted) of one single-token forward after `context` cached tokens (the LM head cut to its first
    `head_rows` rows when given, as with a draft vocabulary)."""
    head = model.get_output_embeddings()
    full_weight = head.weight
    if head_rows is not None:
        head.weight = torch.nn.Parameter(full_weight[:head_rows], requires_grad=False)
    try:
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(vocab_size, (1, context), generator=generator)
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        token, times = prompt[:, -1:], []
        for _ in range(steps + 2):
            start = time.process_time()
            model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.process_time() - start)
        return 1000 * statistics.median(times[2:])
    finally:
        head.weight = full_weight


@torch.no_grad()
def group_perplexity(model, windows: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    result = {}
    for group, group_windows in windows.items():
        loss = tokens = 0.0
        for window in group_windows:
            out = model(input_ids=window, labels=window, use_cache=False)
            loss += out.loss.float().item() * (window.shape[1] - 1)
            tokens += window.shape[1] - 1
        result[group] = math.exp(loss / tokens)
    return result


def held_out_windows(tokenizer, corpus: Path, tokens_per_group: int, window: int) -> dict[str, list[torch.Tensor]]:
    """The first `tokens_per_group` tokens of each group's held-out chunks (corpus order), in windows."""
    rows = pq.read_table(corpus / "test.parquet", columns=["text", "group"]).to_pylist()
    windows = {}
    for group in json.loads((corpus / "manifest.json").read_text())["groups"]:
        ids = []
        for row in rows:
            if row["group"] == group and len(ids) < tokens_per_group:
                ids += tokenizer(row["text"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        ids = torch.tensor(ids[:tokens_per_group])
        windows[group] = [ids[None, start : start + window] for start in range(0, len(ids) - 1, window)]
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parent", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--num-layers", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--strategies", nargs="+", default=["first", "block-influence"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds, every model once per round in turn")
    parser.add_argument("--draft-vocab-size", type=int, default=32000, help="also time a head cut to this many rows")
    parser.add_argument("--tokens-per-group", type=int, default=2048)
    parser.add_argument("--timing-only", action="store_true", help="keep --output's perplexities, redo the timings")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    output = Path(args.output)
    corpus = corpus_dir("multilingual")
    if not (corpus / "calibration.txt").is_file():
        raise ValueError(f"No multilingual corpus in {corpus}: build it first with `osprey data multilingual`.")
    tokenizer = load_tokenizer(args.parent)
    dtype = torch.bfloat16
    parent = load_causal_lm(args.parent, dtype=dtype).eval()
    if args.timing_only:
        results = json.loads(output.read_text())
    else:
        windows = held_out_windows(tokenizer, corpus, args.tokens_per_group, 512)
        results = {"settings": vars(args), "corpus_manifest": str(corpus / "manifest.json"), "rows": []}
        results["parent"] = {"perplexity": group_perplexity(parent, windows)}
        print("parent", results["parent"], flush=True)
        calibration = [(corpus / "calibration.txt").read_text(encoding="utf-8")]
        measured = {}
        for strategy in args.strategies:
            for num_layers in args.num_layers:
                pruned = prune(parent, num_layers, strategy, calibration_texts=calibration, tokenizer=tokenizer)
                pruning = pruned.config.osprey_pruning
                kept = tuple(pruning["kept_layers"])
                if kept not in measured:  # block influence may keep the same blocks as `first`
                    measured[kept] = group_perplexity(pruned.eval(), windows)
                if "block_influence" in pruning:
                    results["block_influence"] = pruning["block_influence"]
                row = {"num_layers": num_layers, "strategy": strategy, "kept_layers": list(kept),
                       "perplexity": measured[kept]}  # fmt: skip
                results["rows"].append(row)
                print(row, flush=True)
                output.write_text(json.dumps(results, indent=1) + "\n")
                del pruned
    # Timings: every model once per round, in turn, so that load from other processes hits all alike.
    results["settings"].update(context=args.context, steps=args.steps, rounds=args.rounds)
    models = {"parent": (parent, None)}
    for row in results["rows"]:
        key = ",".join(map(str, row["kept_layers"]))
        if key not in models:
            pruned = _rebuild_sharing_vocabulary(parent, row["kept_layers"])
            models[key], models[key + "@draft-vocab"] = (pruned, None), (pruned, args.draft_vocab_size)
    target = load_causal_lm(args.target, dtype=dtype).eval()
    models["target"] = (target, None)
    vocab = target.config.vocab_size
    times = {name: [] for name in models}
    for round_index in range(args.rounds):
        for name, (model, head_rows) in models.items():
            times[name].append(step_ms(model, args.context, args.steps, vocab, head_rows))
        print(f"round {round_index}:", {name: round(values[-1], 1) for name, values in times.items()}, flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    results["timings_ms"] = times
    results["target_step_ms"] = median["target"]
    results["parent"]["step_ms"] = median["parent"]
    for row in results["rows"]:
        key = ",".join(map(str, row["kept_layers"]))
        row["step_ms"], row["step_ms_draft_vocab"] = median[key], median[key + "@draft-vocab"]
    output.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))


def _rebuild_sharing_vocabulary(parent, kept_layers):
    """`parent` pruned to `kept_layers`, sharing the parent's embedding and LM head tensors (timing only)."""
    from osprey.stages.prune import _rebuild

    pruned = _rebuild(parent, list(kept_layers), {"kept_layers": list(kept_layers)})
    pruned.model.embed_tokens.weight = parent.model.embed_tokens.weight
    pruned.lm_head.weight = parent.lm_head.weight
    return pruned.eval()


def markdown(results: dict) -> str:
    groups = list(results["parent"]["perplexity"])
    target_ms = results["target_step_ms"]
    lines = [
        "| blocks | strategy | kept | draft step ms (÷ target) | with 32k head | " + " | ".join(groups) + " |",
        "|---|---|---|---|---|" + "---|" * len(groups),
        f"| 24 (parent) | — | all | {results['parent']['step_ms']:.1f} "
        f"({results['parent']['step_ms'] / target_ms:.2f}) "
        "| — | " + " | ".join(f"{results['parent']['perplexity'][g]:.1f}" for g in groups) + " |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['num_layers']} | {row['strategy']} | {row['kept_layers']} | {row['step_ms']:.1f} "
            f"({row['step_ms'] / target_ms:.3f}) | {row['step_ms_draft_vocab']:.1f} "
            f"({row['step_ms_draft_vocab'] / target_ms:.3f}) | "
            + " | ".join(f"{row['perplexity'][g]:.0f}" for g in groups) + " |"
        )  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
