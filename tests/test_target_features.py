import pytest
import torch
from torch import nn
from transformers import DynamicCache, Gemma3Config, Gemma3ForConditionalGeneration

from modeling_osprey.target_features import (
    TargetFeatureCapture,
    decoder_layers,
    default_target_layer_ids,
    extract_target_features,
    validate_target_layer_ids,
)


def random_input_ids(model, batch_size=2, seq_len=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch_size, seq_len), generator=generator)


def default_taps(model):
    return default_target_layer_ids(model.config.num_hidden_layers)


def hook_counts(model):
    return [len(layer._forward_hooks) for layer in decoder_layers(model)]


@pytest.mark.parametrize(
    "num_hidden_layers, expected",
    [(7, [1, 2, 3]), (8, [1, 3, 4]), (28, [1, 13, 24]), (36, [1, 17, 32]), (62, [1, 30, 58]), (80, [1, 39, 76])],
)
def test_default_target_layer_ids(num_hidden_layers, expected):
    assert default_target_layer_ids(num_hidden_layers) == expected


@pytest.mark.parametrize("num_hidden_layers", [0, 2, 4, 6])
def test_default_target_layer_ids_rejects_shallow_targets(num_hidden_layers):
    with pytest.raises(ValueError, match="too shallow.*Pass explicit `target_layer_ids`"):
        default_target_layer_ids(num_hidden_layers)


@pytest.mark.parametrize(
    "layer_ids, message",
    [
        ([1, 3, 8], r"\[8\] outside \[0, 8\).*pass indices from 0 to 7"),
        ([-1, 3, 4], r"\[-1\] outside \[0, 8\).*negative indices are not supported"),
        ([1, 3, 3], r"repeats \[3\]: pass distinct"),
        ([4, 1, 3], r"must be increasing.*pass \[1, 3, 4\]"),
        ([], "non-empty list"),
        (3, "non-empty list"),
        ([1, 3.0, 4], "must hold ints"),
        ([True, 3, 4], "must hold ints"),
    ],
)
def test_bad_layer_ids_raise_naming_the_fix(tiny_target_factory, layer_ids, message):
    target = tiny_target_factory("llama")
    with pytest.raises(ValueError, match=message):
        TargetFeatureCapture(target, layer_ids)
    assert hook_counts(target) == [0] * 8, "a rejected capture must not leave hooks behind"


def test_validate_target_layer_ids_returns_a_tuple():
    assert validate_target_layer_ids([0, 5, 7], num_hidden_layers=8) == (0, 5, 7)


def test_features_match_output_hidden_states(tiny_target):
    input_ids = random_input_ids(tiny_target)
    # Left padding, so the attention mask really changes the computation.
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    taps = default_taps(tiny_target)

    features, logits = extract_target_features(tiny_target, input_ids, taps, attention_mask=attention_mask)

    with torch.no_grad():
        reference = tiny_target(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[i + 1] for i in taps], dim=-1)
    hidden_size = tiny_target.config.hidden_size
    assert features.shape == (2, 12, len(taps) * hidden_size)
    torch.testing.assert_close(features, expected)
    torch.testing.assert_close(logits, reference.logits)
    # transformers' own index selection takes the same (block + 1) indices.
    with torch.no_grad():
        selected = tiny_target(input_ids, attention_mask=attention_mask, output_hidden_states=[i + 1 for i in taps])
    torch.testing.assert_close(features, torch.cat([selected.hidden_states[i + 1] for i in taps], dim=-1))


def test_last_block_tap_is_the_raw_block_output(tiny_target_factory):
    target = tiny_target_factory("llama")
    input_ids = random_input_ids(target)
    features, _ = extract_target_features(target, input_ids, [7])
    with torch.no_grad():
        final_hidden_state = target(input_ids, output_hidden_states=True).hidden_states[8]
        torch.testing.assert_close(target.model.norm(features), final_hidden_state)
    assert not torch.allclose(features, final_hidden_state)


def test_incremental_forwards_yield_features_of_new_positions(tiny_target):
    input_ids = random_input_ids(tiny_target, seq_len=12)
    taps = default_taps(tiny_target)
    full_features, _ = extract_target_features(tiny_target, input_ids, taps)

    cache = DynamicCache(config=tiny_target.config)
    with TargetFeatureCapture(tiny_target, taps) as capture, torch.no_grad():
        # A prefill, then two verification steps, as in speculative decoding.
        for start, end in [(0, 7), (7, 11), (11, 12)]:
            tiny_target(input_ids[:, start:end], cache=cache, use_cache=True)
            # Cached attention runs on other matmul shapes than the full sequence: fp32 rounding, not exactness.
            torch.testing.assert_close(capture.features, full_features[:, start:end], rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 12


def test_hooks_are_removed_on_exit(tiny_target):
    taps = default_taps(tiny_target)
    num_layers = tiny_target.config.num_hidden_layers
    with TargetFeatureCapture(tiny_target, taps):
        assert hook_counts(tiny_target) == [int(i in taps) for i in range(num_layers)]
    assert hook_counts(tiny_target) == [0] * num_layers

    with pytest.raises(KeyError), TargetFeatureCapture(tiny_target, taps):
        raise KeyError("failure inside the capture")
    assert hook_counts(tiny_target) == [0] * num_layers


def test_removed_capture_stops_recording_but_keeps_the_last_features(tiny_target_factory):
    target = tiny_target_factory("qwen3")
    first_input, second_input = random_input_ids(target, seed=0), random_input_ids(target, seed=1)
    capture = TargetFeatureCapture(target, [1, 3, 4])
    with torch.no_grad():
        target(first_input)
    capture.remove()
    capture.remove()  # idempotent
    assert hook_counts(target) == [0] * 8
    with torch.no_grad():
        target(second_input)
    torch.testing.assert_close(capture.features, extract_target_features(target, first_input, [1, 3, 4])[0])


def test_features_need_a_complete_forward(tiny_target_factory):
    target = tiny_target_factory("qwen2")
    with TargetFeatureCapture(target, [1, 3, 4]) as capture:
        with pytest.raises(RuntimeError, match=r"taps \[1, 3, 4\] missing"):
            _ = capture.features
        with torch.no_grad():
            target(random_input_ids(target))
        assert capture.features.shape == (2, 12, 3 * target.config.hidden_size)
        capture.clear()
        with pytest.raises(RuntimeError, match="No complete target forward"):
            _ = capture.features


def test_decoder_layers_of_each_architecture(tiny_target):
    assert decoder_layers(tiny_target) is tiny_target.model.layers


def test_decoder_layers_of_a_multimodal_wrapper():
    config = Gemma3Config(
        text_config={
            "vocab_size": 300,
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
        boi_token_index=297,
        eoi_token_index=298,
        image_token_index=299,
    )
    model = Gemma3ForConditionalGeneration(config)
    assert decoder_layers(model) is model.model.language_model.layers


class TupleReturningBlock(nn.Module):
    """A decoder block of the older transformers style, returning ``(hidden_states, attention_weights)``."""

    def __init__(self, hidden_size):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        return hidden_states + self.proj(hidden_states), None


class TupleReturningDecoder(nn.Module):
    def __init__(self, hidden_size=4, num_layers=3):
        super().__init__()
        self.layers = nn.ModuleList(TupleReturningBlock(hidden_size) for _ in range(num_layers))

    def forward(self, hidden_states):
        outputs = []
        for layer in self.layers:
            hidden_states = layer(hidden_states)[0]
            outputs.append(hidden_states)
        return outputs


def test_tuple_returning_blocks():
    model = TupleReturningDecoder()
    with TargetFeatureCapture(model, [0, 2]) as capture, torch.no_grad():
        block_outputs = model(torch.randn(1, 5, 4))
    torch.testing.assert_close(capture.features, torch.cat([block_outputs[0], block_outputs[2]], dim=-1))


def test_missing_decoder_layers_name_the_model_class():
    with pytest.raises(ValueError, match="decoder layers of Linear"):
        decoder_layers(nn.Linear(2, 2))
