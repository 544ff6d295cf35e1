"""`osprey demo` and the packed (int8-row) drafter format: packing round-trips within its quantization error and
still decodes losslessly; the packaged drafter is there, small, names its target and is package data; the SmolLM2
pilot kept in the repository loads and drafts through `osprey demo --drafter`; the CLI runs end to end and refuses
bad input."""

import json
from pathlib import Path

import pytest
import tomllib
import torch
from test_bench import models  # noqa: F401 (fixture: a near-copy target and drafter, a char tokenizer)
from test_decoding import plain_greedy, prompt
from test_near_tie import take_the_second_best

from osprey import OspreyForDrafting
from osprey.cli import main
from osprey.decoding.decode import speculative_generate
from osprey.decoding.near_tie import ROUNDING, UNEXPLAINED
from osprey.measuring.demo import DEMO_CONFIDENCE_THRESHOLD, DEMO_PROMPTS, DEMO_TARGET, DEMOS, REPOSITORY_DRAFTERS
from osprey.models.compact import PACK_MANIFEST, PACK_WEIGHTS, read_manifest
from osprey.models.pack import PACKED_WEIGHTS, load_drafter, pack_drafter
from osprey.models.zoo import ZOO

REPOSITORY = Path(__file__).resolve().parents[1]
PILOT = "smollm2-135m-instruct"
PILOT_DRAFTER_DIR = REPOSITORY / REPOSITORY_DRAFTERS[PILOT]  # the SmolLM2 pilot: packed, int8 rows, not shipped


@pytest.fixture
def packed(models, tmp_path):  # noqa: F811
    target, drafter, _, tokenizer = models
    drafter.save_pretrained(tmp_path / "drafter")
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    pack_drafter(tmp_path / "drafter", tmp_path / "packed", target_name_or_path=str(tmp_path / "target"))
    return target, drafter, tmp_path


def test_packed_drafter_round_trips_within_int8_row_error(packed):
    _, drafter, tmp_path = packed
    restored = load_drafter(tmp_path / "packed")
    assert restored.config.target_name_or_path == str(tmp_path / "target")
    restored.config.target_name_or_path = drafter.config.target_name_or_path
    assert restored.config.to_diff_dict() | {"_name_or_path": ""} == drafter.config.to_diff_dict() | {
        "_name_or_path": ""
    }
    original = drafter.state_dict()
    quantized = 0
    for name, tensor in restored.state_dict().items():
        reference = original[name]
        if reference.is_floating_point() and reference.dim() == 2:
            row_step = reference.abs().amax(dim=1, keepdim=True) / 127
            assert ((tensor - reference).abs() <= row_step / 2 + 1e-7).all(), name
            quantized += not torch.equal(tensor, reference)
        else:
            assert torch.equal(tensor, reference), name
    assert quantized >= 2  # really quantized: the embedding and the LM head at least


def test_dequantized_drafter_decodes_losslessly(packed):
    target, _, tmp_path = packed
    drafter = load_drafter(tmp_path / "packed")
    input_ids = prompt(9, 1)
    output, stats = speculative_generate(target, drafter, input_ids, max_new_tokens=30)
    assert torch.equal(output, plain_greedy(target, input_ids, 30))
    assert sum(stats.accepted_per_step) > 0


def test_demo_cli_runs_the_target_the_drafter_names(packed, tmp_path, capsys):
    output = tmp_path / "demo" / "results.json"
    assert main(["demo", "--drafter", str(tmp_path / "packed"), "--max-new-tokens", "6", "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert results["target"] == str(tmp_path / "target")  # picked from the drafter's config
    assert results["settings"]["confidence_threshold"] == DEMO_CONFIDENCE_THRESHOLD > 0  # the demo stops early
    assert {row["method"] for row in results["requests"]} == {"target", "osprey"}
    assert {row["prompt_id"] for row in results["requests"]} == {p.prompt_id for p in DEMO_PROMPTS}
    printed = capsys.readouterr().out
    assert "| osprey |" in printed and "| target |" in printed


def test_demo_flags_override_the_drafting_shape(packed, tmp_path, capsys):
    output = tmp_path / "demo" / "results.json"
    shape = ["--draft-topk", "2", "--tree-size", "3", "--prompt-lookup-num-tokens", "4"]
    assert (
        main(["demo", "--drafter", str(tmp_path / "packed"), "--max-new-tokens", "8", *shape, "--output", str(output)])
        == 0
    )
    results = json.loads(output.read_text())
    settings = results["settings"]
    assert (settings["draft_topk"], settings["tree_size"], settings["prompt_lookup_num_tokens"]) == (2, 3, 4)
    assert settings["confidence_threshold"] == 0  # early stop is for chains
    outputs = {(row["method"], row["prompt_id"]): row["output_sha256"] for row in results["requests"]}
    assert all(outputs["osprey", p.prompt_id] == outputs["target", p.prompt_id] for p in DEMO_PROMPTS)  # float32
    assert main(["demo", "--target", "gemma-3-270m"]) == 2
    assert "No drafter ships for 'gemma-3-270m'" in capsys.readouterr().err


def test_pack_and_demo_refuse_bad_input(packed, tmp_path, capsys):
    _, drafter, _ = packed
    assert drafter.config.target_name_or_path is None  # built in memory: no recorded target
    assert main(["pack", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "again")]) == 2
    assert "--target" in capsys.readouterr().err and not (tmp_path / "again").exists()
    assert (
        main(["pack", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "packed"), "--target", "x"])
        == 2
    )
    assert "not an empty directory" in capsys.readouterr().err  # nothing saved is overwritten
    assert main(["demo", "--drafter", str(tmp_path / "drafter")]) == 2  # names no target
    assert "--target" in capsys.readouterr().err
    with pytest.raises(ValueError, match="packed drafter.*osprey.load_drafter.*osprey unpack"):
        OspreyForDrafting.from_pretrained(tmp_path / "packed")  # not "no file named model.safetensors"
    assert main(["unpack", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "out")]) == 2
    assert "not a packed drafter" in capsys.readouterr().err
    assert main(["push", "--drafter", str(tmp_path / "packed"), "--repo-id", "you/packed"]) == 2  # before any upload
    assert "osprey unpack" in capsys.readouterr().err


def test_packaged_drafters_are_small_name_their_targets_and_are_package_data():
    package_data = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = [f"{choice.drafter_dir.name}/*" for choice in DEMOS.values()]
    assert package_data["osprey"] == [*shipped, "backbones/*/*"]  # all it ships: the drafters and the backbones
    for target_name, choice in DEMOS.items():  # every drafter the package ships, under the 50 MB a product may take
        files = {path.name: path.stat().st_size for path in choice.drafter_dir.iterdir()}
        assert "README.md" in files and "config.json" in files and sum(files.values()) <= 50 * 2**20, target_name
        assert {PACK_MANIFEST, PACK_WEIGHTS} <= files.keys(), target_name  # packed against a zoo model
        config = json.loads((choice.drafter_dir / "config.json").read_text())
        assert config["target_name_or_path"] == target_name
        assert read_manifest(choice.drafter_dir)["reference"] in ZOO  # rebuilt from the zoo, no Hub access
    assert DEMO_TARGET in DEMOS and PILOT not in DEMOS


def test_the_pilot_drafter_kept_in_the_repository_loads_and_is_named_when_asked_for(capsys):
    files = {path.name for path in PILOT_DRAFTER_DIR.iterdir()}
    assert PACKED_WEIGHTS in files and "README.md" in files
    drafter = load_drafter(PILOT_DRAFTER_DIR)
    assert drafter.config.target_name_or_path == PILOT and drafter.config.vocab_size == 49152
    assert drafter.config.draft_vocab_size < drafter.config.vocab_size
    assert main(["demo", "--target", PILOT]) == 2  # it does not ship: the error names it
    err = capsys.readouterr().err
    assert f"No drafter ships for '{PILOT}'" in err and f"--drafter {REPOSITORY_DRAFTERS[PILOT]}" in err


@pytest.mark.network
def test_packaged_drafter_drafts_for_the_real_target(smollm2_cache, monkeypatch, tmp_path):
    """`osprey demo --drafter` with the SmolLM2 pilot: the real SmolLM2 target, float32, so every output must equal
    the target's own, and the pilot's drafts are accepted."""
    monkeypatch.setenv("OSPREY_HOME", str(smollm2_cache))
    output = tmp_path / "demo.json"
    command = ["demo", "--target", PILOT, "--drafter", str(PILOT_DRAFTER_DIR), "--max-new-tokens", "24"]
    assert main([*command, "--output", str(output)]) == 0
    results = json.loads(output.read_text())
    assert results["settings"]["confidence_threshold"] == DEMO_CONFIDENCE_THRESHOLD  # chains stop early, as before
    outputs = {(row["method"], row["prompt_id"]): row["output_sha256"] for row in results["requests"]}
    assert all(outputs["osprey", p.prompt_id] == outputs["target", p.prompt_id] for p in DEMO_PROMPTS)
    overall = next(r for r in results["records"] if r["method"] == "osprey" and r["category"] == "overall")
    assert overall["tau"] > 1.05, overall  # its drafts are accepted, with headroom for noise


@pytest.mark.network
def test_demo_in_bf16_explains_every_difference_and_fails_on_a_wrong_verification(smollm2_cache, monkeypatch, tmp_path):
    """In bfloat16 an output may leave the target's own decoding only where the replay shows rounding flipped a near
    tie (`osprey.decoding.near_tie.replay`); the control, a verification that takes the target's second-best token,
    makes `osprey demo` fail, every one of its differing outputs flagged."""
    monkeypatch.setenv("OSPREY_HOME", str(smollm2_cache))
    command = ["demo", "--target", PILOT, "--drafter", str(PILOT_DRAFTER_DIR), "--max-new-tokens", "24"]
    command += ["--dtype", "bfloat16"]

    def labels(output):
        rows = json.loads(output.read_text())["requests"]
        return [row["divergence"]["label"] for row in rows if row["method"] == "osprey" and row["divergence"]]

    assert main([*command, "--output", str(tmp_path / "honest.json")]) == 0
    assert set(labels(tmp_path / "honest.json")) <= {ROUNDING}  # some outputs may differ, each by rounding
    take_the_second_best(monkeypatch)
    assert main([*command, "--output", str(tmp_path / "wrong.json")]) == 1
    assert set(labels(tmp_path / "wrong.json")) == {UNEXPLAINED}


def test_demo_loads_the_shipped_drafter_in_its_measured_quantization_unless_told(monkeypatch):
    """The Qwen demo drafts with the int8 drafter it was measured with; `--drafter-quantization none` overrides it."""
    import osprey.measuring.demo

    seen = []

    def loading(directory, dtype, quantization="none"):
        seen.append(quantization)
        raise RuntimeError("loaded")

    monkeypatch.setattr(osprey.measuring.demo, "load_drafter", loading)
    monkeypatch.setattr(osprey.measuring.demo, "_announce_fetches", lambda *args: None)
    for override in (None, "none"):
        with pytest.raises(RuntimeError, match="loaded"):
            osprey.measuring.demo.run_demo(DEMO_TARGET, drafter_quantization=override)
    assert seen == ["int8", "none"]
    assert DEMOS[DEMO_TARGET].settings["drafter_quantization"] == "int8"
