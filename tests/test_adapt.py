"""`osprey adapt`: one resumable command from a backbone to a drafter (tiny models, no evaluation), and the shipped
pretrained backbone as a zoo product with its card."""

import argparse
import json

import pytest
import torch
from conftest import make_tiny_target
from test_convert import tiny_backbone
from test_trainers import char_tokenizer

from osprey import zoo
from osprey.cli import main as osprey_main
from osprey.demo import DECODING_NAME, demo_choice
from osprey.model_card import backbone_card
from osprey.pack import load_drafter
from trainers import adapt as adapt_module
from trainers.adapt import AdaptRun, AdaptSettings, adapt, parse_amount, parse_minutes


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny target and a tiny Qwen2 backbone sharing a character tokenizer with a chat template, and a JSONL file
    of prompts."""
    root = tmp_path_factory.mktemp("adapt")
    tokenizer = char_tokenizer()
    # wider than the backbone: an engine may swap in a target embedding of the drafter's own width (`osprey export`)
    target = make_tiny_target("llama", vocab_size=len(tokenizer), hidden_size=96)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_backbone("qwen2", len(tokenizer)).save_pretrained(root / "backbone")
    tokenizer.save_pretrained(root / "backbone")
    prompts = ["hi", "tell me a story", "2+2?", "why is the sky blue", "name a colour", "count to five"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return root


def _settings(root, **overrides) -> AdaptSettings:
    values = dict(
        target=str(root / "target"),
        backbone=str(root / "backbone"),
        prompts=(str(root / "prompts.jsonl"),),
        num_prompts=5,
        max_answer_tokens=8,
        draft_vocab_size=None,
        token_passes=300,
        dtype="float32",
        evaluate=False,
    )
    return AdaptSettings(**(values | overrides))


def test_adapt_makes_a_drafter_then_a_rerun_skips_every_stage_and_other_settings_are_refused(
    tiny_models, tmp_path, monkeypatch
):
    output = tmp_path / "run"
    state = adapt(output, _settings(tiny_models, export="vllm"))
    stages = state["stages"]
    assert all(stages[name]["done"] for name in ("answers", "drafter-init", "features", "distill", "drafter", "export"))
    assert {"config.json", "model.safetensors"} <= {path.name for path in (output / "export").iterdir()}
    assert stages["answers"]["answers"] == 5 and stages["distill"]["steps"] >= 1
    drafter = load_drafter(output / "drafter")
    assert drafter.config.target_name_or_path == str(tiny_models / "target")
    # the recorded decoding shape is what `osprey demo --drafter` decodes with
    recorded = json.loads((output / "drafter" / DECODING_NAME).read_text())
    choice = demo_choice(output / "drafter")
    assert choice.dtype == recorded["dtype"] == "float32" and choice.settings["draft_topk"] == recorded["draft_topk"]
    trained = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    init = load_drafter(output / "drafter-init").state_dict()
    assert any(not torch.equal(trained[name], init[name]) for name in trained)

    def must_not_run(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    for name in ("write_answers", "convert_backbone", "build_features", "distill_drafter", "finish_drafter"):
        monkeypatch.setattr(adapt_module, name, must_not_run)
    monkeypatch.setattr(adapt_module, "export_stage", must_not_run)
    assert adapt(output, _settings(tiny_models, export="vllm"))["stages"] == stages
    with pytest.raises(ValueError, match="token_passes: 300 there, 600 asked"):
        adapt(output, **vars(_settings(tiny_models, token_passes=600)))


def test_a_budget_in_minutes_ends_distillation_at_its_deadline(tiny_models, tmp_path):
    state = adapt(tmp_path / "run", _settings(tiny_models, token_passes=None, budget_minutes=1e-6))
    assert state["stages"]["distill"]["steps"] == 1  # the deadline has passed at the first step's end
    assert load_drafter(tmp_path / "run" / "drafter") is not None


def test_a_stopped_stage_keeps_its_time_and_runs_again(tmp_path):
    run = AdaptRun(tmp_path / "run", AdaptSettings(target="t"))
    calls = []

    def stopped():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.run("answers", 1, stopped)
    assert not run.done("answers") and run.state["stages"]["answers"]["minutes"] >= 0
    assert run.run("answers", 1, lambda: {"answers": 3})["answers"] == 3
    reopened = AdaptRun(tmp_path / "run", AdaptSettings(target="t"))
    assert reopened.done("answers") and reopened.run("answers", 1, stopped)["answers"] == 3 and len(calls) == 1


def test_adapt_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and was not made by `osprey adapt`"):
        AdaptRun(tmp_path, AdaptSettings(target="t"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_budgets_parse_and_bad_ones_name_the_format(capsys):
    assert parse_amount("80k") == 80_000 and parse_amount("1.5M") == 1_500_000 and parse_amount("800") == 800
    assert parse_minutes("20min") == 20 and parse_minutes("1.5h") == 90 and parse_minutes("45") == 45
    with pytest.raises(argparse.ArgumentTypeError, match="such as 80k"):
        parse_amount("lots")
    with pytest.raises(SystemExit):
        osprey_main(["adapt", "--target", "t", "--output", "o", "--token-passes", "1k", "--budget", "5min"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_shipped_backbone_is_a_zoo_name_with_a_card():
    name = zoo.DEFAULT_BACKBONE
    assert zoo.is_zoo_name(name) and zoo.get_zoo_model(name) is zoo.BACKBONES[name]
    backbone = zoo.BACKBONES[name]
    facts = backbone.facts
    assert facts["parent"] in zoo.ZOO and (backbone.pack_dir / "osprey_pack.json").is_file()
    assert sum(path.stat().st_size for path in backbone.pack_dir.iterdir()) <= 50 * 2**20  # packed against the parent
    card = str(backbone_card(backbone.pack_dir, f"osprey/{name}"))  # the pack holds the config and the facts
    assert "base_model: Qwen/Qwen2.5-Coder-0.5B-Instruct" in card and "license: apache-2.0" in card
    perplexity = facts["held_out_perplexity"]
    for group in perplexity["groups"]:  # every language group's perplexity, parent / pruned / backbone
        assert f"| {group} | {perplexity['parent'][group]:.1f} |" in card
        assert f"| {perplexity['backbone'][group]:.1f} |" in card
    with pytest.raises(ValueError, match="Did you mean 'osprey-backbone-qwen2.5-0.5b-2l'"):
        zoo.get_zoo_model("osprey-backbone-qwen2.5-0.5b")
