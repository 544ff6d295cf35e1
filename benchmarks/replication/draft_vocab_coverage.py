"""The share of a target's tokens, per language group, that a drafter's draft vocabulary holds: a drafter can never
propose a token outside it, so a chain ends at each one. Counted on the multilingual-chat openings (issue 54).

    python benchmarks/replication/draft_vocab_coverage.py --drafter osprey/demo_drafter_qwen \
        --target qwen2.5-coder-1.5b-instruct
"""

import argparse
import collections

import pyarrow.parquet as pq

from osprey.ground import corpus_dir
from osprey.models.pack import load_drafter
from osprey.models.zoo import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="drafter directory or packed directory")
    parser.add_argument("--target", required=True, help="the target whose tokenizer counts the tokens")
    parser.add_argument("--every", type=int, default=10, help="count every N-th training opening (default 10)")
    args = parser.parse_args()
    vocabulary = set(load_drafter(args.drafter).draft_to_target.tolist())
    tokenizer = load_tokenizer(args.target)
    directory = corpus_dir("multilingual-chat")  # `osprey data multilingual-chat`
    for split, step in (("test", 1), ("train", args.every)):
        counts = collections.defaultdict(lambda: [0, 0])
        for row in pq.read_table(directory / f"{split}.parquet").to_pylist()[::step]:
            ids = tokenizer(row["messages"][0]["content"])["input_ids"]
            counts[row["group"]][0] += sum(token in vocabulary for token in ids)
            counts[row["group"]][1] += len(ids)
        print(split, {group: f"{inside / total:.1%}" for group, (inside, total) in counts.items()})


if __name__ == "__main__":
    main()
