"""The `multilingual` corpus (`osprey data multilingual`), on small synthetic stand-ins for the Debian packages."""

import gzip
import hashlib
import json
import subprocess
import sys
from collections import Counter

import pyarrow.parquet as pq
import pytest
from test_data_prep import fake_deb
from test_vocab_alignment import byte_level_tokenizer

from trainers.corpora import building, loading, multilingual, multilingual_chat
from trainers.corpora.building import block_texts, fortune_texts, normalize_lang, roff_text
from trainers.corpora.multilingual import Source, group_counts, language_group, prepare_multilingual


def test_language_tags_fall_into_script_groups():
    assert [normalize_lang(tag) for tag in ("pt_BR", "de-DE", "zh_CN", "C", "sr@latin", "ja-JP")] == [
        "pt-BR", "de", "zh-CN", "en", "sr@latin", "ja",
    ]  # fmt: skip
    groups = {tag: language_group(tag) for tag in ("en", "de", "vi", "ru", "sr", "sr@latin", "zh-TW", "ko", "ar",
                                                   "th", "el", "hi", "python", "go")}  # fmt: skip
    assert groups == {
        "en": "en", "de": "latin", "vi": "latin", "ru": "cyrillic", "sr": "cyrillic", "sr@latin": "latin",
        "zh-TW": "cjk", "ko": "cjk", "ar": "other-scripts", "th": "other-scripts", "el": "other-scripts",
        "hi": "other-scripts", "python": "code", "go": "code",
    }  # fmt: skip


def test_roff_markup_is_stripped_and_cjk_lines_join_without_spaces():
    source = "\n".join([
        '.\\" a comment that must not appear',
        ".TH LS 1",
        ".SH NAME",
        "ls \\- list \\fBdirectory\\fR contents",
        ".SH 解説",
        "このファイルには、",
        "エイリアスを記述します。",
        ".PP",
        ".B \"--all\"",
        "shows \\fIhidden\\fP entries\\(em all of them.",
    ])  # fmt: skip
    assert roff_text(source).split("\n\n") == [
        "NAME", "ls - list directory contents", "解説", "このファイルには、エイリアスを記述します。",
        "--all shows hidden entries— all of them.",
    ]  # fmt: skip


def test_block_texts_of_html_and_mallard_pages_skip_page_chrome():
    html = (
        "<html><head><title>Head title</title><script>var x = 1;</script></head><body>"
        "<header><p>LibreOffice Help</p></header><h1>Options</h1><p>First <b>bold</b>\n paragraph.</p>"
        "<ul><li>one</li><li>two<br/>lines</li></ul><pre>def f():\n    return 1\n</pre>"
        "<footer><p>Footer</p></footer></body></html>"
    )
    assert block_texts(html) == ["Options", "First bold paragraph.", "one", "two", "lines", "def f():\n    return 1"]
    mallard = (
        '<page xmlns="http://projectmallard.org/1.0/"><info><desc>Not shown.</desc><mal:credit><mal:name>T</mal:name>'
        "</mal:credit></info><title>Wi-Fi</title><p>Click <gui>Connect</gui>.</p></page>"
    )
    assert block_texts(mallard) == ["Wi-Fi", "Click Connect."]


def test_fortune_files_split_at_percent_lines():
    assert fortune_texts("One.\n%\nTwo\nlines.\n%\n\n%\n") == ["One.", "Two\nlines."]


@pytest.fixture
def downloads(tmp_path, monkeypatch):
    downloads = tmp_path / "data" / "downloads"
    downloads.mkdir(parents=True)
    help_dir = "usr/share/help"
    fake_deb(downloads, "gnome-user-docs", {
        f"{help_dir}/C/gnome-help/wifi.page": "<page><title>Wi-Fi</title><p>Connect to a network.</p></page>",
        f"{help_dir}/ja/gnome-help/wifi.page": "<page><title>無線</title><p>Connect to a network.</p></page>",
        f"{help_dir}/ru/gnome-help/wifi.page": "<page><title>Беспроводная сеть</title><p>Подключение.</p></page>",
        f"{help_dir}/ar/gnome-help/wifi.page": "<page><p>" + "الشبكة اللاسلكية. " * 50 + "</p></page>",
    })  # fmt: skip
    monkeypatch.setattr(multilingual, "MANPAGES_LANGS", ("ja",))
    page = gzip.compress(".SH 名称\nls \\- 一覧\n".encode())
    (downloads / "manpages-ja_4.18.1-1_all.deb").write_bytes(b"")
    for path, content in {"usr/share/man/ja/man1/ls.1.gz": page, "usr/share/man/ja/man1/dir.1.gz": b""}.items():
        target = downloads / "manpages-ja_4.18.1-1_all" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    (downloads / "manpages-ja_4.18.1-1_all/usr/share/man/ja/man1/dir.1.gz").write_bytes(gzip.compress(b".so ls.1\n"))
    fake_deb(downloads, "golang-1.19-src", {
        "usr/share/go-1.19/src/fmt/print.go": "package fmt\n",
        "usr/share/go-1.19/src/fmt/print_test.go": "package fmt // skipped\n",
    })  # fmt: skip
    return downloads


def tiny_sources():
    return {
        "gnome-help": Source(multilingual.gnome_help, 300, ("gnome-user-docs",)),
        "manpages": Source(multilingual.manpages, 10_000, ("manpages-ja",)),
        "go-stdlib": Source(building.code("golang-1.19-src", "usr/share/go-1.19/src/**/*.go", "go", ("_test.go",)),
                            10_000, ("golang-1.19-src",)),
    }  # fmt: skip


def test_prepare_multilingual_tags_groups_keeps_budgets_and_records_packages(tmp_path, downloads, capsys):
    directory = prepare_multilingual(tmp_path, sources=tiny_sources())
    manifest = json.loads((directory / "manifest.json").read_text())
    rows = [row for split in ("train", "test") for row in pq.read_table(directory / f"{split}.parquet").to_pylist()]
    by_lang = {}
    for row in rows:
        by_lang.setdefault(row["lang"], []).append(row)
    assert {lang: {row["group"] for row in rows} for lang, rows in by_lang.items()} == {
        "en": {"en"}, "ja": {"cjk"}, "ru": {"cyrillic"}, "ar": {"other-scripts"}, "go": {"code"},
    }  # fmt: skip
    texts = {row["text"] for row in rows}
    assert "無線" in texts  # the untranslated (English) paragraph of the Japanese page is dropped
    assert "Wi-Fi\n\nConnect to a network." in texts and "名称\n\nls - 一覧" in texts
    assert "package fmt\n" not in texts and "package fmt" in texts  # tests left out; chunks are stripped
    assert manifest["sources"]["manpages"]["ja"]["documents"] == 1  # the `.so` include is not a page
    arabic = manifest["sources"]["gnome-help"]["ar"]["characters"]
    assert 300 <= arabic < 300 + 4000  # the budget stops a language after the chunk that crosses it
    deb = downloads / "manpages-ja_4.18.1-1_all.deb"
    assert manifest["packages"]["manpages-ja"] == {
        "version": "4.18.1-1", "file": deb.name, "sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
    }  # fmt: skip
    groups = manifest["groups"]
    assert set(groups) == {"en", "cjk", "cyrillic", "other-scripts", "code"}
    assert sum(split["chunks"] for group in groups.values() for split in group.values()) == len(rows)

    # Deterministic, and a lock naming other package contents is reported, not silently accepted.
    first = [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")]
    lock = tmp_path / "lock.json"
    manifest["packages"]["manpages-ja"]["sha256"] = "0" * 64
    lock.write_text(json.dumps(manifest))
    rebuilt = json.loads((prepare_multilingual(tmp_path, force=True, lock=lock, sources=tiny_sources())
                          / "manifest.json").read_text())  # fmt: skip
    assert [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")] == first
    assert list(rebuilt["lock_mismatches"]) == ["manpages-ja"]
    assert "manpages-ja" in capsys.readouterr().err


def test_group_counts_count_tokens_per_group_and_split():
    records = [{"text": "héllo", "group": "latin"}, {"text": "日本", "group": "cjk"}, {"text": "ab", "group": "cjk"}]
    counts = group_counts(records, byte_level_tokenizer())
    total = {group: sum(split["tokens"] for split in splits.values()) for group, splits in counts.items()}
    assert total == {"latin": len("héllo".encode()), "cjk": len("日本".encode()) + 2}
    assert sum(split["chunks"] for split in counts["cjk"].values()) == 2


def test_empty_sources_are_a_clear_error(tmp_path):
    (tmp_path / "data" / "downloads").mkdir(parents=True)
    empty = {"nothing": Source(lambda downloads: iter(()), 10, ())}
    with pytest.raises(ValueError, match="yielded no text"):
        prepare_multilingual(tmp_path, sources=empty)


def test_calibration_text_takes_every_group_from_the_training_split(tmp_path, downloads):
    directory = prepare_multilingual(tmp_path, sources=tiny_sources())
    assert (directory / "calibration.txt").read_text() == multilingual.calibration_text(directory)
    text = multilingual.calibration_text(directory, characters_per_group=12)
    held_out = {row["text"] for row in pq.read_table(directory / "test.parquet").to_pylist()}
    assert "Wi-Fi" in text and "名称" in text and "package fmt" in text and "الشبكة" in text
    assert all(chunk[:12] not in text for chunk in held_out)
    assert len(text) <= 5 * (12 + 2)


def test_cli_data_multilingual_builds_and_refuses_flags_of_other_corpora(tmp_path, downloads, monkeypatch, capsys):
    from osprey.cli import main

    monkeypatch.setattr(multilingual, "MULTILINGUAL_SOURCES", tiny_sources())
    assert main(["data", "multilingual", "--cache-dir", str(tmp_path)]) == 0
    assert (tmp_path / "data" / "multilingual" / "calibration.txt").is_file()
    assert main(["data", "general", "--cache-dir", str(tmp_path), "--lock", "x.json"]) == 2
    assert "multilingual corpus only" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ multilingual-chat

CHAT_SENTENCES = {  # one sentence per language, numbered so that every paragraph and page differs
    "C": "Section {}: the computer connects to the printer in the office over the wireless network once it is set up.",
    "de": "Abschnitt {}: Der Rechner verbindet sich über das drahtlose Netzwerk mit dem Drucker im Büro, sobald die "
    "Verbindung eingerichtet ist.",
    "pt_BR": "Seção {}: o computador se conecta à impressora do escritório pela rede sem fio assim que a conexão é "
    "configurada.",
    "ru": "Раздел {}: компьютер подключается к принтеру в офисе через беспроводную сеть, как только соединение "
    "настроено.",
    "ja": "第{}節：接続が設定されると、コンピューターは無線ネットワークを通じて事務所のプリンターに接続します。",
    "ar": "القسم {}: يتصل الحاسوب بالطابعة في المكتب عبر الشبكة اللاسلكية بمجرد إعداد الاتصال.",
    "eo": "Sekcio {}: la komputilo konektiĝas al la presilo en la oficejo per la sendrata reto, kiam la konekto "
    "pretas.",
}
CHAT_PAGES = 12


@pytest.fixture
def chat_downloads(tmp_path, monkeypatch):
    """GNOME help pages of a dozen numbered paragraphs in six languages and English (the ones of a page together
    longer than any passage budget), a German page of untranslated English, and Go code; a quarter held out."""
    monkeypatch.setattr(building, "TEST_PER_MILLE", 250)
    downloads = tmp_path / "data" / "downloads"
    downloads.mkdir(parents=True)
    pages = {}
    for locale, sentence in CHAT_SENTENCES.items():
        for page in range(CHAT_PAGES):
            paragraphs = "".join(f"<p>{sentence.format(f'{page}.{n}')}</p>" for n in range(12))
            pages[f"usr/share/help/{locale}/gnome-help/page{page}.page"] = (
                f"<page><title>{page}</title>{paragraphs}</page>"
            )
    english = "".join(
        f"<p>Note {n}: the settings of the printer and of the network are in this panel.</p>" for n in range(9)
    )
    pages["usr/share/help/de/gnome-help/untranslated.page"] = f"<page>{english}</page>"
    fake_deb(downloads, "gnome-user-docs", pages)
    fake_deb(downloads, "golang-1.19-src", {"usr/share/go-1.19/src/fmt/print.go": "package fmt\n\nfunc Print() {}\n"})
    return downloads


def chat_sources():
    return {
        "gnome-help": Source(multilingual.gnome_help, 1_000_000, ("gnome-user-docs",)),
        "go-stdlib": Source(
            building.code("golang-1.19-src", "usr/share/go-1.19/src/**/*.go", "go"), 10_000, ("golang-1.19-src",)
        ),
    }


def split_rows(directory):
    return {split: pq.read_table(directory / f"{split}.parquet").to_pylist() for split in ("train", "test")}


def test_leading_paragraphs_fit_the_budget_and_end_at_a_blank_line():
    text = "Title\n\nFirst paragraph.\n\nSecond one, longer.\n\nThird."
    assert multilingual_chat.leading_paragraphs(text, 30) == "Title\n\nFirst paragraph."
    assert multilingual_chat.leading_paragraphs(text, 1000) == text
    assert multilingual_chat.leading_paragraphs(text, 4) == ""  # the first paragraph alone is too long
    for lang, language in multilingual_chat.CHAT_LANGUAGES.items():
        assert len(language.instructions) == len(multilingual_chat.CHAT_TASKS) and len(set(language.instructions)) == 5
        assert language_group(lang) in ("latin", "cyrillic", "cjk", "other-scripts")
        assert multilingual_chat.chat_language_of(lang) == lang
    tags = ("pt-BR", "zh-HK", "sr@latin", "en")
    assert [multilingual_chat.chat_language_of(tag) for tag in tags] == ["pt", None, None, None]


def test_the_chat_templates_file_holds_the_templates_data_py_held():
    """`trainers/chat_templates.json` gives back `CHAT_LANGUAGES` as it was written in `data.py` before it moved to
    the file: the same languages in the same order, scripts and instructions (hashed then), and the same
    `templates_sha256` in the corpus manifest."""
    languages = multilingual_chat.CHAT_LANGUAGES
    written = {lang: [sorted(language.scripts), list(language.instructions)] for lang, language in languages.items()}
    digest = hashlib.sha256(json.dumps(written, ensure_ascii=False).encode()).hexdigest()
    assert digest == "26b9a2c5b0c2ced8c3442110acd5ccd48bf9fa5e06ae2763ba3a291906a59784"
    manifest = json.dumps({lang: language.instructions for lang, language in languages.items()})
    assert hashlib.sha256(manifest.encode()).hexdigest() == (
        "2c477e3cb09e9d8fb031903757ab83ce2d712d614d6000e398023e9c89e30ce2"
    )
    assert all(isinstance(language.instructions, tuple) for language in languages.values())


def test_a_passage_held_out_is_never_trained_on():
    text = "Titel\n\n" + "Der Drucker ist über das Netzwerk mit dem Rechner im Büro verbunden. " * 4
    chunk = {"text": text, "source": "s", "lang": "de", "group": "latin"}
    other = {**chunk, "text": text.replace("Drucker", "Scanner")}
    splits, stats = multilingual_chat.multilingual_chat_records({"train": [chunk, other], "test": [chunk]}, 10, 10)
    assert [row["messages"][0]["content"].endswith(text.strip()) for row in splits["test"]] == [True]
    assert [row["messages"][0]["content"].endswith(other["text"].strip()) for row in splits["train"]] == [True]
    assert stats["dropped_passages"] == {"de": {"also held out": 1}}


def test_multilingual_chat_asks_in_the_passage_language_and_follows_the_source_split(tmp_path, chat_downloads):
    directory = multilingual_chat.prepare_multilingual_chat(tmp_path, sources=chat_sources())
    source = split_rows(tmp_path / "data" / "multilingual")
    chat = split_rows(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert chat["train"] and chat["test"], "the fixture holds out a quarter of the chunks"
    cut = 0
    for split, rows in chat.items():
        for row in rows:
            language = multilingual_chat.CHAT_LANGUAGES[row["lang"]]
            instruction = language.instruction(row["task"])
            (message,) = row["messages"]
            assert message["role"] == "user" and message["content"].startswith(instruction + "\n\n")
            passage = message["content"][len(instruction) + 2 :]
            assert len(passage) <= multilingual_chat.chat_passage_characters(row["lang"])
            # The chunk it was cut from: in the same split, in a language whose templates it was asked with.
            (chunk,) = [
                (chunk_split, chunk)
                for chunk_split, chunks in source.items()
                for chunk in chunks
                if chunk["text"] == passage or chunk["text"].startswith(passage + "\n\n")
            ]
            assert chunk[0] == split
            assert multilingual_chat.chat_language_of(chunk[1]["lang"]) == row["lang"]
            assert row["group"] == chunk[1]["group"] and row["source"] == chunk[1]["source"] == "gnome-help"
            assert row["id"].startswith(row["lang"] + "/") and row["task"] in multilingual_chat.CHAT_TASKS
            cut += chunk[1]["text"] != passage
    assert cut == sum(map(len, chat.values()))  # every page is longer than its budget: cut at a paragraph boundary
    rows = chat["train"] + chat["test"]
    assert {row["lang"] for row in rows} == {"de", "pt", "ru", "ja", "ar"}  # not English, Esperanto (no templates), Go
    assert {row["group"] for row in rows} == {"latin", "cyrillic", "cjk", "other-scripts"}
    assert len({row["task"] for row in rows}) > 1 and len({row["id"] for row in rows}) == len(rows)
    assert not any("Note" in row["messages"][0]["content"] for row in rows)  # the untranslated English page
    assert manifest["dropped_passages"]["de"]["English"] == 1
    assert manifest["chunks_without_templates"] == {"eo": CHAT_PAGES}
    for lang, entry in manifest["languages"].items():
        assert entry["train"] == sum(row["lang"] == lang for row in chat["train"]) == entry["train_candidates"]
    assert sum(group["train"] + group["test"] for group in manifest["groups"].values()) == len(rows)
    assert manifest["splits"] == {split: len(rows) for split, rows in chat.items()}

    # Capped per language, deterministically; the caps of a built corpus are not silently changed.
    first = [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")]
    capped = multilingual_chat.prepare_multilingual_chat(
        tmp_path, force=True, max_per_language=3, max_test_per_language=1
    )
    capped = split_rows(capped)
    for split, cap in (("train", 3), ("test", 1)):
        counts = Counter(row["lang"] for row in capped[split])
        assert max(counts.values()) == cap and set(counts) == {row["lang"] for row in chat[split]}
        assert {row["id"] for row in capped[split]} <= {row["id"] for row in chat[split]}
    with pytest.raises(ValueError, match="other caps"):
        multilingual_chat.prepare_multilingual_chat(tmp_path, max_per_language=5)
    multilingual_chat.prepare_multilingual_chat(tmp_path, force=True)
    assert [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")] == first


def test_multilingual_chat_without_non_english_prose_is_a_clear_error(tmp_path, downloads):
    english_and_code = {
        "docs": Source(lambda _: iter([("en", "a", "Some text."), ("go", "b.go", "package b")]), 99, ())
    }
    with pytest.raises(ValueError, match="no non-English prose.*only English and code"):
        multilingual_chat.prepare_multilingual_chat(tmp_path / "one", sources=english_and_code)
    # Japanese, Russian and Arabic text, but no passage to ask about: titles alone, one overlong paragraph.
    with pytest.raises(ValueError, match=r"no non-English prose.*\(its non-English languages: ar, ja, ru\)"):
        multilingual_chat.prepare_multilingual_chat(tmp_path, sources=tiny_sources())


def test_multilingual_chat_bench_suite_is_the_held_out_split_by_language_group(tmp_path, chat_downloads, monkeypatch):
    from osprey.cli import main
    from osprey.measuring import bench_suites
    from osprey.measuring.bench_suites import load_suite, select_subset

    # Missing, the corpus is built by `osprey data multilingual-chat`, run here in-process on the fixture's sources.
    monkeypatch.setattr(multilingual, "MULTILINGUAL_SOURCES", chat_sources())
    commands = []

    def run_osprey(command, **kwargs):
        commands.append(command)
        assert command[1:3] == ["-m", "osprey.cli"]
        return subprocess.CompletedProcess(command, main(command[3:]), "", "")

    monkeypatch.setattr(bench_suites.subprocess, "run", run_osprey)
    prompts = load_suite("multilingual_chat", cache_dir=tmp_path)
    assert commands == [[sys.executable, "-m", "osprey.cli", "data", "multilingual-chat", "--cache-dir", str(tmp_path)]]
    held_out = split_rows(tmp_path / "data" / "multilingual-chat")["test"]
    assert [(p.suite, p.category, p.prompt_id, p.text) for p in prompts] == [
        ("multilingual_chat", row["group"], row["id"], row["messages"][0]["content"]) for row in held_out
    ]
    assert load_suite("multilingual_chat", cache_dir=tmp_path) == prompts and len(commands) == 1  # built once
    one_each = select_subset(prompts, 1, seed=0)
    assert sorted(p.category for p in one_each) == sorted({row["group"] for row in held_out})


def test_cli_data_multilingual_chat_takes_its_caps_and_refuses_them_elsewhere(
    tmp_path, chat_downloads, monkeypatch, capsys
):
    from osprey.cli import main

    monkeypatch.setattr(multilingual, "MULTILINGUAL_SOURCES", chat_sources())
    assert main(["data", "multilingual-chat", "--cache-dir", str(tmp_path), "--max-per-language", "2"]) == 0
    manifest = json.loads((tmp_path / "data" / "multilingual-chat" / "manifest.json").read_text())
    assert manifest["max_per_language"] == 2 and max(entry["train"] for entry in manifest["languages"].values()) == 2
    assert main(["data", "multilingual-chat", "--cache-dir", str(tmp_path), "--max-per-language", "3"]) == 2
    assert "other caps" in capsys.readouterr().err
    assert main(["data", "general", "--cache-dir", str(tmp_path), "--max-test-per-language", "1"]) == 2
    assert "multilingual-chat corpus only" in capsys.readouterr().err


def test_each_corpus_name_has_a_builder_and_a_folder(tmp_path):
    from osprey.ground import CORPUS_NAMES, corpus_dir

    assert tuple(loading.CORPORA) == CORPUS_NAMES
    assert loading.CORPORA["multilingual-chat"] is multilingual_chat.prepare_multilingual_chat
    assert corpus_dir("multilingual-chat", tmp_path) == tmp_path / "data" / "multilingual-chat"
    with pytest.raises(ValueError, match="Unknown corpus 'chat'"):
        corpus_dir("chat", tmp_path)
