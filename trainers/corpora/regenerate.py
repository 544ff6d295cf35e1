"""Target-generated responses: a chat corpus whose assistant answers are rewritten by the target itself.

A drafter is judged on text the target writes, so it learns most from that text: regenerating the answers of a chat
corpus with the target is the largest single lever on acceptance in published drafter recipes. `osprey regenerate`
keeps each conversation's opening (an optional system turn and the first user turn), lets the target answer it
greedily, batched, and appends one JSON line per conversation to `<output>/<split>.jsonl`, so that an interrupted run
resumes where it stopped and the folder loads as a dataset anywhere a corpus is accepted (`--dataset_name <output>`).
`manifest.json` records the target, the source and the settings; a resumed run with other settings is refused.
"""

import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .loading import DatasetArguments, load_text_dataset


@dataclass
class RegenerateArguments(DatasetArguments):
    """Which conversations to answer with which target, and how."""

    target_model: str | None = field(
        default=None, metadata={"help": "Target LLM: zoo name, local directory or Hub id.", "aliases": ["--target"]}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Folder of `<split>.jsonl` files (resumable).", "aliases": ["--output"]}
    )
    splits: list[str] = field(default_factory=lambda: ["train", "test"], metadata={"help": "Splits to answer."})
    max_train_conversations: int | None = field(default=None, metadata={"help": "Answer at most this many (train)."})
    max_test_conversations: int | None = field(default=None, metadata={"help": "Answer at most this many (test)."})
    max_prompt_tokens: int = field(default=384, metadata={"help": "Skip openings longer than this (tokens)."})
    max_new_tokens: int = field(default=256, metadata={"help": "Longest answer (tokens)."})
    batch_size: int = field(default=32, metadata={"help": "Openings answered in one batched generate call."})
    dtype: str = field(default="bfloat16", metadata={"help": "Target dtype: bfloat16 or float32."})
    seed: int = field(default=0, metadata={"help": "Seed of the order in which conversations are answered."})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's)."})


def opening(messages: list[dict]) -> list[dict] | None:
    """A conversation's system turns and first user turn, or None if it has no user turn."""
    head = []
    for message in messages:
        head.append({"role": message["role"], "content": message["content"]})
        if message["role"] == "user":
            return head
    return None


SETTINGS = ("target_model", "dataset_name", "max_prompt_tokens", "max_new_tokens", "dtype", "seed")


def _check_manifest(output: Path, args: RegenerateArguments) -> None:
    manifest_path = output / "manifest.json"
    settings = {name: getattr(args, name) for name in SETTINGS}
    if manifest_path.is_file():
        saved = json.loads(manifest_path.read_text())["settings"]
        if saved != settings:
            changed = {name: (saved.get(name), value) for name, value in settings.items() if saved.get(name) != value}
            raise ValueError(
                f"{output} holds answers made with other settings ({changed}, saved vs asked): pass a new "
                "--output, or the saved settings to resume."
            )
    else:
        output.mkdir(parents=True, exist_ok=True)
        manifest = {"corpus": "regenerated", "settings": settings, "arguments": asdict(args)}
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def _done_ids(path: Path) -> set[str]:
    """Ids of the complete lines of a `.jsonl` file; a torn last line (a killed run) is cut off."""
    if not path.is_file():
        return set()
    done, good_bytes = set(), 0
    with path.open("rb") as handle:
        for line in handle:
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                break
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with path.open("r+b") as handle:
            handle.truncate(good_bytes)
    return done


def opening_text(head: list[dict]) -> str:
    """An opening as plain text, for a target with no chat template: its turns' contents, a blank line apart."""
    return "\n\n".join(message["content"] for message in head)


def text_format(tokenizer) -> str:
    """How a target is prompted: `chat` through its tokenizer's chat template, or `text` (a base model has none),
    its openings continued as plain text."""
    return "chat" if tokenizer.chat_template is not None else "text"


def regenerate_split(target, tokenizer, records, path: Path, args: RegenerateArguments, limit: int | None) -> int:
    """Answers the openings of `records` not yet in `path`, appending a line each; returns how many it wrote.

    A tokenizer with a chat template gets each opening as a chat and the answer as the assistant turn (`messages`).
    A base model's tokenizer has none: the opening is plain text cut to its first `max_prompt_tokens` tokens (a
    document's opening is as good a prompt as a whole one), the target continues it, and the line holds the text
    (`text`, with `prompt` and `answer`)."""
    chat = text_format(tokenizer) == "chat"
    done = _done_ids(path)
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    todo = []
    for index in order:
        if limit is not None and len(done) + len(todo) >= limit:
            break
        record = records[index]
        key = str(record.get("id") or index)
        head = opening(record["messages"])
        if key in done or head is None:
            continue
        if chat:
            prompt = tokenizer.apply_chat_template(head, add_generation_prompt=True, return_dict=True)["input_ids"]
            if len(prompt) <= args.max_prompt_tokens:
                todo.append((key, head, prompt))
        else:
            prompt = tokenizer(opening_text(head))["input_ids"][: args.max_prompt_tokens]
            if len(prompt) > 1:  # a lone BOS (an empty opening) gives the target nothing to continue
                todo.append((key, head, prompt))
    # Batches of similar length waste little on padding; the order inside the file does not matter.
    todo.sort(key=lambda item: len(item[2]))
    batches = [todo[start : start + args.batch_size] for start in range(0, len(todo), args.batch_size)]
    random.Random(args.seed).shuffle(batches)  # early stops still cover every length
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    written = 0
    with path.open("a", encoding="utf-8") as handle:
        for batch in tqdm(batches, desc=f"regenerating {path.stem}", unit="batch"):
            width = max(len(prompt) for _, _, prompt in batch)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for _, _, p in batch])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, _, p in batch])
            with torch.inference_mode():
                output = target.generate(
                    input_ids=input_ids.to(target.device),
                    attention_mask=attention_mask.to(target.device),
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            for (key, head, prompt), answer in zip(batch, output[:, width:].tolist()):
                finished = not eos_ids.isdisjoint(answer)
                text = tokenizer.decode(answer, skip_special_tokens=True)
                if chat:
                    line = {"id": key, "messages": head + [{"role": "assistant", "content": text}]}
                else:
                    start = tokenizer.decode(prompt, skip_special_tokens=True)
                    line = {"id": key, "text": start + text, "prompt": start, "answer": text}
                line["finished"] = finished
                handle.write(json.dumps(line, ensure_ascii=False) + "\n")
            handle.flush()
            written += len(batch)
    return written


def main(argv: list[str] | None = None) -> int:
    """`osprey regenerate`: `--config config.yaml` and/or flags, see `osprey regenerate --help`."""
    from trl import TrlParser

    from osprey.models.zoo import load_causal_lm, load_tokenizer

    (args,) = TrlParser((RegenerateArguments,), prog="osprey regenerate", description=__doc__).parse_args_and_config(
        argv
    )
    if args.target_model is None or args.dataset_name is None or args.output_dir is None:
        raise ValueError("Pass --target, --dataset-name (e.g. sharegpt) and --output.")
    if args.threads:
        torch.set_num_threads(args.threads)
    output = Path(args.output_dir)
    _check_manifest(output, args)
    tokenizer = load_tokenizer(args.target_model)
    target = load_causal_lm(args.target_model, dtype=getattr(torch, args.dtype)).eval()
    dataset = load_text_dataset(args)
    limits = {"train": args.max_train_conversations, "test": args.max_test_conversations}
    for split in args.splits:
        if split not in dataset:
            raise ValueError(f"{args.dataset_name} has no split {split!r}: it has {sorted(dataset)}.")
        written = regenerate_split(
            target, tokenizer, dataset[split], output / f"{split}.jsonl", args, limits.get(split)
        )
        print(f"{split}: {written} answers written to {output / f'{split}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
