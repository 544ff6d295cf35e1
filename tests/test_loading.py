"""One drafter loader and one target-alone baseline, used by every command:

- `load_drafter` builds the installed `OspreyForDrafting`, never the modeling files copied beside the weights, and
  `osprey decode` / `osprey bench` load through it;
- `osprey decode --compare` and `osprey bench` decode the target alone identically (the target's own sampling filters
  off, as in the speculative loop);
- a packed drafter unpacks (`osprey unpack`) into an ordinary checkpoint that loads and drafts with transformers alone,
  in a process that cannot import this package.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_bench import models  # noqa: F401 (fixture: a near-copy target and drafter, a char tokenizer)

from osprey.cli import main
from osprey.decoding.decode import encode_prompt, speculative_generate, target_generate
from osprey.measuring.demo import REPOSITORY_DRAFTERS
from osprey.measuring.methods import load_method
from osprey.models.pack import load_drafter, pack_drafter

PROMPT = "abc abc abc"
# The SmolLM2 pilot, packed as int8 rows, kept in the repository (not shipped)
PILOT_DRAFTER_DIR = Path(__file__).resolve().parents[1] / REPOSITORY_DRAFTERS["smollm2-135m-instruct"]
INSTALLED_MODULE = "modeling_osprey.modeling_osprey"


@pytest.fixture
def saved(models, tmp_path):  # noqa: F811
    """The near-copy pair saved as a user would have them: the target with its tokenizer, and a drafter that names
    it, with the sampling filters of a chat model's generation config switched on in the target's."""
    target, drafter, _, tokenizer = models
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    generation = json.loads((target_dir / "generation_config.json").read_text())
    generation |= {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "top_k": 3, "eos_token_id": None}
    (target_dir / "generation_config.json").write_text(json.dumps(generation))
    drafter.config.target_name_or_path = str(target_dir)
    drafter.save_pretrained(drafter_dir)
    drafter.config.target_name_or_path = None
    return target_dir, drafter_dir


def test_every_loader_builds_the_installed_drafter_class_not_the_copied_files(saved, models):  # noqa: F811
    _, drafter_dir = saved
    copied = drafter_dir / "modeling_osprey.py"
    assert copied.is_file()  # save_pretrained copies the remote code beside the weights ...
    copied.write_text(copied.read_text() + "\nraise RuntimeError('the copied remote code ran')\n")  # ... a stale copy
    assert type(load_drafter(drafter_dir)).__module__ == INSTALLED_MODULE
    tokenizer = models[3]
    assert type(
        load_method("osprey", f"drafter:{drafter_dir}", tokenizer, torch.float32, "cpu").drafter
    ).__module__ == (INSTALLED_MODULE)
    assert type(load_drafter(PILOT_DRAFTER_DIR)).__module__ == INSTALLED_MODULE  # packed


def test_decode_compare_and_bench_decode_the_target_alone_alike(saved, capsys):
    target_dir, drafter_dir = saved
    args = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "24"]
    assert main(["decode", *args, "--prompt", PROMPT, "--compare"]) == 0
    report = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    assert report["identical_to_target_only"] is True

    output = target_dir.parent / "bench.json"
    prompts = target_dir.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "category": "toy"}) + "\n")
    assert main(["bench", *args, "--prompts", str(prompts), "--output", str(output)]) == 0
    rows = {row["method"]: row for row in json.loads(output.read_text())["requests"]}
    assert rows["target"]["completion"] == report["target_only_completion"] == rows["osprey"]["completion"]


def test_target_alone_ignores_the_target_generation_config_filters(saved):
    """What makes the agreement above meaningful: with the target's own filters (repetition penalty, no-repeat
    n-grams) plain `generate` decodes something else than the speculative loop, whose output `target_generate`
    reproduces."""
    target_dir, drafter_dir = saved
    from osprey.models.zoo import load_causal_lm, load_tokenizer

    target, tokenizer = load_causal_lm(target_dir).eval(), load_tokenizer(target_dir)
    input_ids = encode_prompt(tokenizer, PROMPT)
    speculative, _ = speculative_generate(target, load_drafter(drafter_dir), input_ids, max_new_tokens=24)
    assert torch.equal(target_generate(target, input_ids, 24), speculative)
    with_filters = target.generate(input_ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert not torch.equal(with_filters, speculative)  # the control: the filters change this target's output


# Run by a fresh interpreter that cannot import the package: an import hook refuses its top-level modules (the
# editable install would otherwise find them), so only transformers' remote-code copy of the drafter can load.
WITHOUT_PACKAGE = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Uninstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("osprey", "modeling_osprey", "trainers", "hub_cards"):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, Uninstalled())
    try:
        import osprey
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("the osprey package is importable: the test would prove nothing")

    import torch
    from transformers import AutoModelForCausalLM

    drafter_dir, target_dir, ids, max_new_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir, trust_remote_code=True).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    input_ids = torch.tensor([ids])
    plain = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    calls = []
    target.register_forward_pre_hook(lambda module, args: calls.append(1))
    drafter.attach_target(target)
    assisted = target.generate(
        input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    print(json.dumps({
        "module": type(drafter).__module__, "target_name_or_path": drafter.config.target_name_or_path,
        "identical": torch.equal(plain, assisted), "new_tokens": assisted.shape[1] - input_ids.shape[1],
        "target_forwards": len(calls),
    }))
    """
)


def decode_without_package(drafter_dir, target_dir, input_ids, max_new_tokens, tmp_path) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-I", "-c", WITHOUT_PACKAGE, str(drafter_dir), str(target_dir)]
    command += [json.dumps(input_ids[0].tolist()), str(max_new_tokens)]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_unpacked_drafter_drafts_with_transformers_alone(saved, tmp_path):
    target_dir, drafter_dir = saved
    pack_drafter(drafter_dir, tmp_path / "packed")
    assert main(["unpack", "--drafter", str(tmp_path / "packed"), "--output", str(tmp_path / "unpacked")]) == 0
    input_ids = torch.randint(6, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    remote = decode_without_package(tmp_path / "unpacked", target_dir, input_ids, 20, tmp_path)
    assert remote["module"].startswith("transformers_modules.")  # the checkpoint's own remote code
    assert remote["target_name_or_path"] == str(target_dir) and remote["identical"]
    assert remote["new_tokens"] / remote["target_forwards"] > 1.5  # the drafts are accepted, more than one per step


@pytest.mark.network
def test_pilot_drafter_unpacks_and_drafts_for_its_target_without_the_package(smollm2_cache, monkeypatch, tmp_path):
    """What every shipped drafter must do, checked on the SmolLM2 pilot kept in the repository: it unpacks, loads
    without the package, names its target, and through `target.generate(ids, assistant_model=drafter)` gives the
    target's own greedy output with more than one token per target forward."""
    monkeypatch.setenv("OSPREY_HOME", str(smollm2_cache))
    from osprey.models.zoo import fetch, load_tokenizer

    assert main(["unpack", "--drafter", str(PILOT_DRAFTER_DIR), "--output", str(tmp_path / "unpacked")]) == 0
    target_name = load_drafter(tmp_path / "unpacked").config.target_name_or_path
    input_ids = encode_prompt(load_tokenizer(target_name), "Write a Python function that reverses a string.")
    remote = decode_without_package(tmp_path / "unpacked", fetch(target_name), input_ids, 48, tmp_path)
    assert remote["target_name_or_path"] == "smollm2-135m-instruct" and remote["identical"]
    assert remote["new_tokens"] > remote["target_forwards"]


def test_a_drafter_packed_against_the_model_it_was_made_from_loads_and_unpacks(saved, tmp_path):
    """`osprey pack --drafter DIR --reference MODEL --delta-bits 4`: tensors copied from the reference are rebuilt
    from it, changed ones come back within half an int4 step of their change; the pack loads wherever a drafter
    directory is accepted and unpacks into a checkpoint that drafts with transformers alone."""
    target_dir, drafter_dir = saved
    drafter = load_drafter(drafter_dir)
    head = drafter.lm_head.weight  # the near-copy drafter's head is the target's: "trained" a little here
    with torch.no_grad():
        head.add_(0.05 * head.abs().amax() * torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    drafter.save_pretrained(tmp_path / "trained")
    packed = tmp_path / "packed"
    command = ["pack", "--drafter", str(tmp_path / "trained"), "--output", str(packed)]
    assert main([*command, "--reference", str(target_dir), "--delta-bits", "4"]) == 0
    entry = json.loads((packed / "osprey_pack.json").read_text())["tensors"]["lm_head.weight"]
    assert (entry["kind"], entry["ref"], entry["bits"]) == ("delta", "lm_head.weight", 4)
    loaded = load_drafter(packed)
    assert type(loaded).__module__ == INSTALLED_MODULE
    target_head = load_drafter(drafter_dir).lm_head.weight  # as saved: a copy of the target's
    change = head - target_head
    step = change.abs().amax(dim=1, keepdim=True) / 7
    assert ((loaded.lm_head.weight - head).abs() <= step / 2 + 1e-6).all()
    assert not torch.equal(loaded.lm_head.weight, target_head)
    assert main(["unpack", "--drafter", str(packed), "--output", str(tmp_path / "unpacked")]) == 0
    input_ids = torch.randint(6, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    remote = decode_without_package(tmp_path / "unpacked", target_dir, input_ids, 20, tmp_path)
    assert remote["identical"] and remote["new_tokens"] / remote["target_forwards"] > 1.5


@pytest.mark.network
def test_shipped_qwen_drafter_unpacks_and_drafts_for_its_target_without_the_package(tmp_path):
    """The same bar for the drafter `osprey demo` runs by default, packed against its zoo backbone: unpacking rebuilds
    its frozen tensors from qwen2.5-coder-0.5b-instruct (checked by SHA-256), and the checkpoint drafts for the
    1.5B target with transformers alone, token-identically (float32), more than one token per target forward."""
    from osprey.measuring.demo import QWEN_DEMO_DRAFTER_DIR
    from osprey.models.zoo import fetch, load_tokenizer

    assert main(["unpack", "--drafter", str(QWEN_DEMO_DRAFTER_DIR), "--output", str(tmp_path / "unpacked")]) == 0
    target_name = load_drafter(tmp_path / "unpacked").config.target_name_or_path
    assert target_name == "qwen2.5-coder-1.5b-instruct"
    input_ids = encode_prompt(load_tokenizer(target_name), "Write a Python function that reverses a string.")
    remote = decode_without_package(tmp_path / "unpacked", fetch(target_name), input_ids, 32, tmp_path)
    assert remote["target_name_or_path"] == target_name and remote["identical"]
    assert remote["new_tokens"] > 1.3 * remote["target_forwards"]


def test_int8_drafter_drafts_as_well_and_decodes_exactly_like_the_target(saved):
    """`load_drafter(..., quantization="int8")`: every linear layer becomes a dynamic int8 one, the drafter still
    drafts what it did (the near-copy drafter's τ stays high) and the output stays the target's own, for chains,
    trees and through `osprey bench`, which records the setting."""
    from osprey.models.zoo import load_causal_lm, load_tokenizer

    target_dir, drafter_dir = saved
    target, tokenizer = load_causal_lm(target_dir).eval(), load_tokenizer(target_dir)
    drafter, quantized = load_drafter(drafter_dir), load_drafter(drafter_dir, quantization="int8")
    linear = torch.ao.nn.quantized.dynamic.Linear
    assert not any(isinstance(module, torch.nn.Linear) for module in quantized.modules())
    assert sum(isinstance(module, linear) for module in quantized.modules()) == sum(
        isinstance(module, torch.nn.Linear) for module in drafter.modules()
    )
    input_ids = encode_prompt(tokenizer, PROMPT)
    expected = target_generate(target, input_ids, 40)
    for shape in ({}, {"draft_topk": 3, "tree_size": 6}):
        reference, reference_stats = speculative_generate(target, drafter, input_ids, max_new_tokens=40, **shape)
        output, stats = speculative_generate(target, quantized, input_ids, max_new_tokens=40, **shape)
        assert torch.equal(reference, expected) and torch.equal(output, expected)
        assert stats.tau > 2 and stats.tau >= 0.8 * reference_stats.tau

    output = target_dir.parent / "bench-int8.json"
    prompts = target_dir.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "category": "toy"}) + "\n")
    args = ["bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "24"]
    assert main([*args, "--prompts", str(prompts), "--output", str(output), "--drafter-quantization", "int8"]) == 0
    results = json.loads(output.read_text())
    assert results["settings"]["drafter_quantization"] == "int8"
    rows = {row["method"]: row for row in results["requests"]}
    assert rows["osprey"]["completion"] == rows["target"]["completion"]


def test_bad_drafter_quantization_is_refused_with_the_fix(saved):
    _, drafter_dir = saved
    with pytest.raises(ValueError, match="choose from none, int8"):
        load_drafter(drafter_dir, quantization="int4")
    with pytest.raises(ValueError, match="CPU only.*device='cpu'"):
        load_drafter(drafter_dir, device="cuda", quantization="int8")
