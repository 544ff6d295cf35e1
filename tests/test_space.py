"""The Gradio Space (space/): its event functions on a tiny target and drafter, and the served app driven through
gradio_client the way a visitor's browser drives it."""

import json
import shutil
import socket
import sys
from pathlib import Path

import gradio as gr
import pytest
import torch
from gradio_client import Client
from test_decoding import near_copy_pair, random_drafter
from test_vocab_alignment import byte_level_tokenizer

from osprey.decode import speculative_generate
from osprey.demo import DEMO_DRAFTER_DIR
from osprey.pack import load_drafter, pack_drafter

# space/ is the Space's root folder, not a package: its modules import each other by plain name.
SPACE_DIR = Path(__file__).resolve().parents[1] / "space"
sys.path.insert(0, str(SPACE_DIR))
from allowlist import ModelCatalog, TargetChoice  # noqa: E402 (found through the path above)
from app import benchmark_outputs, build_demo  # noqa: E402
from live_decoding import ACCEPTED, OUTPUT_NAMES, TARGET, Limits, OspreySpace, SegmentedText  # noqa: E402

PROMPT = "Translate into German: good morning"
MAX_NEW_TOKENS = 40
LIMITS = Limits(max_prompt_chars=200, max_new_tokens=64)


def tiny_tokenizer():
    """Byte-level, one token per byte: 4 specials + 252 bytes fill the tiny targets' 256-token vocabulary."""
    return byte_level_tokenizer(words=(), missing_bytes=(0, 1, 2, 3))


@pytest.fixture(scope="module")
def tiny_models():
    target, drafter = near_copy_pair("llama")  # drafts are often, not always, accepted
    target.generation_config.eos_token_id = None  # runs to max_new_tokens: every step's tokens are all emitted
    return target, tiny_tokenizer(), drafter


@pytest.fixture(scope="module")
def space(tiny_models, tmp_path_factory):
    target, tokenizer, drafter = tiny_models
    catalog = ModelCatalog({"tiny-llama": TargetChoice(lambda: (target, tokenizer), {"near-copy": lambda: drafter})})
    return OspreySpace(catalog, LIMITS, results_dir=tmp_path_factory.mktemp("results"))


def plain_greedy_text(target, tokenizer, max_new_tokens) -> str:
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    output = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_generate_streams_highlighted_osprey_output_equal_to_the_target_alone(space, tiny_models):
    target, tokenizer, drafter = tiny_models
    rows = [dict(zip(OUTPUT_NAMES, row)) for row in space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 40)]
    final = rows[-1]
    osprey_text = "".join(text for text, _ in final["osprey"])
    assert osprey_text == final["target_only"] == plain_greedy_text(target, tokenizer, MAX_NEW_TOKENS)
    assert {label for _, label in final["osprey"]} == {ACCEPTED, TARGET}

    # Streamed: the Osprey text grows step by step before the target-only run starts, which then grows too.
    osprey_stream = ["".join(text for text, _ in row["osprey"]) for row in rows if not row["target_only"]]
    target_stream = [row["target_only"] for row in rows if row["target_only"]]
    assert len(osprey_stream) > 3 and len(target_stream) > 3
    assert all(final["target_only"].startswith(text) for text in osprey_stream + target_stream)

    # Statistics: τ is tokens per verification step (the prefill's token decided before any), as decode reports it.
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    _, stats = speculative_generate(target, drafter, input_ids, max_new_tokens=MAX_NEW_TOKENS, num_draft_tokens=4)
    assert (final["new_tokens"], final["verify_steps"]) == (str(MAX_NEW_TOKENS), str(stats.verify_steps))
    assert final["tau"] == f"{stats.tau:.2f}" == f"{(MAX_NEW_TOKENS - 1) / stats.verify_steps:.2f}"
    osprey_rate, target_rate = float(final["osprey_tokens_per_s"]), float(final["target_tokens_per_s"])
    assert float(final["speedup"]) == pytest.approx(osprey_rate / target_rate, rel=0.02)
    assert all(row["speedup"] == "" for row in rows[:-1])  # blank until both runs are timed


def test_early_stop_shortens_the_chains_and_keeps_the_output(space, tiny_models):
    target, tokenizer, _ = tiny_models
    finals = {}
    for threshold in (0.0, 1.0):  # 1: every chain ends after its first draft
        *_, last = space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, MAX_NEW_TOKENS, threshold)
        finals[threshold] = dict(zip(OUTPUT_NAMES, last))
    for final in finals.values():
        assert "".join(text for text, _ in final["osprey"]) == plain_greedy_text(target, tokenizer, MAX_NEW_TOKENS)
    assert float(finals[1.0]["tau"]) <= 2 < float(finals[0.0]["tau"])


def test_segmented_text_holds_back_a_character_until_its_last_byte(space):
    tokenizer = tiny_tokenizer()
    ids = tokenizer("a长", add_special_tokens=False)["input_ids"]  # 1 + 3 byte tokens
    text = SegmentedText(tokenizer)
    text.add(ids[:2], ACCEPTED)
    assert text.segments == [("a", ACCEPTED)]
    text.add(ids[2:3], TARGET)
    assert text.text == "a"
    text.add(ids[3:], TARGET)
    assert text.segments == [("a", ACCEPTED), ("长", TARGET)]

    unfinished = SegmentedText(tokenizer)
    unfinished.add(ids[:2], TARGET)
    unfinished.add([], TARGET, final=True)  # generation ended mid-character: shown as the tokenizer decodes it
    assert unfinished.text == tokenizer.decode(ids[:2]) and unfinished.text.endswith("\ufffd")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            (PROMPT, "../../etc/passwd", "near-copy", 4, 0, 8),
            "Unknown target '../../etc/passwd'; choose one of: tiny-llama",
        ),
        ((PROMPT, "tiny-llama", "/tmp/drafter", 4, 0, 8), "Unknown drafter '/tmp/drafter'"),
        ("x" * 201, "The prompt has 201 characters; this Space takes at most 200"),
        ("   ", "Type a prompt"),
        ((PROMPT, "tiny-llama", "near-copy", 4, 0, 65), "Max new tokens must be between 1 and 64"),
        ((PROMPT, "tiny-llama", "near-copy", 0, 0, 8), "Draft length must be between 1 and 10"),
        ((PROMPT, "tiny-llama", "near-copy", 4, 2.5, 8), "Temperature must be between 0 and 2.0"),
        ((PROMPT, "tiny-llama", "near-copy", 4, 0, 8, 1.5), "Early stop must be between 0 and 1"),
    ],
)
def test_generate_refuses_bad_requests_with_a_clear_message(space, arguments, message):
    if isinstance(arguments, str):
        arguments = (arguments, "tiny-llama", "near-copy", 4, 0, 8)
    with pytest.raises(gr.Error, match=message.replace(".", r"\.").replace("(", r"\(")):
        next(space.generate(*arguments))


def test_catalog_refuses_a_drafter_converted_for_another_target(tiny_models):
    target, tokenizer, _ = tiny_models
    other = random_drafter(target, vocab_size=300)
    catalog = ModelCatalog({"tiny": TargetChoice(lambda: (target, tokenizer), {"other": lambda: other})})
    with pytest.raises(gr.Error, match="Drafter 'other' does not fit target 'tiny'.*vocab_size 256.*Fix the Space"):
        next(OspreySpace(catalog, LIMITS).generate(PROMPT, "tiny", "other", 4, 0, 8))


def test_a_failing_generation_reaches_the_visitor_as_a_message(tiny_models):
    target, tokenizer, _ = tiny_models
    broken = random_drafter(target)
    broken.model.fc = torch.nn.Linear(7, broken.config.hidden_size)  # fits the target on paper, fails in its forward
    catalog = ModelCatalog({"tiny": TargetChoice(lambda: (target, tokenizer), {"broken": lambda: broken})})
    with pytest.raises(gr.Error, match="Generation failed: RuntimeError: .*7"):
        next(OspreySpace(catalog, LIMITS).generate(PROMPT, "tiny", "broken", 4, 0, 8))


def test_catalog_from_json_lists_only_drafters_present_on_the_server(tmp_path):
    (tmp_path / "drafters" / "built").mkdir(parents=True)
    spec = {
        "targets": {
            "SmolLM2": {"model": "smollm2-135m-instruct", "drafters": {"built": "./drafters/built", "gone": "./nope"}},
            "Gemma": {"model": "gemma-3-270m", "drafters": {"gone": "../nowhere"}},
        }
    }
    (tmp_path / "models.json").write_text(json.dumps(spec))
    catalog = ModelCatalog.from_json(tmp_path / "models.json")  # nothing is loaded yet
    assert catalog.target_names() == ["SmolLM2"] and catalog.drafter_names("SmolLM2") == ["built"]

    del spec["targets"]["SmolLM2"]
    (tmp_path / "models.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="No drafter listed in .* exists on this machine"):
        ModelCatalog.from_json(tmp_path / "models.json")


def test_catalog_serves_a_packed_drafter_for_the_target_it_names(tiny_models, tmp_path):
    target, tokenizer, drafter = tiny_models
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    pack_drafter(tmp_path / "drafter", tmp_path / "packed", target_name_or_path=str(tmp_path / "target"))
    spec = {"targets": {"tiny": {"drafters": {"packed": "./packed"}}}}  # no `model`: the drafter names its target
    (tmp_path / "models.json").write_text(json.dumps(spec))
    catalog = ModelCatalog.from_json(tmp_path / "models.json")
    served_target, _, served = catalog.load("tiny", "packed")
    assert served_target.name_or_path == str(tmp_path / "target")
    expected = load_drafter(tmp_path / "packed").state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in served.state_dict().items())
    *_, last = OspreySpace(catalog, LIMITS).generate(PROMPT, "tiny", "packed", 4, 0, 12)
    final = dict(zip(OUTPUT_NAMES, last))
    assert "".join(text for text, _ in final["osprey"]) == final["target_only"]


def test_shipped_allow_list_serves_the_packaged_demo_drafter():
    spec = json.loads((SPACE_DIR / "models.json").read_text())
    drafters = spec["targets"]["SmolLM2-135M-Instruct"]["drafters"].values()
    assert any((SPACE_DIR / location).resolve() == DEMO_DRAFTER_DIR.resolve() for location in drafters)


def test_benchmark_view_plots_saved_results_and_says_what_to_run_without_them(space):
    plot, note = benchmark_outputs(space)
    assert not plot.visible and "No benchmark results yet" in note and "osprey bench" in note

    record = {"method": "osprey", "suite": "multilingual", "num_prompts": 10, "tokens_per_s": 50.0, "speedup": 1.9}
    records = [record | {"category": language, "tau": tau} for language, tau in [("de", 2.5), ("ja", 2.1)]]
    (space.results_dir / "osprey.json").write_text(json.dumps({"format": 1, "records": records}))  # osprey bench's
    (space.results_dir / "extra.json").write_text(json.dumps([record | {"category": "zh", "tau": 1.5}]))
    (space.results_dir / "broken.json").write_text(json.dumps({"tau": 3}))
    assert benchmark_outputs(space)[0].visible
    frame, note = space.benchmark_view()
    assert frame[["series", "category", "tau"]].values.tolist() == [
        ["extra: osprey", "multilingual / zh", 1.5],
        ["osprey: osprey", "multilingual / de", 2.5],
        ["osprey: osprey", "multilingual / ja", 2.1],
    ]
    assert note.startswith("Skipped `broken.json: expected records with keys")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_served_app_through_gradio_client(space, tiny_models):
    target, tokenizer, _ = tiny_models
    demo = build_demo(space)
    demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(demo.local_url, verbose=False)
        osprey, target_only, tau, _, _, speedup, new_tokens, steps, tree = client.predict(
            PROMPT, "tiny-llama", "near-copy", 4, 0, MAX_NEW_TOKENS, 0.0, 1, 4, api_name="/generate"
        )
        assert "".join(part["token"] for part in osprey) == target_only
        assert target_only == plain_greedy_text(target, tokenizer, MAX_NEW_TOKENS)
        assert {part["class_or_confidence"] for part in osprey} == {ACCEPTED, TARGET}
        assert new_tokens == str(MAX_NEW_TOKENS) and tau == f"{(MAX_NEW_TOKENS - 1) / int(steps):.2f}"
        assert float(speedup) > 0 and tree == ""
        *_, tree = client.predict(PROMPT, "tiny-llama", "near-copy", 4, 0, 12, 0.0, 3, 9, api_name="/generate")
        assert tree.startswith("<p>Last step:")

        for arguments, message in [
            ((PROMPT, "/etc/passwd", "near-copy"), "/etc/passwd"),
            (("x" * 201, "tiny-llama", "near-copy"), "at most 200"),
        ]:
            with pytest.raises(Exception, match=message) as refusal:
                client.predict(*arguments, 4, 0, 8, 0.0, 1, 4, api_name="/generate")
            assert "Traceback" not in str(refusal.value)
    finally:
        demo.close()


def test_prefilled_page_opens_on_a_finished_run(space):
    """What `--prefill-example` serves (used for the docs screenshot): the outputs already filled in."""
    demo = build_demo(space, prefill={"prompt": PROMPT, "max_new_tokens": 8})
    values = {block.label: block.value for block in demo.blocks.values() if getattr(block, "label", None)}
    osprey_text = "".join(part["token"] for part in values["Osprey: target + drafter"])
    assert values["Prompt"] == PROMPT and values["New tokens"] == "8"
    assert osprey_text == values["Target only"] != ""


def test_tree_drafting_shows_the_verified_tree_with_the_accepted_path(space, tiny_models):
    target, tokenizer, _ = tiny_models
    rows = [
        dict(zip(OUTPUT_NAMES, row)) for row in space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 40, 0.0, 3, 9)
    ]
    final = rows[-1]
    assert "".join(text for text, _ in final["osprey"]) == plain_greedy_text(target, tokenizer, MAX_NEW_TOKENS)
    tree = final["tree"]
    assert tree.startswith("<p>Last step:") and tree.count("<li>") <= 9 and "<ul>" in tree
    shown = [row["tree"] for row in rows if row["tree"]]
    assert len(set(shown)) > 2, "the tree view follows the steps"
    assert any("font-weight:bold" in view for view in shown), "some step accepted a draft node, shown highlighted"
    chain_rows = [dict(zip(OUTPUT_NAMES, row)) for row in space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 20)]
    assert chain_rows[-1]["tree"] == ""  # chains have no tree to show


def test_tree_settings_are_bounded(space):
    with pytest.raises(gr.Error, match="Branching must be between 1 and"):
        next(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 8, 0.0, 99, 9))
    with pytest.raises(gr.Error, match="Set one"):
        next(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 8, 0.3, 3, 9))


def test_custom_route_decodes_through_the_drafter_folders_custom_generate(tiny_models, tmp_path):
    """The `custom` route runs `target.generate(custom_generate=DRAFTER_DIR)`: the same text and steps as the
    standalone loop, the tree view included; a drafter folder without custom_generate/ is refused clearly."""
    target, tokenizer, drafter = tiny_models
    drafter.save_pretrained(tmp_path / "drafter")
    saved = load_drafter(tmp_path / "drafter")
    (tmp_path / "old").mkdir()
    saved.save_pretrained(tmp_path / "old")
    shutil.rmtree(tmp_path / "old" / "custom_generate")
    old = load_drafter(tmp_path / "old")
    catalog = ModelCatalog(
        {"tiny-llama": TargetChoice(lambda: (target, tokenizer), {"saved": lambda: saved, "old": lambda: old})}
    )
    space = OspreySpace(catalog)
    runs = {
        route: [
            dict(zip(OUTPUT_NAMES, row))
            for row in space.generate(PROMPT, "tiny-llama", "saved", 4, 0, 40, 0.0, 3, 9, route)
        ]
        for route in ("standalone", "custom")
    }
    standalone, custom = runs["standalone"][-1], runs["custom"][-1]
    assert custom["osprey"] == standalone["osprey"]  # same text, same accepted / target labels
    assert "".join(text for text, _ in custom["osprey"]) == plain_greedy_text(target, tokenizer, 40)
    assert custom["tau"] == standalone["tau"] and custom["verify_steps"] == standalone["verify_steps"]
    assert float(custom["tau"]) > 1.0 and custom["tree"].startswith("<p>Last step:")
    assert len(runs["custom"]) > 3, "the custom route streams step by step"
    with pytest.raises(gr.Error, match="custom_generate/generate.py"):
        next(space.generate(PROMPT, "tiny-llama", "old", 4, 0, 8, 0.0, 1, 4, "custom"))
    with pytest.raises(gr.Error, match="Unknown route"):
        next(space.generate(PROMPT, "tiny-llama", "saved", 4, 0, 8, 0.0, 1, 4, "vllm"))
