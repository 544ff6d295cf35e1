"""The Gradio Space (space/): its event functions on a tiny target and drafter, and the served app driven through
gradio_client the way a visitor's browser drives it."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import gradio as gr
import pytest
import torch
from gradio_client import Client
from PIL import Image
from test_decoding import near_copy_pair, random_drafter
from test_near_tie import take_the_second_best
from test_vocab_alignment import byte_level_tokenizer

from osprey.decoding.decode import speculative_generate
from osprey.measuring.demo import DEMO_TARGET, DEMOS
from osprey.models.pack import load_drafter, pack_drafter

# space/ is the Space's root folder, not a package: its modules import each other by plain name.
SPACE_DIR = Path(__file__).resolve().parents[1] / "space"
sys.path.insert(0, str(SPACE_DIR))
from allowlist import PAGE_SETTINGS, ModelCatalog, TargetChoice  # noqa: E402 (found through the path above)
from app import EXAMPLES, benchmark_outputs, build_demo  # noqa: E402
from browser import BrowserMissing, find_browser, press_generate, served  # noqa: E402
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


def plain_greedy_text(target, tokenizer, max_new_tokens, prompt=PROMPT) -> str:
    input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
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
    assert re.fullmatch(r"\d+\.\d\dx", final["speedup"])  # "1.85x"
    assert float(final["speedup"][:-1]) == pytest.approx(osprey_rate / target_rate, rel=0.02)
    assert all(row["speedup"] == "" for row in rows[:-1])  # blank until both runs are timed


def test_a_differing_output_is_replayed_and_a_wrong_decision_reported(space, tiny_models, monkeypatch):
    """Equal outputs get no note; a verification that takes the target's second-best token (the control) makes the
    outputs differ, and the page says where and that the check finds a decoding bug: the audit of every token
    (`osprey.decoding.near_tie.check_difference`) names a token far below a clean forward's best."""
    final = dict(zip(OUTPUT_NAMES, list(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 40))[-1]))
    assert "outputs differ" not in final["tree"]
    take_the_second_best(monkeypatch)
    final = dict(zip(OUTPUT_NAMES, list(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 40))[-1]))
    note = r"The outputs differ from new token \d+</b>: a decoding bug .*UNEXPLAINED .*token \d+ lies .* below the best"
    assert re.search(note, final["tree"])


def test_an_honest_difference_is_explained_by_the_replay(tiny_models):
    """Where an honest decoding leaves the target alone's output (here a reference changed at new token 5, as
    rounding at a near tie would), the replay vouches for Osprey's token and the note says so."""
    import threading

    import live_decoding

    target, tokenizer, drafter = tiny_models
    input_ids = torch.tensor([[5, 17, 33, 90, 12, 7]])
    request = live_decoding._Request(target, tokenizer, drafter, input_ids, 4, 0.0, 0, 20, threading.Lock())
    sequence, _ = live_decoding._osprey_decode(request, lambda item: None)
    output = sequence[0, 6:].tolist()
    reference = output[:5] + [(output[5] + 1) % target.config.vocab_size] + output[6:]
    note = live_decoding.difference_note(request, output, reference)
    assert "The outputs differ from new token 5</b>: a near tie" in note and "rounding (shape-dependent)" in note
    assert live_decoding.difference_note(request, output, output) == ""


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


def control_values(demo) -> dict:
    return {block.elem_id: block.value for block in demo.blocks.values() if getattr(block, "elem_id", None)}


def test_shipped_allow_list_opens_on_the_shipped_drafter_with_the_demos_dtype_and_settings():
    """Out of the box the page runs the drafter `osprey demo` ships for its default target, in the demo's dtype, with
    the decoding shape measured best for it (`DEMOS`, read, not copied). Nothing is loaded to check this."""
    catalog = ModelCatalog.from_json(SPACE_DIR / "models.json", device="cpu")
    target_name = catalog.target_names()[0]
    drafter_name = catalog.drafter_names(target_name)[0]
    demo = DEMOS[DEMO_TARGET]
    choice = catalog.targets[target_name]
    assert choice.load.args[:2] == (DEMO_TARGET, getattr(torch, demo.dtype))  # _load_target(model, dtype, device)
    location, dtype, _, quantization = choice.drafters[drafter_name].args  # load_drafter's
    assert (location, dtype) == (demo.drafter_dir, getattr(torch, demo.dtype))
    assert quantization == demo.settings.get("drafter_quantization", "none")
    measured = {name: value for name, value in demo.settings.items() if name in PAGE_SETTINGS}
    assert catalog.settings(target_name, drafter_name) == PAGE_SETTINGS | measured
    assert measured.get("draft_topk", 1) > 1 or measured.get("prompt_lookup_num_tokens", 0) > 0  # a tree shape

    values = control_values(build_demo(OspreySpace(catalog)))
    assert values["prompt"] == EXAMPLES[0][1]
    assert {name: values[name] for name in PAGE_SETTINGS} == PAGE_SETTINGS | measured


def write_allow_list(directory: Path, spec: dict) -> Path:
    (directory / "models.json").write_text(json.dumps(spec))
    return directory / "models.json"


def test_catalog_dtype_is_per_target_then_the_shipped_drafters_then_the_files(tmp_path):
    """A target's dtype: its entry's `dtype`, else the measured one of the drafter `osprey demo` ships for it, else the
    file's `dtype` (float32 when none)."""
    (tmp_path / "drafter").mkdir()
    measured = DEMOS[DEMO_TARGET].dtype
    other = "float32" if measured == "bfloat16" else "bfloat16"
    demo = {"drafters": {"shipped": {"demo": DEMO_TARGET}}}
    plain = {"model": "smollm2-135m-instruct", "drafters": {"built": "./drafter"}}
    spec = {"dtype": other, "targets": {"demo": demo, "demo-other": demo | {"dtype": other}, "plain": plain}}
    catalog = ModelCatalog.from_json(write_allow_list(tmp_path, spec), device="cpu")
    dtypes = {name: str(choice.load.args[1]) for name, choice in catalog.targets.items()}  # _load_target's dtype
    assert dtypes == {"demo": f"torch.{measured}", "demo-other": f"torch.{other}", "plain": f"torch.{other}"}
    del spec["dtype"]
    assert ModelCatalog.from_json(write_allow_list(tmp_path, spec)).targets["plain"].load.args[1] == torch.float32
    assert catalog.settings("plain", "built") == PAGE_SETTINGS  # no measured settings: the page's

    # int8 drafters run on a CPU only: on a GPU the shipped drafter loads unquantized (nothing loads here)
    quantization = DEMOS[DEMO_TARGET].settings.get("drafter_quantization", "none")
    assert catalog.targets["demo"].drafters["shipped"].args[3] == quantization
    on_gpu = ModelCatalog.from_json(tmp_path / "models.json", device="cuda")
    assert on_gpu.targets["demo"].drafters["shipped"].args[3] == "none"


@pytest.mark.parametrize(
    "drafter, dtype, message",
    [
        ({"demo": "no-such-target"}, None, r"is \{\"demo\": \"no-such-target\"\}: .* one of: " + DEMO_TARGET),
        ({"demo": DEMO_TARGET, "path": "x"}, None, r"\{\"demo\": TARGET\} for the drafter `osprey demo` ships"),
        ({"demo": DEMO_TARGET}, "float16", "has dtype 'float16': use one of float32, bfloat16"),
    ],
)
def test_catalog_refuses_a_bad_drafter_entry_or_dtype_naming_the_fix(tmp_path, drafter, dtype, message):
    entry = {"drafters": {"d": drafter}} | ({"dtype": dtype} if dtype else {})
    with pytest.raises(ValueError, match=message):
        ModelCatalog.from_json(write_allow_list(tmp_path, {"targets": {"t": entry}}))


def test_picking_a_drafter_sets_its_measured_settings(tiny_models):
    target, tokenizer, drafter = tiny_models
    measured = {"draft_topk": 3, "tree_size": 4, "prompt_lookup_num_tokens": 8, "drafter_quantization": "int8"}
    catalog = ModelCatalog(
        {
            "tiny": TargetChoice(
                lambda: (target, tokenizer),
                {"tuned": lambda: drafter, "plain": lambda: drafter},
                settings={"tuned": measured},
            )
        }
    )
    space = OspreySpace(catalog, LIMITS)
    expected = PAGE_SETTINGS | {"draft_topk": 3, "tree_size": 4, "prompt_lookup_num_tokens": 8}
    assert space.drafter_settings("tiny", "tuned") == tuple(expected.values())
    assert space.drafter_settings("tiny", "plain") == tuple(PAGE_SETTINGS.values())
    values = control_values(build_demo(space))  # the first drafter's, when the page opens
    assert {name: values[name] for name in PAGE_SETTINGS} == expected
    with pytest.raises(gr.Error, match="Unknown drafter 'other'"):
        space.drafter_settings("tiny", "other")


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


def test_served_app_through_gradio_client(space, tiny_models):
    target, tokenizer, _ = tiny_models
    with served(build_demo(space)) as url:
        client = Client(url, verbose=False)
        osprey, target_only, tau, _, _, speedup, new_tokens, steps, tree = client.predict(
            PROMPT, "tiny-llama", "near-copy", 4, 0, MAX_NEW_TOKENS, 0.0, 1, 4, "standalone", 0, api_name="/generate"
        )
        assert "".join(part["token"] for part in osprey) == target_only
        assert target_only == plain_greedy_text(target, tokenizer, MAX_NEW_TOKENS)
        assert {part["class_or_confidence"] for part in osprey} == {ACCEPTED, TARGET}
        assert new_tokens == str(MAX_NEW_TOKENS) and tau == f"{(MAX_NEW_TOKENS - 1) / int(steps):.2f}"
        assert float(speedup.removesuffix("x")) > 0 and tree == ""
        *_, tree = client.predict(PROMPT, "tiny-llama", "near-copy", 4, 0, 12, 0.0, 3, 9, api_name="/generate")
        assert tree.startswith("<p>Last step:")

        for arguments, message in [
            ((PROMPT, "/etc/passwd", "near-copy"), "/etc/passwd"),
            (("x" * 201, "tiny-llama", "near-copy"), "at most 200"),
        ]:
            with pytest.raises(Exception, match=message) as refusal:
                client.predict(*arguments, 4, 0, 8, 0.0, 1, 4, api_name="/generate")
            assert "Traceback" not in str(refusal.value)


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
    with pytest.raises(gr.Error, match="Prompt-lookup branch must be between 0 and 16"):
        next(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 8, 0.0, 1, 9, "standalone", 17))
    with pytest.raises(gr.Error, match="a prompt-lookup branch makes the draft a tree.*Set one of the two to 0"):
        next(space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 8, 0.3, 1, 9, "standalone", 4))


def test_prompt_lookup_branch_reaches_the_decoding_loop(space, tiny_models):
    """The lookup slider decodes as `speculative_generate(prompt_lookup_num_tokens=...)` does: same steps, same text."""
    target, tokenizer, drafter = tiny_models
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    for lookup in (0, 4):
        *_, last = space.generate(PROMPT, "tiny-llama", "near-copy", 4, 0, 40, 0.0, 1, 8, "standalone", lookup)
        final = dict(zip(OUTPUT_NAMES, last))
        _, stats = speculative_generate(
            target,
            drafter,
            input_ids,
            max_new_tokens=40,
            num_draft_tokens=4,
            tree_size=8,
            prompt_lookup_num_tokens=lookup,
        )
        assert final["verify_steps"] == str(stats.verify_steps)
        assert "".join(text for text, _ in final["osprey"]) == plain_greedy_text(target, tokenizer, 40)
        assert final["tree"].startswith("<p>Last step:") == (lookup > 0)  # the branch makes every draft a tree


@pytest.mark.parametrize("lookup", [0, 4])
def test_custom_route_decodes_through_the_drafter_folders_custom_generate(tiny_models, tmp_path, lookup):
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
            for row in space.generate(PROMPT, "tiny-llama", "saved", 4, 0, 40, 0.0, 3, 9, route, lookup)
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


@pytest.fixture(scope="module")
def chromium():
    """Chromium, chromedriver and Selenium: skipped without them, except in CI (`CI` set), where that fails."""
    try:
        find_browser()
    except BrowserMissing as missing:
        if os.environ.get("CI"):
            pytest.fail(str(missing))
        pytest.skip(str(missing))


def test_generate_in_a_real_browser_renders_the_speedup_and_tau(space, tiny_models, chromium, tmp_path):
    """Headless Chromium opens the served page and presses Generate on what it opens with (the first example, the
    first target and drafter); the finished run's speedup, τ and outputs are rendered, and a screenshot is saved."""
    target, tokenizer, _ = tiny_models
    with served(build_demo(space)) as url:
        run = press_generate(url, tmp_path / "page.png", size=(1280, 1000), timeout_s=180)
    assert run.prompt == EXAMPLES[0][1]
    assert re.fullmatch(r"\d+\.\d\dx", run.stats["speedup"]), run.stats
    new_tokens, steps = int(run.stats["new_tokens"]), int(run.stats["verify_steps"])
    assert new_tokens == LIMITS.max_new_tokens  # the page's default length, under this Space's limit
    assert run.stats["tau"] == f"{(new_tokens - 1) / steps:.2f}" and float(run.stats["tau"]) > 1
    expected = plain_greedy_text(target, tokenizer, new_tokens, prompt=EXAMPLES[0][1])
    assert run.target_text.strip() == expected.strip() != ""
    assert run.osprey_text.strip()
    screenshot = (tmp_path / "page.png").read_bytes()
    assert screenshot.startswith(b"\x89PNG\r\n\x1a\n")
    assert Image.open(tmp_path / "page.png").size == (1280, 1000)
