"""The `multilingual-chat` corpus: chat openings in 28 languages made of `multilingual` passages, for the target to
answer (`osprey regenerate`).
"""

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from osprey.ground import (
    corpus_dir,
    letter_script,
)

from .building import _write_splits
from .multilingual import LANGUAGE_GROUPS, Source, _sha256, language_group, prepare_multilingual

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
CHAT_TEMPLATES_FILE = Path(__file__).parent.parent / "chat_templates.json"


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
