"""OspreyConfig / OspreyForDrafting: architecture, cache, masks, save/load and the errors users hit."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from osprey import OspreyConfig, OspreyForDrafting, OspreyModel


def tiny_config(**overrides) -> OspreyConfig:
    values = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_hidden_size=48,
        target_layer_ids=[1, 3, 4],
        target_model_type="llama",
        backbone_model_type="llama",
    )
    values.update(overrides)
    return OspreyConfig(**values)


def tiny_drafter(seed: int = 0, **overrides) -> OspreyForDrafting:
    torch.manual_seed(seed)
    return OspreyForDrafting(tiny_config(**overrides)).eval()


def random_inputs(config: OspreyConfig, batch_size: int = 2, seq_len: int = 9, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
    features = torch.randn(batch_size, seq_len, config.fused_feature_size, generator=generator)
    return input_ids, features


def assert_same_state_dict(expected: torch.nn.Module, actual: torch.nn.Module):
    expected_state, actual_state = expected.state_dict(), actual.state_dict()
    assert expected_state.keys() == actual_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(tensor, actual_state[name]), f"{name} changed across save/load"


# --- configuration ---------------------------------------------------------------------------------------------


def test_config_defaults_derive_head_dim_and_draft_vocab():
    config = tiny_config()
    assert config.head_dim == 16
    assert config.draft_vocab_size == config.vocab_size
    assert config.fused_feature_size == 3 * 48
    assert OspreyConfig().model_type == "osprey"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(draft_vocab_size=200), "subset of the target vocabulary"),
        (dict(draft_vocab_size=32, tie_word_embeddings=True), "tie_word_embeddings=False"),
        (dict(target_layer_ids=[]), "at least one target tap"),
        (dict(target_layer_ids=[4, 1, 3]), "increasing"),
        (dict(target_layer_ids=[1, 1, 3]), "distinct"),
    ],
)
def test_config_rejects_inconsistent_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_config_json_round_trip_keeps_every_public_field(tmp_path):
    config = tiny_config(draft_vocab_size=40, use_qk_norm=True, attention_bias=True, rope_theta=1e6)
    config.save_pretrained(tmp_path)
    reloaded = AutoConfig.from_pretrained(tmp_path)
    for name in [
        "vocab_size",
        "draft_vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "target_hidden_size",
        "target_layer_ids",
        "target_model_type",
        "backbone_model_type",
        "use_qk_norm",
        "attention_bias",
    ]:
        assert getattr(reloaded, name) == getattr(config, name), name


# --- forward ---------------------------------------------------------------------------------------------------


def test_forward_returns_draft_logits_and_prenorm_hidden_states():
    drafter = tiny_drafter(draft_vocab_size=40)
    input_ids, features = random_inputs(drafter.config)
    output = drafter(input_ids, target_hidden_states=features)
    assert output.logits.shape == (2, 9, 40)
    assert output.prenorm_hidden_states.shape == (2, 9, 64)
    # The final norm sits between the pre-norm states and the head.
    expected_logits = drafter.lm_head(drafter.model.norm(output.prenorm_hidden_states))
    torch.testing.assert_close(output.logits, expected_logits)


def test_draft_hidden_states_bypass_fc():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config)
    via_target = drafter(input_ids, target_hidden_states=features, use_cache=False)
    via_draft = drafter(input_ids, draft_hidden_states=drafter.model.fc(features), use_cache=False)
    torch.testing.assert_close(via_target.logits, via_draft.logits)


def test_target_features_change_the_output():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config)
    first = drafter(input_ids, target_hidden_states=features).logits
    second = drafter(input_ids, target_hidden_states=features + 1.0).logits
    assert not torch.allclose(first, second)


def test_reduced_draft_vocab_maps_back_to_target_ids():
    drafter = tiny_drafter(draft_vocab_size=5)
    assert drafter.draft_to_target.tolist() == [0, 1, 2, 3, 4]
    drafter.draft_to_target.copy_(torch.tensor([7, 3, 90, 11, 0]))
    assert drafter.draft_ids_to_target_ids(torch.tensor([[2, 0, 4]])).tolist() == [[90, 7, 0]]


def test_incremental_decoding_with_cache_matches_full_forward():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config, batch_size=1, seq_len=10)
    full = drafter(input_ids, target_hidden_states=features, use_cache=False).logits
    prefix = drafter(input_ids[:, :6], target_hidden_states=features[:, :6], use_cache=True)
    cache = prefix.cache
    pieces = [prefix.logits]
    for position in range(6, 10):
        step = drafter(
            input_ids[:, position : position + 1],
            target_hidden_states=features[:, position : position + 1],
            cache=cache,
        )
        pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_cache_crop_rolls_back_rejected_positions():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config, batch_size=1, seq_len=8)
    cache = drafter(input_ids[:, :5], target_hidden_states=features[:, :5], use_cache=True).cache
    drafter(input_ids[:, 5:], target_hidden_states=torch.randn_like(features[:, 5:]), cache=cache)
    cache.crop(-3)  # reject the last three positions, as after a failed verification (5.24: negative = remove n)
    redone = drafter(input_ids[:, 5:], target_hidden_states=features[:, 5:], cache=cache).logits
    full = drafter(input_ids, target_hidden_states=features, use_cache=False).logits
    torch.testing.assert_close(redone, full[:, 5:], rtol=1e-5, atol=1e-5)


def test_right_padding_does_not_change_real_positions():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config, batch_size=2, seq_len=7)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0
    padded = drafter(input_ids, target_hidden_states=features, attention_mask=attention_mask, use_cache=False).logits
    alone = drafter(input_ids[1:, :4], target_hidden_states=features[1:, :4], use_cache=False).logits
    torch.testing.assert_close(padded[1:, :4], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(padded).all()


def test_full_4d_mask_is_used_as_given():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config, batch_size=1, seq_len=6)
    causal = drafter(input_ids, target_hidden_states=features, use_cache=False).logits
    explicit = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    same = drafter(input_ids, target_hidden_states=features, attention_mask=explicit, use_cache=False).logits
    torch.testing.assert_close(same, causal)
    diagonal_only = torch.eye(6, dtype=torch.bool)[None, None]
    isolated = drafter(input_ids, target_hidden_states=features, attention_mask=diagonal_only, use_cache=False).logits
    one_by_one = torch.cat(
        [
            drafter(
                input_ids[:, i : i + 1],
                target_hidden_states=features[:, i : i + 1],
                position_ids=torch.tensor([[i]]),
                use_cache=False,
            ).logits
            for i in range(6)
        ],
        dim=1,
    )
    torch.testing.assert_close(isolated, one_by_one, rtol=1e-5, atol=1e-5)


def test_gradients_reach_fc_and_both_qkv_halves():
    drafter = tiny_drafter().train()
    input_ids, features = random_inputs(drafter.config)
    drafter(input_ids, target_hidden_states=features).logits.logsumexp(-1).mean().backward()
    q_grad = drafter.model.layers[0].self_attn.q_proj.weight.grad
    assert drafter.model.fc.weight.grad.abs().sum() > 0
    assert q_grad[:, :64].abs().sum() > 0 and q_grad[:, 64:].abs().sum() > 0


# --- equivalence with the backbone families ----------------------------------------------------------------------

BACKBONES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"attention_bias": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_qk_norm": True}),
}


@pytest.mark.parametrize("family", sorted(BACKBONES))
def test_zero_feature_half_computes_exactly_the_backbone(family):
    """The Osprey first-layer routing at zero-initialised feature weights is the backbone's own block: checked against
    transformers' Llama / Qwen2 / Qwen3 implementations (RoPE, GQA, q/k norm, qkv bias)."""
    config_class, model_class, drafter_overrides = BACKBONES[family]
    torch.manual_seed(0)
    backbone = model_class(
        config_class(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            tie_word_embeddings=False,
        )
    ).eval()
    with torch.no_grad():  # biases and norm weights start at 0 / 1; perturb them so copying is really tested
        for name, parameter in backbone.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    drafter = tiny_drafter(rms_norm_eps=1e-6, rope_theta=5e5, backbone_model_type=family, **drafter_overrides)
    drafter_state = drafter.state_dict()
    with torch.no_grad():
        for name, tensor in backbone.state_dict().items():
            if (
                ".self_attn." in name
                and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
                and name.endswith("weight")
            ):
                widened = torch.zeros_like(drafter_state[name]) if name.startswith("model.layers.0.") else None
                if widened is not None:
                    widened[:, 64:] = tensor  # [0 | W]: nothing flows from the target features yet
                    tensor = widened
            drafter_state[name].copy_(tensor)
    input_ids, features = random_inputs(drafter.config, batch_size=2, seq_len=11)
    expected = backbone(input_ids).logits
    actual = drafter(input_ids, target_hidden_states=features * 10).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


# --- save / load -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"draft_vocab_size": 32}, {"tie_word_embeddings": True}])
def test_save_load_preserves_every_tensor(tmp_path, overrides):
    drafter = tiny_drafter(**overrides)
    drafter.draft_to_target.copy_(torch.randperm(drafter.config.vocab_size)[: drafter.config.draft_vocab_size])
    drafter.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded, OspreyForDrafting)
    assert_same_state_dict(drafter, reloaded)
    input_ids, features = random_inputs(drafter.config)
    torch.testing.assert_close(
        reloaded(input_ids, target_hidden_states=features).logits,
        drafter(input_ids, target_hidden_states=features).logits,
    )
    body = AutoModel.from_pretrained(tmp_path)
    assert isinstance(body, OspreyModel)
    assert_same_state_dict(drafter.model, body)


def test_save_writes_auto_map_and_remote_code(tmp_path):
    tiny_drafter().save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_osprey.OspreyConfig",
        "AutoModel": "modeling_osprey.OspreyModel",
        "AutoModelForCausalLM": "modeling_osprey.OspreyForDrafting",
    }
    remote_code = {"modeling_osprey.py", "configuration_osprey.py", "generation_osprey.py", "target_features.py"}
    assert remote_code | {"model.safetensors", "generation_config.json"} <= set(os.listdir(tmp_path))
    loop = {"generate.py", "decoding_osprey.py", "generation_osprey.py", "target_features.py"}  # custom_generate
    assert loop <= set(os.listdir(tmp_path / "custom_generate"))


REMOTE_LOAD_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys
    import torch

    class RefuseOsprey(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("osprey", "modeling_osprey"):
                raise ImportError(f"{name} must not be importable in this test")

    sys.meta_path.insert(0, RefuseOsprey())
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    checkpoint, inputs_path = sys.argv[1], sys.argv[2]
    inputs = torch.load(inputs_path)
    drafter = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)
    body = AutoModel.from_pretrained(checkpoint, trust_remote_code=True)
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    assert type(body).__name__ == "OspreyModel", type(body)
    with torch.no_grad():
        logits = drafter(inputs["input_ids"], target_hidden_states=inputs["features"]).logits

    # The remote-code drafter also speculates for a target through plain transformers.
    target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=8,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    drafter.attach_target(target)
    prompt = inputs["input_ids"][:1, :5]
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assisted = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                               eos_token_id=None, pad_token_id=0)
    assert torch.equal(plain, assisted), (plain, assisted)
    torch.save({"logits": logits, "state": drafter.state_dict()}, inputs_path + ".out")
    """
)


def test_trust_remote_code_round_trip_offline_without_the_package(tmp_path):
    drafter = tiny_drafter(draft_vocab_size=40, use_qk_norm=True)
    checkpoint = tmp_path / "drafter"
    drafter.save_pretrained(checkpoint)
    input_ids, features = random_inputs(drafter.config)
    inputs_path = str(tmp_path / "inputs.pt")
    torch.save({"input_ids": input_ids, "features": features}, inputs_path)
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_LOAD_SCRIPT)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, "-I", str(script), str(checkpoint), inputs_path],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(inputs_path + ".out")
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], drafter(input_ids, target_hidden_states=features).logits)
    expected_state = drafter.state_dict()
    assert remote["state"].keys() == expected_state.keys()
    assert all(torch.equal(remote["state"][name], tensor) for name, tensor in expected_state.items())


# --- errors users hit ----------------------------------------------------------------------------------------------


def test_features_of_another_target_are_rejected_with_the_reason():
    drafter = tiny_drafter()
    input_ids, features = random_inputs(drafter.config)
    with pytest.raises(ValueError, match="target_hidden_size=48"):
        drafter(input_ids, target_hidden_states=features[..., :96])
    with pytest.raises(ValueError, match="exactly one"):
        drafter(input_ids)
    with pytest.raises(ValueError, match="exactly one"):
        drafter(input_ids, target_hidden_states=features, draft_hidden_states=torch.zeros(2, 9, 64))


def test_checkpoint_missing_tensors_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_drafter().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.fc.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \['model.fc.weight'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_pickle_weights_are_refused_with_the_fix(tmp_path):
    drafter = tiny_drafter()
    drafter.config.save_pretrained(tmp_path)
    torch.save(drafter.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickle weights.*save_pretrained"):
        OspreyForDrafting.from_pretrained(tmp_path)


def test_truncated_weights_are_reported_as_corrupted(tmp_path):
    tiny_drafter().save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(OSError, match="corrupted"):
        OspreyForDrafting.from_pretrained(tmp_path)
