"""`osprey adapt`: one resumable command from a backbone to a drafter (tiny models), its checks of bad input before
anything is written, its lossless gate before anything leaves the folder, a base-model target of another tokenizer
family, and the shipped pretrained backbone as a zoo product with its card."""

import argparse
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_target
from test_convert import tiny_backbone
from test_trainers import char_tokenizer

from osprey.cli import main as osprey_main
from osprey.measuring.demo import DECODING_NAME, demo_choice
from osprey.models import zoo
from osprey.models.model_card import backbone_card, drafter_card
from osprey.models.pack import load_drafter
from trainers import adapt as adapt_module
from trainers.adapt import AdaptRun, AdaptSettings, adapt, parse_amount, parse_minutes
from trainers.corpora import regenerate


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
    held_out = ["say hello", "what is a cat", "add 3 and 4"]
    (root / "held-out.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in held_out))
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
    state = adapt(output, _exporting(tiny_models))
    stages = state["stages"]
    assert all(stages[name]["done"] for name in ("answers", "drafter-init", "features", "distill", "drafter", "export"))
    assert {"config.json", "model.safetensors"} <= {path.name for path in (output / "export" / "vllm").iterdir()}
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
    monkeypatch.setattr(adapt_module, "evaluate_drafter", must_not_run)
    assert adapt(output, _exporting(tiny_models))["stages"] == stages
    with pytest.raises(ValueError, match="token_passes: 300 there, 600 asked"):
        adapt(output, **vars(_settings(tiny_models, token_passes=600)))
    with pytest.raises(ValueError, match="answer_batch_size: 32 there, 2 asked"):  # batching changes the answers
        adapt(output, _settings(tiny_models, answer_batch_size=2))
    # a rerun asking for another export runs that one (here: refused, an engine's EAGLE-3 layer differs from
    # Osprey's first block), and keeps the first
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot be exported as speculators"):
        adapt(output, _exporting(tiny_models, export="speculators"))
    assert set(json.loads((output / "adapt.json").read_text())["stages"]["export"]["formats"]) == {"vllm"}
    assert (output / "export" / "vllm" / "config.json").is_file()


def test_adapt_evaluates_and_only_a_drafter_that_passes_the_lossless_check_is_exported_or_pushed(
    tiny_models, tmp_path, monkeypatch
):
    pushed = []
    monkeypatch.setattr(
        "osprey.models.hub.push_drafter_folder",
        lambda *args, **kwargs: pushed.append(args) or SimpleNamespace(repo_url="u"),
    )
    settings = _settings(
        tiny_models,
        evaluate=True,
        eval_prompts=(str(tiny_models / "held-out.jsonl"),),
        held_out_tokens=8,
        export="vllm",
        push_to_hub="me/drafter",
    )
    # the same drafter twice: once as it is, once with the check made to fail
    output, failing = tmp_path / "run", tmp_path / "failing"
    partial = adapt(output, _replace(settings, evaluate=False, export=None, push_to_hub=None))
    assert "evaluate" not in partial["stages"]
    shutil.copytree(output, failing)

    state = adapt(output, settings)
    evaluation = state["stages"]["evaluate"]
    assert evaluation["outputs_checked"] and evaluation["format"] == "chat" and evaluation["left_out"] == []
    assert evaluation["tau"]["held-out"] >= 1.0 and evaluation["speedup"] > 0
    card = (output / "drafter" / "README.md").read_text()
    assert "the target answered 5 chat openings" in card and "| osprey | held-out |" in card
    assert (output / "export" / "vllm" / "config.json").is_file() and len(pushed) == 1

    monkeypatch.setattr(
        "osprey.measuring.bench_report.exit_status", lambda results: 1
    )  # a decoding that is not lossless
    with pytest.raises(RuntimeError, match="nothing was exported or published"):
        adapt(failing, settings)
    assert not (failing / "export").exists() and len(pushed) == 1
    assert json.loads((failing / "adapt.json").read_text())["stages"]["evaluate"]["outputs_checked"] is False


def _exporting(root, **overrides) -> AdaptSettings:
    """Settings that export, hence evaluate first: a short evaluation on the tiny held-out prompts."""
    values = dict(evaluate=True, eval_prompts=(str(root / "held-out.jsonl"),), held_out_tokens=8, export="vllm")
    return _settings(root, **(values | overrides))


def _replace(settings: AdaptSettings, **changes) -> AdaptSettings:
    return AdaptSettings(**(vars(settings) | changes))


def test_bad_input_is_refused_in_one_line_before_anything_is_written(tiny_models, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # the Hub unreachable, at once
    output = tmp_path / "run"
    cases = [
        (dict(target="someone/no-such-model"), "--target .*Hub did not give its config .*hf auth login"),
        (dict(target="qwen2.5-coder-1.5b-instrukt"), "--target .* Did you mean 'qwen2.5-coder-1.5b-instruct'"),
        (dict(target=str(tmp_path)), "--target .*no config.json"),
        (dict(backbone="osprey-backbone-qwen2.5-0.5b"), "--backbone .* Did you mean"),
        (dict(prompts=(str(tmp_path / "missing.jsonl"),)), "--prompts .*no such file or folder"),
        (dict(token_passes=0), "--token-passes must be positive, got 0"),
        (dict(num_prompts=-1), "--num-prompts must be positive"),
        (dict(token_passes=None, budget_minutes=0.0), "--budget must be positive"),
        (dict(max_answer_tokens=0), "--max-new-tokens must be positive"),
        (dict(export="vllm"), "--export and --push-to-hub wait for the evaluation's lossless check"),
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases.append((dict(prompts=(str(empty),)), "--prompts .*empty.jsonl: the file is empty"))
    cases.append((dict(eval_prompts=(str(empty),)), "--eval-prompts .*empty.jsonl: it holds no prompts"))
    cases.append((dict(eval_prompts=(str(tmp_path / "none.jsonl"),)), "--eval-prompts .*none.jsonl.* neither a suite"))
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            adapt(output, _settings(tiny_models, **change))
        assert not output.exists()
    # the CLI says it in one line, naming the flag, and `--token-passes 0` is not read as the default
    argv = ["adapt", "--target", str(tiny_models / "target"), "--output", str(output), "--token-passes", "0"]
    assert osprey_main(argv) == 2
    assert "osprey adapt: error: --token-passes must be positive, got 0." in capsys.readouterr().err
    assert not output.exists()


def test_a_stage_stopped_midway_is_resumed_by_adapt(tiny_models, tmp_path, monkeypatch):
    output = tmp_path / "run"
    settings = _settings(tiny_models, answer_batch_size=2)
    stream = regenerate.tqdm

    def stopped_after_one_batch(batches, **kwargs):
        for index, batch in enumerate(stream(batches, **kwargs)):
            if index == 1:
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(regenerate, "tqdm", stopped_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        adapt(output, settings)
    part = next((output / "answers").glob("0-*.jsonl"))
    first = part.read_text().splitlines()
    assert len(first) == 2 and not AdaptRun(output, settings).done("answers")

    monkeypatch.undo()
    answered = []
    generate = regenerate.regenerate_split

    def counting(target, tokenizer, records, path, arguments, limit):
        written = generate(target, tokenizer, records, path, arguments, limit)
        answered.append(written)
        return written

    monkeypatch.setattr(regenerate, "regenerate_split", counting)
    state = adapt(output, settings)
    assert answered == [3]  # only the openings the stopped run had not answered
    assert part.read_text().splitlines()[:2] == first and state["stages"]["answers"]["answers"] == 5
    assert state["stages"]["drafter"]["done"] and load_drafter(output / "drafter") is not None


def _bpe_tokenizer(texts):
    """A byte-level BPE tokenizer trained on `texts`, with no chat template: another family than the backbone's
    character tokenizer, as a base model ships it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def test_a_base_model_of_another_tokenizer_family_is_adapted_on_plain_text(tiny_models, tmp_path):
    prompts = [json.loads(line)["prompt"] for line in (tiny_models / "prompts.jsonl").read_text().splitlines()]
    tokenizer = _bpe_tokenizer(prompts * 20 + ["the quick brown fox jumps over the lazy dog"] * 20)
    assert tokenizer.chat_template is None
    target = make_tiny_target("gemma3", vocab_size=len(tokenizer), hidden_size=64)
    target.save_pretrained(tmp_path / "base")  # a local directory in no zoo, as `save_pretrained` writes it
    tokenizer.save_pretrained(tmp_path / "base")
    output = tmp_path / "run"
    settings = _settings(
        tiny_models,
        target=str(tmp_path / "base"),
        evaluate=True,
        eval_prompts=(str(tiny_models / "held-out.jsonl"),),
        held_out_tokens=8,
    )
    state = adapt(output, settings)
    assert state["stages"]["answers"]["format"] == "text" and state["stages"]["evaluate"]["format"] == "text"
    record = json.loads((output / "answers" / "train.jsonl").read_text().splitlines()[0])
    assert "messages" not in record and record["text"] == record["prompt"] + record["answer"]
    assert record["prompt"] in prompts
    assert json.loads((output / "drafter" / DECODING_NAME).read_text())["chat_template"] is False
    assert demo_choice(output / "drafter").settings["chat_template"] is False
    assert state["stages"]["evaluate"]["outputs_checked"]
    card = (output / "drafter" / "README.md").read_text()
    assert "no chat template, so it continued 5 plain-text" in card
    assert 'tokenizer("Speculative decoding is"' in card  # its usage prompts it as plain text


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


def test_a_drafter_adapted_for_one_target_is_adapted_again_for_its_update(tiny_models, tmp_path):
    first = adapt(tmp_path / "v1", _settings(tiny_models))
    assert first["stages"]["drafter"]["done"]
    parent = tmp_path / "v1" / "drafter"
    # the update: the same architecture and tokenizer, other weights (a fine-tune)
    tokenizer = char_tokenizer()
    make_tiny_target("llama", seed=1, vocab_size=len(tokenizer), hidden_size=96).save_pretrained(tmp_path / "v2")
    tokenizer.save_pretrained(tmp_path / "v2")
    output = tmp_path / "v2-run"
    state = adapt(output, _settings(tiny_models, target=str(tmp_path / "v2"), from_drafter=str(parent)))
    assert state["settings"]["from_drafter"] == str(parent) and state["stages"]["drafter-init"]["parent"] == str(parent)
    init, old = load_drafter(output / "drafter-init"), load_drafter(parent)
    assert init.config.target_name_or_path == str(tmp_path / "v2")
    assert init.config.target_layer_ids == old.config.target_layer_ids
    assert all(torch.equal(tensor, old.state_dict()[name]) for name, tensor in init.state_dict().items())
    adaptation = json.loads((output / "drafter" / "osprey_adaptation.json").read_text())
    assert adaptation["parent"] == str(parent)
    card = str(drafter_card(output / "drafter", "me/drafter-v2"))
    assert f"from the drafter `{parent}`, made for an earlier\nversion of the target" in card

    # what V1's drafter cannot serve is refused, naming why, before anything is written
    refused = tmp_path / "refused"
    for name, model, message in [
        ("wider", make_tiny_target("llama", vocab_size=len(tokenizer), hidden_size=128), "hidden_size 128"),
        ("deeper", make_tiny_target("llama", vocab_size=len(tokenizer), hidden_size=96, num_hidden_layers=12),
         "another layer count"),
    ]:  # fmt: skip
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        with pytest.raises(ValueError, match=message):
            adapt(refused, _settings(tiny_models, target=str(tmp_path / name), from_drafter=str(parent)))
        assert not refused.exists()
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tmp_path / "v2", other)
    swapped = char_tokenizer()
    swapped.add_tokens(["<tool>"])  # one more token: an id the drafter would read as other text
    (other / "tokenizer.json").unlink()
    swapped.save_pretrained(other)
    with pytest.raises(ValueError, match="tokenizer, and .* differs"):
        adapt(refused, _settings(tiny_models, target=str(other), from_drafter=str(parent)))
    assert not refused.exists()
