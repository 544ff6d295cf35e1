"""The `multilingual` corpus (`osprey data multilingual`), on small synthetic stand-ins for the Debian packages."""

import gzip
import hashlib
import json

import pyarrow.parquet as pq
import pytest
from test_data_prep import fake_deb
from test_vocab_alignment import byte_level_tokenizer

from trainers import data as multilingual
from trainers.data import (
    Source,
    block_texts,
    fortune_texts,
    group_counts,
    language_group,
    normalize_lang,
    prepare_multilingual,
    roff_text,
)


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
        "go-stdlib": Source(multilingual.code("golang-1.19-src", "usr/share/go-1.19/src/**/*.go", "go", ("_test.go",)),
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
