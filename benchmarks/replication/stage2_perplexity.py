"""Held-out perplexity per language group of the `multilingual` corpus (issue 17 §2): a pruned backbone before and after
stage 2 against the unpruned parent it was pruned from, on the same tokens.

    python benchmarks/replication/stage2_perplexity.py \
        --model parent=qwen2.5-coder-0.5b-instruct \
        --model pruned=/work/runs/stage2-qwen2.5-coder-0.5b-2l-first/init \
        --output benchmarks/results/stage2-perplexity-qwen2.5-coder-0.5b-2l.json

Every model reads the first `--tokens-per-group` tokens of each group's test chunks (corpus order; each chunk on its
own, cut at `--max-length`), with its weights in `--dtype` (bfloat16 by default; the loss is summed in float32).
The corpus is `osprey data multilingual` (built if missing). Perplexity is exp of the mean next-token loss of the group.
"""

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from osprey.ground import corpus_dir
from osprey.models.zoo import load_causal_lm, load_tokenizer


def group_token_ids(tokenizer, tokens_per_group: int, max_length: int) -> dict[str, list[list[int]]]:
    """Each group's test chunks as token ids, in corpus order, until `tokens_per_group` tokens."""
    corpus = corpus_dir("multilingual") / "test.parquet"
    if not corpus.is_file():
        raise FileNotFoundError(f"{corpus} is missing: build it with `osprey data multilingual`.")
    chunks: dict[str, list[list[int]]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for text, group in pd.read_parquet(corpus)[["text", "group"]].itertuples(index=False):
        room = tokens_per_group - counts[group]
        if room < 2:
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids[: min(max_length, room)]
        if len(ids) >= 2:
            chunks[group].append(ids)
            counts[group] += len(ids)
    return dict(sorted(chunks.items()))


@torch.no_grad()
def group_losses(model, chunks: dict[str, list[list[int]]]) -> dict[str, dict]:
    results = {}
    for group, sequences in chunks.items():
        total, predicted = 0.0, 0
        for ids in sequences:
            input_ids = torch.tensor([ids])
            logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1]
            total += F.cross_entropy(logits.float(), input_ids[0, 1:], reduction="sum").item()
            predicted += len(ids) - 1
        results[group] = {"tokens": predicted, "loss": total / predicted, "perplexity": math.exp(total / predicted)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="NAME=zoo name or directory (repeat).")
    parser.add_argument("--tokens-per-group", type=int, default=16384)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--reuse", type=Path, help="An earlier output: its models of the same name and path are kept.")
    args = parser.parse_args(argv)
    models = dict(spec.split("=", 1) for spec in args.model)
    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(next(iter(models.values())))
    chunks = group_token_ids(tokenizer, args.tokens_per_group, args.max_length)
    settings = {"tokens_per_group": args.tokens_per_group, "max_length": args.max_length, "dtype": args.dtype}
    earlier = json.loads(args.reuse.read_text()) if args.reuse else {"settings": settings, "models": {}}
    if earlier["settings"] != settings:
        raise ValueError(f"{args.reuse} was measured with {earlier['settings']}, not {settings}: its numbers differ.")
    report = {
        "settings": settings,
        "command": "python benchmarks/replication/stage2_perplexity.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "models": {},
    }
    for name, path in models.items():
        if name in earlier["models"] and earlier["models"][name]["path"] == path:
            report["models"][name] = {**earlier["models"][name], "from": str(args.reuse)}
            continue
        start = time.perf_counter()
        model = load_causal_lm(path, dtype=dtype).eval()
        report["models"][name] = {"path": path, "groups": group_losses(model, chunks)}
        report["models"][name]["seconds"] = round(time.perf_counter() - start, 1)
        del model
        print(name, json.dumps(report["models"][name]), flush=True)
    names = list(models)
    for name in names[1:]:  # every model against the first (the parent)
        for group, result in report["models"][name]["groups"].items():
            result["perplexity_vs_" + names[0]] = (
                result["perplexity"] / report["models"][names[0]]["groups"][group]["perplexity"]
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
