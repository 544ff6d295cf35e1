"""Stage 3 conversion: the drafter computes exactly what its backbone computes on directly mapped tokens, whatever the
target features, for Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm) backbones; plus the saved artefacts, the reduced
draft vocabulary, the CLI and the errors users hit. One test converts the real SmolLM2 (zoo download, `network`)."""

import argparse
import json

import pytest
import torch
from test_vocab_alignment import byte_level_tokenizer, metaspace_tokenizer
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from osprey import OspreyForDrafting
from osprey.models import zoo
from osprey.models.pack import load_drafter, pack_drafter
from osprey.stages import convert as convert_module
from osprey.stages.convert import convert
from osprey.stages.prune import prune
from osprey.stages.vocab_alignment import align_vocabularies

BACKBONES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
HIDDEN = 64


def tiny_backbone(family: str, vocab_size: int, **overrides):
    config_class, model_class = BACKBONES[family]
    values = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    values.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**values)).eval()
    with torch.no_grad():  # norms and biases start at 1 / 0; perturb them so that copying them is really tested
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def tiny_target_config(hidden_size: int = 48, extra_rows: int = 3, **overrides):
    """A Gemma3 target: only its config and tokenizer are needed, never its weights."""
    values = dict(
        vocab_size=len(metaspace_tokenizer()) + extra_rows,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    values.update(overrides)
    return Gemma3TextConfig(**values)


def convert_tiny(family="llama", target_hidden_size=48, tie_word_embeddings=False, **kwargs):
    source, target = byte_level_tokenizer(), metaspace_tokenizer()
    backbone = tiny_backbone(family, len(source), tie_word_embeddings=tie_word_embeddings)
    drafter, report = convert(
        backbone, tiny_target_config(target_hidden_size), backbone_tokenizer=source, target_tokenizer=target, **kwargs
    )
    return backbone, drafter, report, align_vocabularies(source, target, drafter.config.vocab_size)


def direct_pairs(alignment) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids that map directly and the backbone ids they map to."""
    direct = [index for index, kind in enumerate(alignment.kinds) if kind == "direct"]
    return torch.tensor(direct), torch.tensor([alignment.source_ids[index][0] for index in direct])


def direct_sequences(target_ids, source_ids, batch_size=2, seq_len=12):
    picks = torch.randint(0, len(target_ids), (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return target_ids[picks], source_ids[picks]


@torch.no_grad()
@pytest.mark.parametrize("family, tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)])
def test_drafter_computes_the_backbone_for_any_target_features(family, tied):
    backbone, drafter, _, alignment = convert_tiny(family, tie_word_embeddings=tied)
    assert not drafter.config.tie_word_embeddings
    target_ids, source_ids = direct_pairs(alignment)
    assert len(target_ids) > 30
    target_inputs, source_inputs = direct_sequences(target_ids, source_ids)
    features = torch.randn(*target_inputs.shape, drafter.config.fused_feature_size) * 10
    expected = backbone(source_inputs).logits[..., source_ids]
    actual = drafter(target_inputs, target_hidden_states=features).logits[..., target_ids]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # It holds because the feature half of q/k/v starts at zero: any weight there lets the features in.
    drafter.model.layers[0].self_attn.k_proj.weight[:, :HIDDEN].normal_()
    perturbed = drafter(target_inputs, target_hidden_states=features).logits[..., target_ids]
    assert not torch.allclose(perturbed, expected, atol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("target_hidden_size", [48, HIDDEN, 96])
def test_fc_passes_the_deepest_tap_through(target_hidden_size):
    _, drafter, _, _ = convert_tiny(target_hidden_size=target_hidden_size, target_layer_ids=[1, 3, 4])
    taps = torch.randn(2, 5, 3, target_hidden_size)
    projected = drafter.model.fc(taps.flatten(-2))
    width = min(HIDDEN, target_hidden_size)
    assert torch.equal(projected[..., :width], taps[..., 2, :width])
    assert not projected[..., width:].any()


@torch.no_grad()
def test_weights_follow_the_conversion_rules():
    backbone, drafter, report, alignment = convert_tiny("qwen2")
    source_state, state = backbone.state_dict(), drafter.state_dict()
    q_proj, source_q_proj = (weights["model.layers.0.self_attn.q_proj.weight"] for weights in (state, source_state))
    assert not q_proj[:, :HIDDEN].any() and torch.equal(q_proj[:, HIDDEN:], source_q_proj)
    hidden_norm = state["model.layers.0.hidden_norm.weight"]
    assert torch.equal(hidden_norm, source_state["model.layers.0.input_layernorm.weight"])
    for name in ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.equal(state[name], source_state[name])
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        torch.testing.assert_close(state[name], alignment.project(source_state[name]))
    assert not drafter.config.tie_word_embeddings and drafter.config.attention_bias and not drafter.config.use_qk_norm
    assert (drafter.config.vocab_size, drafter.config.target_layer_ids) == (len(metaspace_tokenizer()) + 3, [1, 3, 4])
    assert (drafter.config.eos_token_id, drafter.config.bos_token_id, drafter.config.pad_token_id) == (1, 2, 0)
    assert drafter.generation_config.num_assistant_tokens == 5
    assert report["alignment"]["counts"] == alignment.counts()


@torch.no_grad()
def test_reduced_draft_vocabulary_keeps_function_preservation(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" hello hello world the\nhello" * 5)
    backbone, drafter, report, alignment = convert_tiny(draft_vocab_size=12, corpus=[corpus])
    assert drafter.lm_head.weight.shape == (12, HIDDEN) and drafter.config.draft_vocab_size == 12
    draft_to_target = drafter.draft_to_target.tolist()
    assert report["draft_vocab"]["corpus_coverage"] == 1.0 and draft_to_target == sorted(draft_to_target)
    draft_direct = [j for j, index in enumerate(draft_to_target) if alignment.kinds[index] == "direct"]
    assert len(draft_direct) >= 3
    target_ids, source_ids = direct_pairs(alignment)
    target_inputs, source_inputs = direct_sequences(target_ids, source_ids)
    features = torch.randn(*target_inputs.shape, drafter.config.fused_feature_size)
    logits = drafter(target_inputs, target_hidden_states=features).logits
    expected = backbone(source_inputs).logits
    for j in draft_direct:
        torch.testing.assert_close(logits[..., j], expected[..., alignment.source_ids[draft_to_target[j]][0]])


def _save_backbone_and_target(tmp_path, family="qwen3"):
    backbone_dir, target_dir = tmp_path / "backbone", tmp_path / "target"
    source = byte_level_tokenizer()
    tiny_backbone(family, len(source)).save_pretrained(backbone_dir)
    source.save_pretrained(backbone_dir)
    tiny_target_config().save_pretrained(target_dir)  # config and tokenizer only: no target weights
    metaspace_tokenizer().save_pretrained(target_dir)
    return backbone_dir, target_dir


def test_converted_drafter_is_saved_with_everything_needed(tmp_path):
    backbone_dir, target_dir = _save_backbone_and_target(tmp_path)
    output = tmp_path / "drafter"
    drafter, report = convert(backbone_dir, target_dir, output_dir=output)
    expected_files = {"config.json", "model.safetensors", "generation_config.json", "alignment_report.json"}
    assert expected_files | {"tokenizer.json"} <= {path.name for path in output.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(output)
    assert isinstance(reloaded, OspreyForDrafting) and reloaded.config.use_qk_norm
    assert all(torch.equal(tensor, reloaded.state_dict()[name]) for name, tensor in drafter.state_dict().items())
    assert reloaded.generation_config.num_assistant_tokens == 5
    assert reloaded.config.target_name_or_path == str(target_dir)  # the target as it was named, for demos and checks
    assert json.loads((output / "alignment_report.json").read_text()) == json.loads(json.dumps(report))
    assert report["target_model_type"] == "gemma3_text" and report["backbone_model_type"] == "qwen3"
    with pytest.raises(ValueError, match="not an empty directory"):
        convert(backbone_dir, target_dir, output_dir=output)


def _cli(arguments):
    parser = argparse.ArgumentParser()
    convert_module.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["convert", *arguments])
    return args.run(args)


def test_cli_converts_with_taps_and_a_reduced_vocabulary(tmp_path, capsys):
    backbone_dir, target_dir = _save_backbone_and_target(tmp_path, family="llama")
    (tmp_path / "corpus.txt").write_text(" hello world\n" * 3)
    output = tmp_path / "drafter"
    arguments = ["--backbone", str(backbone_dir), "--target", str(target_dir), "--output", str(output)]
    corpus = str(tmp_path / "corpus.txt")
    extra = ["--target-layers", "2,5,6", "--draft-vocab-size", "16", "--draft-vocab-corpus", corpus]
    assert _cli(arguments + extra) == 0
    printed = capsys.readouterr().out
    assert "direct" in printed and "<eos> -> <|im_end|>" in printed and "16 tokens cover 100.00%" in printed
    config = json.loads((output / "config.json").read_text())
    assert config["target_layer_ids"] == [2, 5, 6] and config["draft_vocab_size"] == 16
    with pytest.raises(SystemExit):
        _cli(arguments + ["--target-layers", "1,x"])


def test_the_draft_vocabulary_can_be_taken_from_another_drafter(tmp_path, capsys):
    """A second backbone converted with `--draft-vocab-from` predicts exactly the first drafter's target tokens, also
    from its packed form, whatever another corpus would count; bad combinations are refused."""
    backbone_dir, target_dir = _save_backbone_and_target(tmp_path, family="llama")
    (tmp_path / "corpus.txt").write_text(" hello world\n" * 3)
    (tmp_path / "other.txt").write_text(" the cat sat on a mat, said the dog\n" * 3)
    arguments = ["--backbone", str(backbone_dir), "--target", str(target_dir)]
    corpus_flags = ["--draft-vocab-size", "16", "--draft-vocab-corpus", str(tmp_path / "corpus.txt")]
    assert _cli([*arguments, "--output", str(tmp_path / "first"), *corpus_flags]) == 0
    pack_drafter(tmp_path / "first", tmp_path / "first-packed")
    first = load_drafter(tmp_path / "first").draft_to_target
    other_corpus = ["--draft-vocab-size", "16", "--draft-vocab-corpus", str(tmp_path / "other.txt")]
    assert _cli([*arguments, "--output", str(tmp_path / "counted"), *other_corpus]) == 0
    assert not torch.equal(load_drafter(tmp_path / "counted").draft_to_target, first)  # the control: it differs
    second_backbone = tmp_path / "second-backbone"
    tiny_backbone("qwen3", len(byte_level_tokenizer())).save_pretrained(second_backbone)
    byte_level_tokenizer().save_pretrained(second_backbone)
    for source in ("first", "first-packed"):
        output = tmp_path / f"from-{source}"
        flags = ["--backbone", str(second_backbone), "--target", str(target_dir), "--output", str(output)]
        assert _cli([*flags, "--draft-vocab-from", str(tmp_path / source)]) == 0
        drafter = load_drafter(output)
        assert torch.equal(drafter.draft_to_target, first) and drafter.config.draft_vocab_size == 16
        report = json.loads((output / "alignment_report.json").read_text())
        assert report["draft_vocab"] == {"size": 16, "from": str(tmp_path / source)}
    assert "the 16 tokens of" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not both"):
        convert(backbone_dir, target_dir, corpus=[tmp_path / "other.txt"], draft_vocab_from=tmp_path / "first")
    with pytest.raises(ValueError, match="not the 8 asked for"):
        convert(backbone_dir, target_dir, draft_vocab_size=8, draft_vocab_from=tmp_path / "first")
    other_target = tmp_path / "other-target"
    tiny_target_config(extra_rows=7).save_pretrained(other_target)
    metaspace_tokenizer().save_pretrained(other_target)
    with pytest.raises(ValueError, match="for the same target"):
        convert(backbone_dir, other_target, draft_vocab_from=tmp_path / "first")


# --- errors users hit ----------------------------------------------------------------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_target_layers_must_exist_in_the_target():
    with pytest.raises(ValueError, match=r"\[9\] outside \[0, 8\)"):
        convert_tiny(target_layer_ids=[1, 3, 9])


@pytest.mark.parametrize(
    "make_backbone, message",
    [
        (lambda factory: factory("gemma3"), "Gemma blocks scale embeddings"),
        (lambda factory: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)), "Unsupported backbone.*'gpt2'"),
        (lambda factory: tiny_backbone("llama", 300, rope_parameters=LLAMA3_ROPE), "only unscaled"),
        (lambda factory: tiny_backbone("llama", 300, attention_bias=True), "attention_bias=True"),
        (lambda factory: tiny_backbone("qwen2", 300, layer_types=["sliding_attention"] * 2), "sliding"),
    ],
)
def test_backbones_the_drafter_cannot_reproduce_are_refused(tiny_target_factory, make_backbone, message):
    with pytest.raises(ValueError, match=message):
        convert(
            make_backbone(tiny_target_factory),
            tiny_target_config(),
            backbone_tokenizer=byte_level_tokenizer(),
            target_tokenizer=metaspace_tokenizer(),
        )


def test_missing_inputs_are_explained(tmp_path):
    backbone_dir, target_dir = _save_backbone_and_target(tmp_path)
    (target_dir / "tokenizer.json").unlink()
    (target_dir / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no vocabulary to align"):
        convert(backbone_dir, target_dir)  # transformers builds an empty Gemma tokenizer from the config alone
    LlamaConfig(num_hidden_layers=8).save_pretrained(target_dir)
    with pytest.raises(ValueError, match="must include its tokenizer files"):
        convert(backbone_dir, target_dir)
    with pytest.raises(ValueError, match="backbone_tokenizer"):
        convert(tiny_backbone("llama", 300), tiny_target_config(), target_tokenizer=metaspace_tokenizer())
    with pytest.raises(ValueError, match="--draft-vocab-corpus"):
        convert_tiny(draft_vocab_size=8)


def test_an_occupied_output_directory_is_refused_before_any_work(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="not an empty directory"):
        convert("no-such-backbone", "no-such-target", output_dir=tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "precious"


# --- the real SmolLM2 ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_pruned():
    """SmolLM2-135M from the zoo's default cache (downloaded once), pruned to its first two blocks."""
    directory = zoo.fetch("smollm2-135m-instruct")
    return prune(zoo.load_causal_lm(directory), 2), zoo.load_tokenizer(directory)


@pytest.mark.network
@torch.no_grad()
def test_real_smollm2_converts_function_preserving_to_itself_and_to_a_gemma_style_vocabulary(smollm2_pruned):
    backbone, tokenizer = smollm2_pruned
    drafter, report = convert(
        backbone,
        tiny_target_config(vocab_size=len(tokenizer), hidden_size=96),
        backbone_tokenizer=tokenizer,
        target_tokenizer=tokenizer,
    )
    assert report["alignment"]["counts"]["direct"] + report["alignment"]["counts"]["special"] == len(tokenizer)
    ids = tokenizer("The capital of France is Paris, and", return_tensors="pt")["input_ids"]
    features = torch.randn(*ids.shape, drafter.config.fused_feature_size)
    torch.testing.assert_close(drafter(ids, target_hidden_states=features).logits, backbone(ids).logits)

    gemma_style = metaspace_tokenizer()
    _, report = convert(backbone, tiny_target_config(), backbone_tokenizer=tokenizer, target_tokenizer=gemma_style)
    assert report["alignment"]["special_tokens"] == {
        "<eos>": "<|im_end|>",
        "<bos>": "<|im_start|>",
        "<pad>": "<|im_end|>",
        "<unk>": "<|endoftext|>",
        "<start_of_turn>": "<|im_start|>",
        "<end_of_turn>": "<|im_end|>",
        "<|file_sep|>": "<file_sep>",
    }
    assert report["alignment"]["counts"]["direct"] > 250
