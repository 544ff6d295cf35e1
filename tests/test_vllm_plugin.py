"""The osprey-vllm plugin's engine-start check, without vLLM: `osprey_vllm.checks`, which decides whether an exported
drafter reads the target's token ids and taps, run on the `config.json` that `osprey export --format vllm` writes and
on stand-in target configs.

The plugin's package is imported from `serving/vllm` (its `__init__` and `checks` import nothing of vLLM).
tests/test_vllm.py runs the plugin in vLLM itself.
"""

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from osprey import OspreyConfig, OspreyForDrafting
from osprey.export import VLLM, export_drafter

PLUGIN_ROOT = Path(__file__).resolve().parents[1] / "serving" / "vllm"


@pytest.fixture(scope="module")
def plugin():
    """The plugin package, `osprey_vllm`, imported from the repository (not from an installed copy)."""
    sys.path.insert(0, str(PLUGIN_ROOT))
    try:
        package = importlib.import_module("osprey_vllm")
        assert Path(package.__file__).resolve().parent == PLUGIN_ROOT / "osprey_vllm"
        yield SimpleNamespace(package=package, checks=importlib.import_module("osprey_vllm.checks"))
    finally:
        sys.path.remove(str(PLUGIN_ROOT))


# --- the engine-start check ------------------------------------------------------------------------------------


def stand_in_vllm_config(num_layers=8, vocab_size=256, hidden_size=128, model="targets/tiny-qwen2"):
    """What check_drafter reads of vLLM's `VllmConfig`: the target's shapes and the drafter's path."""
    model_config = SimpleNamespace(
        model=model,
        get_vocab_size=lambda: vocab_size,
        get_hidden_size=lambda: hidden_size,
        get_total_num_hidden_layers=lambda: num_layers,
    )
    return SimpleNamespace(model_config=model_config, speculative_config=SimpleNamespace(model="drafter-vllm"))


@pytest.fixture(scope="module")
def exported_config(tmp_path_factory):
    """The config.json `osprey export --format vllm` writes for a drafter of a 128-wide, 8-block target tapped at
    blocks 1, 3 and 7 (the last), as vLLM's transformers parses it: attributes."""
    config = OspreyConfig(
        vocab_size=256,
        draft_vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        target_hidden_size=128,
        target_layer_ids=[1, 3, 7],
        residual_stream="tokens",
        target_name_or_path="targets/tiny-qwen2",
    )
    torch.manual_seed(0)
    output = export_drafter(OspreyForDrafting(config), VLLM, tmp_path_factory.mktemp("export") / "drafter-vllm")
    return json.loads((output / "config.json").read_text())


def test_the_plugin_accepts_what_osprey_export_writes_for_the_target_it_fits(plugin, exported_config):
    assert exported_config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 8]
    plugin.checks.check_drafter(SimpleNamespace(**exported_config), stand_in_vllm_config())


def test_the_tap_bound_is_the_layers_vllm_collects(plugin):
    """vLLM collects aux id k after the first k layers have run, k = 0..L: aux id L (Osprey's tap on the last block,
    L - 1) is collected, and tests/test_vllm.py serves a drafter tapping it; L + 1 never is."""
    assert plugin.checks.tap_problem([2, 4, 8], 8) is None
    assert plugin.checks.tap_problem([1, 4, 8], 8) is None
    assert plugin.checks.tap_problem([2, 4, 9], 8) == (
        "8 decoder layers (the drafter taps the outputs of blocks [1, 3, 8]; this target has blocks 0 to 7)"
    )
    assert plugin.checks.tap_problem([0, 4, 8], 8) is not None  # aux id 0 is the embedding, no Osprey tap


@pytest.mark.parametrize(
    "target, message",
    [
        ({"num_layers": 7}, r"has 7 decoder layers \(the drafter taps the outputs of blocks \[1, 3, 7\]; this target"),
        ({"vocab_size": 300}, r"a vocabulary of 300 tokens \(the drafter's: 256\)"),
        ({"hidden_size": 96}, r"hidden size 96 \(the drafter's fc reads 128\)"),
    ],
)
def test_a_target_the_drafter_does_not_fit_is_refused_naming_the_fix(plugin, exported_config, target, message):
    with pytest.raises(ValueError, match=message) as refusal:
        plugin.checks.check_drafter(SimpleNamespace(**exported_config), stand_in_vllm_config(**target))
    assert "`osprey convert` / `osprey distill` (taps from `--target-layers`" in str(refusal.value)


def test_an_unknown_format_version_is_refused(plugin, exported_config):
    with pytest.raises(ValueError, match=r"format version 2; this osprey-vllm plugin reads version 1"):
        plugin.checks.check_drafter(
            SimpleNamespace(**{**exported_config, "osprey_format_version": 2}), stand_in_vllm_config()
        )
