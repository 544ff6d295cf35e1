"""Publishing to the Hub (`osprey push`, `osprey.models.hub.push_drafter`), over real HTTP against the local fake Hub of
`hub_server.py`: what is uploaded, the generated model card, loading the drafter back with remote code, and that
failed uploads change nothing local and say what to retry."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hub_server import FakeHub
from huggingface_hub import ModelCard, constants, hf_hub_download
from safetensors.torch import load as load_safetensors
from test_convert import tiny_backbone, tiny_target_config
from test_vocab_alignment import byte_level_tokenizer, metaspace_tokenizer
from transformers import AutoModelForCausalLM

from osprey import OspreyForDrafting
from osprey.cli import main
from osprey.models import zoo
from osprey.models.hub import push_drafter
from osprey.models.model_card import TAGS, ZOO_HUB_IDS, drafter_card, hub_model_id
from osprey.stages.convert import convert

TARGET_ID = "acme/tiny-gemma"
REMOTE_CODE = {
    "configuration_osprey.py",
    "modeling_osprey.py",
    "generation_osprey.py",
    "target_features.py",
    "decoding_osprey.py",
    "custom_generate/generate.py",
    "custom_generate/decoding_osprey.py",
    "custom_generate/generation_osprey.py",
    "custom_generate/target_features.py",
}
# What a distillation run leaves beside the weights and must stay local (pickles, checkpoints, the user's notes).
LOCAL_ONLY = {"training_args.bin", "checkpoint-3/optimizer.pt", "checkpoint-3/trainer_state.json"}


def trainer_state(step: int) -> dict:
    logs = [{"step": s, "loss": 4.0 / s} for s in range(1, step + 1)] + [{"step": step, "eval_loss": 3.5}]
    return {"global_step": step, "max_steps": 2 * step, "epoch": 0.25, "train_batch_size": 4, "log_history": logs}


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A tiny drafter as `osprey convert` saves it, plus the training leftovers that must not be published."""
    folder = tmp_path_factory.mktemp("hub") / "drafter"
    source = byte_level_tokenizer()
    backbone = tiny_backbone("qwen3", len(source))
    backbone.config.name_or_path = "/work/runs/tiny-qwen3-2l"
    target_config = tiny_target_config()
    target_config.name_or_path = TARGET_ID
    convert(
        backbone, target_config, backbone_tokenizer=source, target_tokenizer=metaspace_tokenizer(), output_dir=folder
    )
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(6)))
    (folder / "checkpoint-3").mkdir()
    (folder / "checkpoint-3" / "trainer_state.json").write_text(json.dumps(trainer_state(3)))
    (folder / "checkpoint-3" / "optimizer.pt").write_bytes(os.urandom(64))
    (folder / "training_args.bin").write_bytes(os.urandom(64))
    (folder / "README.md").write_text("my own notes\n")  # replaced by the generated card on the Hub only
    return folder


@pytest.fixture(scope="module")
def bench_path(tmp_path_factory):
    """`osprey bench --output` results for the drafter, an EAGLE-3 baseline and the target alone on two suites."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for suite, category in (("spec_bench", "coding"), ("mt_bench", "writing")):
        records.append(
            {
                "method": "target",
                "suite": suite,
                "category": category,
                "num_prompts": 8,
                "tau": None,
                "tokens_per_s": 10.0,
                "speedup": 1.0,
            }
        )
        for method in ("osprey", "eagle3"):
            tau, tokens_per_s = (1 + 4 * torch.rand(2, generator=generator)).tolist()
            records.append(
                {
                    "method": method,
                    "suite": suite,
                    "category": category,
                    "num_prompts": 8,
                    "tau": tau,
                    "tokens_per_s": 10 * tokens_per_s,
                    "speedup": tokens_per_s,
                }
            )
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    path.write_text(json.dumps({"format": 1, "methods": {}, "requests": [], "records": records}))
    return path


def bench_records(bench_path) -> list[dict]:
    return json.loads(bench_path.read_text())["records"]


@pytest.fixture(scope="module")
def fake_hub():
    hub = FakeHub()
    with hub.serving():
        yield hub


@pytest.fixture
def hub(fake_hub, monkeypatch, tmp_path):
    """The fake Hub as huggingface_hub's endpoint (read at call time), a write token and an empty download cache."""
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))
    monkeypatch.setenv("HF_TOKEN", FakeHub.TOKEN)
    fake_hub.unhandled.clear()
    yield fake_hub
    assert not fake_hub.unhandled, f"clients called routes the fake Hub lacks: {fake_hub.unhandled}"


def snapshot(folder) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def assert_card_describes_the_drafter(card: ModelCard, bench_path, repo_id: str):
    assert card.data.base_model == TARGET_ID
    assert set(TAGS) <= set(card.data.tags)
    assert (card.data.library_name, card.data.pipeline_tag, card.data.license) == (
        "transformers",
        "text-generation",
        "apache-2.0",
    )
    own = {(r["suite"], r["category"]): r for r in bench_records(bench_path) if r["method"] == "osprey"}
    published = {(e.dataset_type, e.dataset_config, e.metric_type): e.metric_value for e in card.data.eval_results}
    assert published == {
        key: value
        for (suite, category), record in own.items()
        for key, value in (
            ((suite, category, "mean_acceptance_length"), record["tau"]),
            ((suite, category, "speedup"), record["speedup"]),
            ((suite, category, "tokens_per_second"), record["tokens_per_s"]),
        )
    }
    assert f'AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True' in card.text
    assert "with drafter.attached(target):" in card.text and "assistant_model=drafter" in card.text
    assert f'custom_generate="{repo_id}", trust_remote_code=True' in card.text
    assert f"`target_name_or_path: {TARGET_ID}`" in card.text  # the target the drafter records (from its config)


def test_card_names_target_backbone_alignment_training_and_results(drafter_dir, bench_path):
    card = drafter_card(drafter_dir, "osprey-tester/tiny-drafter", bench_results=bench_path)
    assert_card_describes_the_drafter(card, bench_path, "osprey-tester/tiny-drafter")
    report = json.loads((drafter_dir / "alignment_report.json").read_text())
    counts = report["alignment"]["counts"]
    assert "| " + " | ".join(str(counts[kind]) for kind in counts) + " |" in card.text
    assert "tiny-qwen3-2l (`qwen3`)" in card.text and "blocks 1, 3, 4" in card.text
    assert "6 optimizer steps of 12" in card.text  # the directory's own trainer_state.json, not the checkpoint's
    for record in bench_records(bench_path):  # the table compares every method, the target alone too
        tau = "" if record["tau"] is None else f"{record['tau']:.2f}"
        assert f"| {record['method']} | {record['suite']} | {record['category']} | 8 | {tau} |" in card.text


def test_push_publishes_a_drafter_that_loads_back_with_remote_code(hub, drafter_dir, bench_path, tmp_path, capsys):
    before = snapshot(drafter_dir)
    repo_id = "osprey-tester/tiny-drafter"
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", repo_id, "--bench-results", str(bench_path)]) == 0
    assert repo_id in capsys.readouterr().out
    assert snapshot(drafter_dir) == before

    files = hub.files(repo_id)
    published = {"config.json", "model.safetensors", "tokenizer.json", "alignment_report.json", "trainer_state.json"}
    for name in published | REMOTE_CODE:
        assert files[name] == before[name], name
    assert not LOCAL_ONLY & set(files) and files["README.md"] != before["README.md"]  # the card, not the notes
    assert json.loads(files["config.json"])["auto_map"]["AutoModelForCausalLM"] == "modeling_osprey.OspreyForDrafting"
    assert json.loads(files["generation_config.json"])["num_assistant_tokens"] == 5
    assert_card_describes_the_drafter(ModelCard.load(repo_id), bench_path, repo_id)

    drafter = OspreyForDrafting.from_pretrained(drafter_dir)
    remote = load_in_fresh_python(hub.url, repo_id, drafter, tmp_path)
    assert remote["module"].startswith("transformers_modules.")  # the published remote code, not this package
    assert remote["num_assistant_tokens"] == 5 and remote["vocab"] == len(metaspace_tokenizer())


LOAD_FROM_HUB = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo_id, inputs_path = sys.argv[1:]
    drafter = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    inputs = torch.load(inputs_path)
    with torch.no_grad():
        logits = drafter(inputs["input_ids"], target_hidden_states=inputs["features"]).logits
    tokenizer = AutoTokenizer.from_pretrained(repo_id)
    torch.save({"logits": logits, "module": type(drafter).__module__, "vocab": len(tokenizer),
                "num_assistant_tokens": drafter.generation_config.num_assistant_tokens}, inputs_path + ".out")
    """
)


def load_in_fresh_python(endpoint: str, repo_id: str, drafter: OspreyForDrafting, tmp_path) -> dict:
    """Loads `repo_id` from the Hub at `endpoint` in a new interpreter (HF_ENDPOINT is read at import) with empty
    caches, and checks its logits against `drafter`'s."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, drafter.config.vocab_size, (1, 7), generator=generator)
    features = torch.randn(1, 7, drafter.config.fused_feature_size, generator=generator)
    inputs_path = str(tmp_path / "inputs.pt")
    torch.save({"input_ids": input_ids, "features": features}, inputs_path)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-I", "-c", LOAD_FROM_HUB, repo_id, inputs_path]
    result = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = torch.load(inputs_path + ".out")
    with torch.no_grad():
        torch.testing.assert_close(remote["logits"], drafter(input_ids, target_hidden_states=features).logits)
    return remote


def test_push_drafter_publishes_the_osprey_card_with_the_tokenizer(hub, drafter_dir, bench_path):
    drafter = OspreyForDrafting.from_pretrained(drafter_dir)
    push_drafter(drafter, "pushed-from-python", private=True, bench_results=bench_path)
    repo_id = f"{FakeHub.USER}/pushed-from-python"  # no namespace given: the token's user
    files = hub.files(repo_id)
    assert hub.repos["model", repo_id].private
    assert_card_describes_the_drafter(ModelCard.load(repo_id), bench_path, repo_id)
    for name in ("tokenizer.json", "alignment_report.json", "trainer_state.json"):
        assert files[name] == (drafter_dir / name).read_bytes(), name
    weights = load_safetensors(files["model.safetensors"])
    assert all(torch.equal(weights[name], tensor) for name, tensor in drafter.state_dict().items())
    assert set(files) >= REMOTE_CODE and not LOCAL_ONLY & set(files)


def fail_commit(hub, monkeypatch):
    hub.fail_next("commit", 500)
    return ["HTTP 500", "server-side problem"]


def reject_token(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_valid_token")
    return ["HTTP 401", "hf auth login", "can write to osprey-tester"]


def take_the_network_down(hub, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    return ["network connection", f"127.0.0.1:{port}"]


@pytest.mark.parametrize("break_upload", [fail_commit, reject_token, take_the_network_down])
def test_failed_upload_changes_nothing_and_says_what_to_retry(
    hub, drafter_dir, monkeypatch, capsys, break_upload, request
):
    repo_id = f"osprey-tester/retry-{request.node.callspec.id}"
    before = snapshot(drafter_dir)
    expected = break_upload(hub, monkeypatch)
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", repo_id, "--base-model", TARGET_ID]) == 1
    message = capsys.readouterr().err
    assert "No files were committed and nothing local was changed" in message and "push again" in message
    assert all(part in message for part in expected), message
    assert snapshot(drafter_dir) == before
    assert ("model", repo_id) not in hub.repos or "README.md" not in hub.files(repo_id)

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # the cause is fixed: the same command now publishes
    monkeypatch.setenv("HF_TOKEN", FakeHub.TOKEN)
    assert main(["push", "--drafter", str(drafter_dir), "--repo-id", repo_id, "--base-model", TARGET_ID]) == 0
    assert hub.files(repo_id)["model.safetensors"] == before["model.safetensors"]


def without_config(folder):
    (folder / "config.json").unlink()
    (folder / "app.py").write_text("import gradio\n")
    return "not a saved drafter: pass the directory written by `osprey convert` or `osprey distill`. For a Gradio"


def with_another_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return "holds a 'llama' model, not an Osprey drafter"


def without_remote_code(folder):
    (folder / "target_features.py").unlink()
    return "lacks the remote-code files ['target_features.py']"


def with_pickle_weights_only(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    return "holds only pickle weights"


@pytest.mark.parametrize(
    "spoil", [without_config, with_another_model_type, without_remote_code, with_pickle_weights_only]
)
def test_folders_that_would_not_load_from_the_hub_are_refused(hub, drafter_dir, tmp_path, capsys, spoil):
    folder = tmp_path / "drafter"
    shutil.copytree(drafter_dir, folder)
    expected = spoil(folder)
    assert main(["push", "--drafter", str(folder), "--repo-id", "osprey-tester/refused"]) == 2
    assert expected in capsys.readouterr().err
    assert ("model", "osprey-tester/refused") not in hub.repos


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"method": "osprey", "suite": "mt_bench"}], "lacks ['category', 'num_prompts', 'tau'"),
        ({"requests": []}, "expected its results, with a list of `records`"),
        (
            [
                {
                    "method": "eagle3",
                    "suite": "mt_bench",
                    "category": "all",
                    "num_prompts": 1,
                    "tau": 2.0,
                    "tokens_per_s": None,
                    "speedup": None,
                }
            ],
            "No benchmark record has method 'osprey' (found: eagle3); pass --bench-method",
        ),
    ],
)
def test_bad_bench_results_are_explained(hub, drafter_dir, tmp_path, capsys, records, message):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(records))
    assert (
        main(
            ["push", "--drafter", str(drafter_dir), "--repo-id", "osprey-tester/refused", "--bench-results", str(bench)]
        )
        == 2
    )
    assert message in capsys.readouterr().err
    assert ("model", "osprey-tester/refused") not in hub.repos


SPACE_README = "---\ntitle: Osprey demo\nsdk: gradio\napp_file: app.py\n---\n\n# Osprey demo\n"


def test_push_space_uploads_a_gradio_folder(hub, tmp_path, capsys):
    space = tmp_path / "space"
    (space / "__pycache__").mkdir(parents=True)
    (space / "app.py").write_text("import gradio as gr\n\ngr.Interface(str.upper, 'text', 'text').launch()\n")
    (space / "README.md").write_text(SPACE_README)
    (space / "assets").mkdir()
    (space / "assets" / "results.json").write_text("[]\n")
    (space / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"\0")
    (space / ".env").write_text("SECRET=1\n")
    before = snapshot(space)
    assert main(["push", "--space", str(space), "--repo-id", "osprey-tester/osprey-demo"]) == 0
    assert snapshot(space) == before
    repo = hub.repos["space", "osprey-tester/osprey-demo"]
    assert repo.sdk == "gradio"
    files = hub.files("osprey-tester/osprey-demo", repo_type="space")
    assert set(files) == {".gitattributes", "app.py", "README.md", "assets/results.json"}
    downloaded = hf_hub_download("osprey-tester/osprey-demo", "app.py", repo_type="space")
    assert Path(downloaded).read_bytes() == before["app.py"]

    (space / "README.md").write_text("# no metadata\n")
    assert main(["push", "--space", str(space), "--repo-id", "osprey-tester/other-demo"]) == 2
    assert "add `sdk: gradio`" in capsys.readouterr().err


def test_zoo_models_and_hub_ids_map_to_base_models(tmp_path):
    assert set(ZOO_HUB_IDS) == set(zoo.ZOO)  # a new zoo model needs the Hub id its card will link to
    cached = zoo.cache_root(tmp_path) / "models" / "gemma-3-270m"
    assert hub_model_id(str(cached)) == hub_model_id("gemma-3-270m") == ZOO_HUB_IDS["gemma-3-270m"]
    assert hub_model_id("Qwen/Qwen2.5-Coder-1.5B-Instruct") == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert hub_model_id(str(tmp_path / "my-target")) is None and hub_model_id(None) is None


def test_push_backbone_publishes_a_plain_causal_lm_with_its_card(hub, tmp_path, capsys):
    folder = tmp_path / "backbone"
    tiny_backbone("qwen2", len(byte_level_tokenizer())).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    facts = zoo.BACKBONES[zoo.DEFAULT_BACKBONE].pack_dir / "osprey_backbone.json"
    shutil.copy2(facts, folder / facts.name)
    (folder / "optimizer.pt").write_bytes(b"\0")  # training leftovers stay local
    before = snapshot(folder)
    assert main(["push", "--backbone", str(folder), "--repo-id", "osprey-tester/backbone"]) == 0
    assert snapshot(folder) == before
    files = set(hub.files("osprey-tester/backbone"))
    assert {"model.safetensors", "config.json", "osprey_backbone.json", "tokenizer.json", "README.md"} <= files
    assert "optimizer.pt" not in files
    card = ModelCard.load(hf_hub_download("osprey-tester/backbone", "README.md"))
    assert card.data.base_model == "Qwen/Qwen2.5-Coder-0.5B-Instruct" and "drafter-backbone" in card.data.tags
    reloaded = AutoModelForCausalLM.from_pretrained("osprey-tester/backbone")  # no remote code
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"

    folder.joinpath("osprey_backbone.json").unlink()
    assert main(["push", "--backbone", str(folder), "--repo-id", "osprey-tester/other"]) == 2
    assert "not a pretrained Osprey backbone" in capsys.readouterr().err
