"""The replication's controls: the EAGLE-3 residual stream, the body-random (scratch) control and the EAGLE-3
drafter built in the Osprey format, and frozen embeddings in distillation."""

import argparse

import pytest
import torch
from conftest import make_tiny_target
from test_trainers import char_tokenizer, distill_config, token_dataset
from transformers import GenerationConfig

from osprey import OspreyConfig, OspreyForDrafting
from osprey.decoding.decode import speculative_generate
from osprey.stages import baselines as baselines_module
from osprey.stages.baselines import build_baseline, scratch_drafter
from trainers import OspreyDistillTrainer


def reference_drafter(target, seed: int = 0, **overrides) -> OspreyForDrafting:
    values = dict(
        vocab_size=target.config.vocab_size,
        draft_vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_hidden_size=target.config.hidden_size,
        target_layer_ids=[1, 3, 4],
    )
    values.update(overrides)
    torch.manual_seed(seed)
    drafter = OspreyForDrafting(OspreyConfig(**values)).eval()
    drafter.draft_to_target.copy_(torch.randperm(target.config.vocab_size)[: drafter.config.draft_vocab_size])
    drafter.generation_config = GenerationConfig(num_assistant_tokens=5)
    return drafter


@pytest.mark.parametrize("residual_stream", ["tokens", "features"])
def test_residual_stream_is_what_the_fusion_block_adds_to(residual_stream):
    target = make_tiny_target("llama")
    drafter = reference_drafter(target, num_hidden_layers=1, residual_stream=residual_stream)
    with torch.no_grad():  # a block that adds nothing exposes its residual stream
        drafter.model.layers[0].self_attn.o_proj.weight.zero_()
        drafter.model.layers[0].mlp.down_proj.weight.zero_()
    input_ids = torch.randint(0, 256, (1, 7))
    features = torch.randn(1, 7, drafter.config.fused_feature_size)
    hidden = drafter(input_ids, target_hidden_states=features).prenorm_hidden_states
    expected = drafter.model.fc(features) if residual_stream == "features" else drafter.model.embed_tokens(input_ids)
    torch.testing.assert_close(hidden, expected)


def test_residual_stream_must_be_tokens_or_features():
    with pytest.raises(ValueError, match="residual_stream must be 'tokens' \\(Osprey\\) or 'features'"):
        OspreyConfig(residual_stream="embeddings")


def test_scratch_control_re_initialises_only_the_body():
    reference = reference_drafter(make_tiny_target("llama"))
    scratch = scratch_drafter(reference, seed=1)
    assert torch.equal(
        scratch_drafter(reference, seed=1).model.layers[0].mlp.up_proj.weight,
        scratch.model.layers[0].mlp.up_proj.weight,
    )
    for name, tensor in reference.state_dict().items():
        same = torch.equal(tensor, scratch.state_dict()[name])
        is_body_matrix = name.startswith("model.layers.") and "norm" not in name
        assert same != is_body_matrix, name
    feature_half = scratch.model.layers[0].self_attn.q_proj.weight[:, : scratch.config.hidden_size]
    assert feature_half.abs().sum() > 0 and feature_half.std() < 2 * scratch.config.initializer_range


@pytest.fixture
def saved_reference_and_target(tmp_path):
    target = make_tiny_target("qwen2")
    target.save_pretrained(tmp_path / "target")
    reference = reference_drafter(target)
    reference.save_pretrained(tmp_path / "osprey")
    char_tokenizer().save_pretrained(tmp_path / "osprey")
    return target, reference, tmp_path


def test_eagle3_control_is_one_target_width_block_on_the_targets_embedding(saved_reference_and_target):
    target, reference, tmp_path = saved_reference_and_target
    build_baseline("eagle3", tmp_path / "osprey", tmp_path / "eagle3", target=str(tmp_path / "target"))
    eagle3 = OspreyForDrafting.from_pretrained(tmp_path / "eagle3").eval()
    config = eagle3.config
    assert (config.num_hidden_layers, config.hidden_size, config.residual_stream) == (1, 64, "features")
    assert config.target_layer_ids == reference.config.target_layer_ids
    assert torch.equal(eagle3.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(eagle3.draft_to_target, reference.draft_to_target)
    assert eagle3.generation_config.num_assistant_tokens == 5
    input_ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(speculative_generate(target, eagle3, input_ids, max_new_tokens=24)[0], expected)


def test_eagle3_control_refuses_a_target_it_does_not_fit(saved_reference_and_target, tmp_path):
    _, _, root = saved_reference_and_target
    make_tiny_target("llama", vocab_size=300).save_pretrained(root / "other")
    with pytest.raises(ValueError, match="pass the target the reference drafter was converted for"):
        build_baseline("eagle3", root / "osprey", root / "eagle3", target=str(root / "other"))
    with pytest.raises(ValueError, match="pass the target"):
        build_baseline("eagle3", root / "osprey", root / "eagle3b")


def test_cli_builds_the_scratch_control_and_never_overwrites(saved_reference_and_target, capsys):
    _, reference, root = saved_reference_and_target
    parser = argparse.ArgumentParser()
    baselines_module.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["baseline", "scratch", "--drafter", str(root / "osprey"), "--output", str(root / "s")])
    assert args.run(args) == 0 and "saved the scratch control" in capsys.readouterr().out
    scratch = OspreyForDrafting.from_pretrained(root / "s")
    assert torch.equal(scratch.lm_head.weight, reference.lm_head.weight)
    with pytest.raises(ValueError, match="not an empty directory"):
        args.run(args)


def test_frozen_embeddings_stay_put_while_the_rest_trains(tmp_path):
    target = make_tiny_target("llama")
    drafter = reference_drafter(target, draft_vocab_size=256).train()
    drafter.draft_to_target.copy_(torch.arange(256))
    embedding, fc = drafter.model.embed_tokens.weight.clone(), drafter.model.fc.weight.clone()
    config = distill_config(tmp_path, max_steps=2, freeze_embeddings=True)
    OspreyDistillTrainer(drafter, config, train_dataset=token_dataset(8, 12), target_model=target).train()
    assert torch.equal(drafter.model.embed_tokens.weight, embedding)
    assert not torch.equal(drafter.model.fc.weight, fc)
