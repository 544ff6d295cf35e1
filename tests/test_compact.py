"""Compact checkpoints (`osprey pack` / `osprey unpack`): what references the zoo model is rebuilt exactly and checked,
the rest comes back within the stated int8 error."""

import gzip
import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_vocab_alignment import byte_level_tokenizer

from osprey.models.compact import PACK_MANIFEST, int3_clip, pack, pack_size_mib, unpack
from osprey.stages.prune import _rebuild


@pytest.fixture
def parent_dir(tiny_target_factory, tmp_path):
    parent = tiny_target_factory("qwen2", vocab_size=512)
    parent.save_pretrained(tmp_path / "parent")
    return tmp_path / "parent"


def pruned_and_trained(parent_dir, tmp_path):
    """A backbone of the parent's blocks 0, 3 and 5, whose second block's query projection was then 'trained'."""
    from transformers import AutoModelForCausalLM

    parent = AutoModelForCausalLM.from_pretrained(parent_dir)
    model = _rebuild(parent, [0, 3, 5], {"strategy": "block-influence", "kept_layers": [0, 3, 5]})
    weight = model.model.layers[1].self_attn.q_proj.weight
    with torch.no_grad():
        weight.add_(0.01 * torch.randn_like(weight))
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def int8_row_bound(tensor: torch.Tensor) -> torch.Tensor:
    """Half a quantisation step per row: the most round-to-nearest int8 with absmax scaling can be off by."""
    return tensor.abs().amax(dim=1, keepdim=True) / 127 / 2 + 1e-7


def test_pack_references_frozen_copies_and_stores_changes_as_int8_deltas(parent_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("osprey.models.compact.MIN_GZIPPED_FILE_BYTES", 0)  # these small files stand in for large ones
    model_dir = pruned_and_trained(parent_dir, tmp_path)
    (model_dir / "trainer_state.json").write_text('{"global_step": 7}')
    (parent_dir / "vocab.txt").write_text("a vocabulary file")
    shutil.copy(parent_dir / "vocab.txt", model_dir / "vocab.txt")
    byte_level_tokenizer().save_pretrained(parent_dir)
    byte_level_tokenizer().save_pretrained(model_dir)  # what a trainer's checkpoint holds
    tokenizer_files = sorted(path.name for path in model_dir.glob("tokenizer*"))
    packed = pack(model_dir, tmp_path / "packed", reference=str(parent_dir))
    files = json.loads((packed / PACK_MANIFEST).read_text())["files"]
    assert {files[name]["from"] for name in [*tokenizer_files, "vocab.txt", "config.json"]} == {"gzip"}
    assert (packed / "vocab.txt.gz").is_file() and not (packed / "vocab.txt").exists()
    entries = json.loads((packed / PACK_MANIFEST).read_text())["tensors"]
    kinds = {name: entry["kind"] for name, entry in entries.items()}
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == "ref"
    assert entries["model.layers.2.mlp.up_proj.weight"] == {  # an untouched block: a copy of the parent's block 5
        "dtype": "float32", "shape": [128, 64], "kind": "ref", "ref": "model.layers.5.mlp.up_proj.weight",
        "sha256": entries["model.layers.2.mlp.up_proj.weight"]["sha256"],
    }  # fmt: skip
    assert kinds["model.layers.1.self_attn.q_proj.weight"] == "delta"
    assert entries["model.layers.1.self_attn.q_proj.weight"]["ref"] == "model.layers.3.self_attn.q_proj.weight"
    assert kinds["model.norm.weight"] == "raw"  # vectors are stored as they are
    original = load_file(model_dir / "model.safetensors")
    packed_bytes = (packed / "packed.safetensors").stat().st_size
    assert packed_bytes < 0.05 * (model_dir / "model.safetensors").stat().st_size

    restored = load_file(unpack(packed, tmp_path / "restored") / "model.safetensors")
    assert restored.keys() == original.keys()
    parent = load_file(parent_dir / "model.safetensors")
    for name, tensor in original.items():
        if kinds[name] == "delta":
            change = tensor - parent[entries[name]["ref"]]
            assert ((restored[name] - tensor).abs() <= int8_row_bound(change)).all(), name
            assert not torch.equal(restored[name], parent[entries[name]["ref"]])
        else:
            assert torch.equal(restored[name], tensor), name
    assert json.loads((tmp_path / "restored" / "trainer_state.json").read_text()) == {"global_step": 7}
    for name in tokenizer_files + ["vocab.txt"]:
        assert (tmp_path / "restored" / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (tmp_path / "restored" / "config.json").is_file()


def test_rows_of_a_reference_matrix_are_stored_as_indices(parent_dir, tmp_path):
    weights = load_file(parent_dir / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    embedding[5, 1] = 0.0
    save_file(weights, str(parent_dir / "model.safetensors"), metadata={"format": "pt"})
    rows = [5, 3, 9, 3, 0]
    special = embedding[rows].clone()
    special[2] = 0.5  # a row that is no copy (a converted drafter's special token)
    copied = embedding[rows].clone()
    copied[0, 1] = -0.0  # a copy made arithmetically: equal values, another sign of zero
    (tmp_path / "drafter").mkdir()
    save_file({"embed.weight": copied, "special.weight": special, "fc.weight": torch.randn(4, 8)},
              str(tmp_path / "drafter" / "model.safetensors"))  # fmt: skip
    packed = pack(tmp_path / "drafter", tmp_path / "packed", reference=str(parent_dir))
    entries = json.loads((packed / PACK_MANIFEST).read_text())["tensors"]
    assert entries["embed.weight"]["kind"] == entries["special.weight"]["kind"] == "ref"
    assert entries["fc.weight"]["kind"] == "int8"
    assert load_file(packed / "packed.safetensors")["special.weight.patch"].shape == (1, 64)
    restored = load_file(unpack(packed, tmp_path / "restored") / "model.safetensors")
    assert torch.equal(restored["embed.weight"], embedding[rows])
    assert torch.equal(restored["special.weight"], special)


def test_without_a_reference_matrices_are_int8_rows_within_half_a_step(tmp_path):
    (tmp_path / "model").mkdir()
    weights = {"w": torch.randn(16, 32) * torch.linspace(0.1, 10, 16)[:, None], "norm": torch.rand(32)}
    save_file(weights, str(tmp_path / "model" / "model.safetensors"))
    packed = pack(tmp_path / "model", tmp_path / "packed")
    restored = load_file(unpack(packed, tmp_path / "restored") / "model.safetensors")
    assert ((restored["w"] - weights["w"]).abs() <= int8_row_bound(weights["w"])).all()
    assert torch.equal(restored["norm"], weights["norm"])
    assert pack_size_mib(packed) < pack_size_mib(tmp_path / "model")
    bf16 = load_file(unpack(pack(tmp_path / "model", tmp_path / "bf16", dtype="bfloat16"), tmp_path / "r2")
                     / "model.safetensors")  # fmt: skip
    assert torch.equal(bf16["w"], weights["w"].to(torch.bfloat16).float())


def test_a_changed_reference_is_refused_with_the_fix(parent_dir, tmp_path):
    model_dir = pruned_and_trained(parent_dir, tmp_path)
    packed = pack(model_dir, tmp_path / "packed", reference=str(parent_dir))
    weights = load_file(parent_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][7, 0] += 1.0
    save_file(weights, str(parent_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match the SHA-256.*osprey fetch"):
        unpack(packed, tmp_path / "restored")
    with pytest.raises(ValueError, match="already exists"):
        pack(model_dir, packed, reference=str(parent_dir))
    with pytest.raises(ValueError, match="osprey pack"):
        unpack(model_dir, tmp_path / "other")


def test_a_file_an_older_pack_takes_from_the_reference_is_still_rebuilt_and_checked(parent_dir, tmp_path):
    """Packs written before 2026-12-04 record large files identical to the reference's as `"from": "file"`."""
    model_dir = pruned_and_trained(parent_dir, tmp_path)
    for directory in (parent_dir, model_dir):
        (directory / "vocab.txt").write_text("{}" * 2**20)
    packed = pack(model_dir, tmp_path / "packed", reference=str(parent_dir))
    manifest = json.loads((packed / PACK_MANIFEST).read_text())
    manifest["files"]["vocab.txt"]["from"] = "file"
    (packed / PACK_MANIFEST).write_text(json.dumps(manifest))
    (packed / "vocab.txt.gz").unlink()
    assert (unpack(packed, tmp_path / "restored") / "vocab.txt").read_text() == "{}" * 2**20
    (parent_dir / "vocab.txt").write_text('{"changed": 1}' * 2**20)
    with pytest.raises(ValueError, match="'vocab.txt' rebuilt from .*does not match the SHA-256"):
        unpack(packed, tmp_path / "restored-again")


def test_files_travel_with_the_pack_so_a_later_reference_may_differ_in_them(parent_dir, tmp_path):
    """A drafter's checkpoint packed against its own init: the init is rebuilt on the next machine by a later
    version of the library, whose remote code, configs and saved tokenizer may differ. Files other than tensors are
    copied, large ones (a tokenizer) gzipped, so the pack unpacks exactly against that later reference."""
    model_dir = pruned_and_trained(parent_dir, tmp_path)
    for directory in (parent_dir, model_dir):
        (directory / "modeling_osprey.py").write_text("# the library's remote code\n")
        (directory / "big.bin").write_bytes(b"x" * 2**20)
    packed = pack(model_dir, tmp_path / "packed", reference=str(parent_dir))
    assert json.loads((packed / PACK_MANIFEST).read_text())["files"] == {
        "big.bin": {"sha256": hashlib.sha256(b"x" * 2**20).hexdigest(), "from": "gzip"}
    }
    assert (packed / "modeling_osprey.py").is_file() and not (packed / "big.bin").exists()
    assert (packed / "big.bin.gz").stat().st_size < 2**20 / 100
    (parent_dir / "modeling_osprey.py").write_text("# a later version\n")
    (parent_dir / "big.bin").write_bytes(b"y" * 2**20)
    restored = unpack(packed, tmp_path / "restored")
    assert (restored / "modeling_osprey.py").read_text() == "# the library's remote code\n"
    assert (restored / "big.bin").read_bytes() == b"x" * 2**20
    assert not (restored / "big.bin.gz").exists()
    with gzip.open(packed / "big.bin.gz", "wb") as file:  # control: what comes out of the pack is checked
        file.write(b"z" * 2**20)
    with pytest.raises(ValueError, match="big.bin.gz does not unpack to the file that was packed"):
        unpack(packed, tmp_path / "restored-again")


def test_a_packed_optimizer_keeps_its_groups_so_the_schedule_resumes(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "checkpoint" / "optimizer.pt")
    save_file({"w": weight.detach()}, str(tmp_path / "checkpoint" / "model.safetensors"))
    packed = pack(tmp_path / "checkpoint", tmp_path / "packed")
    state = torch.load(packed / "optimizer.pt", weights_only=True)
    assert state["state"] == {} and state["param_groups"] == optimizer.state_dict()["param_groups"]
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 4))], lr=0.5)
    fresh.load_state_dict(state)  # what Trainer does on resume
    assert fresh.param_groups[0]["lr"] == 0.1


def test_cli_pack_and_unpack(parent_dir, tmp_path, capsys):
    from osprey.cli import main

    model_dir = pruned_and_trained(parent_dir, tmp_path)
    argv = ["pack", "--checkpoint", str(model_dir), "--output", str(tmp_path / "p"), "--reference", str(parent_dir)]
    assert main(argv) == 0
    assert main(["unpack", "--checkpoint", str(tmp_path / "p"), "--output", str(tmp_path / "u")]) == 0
    assert load_file(tmp_path / "u" / "model.safetensors").keys() == load_file(model_dir / "model.safetensors").keys()
    assert main(["unpack", "--checkpoint", str(model_dir), "--output", str(tmp_path / "v")]) == 2
    assert "written by `osprey pack --checkpoint`" in capsys.readouterr().err
    argv = ["pack", "--drafter", str(model_dir), "--output", str(tmp_path / "w"), "--reference", str(parent_dir)]
    assert main(argv) == 2 and "not an Osprey drafter" in capsys.readouterr().err  # --drafter packs drafters only
    assert not (tmp_path / "w").exists()


def test_a_trained_draft_head_is_a_delta_from_its_reference_rows_and_fewer_bits_shrink_the_deltas(parent_dir, tmp_path):
    """A converted drafter's LM head starts as the reference's rows of its `draft_to_target` ids; after training it is
    stored as the change from those rows. With delta_bits=4 (or 3) each change comes back within half an int4 (3-bit)
    step, in half (three eighths) of the int8 size; 3-bit rows saturate at `int3_clip`."""
    embedding = load_file(parent_dir / "model.safetensors")["model.embed_tokens.weight"]
    draft_to_target = torch.tensor([7, 2, 300, 41, 5, 511])
    head = embedding[draft_to_target] + 0.05 * torch.randn(6, 64) * embedding[draft_to_target].abs().amax()
    far = torch.randn(6, 64) * 100  # no longer near the rows it started from: stored whole
    (tmp_path / "drafter").mkdir()
    save_file({"lm_head.weight": head, "other_head.weight": far, "draft_to_target": draft_to_target},
              str(tmp_path / "drafter" / "model.safetensors"))  # fmt: skip
    sizes = {}
    for bits in (8, 4, 3):
        packed = pack(tmp_path / "drafter", tmp_path / f"packed{bits}", reference=str(parent_dir), delta_bits=bits)
        entries = json.loads((packed / PACK_MANIFEST).read_text())["tensors"]
        assert entries["lm_head.weight"] | {"ref_sha256": None} == {
            "dtype": "float32", "shape": [6, 64], "kind": "delta", "ref": "model.embed_tokens.weight",
            "ref_sha256": None, "rows": "draft_to_target", "bits": bits,
        }  # fmt: skip
        assert entries["other_head.weight"]["kind"] == "int8"
        restored = load_file(unpack(packed, tmp_path / f"restored{bits}") / "model.safetensors")
        change = head - embedding[draft_to_target]
        clip = int3_clip(change) if bits == 3 else change.abs().amax(dim=1, keepdim=True)  # 3 bits saturate
        step = clip / {8: 127, 4: 7, 3: 3}[bits]
        error = (restored["lm_head.weight"] - head).abs()
        assert ((error <= step / 2 + 1e-6) | (change.abs() > clip)).all()
        assert (error - (change.abs() - clip).clamp(min=0) <= step / 2 + 1e-6).all()
        assert error.norm() < {8: 0.01, 4: 0.15, 3: 0.3}[bits] * change.norm()
        assert not torch.equal(restored["lm_head.weight"], embedding[draft_to_target])
        assert torch.equal(restored["draft_to_target"], draft_to_target)
        sizes[bits] = load_file(packed / "packed.safetensors")["lm_head.weight"].numel()
    assert sizes[4] * 2 == sizes[8] and sizes[3] * 8 == sizes[8] * 3
    with pytest.raises(ValueError, match="delta_bits must be one of"):
        pack(tmp_path / "drafter", tmp_path / "packed2", reference=str(parent_dir), delta_bits=2)
