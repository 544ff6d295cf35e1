"""Writing systems of a chat dataset: for each conversation, the script its first user turn and its first answer are
mostly written in. The distillation data's languages bound what a drafter can learn to draft; this counts them.

    python benchmarks/replication/writing_systems.py \
        benchmarks/checkpoints/regenerated-sharegpt-qwen2.5-coder-1.5b-instruct/train.jsonl.gz --limit 4800

A turn's script is the Unicode script name (the first word of the character names: LATIN, CJK, HANGUL, ARABIC...) of
most of its letters; ASCII letters count as LATIN, and a turn without letters is `none`. Latin covers English and the
other Latin-script languages alike: the count tells the non-Latin share, not the English one. Files are .jsonl,
.jsonl.gz, .json or .parquet with chat `messages` (`role`, `content`), as `osprey data` and `osprey regenerate`
write them; `--limit N` counts their first N rows (the full-budget run distills on the first 4,800 answers).
"""

import argparse
import collections

from datasets import load_dataset

from osprey.ground import text_script


def first_turn(messages: list[dict], role: str) -> str:
    return next((m["content"] for m in messages if m["role"] == role), "")


def count_scripts(rows) -> dict[str, collections.Counter]:
    """Per role (`user`, `assistant`), how many conversations' first turn of that role is in each script."""
    counts = {"user": collections.Counter(), "assistant": collections.Counter()}
    for row in rows:
        for role, counter in counts.items():
            counter[text_script(first_turn(row["messages"], role)) or "none"] += 1
    return counts


def load_rows(path: str, limit: int | None):
    builder = "parquet" if path.endswith(".parquet") else "json"
    rows = load_dataset(builder, data_files=path, split="train")
    return rows.select(range(min(limit, len(rows)))) if limit else rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="chat datasets (.jsonl, .jsonl.gz, .json, .parquet)")
    parser.add_argument("--limit", type=int, default=None, help="count only each file's first N conversations")
    args = parser.parse_args()
    for path in args.files:
        rows = load_rows(path, args.limit)
        counts = count_scripts(rows)
        print(f"\n{path}: {len(rows)} conversations\n")
        print("| script | first user turn | first answer |\n|---|---:|---:|")
        for script in sorted(set(counts["user"]) | set(counts["assistant"]), key=lambda s: -counts["user"][s]):
            print(f"| {script} | {counts['user'][script]} | {counts['assistant'][script]} |")


if __name__ == "__main__":
    main()
