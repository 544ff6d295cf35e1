"""The paper's seed targets (Qwen3-8B, Llama-3.3-70B-Instruct, MiniMax-M2.5): their presets are picked from full-size
configs (configs only, never weights), and on tiny random models of the same architectures (GQA everywhere, Qwen3's and
MiniMax-M2's q/k norms, MiniMax-M2's sigmoid-routed MoE) a drafter converts, takes a distillation step and decodes
token-identically to plain greedy generation."""

import argparse

import pytest
import torch
from conftest import make_tiny_target
from test_convert import tiny_backbone
from test_trainers import distill_config, logged, token_dataset
from test_vocab_alignment import byte_level_tokenizer
from transformers import LlamaConfig, MiniMaxM2Config, Qwen3Config

from osprey.stages import convert as convert_module
from osprey.stages.convert import convert, drafter_config
from osprey.stages.presets import PRESETS, resolve_preset
from trainers import OspreyDistillTrainer

# Each architecture's special tokens as its chat template uses them; the first three are unk, bos and eos.
SPECIAL_TOKENS = {
    "qwen3": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    "llama": ("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"),
    "minimax_m2": ("]!d~[", "]~!b[", "[e~[", "]~b]"),
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# The published configs' shapes (only what the presets and the drafter read).
FULL_SIZE_TARGETS = {
    "qwen3-8b": (
        Qwen3Config,
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
    ),
    "llama-3.3-70b-instruct": (
        LlamaConfig,
        {
            "vocab_size": 128256,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "rope_parameters": LLAMA3_ROPE,
        },
    ),
    "minimax-m2.5": (
        MiniMaxM2Config,
        {
            "vocab_size": 200064,
            "hidden_size": 3072,
            "intermediate_size": 1536,
            "num_hidden_layers": 62,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_local_experts": 256,
            "num_experts_per_tok": 8,
        },
    ),
}


def target_tokenizer(arch: str):
    return byte_level_tokenizer(specials=SPECIAL_TOKENS[arch])


def full_size_target(name: str, **overrides):
    """A seed target's config whose special ids point into its (tiny) stand-in tokenizer, the config naming only
    the tokenizer's eos as `eos_token_id`, as Qwen3-8B's `config.json` does."""
    config_class, values = FULL_SIZE_TARGETS[name]
    tokenizer = target_tokenizer(PRESETS[name].model_type)
    special_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": None}
    return config_class(**{**values, **special_ids, **overrides}), tokenizer


def backbone_and_tokenizer():
    tokenizer = byte_level_tokenizer()
    return tiny_backbone("llama", len(tokenizer)), tokenizer


@pytest.mark.parametrize("name", list(FULL_SIZE_TARGETS))
def test_full_size_seed_target_gets_its_preset_taps_and_end_of_turn_tokens(name):
    target_config, tokenizer = full_size_target(name)
    preset = PRESETS[name]
    assert resolve_preset(target_config) is preset
    backbone, backbone_tokenizer = backbone_and_tokenizer()
    drafter, report = convert(
        backbone, target_config, backbone_tokenizer=backbone_tokenizer, target_tokenizer=tokenizer
    )
    num_layers = target_config.num_hidden_layers
    assert report["preset"] == name
    assert drafter.config.target_layer_ids == list(preset.target_layer_ids) == [1, num_layers // 2 - 1, num_layers - 4]
    assert drafter.config.target_hidden_size == preset.hidden_size
    assert drafter.config.vocab_size == target_config.vocab_size
    end_of_turn = [tokenizer.convert_tokens_to_ids(token) for token in preset.end_of_turn_tokens]
    eos = drafter.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else eos
    assert eos[0] == target_config.eos_token_id and set(eos) == {target_config.eos_token_id, *end_of_turn}
    assert drafter.config.eos_token_id == target_config.eos_token_id  # the config keeps the target's own


def test_presets_match_only_their_architecture_and_can_be_overridden():
    backbone_config = backbone_and_tokenizer()[0].config
    qwen3_8b, _ = full_size_target("qwen3-8b")
    near_misses = [
        full_size_target("qwen3-8b", num_hidden_layers=28, hidden_size=2048)[0],  # a smaller Qwen3
        full_size_target("llama-3.3-70b-instruct", hidden_size=4096)[0],  # 80 layers, but not 8192 wide
        LlamaConfig(hidden_size=4096, num_hidden_layers=36),  # Qwen3-8B's shape, another architecture
    ]
    assert [resolve_preset(config) for config in near_misses] == [None, None, None]
    assert drafter_config(backbone_config, near_misses[0]).target_layer_ids == [1, 13, 24]  # EAGLE-3's default
    assert resolve_preset(qwen3_8b, "none") is None
    explicit = drafter_config(backbone_config, qwen3_8b, [2, 20, 33], preset=PRESETS["qwen3-8b"])
    assert explicit.target_layer_ids == [2, 20, 33]
    with pytest.raises(ValueError, match="Unknown target preset 'qwen3'.*qwen3-8b"):
        resolve_preset(qwen3_8b, "qwen3")
    with pytest.raises(ValueError, match=r"\[39, 76\] outside \[0, 36\)"):
        drafter_config(backbone_config, qwen3_8b, preset=resolve_preset(qwen3_8b, "llama-3.3-70b-instruct"))


def test_cli_reports_the_detected_preset(tmp_path, capsys):
    backbone, backbone_tokenizer = backbone_and_tokenizer()
    backbone.save_pretrained(tmp_path / "backbone")
    backbone_tokenizer.save_pretrained(tmp_path / "backbone")
    target_config, tokenizer = full_size_target("minimax-m2.5")
    target_config.save_pretrained(tmp_path / "target")  # a config and a tokenizer: no weights
    tokenizer.save_pretrained(tmp_path / "target")
    parser = argparse.ArgumentParser()
    convert_module.add_subcommand(parser.add_subparsers())
    arguments = ["convert", "--backbone", str(tmp_path / "backbone"), "--target", str(tmp_path / "target")]
    for preset, output, expected in [("auto", "auto", "minimax-m2.5; taps [1, 30, 58]"), ("none", "none", "none")]:
        args = parser.parse_args(arguments + ["--output", str(tmp_path / output), "--preset", preset])
        assert args.run(args) == 0
        assert f"target preset: {expected}" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["qwen3", "llama", "minimax_m2"])
def test_seed_architecture_converts_distills_and_decodes_losslessly(arch, tmp_path):
    tokenizer = target_tokenizer(arch)
    special_ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": 0}
    target = make_tiny_target(arch, vocab_size=len(tokenizer) + 3, **special_ids)
    backbone, backbone_tokenizer = backbone_and_tokenizer()
    drafter, report = convert(
        backbone, target.config, backbone_tokenizer=backbone_tokenizer, target_tokenizer=tokenizer
    )
    assert report["preset"] is None and drafter.config.target_layer_ids == [1, 3, 4]  # tiny: EAGLE-3's default taps
    feature_columns = drafter.model.layers[0].self_attn.q_proj.weight[:, : drafter.config.hidden_size]
    assert not feature_columns.any()  # converted: the drafter does not read the target yet

    trainer = OspreyDistillTrainer(
        drafter,
        distill_config(tmp_path, max_steps=1, logging_steps=1),
        train_dataset=token_dataset(4, 20),
        target_model=target,
    )
    trainer.train()
    assert torch.isfinite(torch.tensor(logged(trainer, "loss") + logged(trainer, "ttt_loss_2"))).all()
    feature_columns = drafter.model.layers[0].self_attn.q_proj.weight[:, : drafter.config.hidden_size]
    assert feature_columns.abs().min() > 0  # one step through the target's taps: every feature weight moved

    drafter.eval()
    drafter.attach_target(target)
    for length, max_new_tokens in [(1, 12), (7, 30)]:
        input_ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(length))
        settings = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": 0}
        expected = target.generate(input_ids, **settings)
        assert torch.equal(target.generate(input_ids, assistant_model=drafter, **settings), expected)
    drafter.detach_target()
