"""`osprey.decoding.near_tie`: an output that differs from the target alone's is audited token by token against one
clean forward over it, and replayed at its first differing token: the token must be the argmax of the verification
forward that decided it, and that forward's logits must agree with a clean forward's within rounding ("rounding
(shape-dependent)"), else "UNEXPLAINED". Failing controls: a verifier that emits a non-argmax token (a wrong decision),
one that keeps the wrong tree nodes in the cache (a wrong forward), and the realistic bugs of
`benchmarks/numerics/faults.py`; a bench run in bf16 labels its differences with the same check."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from test_bench import PROMPTS, _write_jsonl
from test_decoding import near_copy_pair
from test_trainers import char_tokenizer

import modeling_osprey.decoding_osprey as decoding_osprey
import osprey.measuring.bench
import osprey.measuring.demo
from osprey.cli import main
from osprey.decoding.decode import speculative_generate, target_generate
from osprey.decoding.near_tie import (
    NEAR_TIE,
    ROUNDING,
    UNEXPLAINED,
    Divergence,
    audit,
    check_difference,
    first_divergence,
    float32_margin,
    replay,
    upcast,
)
from osprey.measuring.bench import label_divergences, output_sha256, run_benchmark
from osprey.measuring.bench_report import (
    DIFFERENCES_NOTE,
    UNCHECKED,
    difference_label,
    exit_status,
    fails,
    markdown_table,
)
from osprey.measuring.methods import BenchMethod, BenchSettings

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "numerics"))  # beside their scripts
import faults  # noqa: E402
import old_results  # noqa: E402
from old_results import output_token_ids  # noqa: E402


def test_first_divergence_finds_the_first_differing_token_or_a_length_difference():
    assert first_divergence([5, 6, 7], [5, 6, 7]) is None
    assert first_divergence([5, 6, 7], [5, 9, 7]) == 1
    assert first_divergence([5, 6], [5, 6, 7]) == 2


def test_upcast_gives_the_model_back_bit_identical():
    """Every parameter and buffer comes back in its own dtype with its own values, the float32 rotary frequencies a
    bf16 model keeps included (`model.to` would round them), so the target decodes as before."""
    target = make_tiny_target("qwen2").to(torch.bfloat16)
    target.model.rotary_emb.inv_freq = target.model.rotary_emb.inv_freq.float()  # as from_pretrained(dtype=bf16) has it
    before = {name: tensor.clone() for name, tensor in [*target.named_parameters(), *target.named_buffers()]}
    ids = torch.tensor([[3, 17, 42, 9]])
    greedy = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with upcast(target):
        assert all(tensor.dtype == torch.float32 for tensor in [*target.parameters(), *target.buffers()])
    after = dict([*target.named_parameters(), *target.named_buffers()])
    assert after.keys() == before.keys() and "model.rotary_emb.inv_freq" in after
    assert all(after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]) for name in before)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0), greedy)


def _bf16_target_and_its_tensors():
    target = make_tiny_target("qwen2").to(torch.bfloat16)
    target.model.rotary_emb.inv_freq = target.model.rotary_emb.inv_freq.float()  # as from_pretrained(dtype=bf16) has it
    tensors = {name: (tensor, tensor.dtype, tensor.clone()) for name, tensor in _named_tensors(target).items()}
    return target, tensors


def _named_tensors(model) -> dict:
    return dict([*model.named_parameters(), *model.named_buffers()])


def _is_as_before(model, tensors: dict) -> bool:
    now = _named_tensors(model)
    return now.keys() == tensors.keys() and all(
        now[name].dtype == dtype and torch.equal(now[name], values) for name, (_, dtype, values) in tensors.items()
    )


@pytest.mark.parametrize("failing_cast", [1, 7, 20])
def test_upcast_leaves_the_model_as_it_was_when_the_cast_itself_fails(monkeypatch, failing_cast):
    """Running out of memory halfway through the cast (here: the n-th tensor cast to float32 raises) puts back every
    tensor already cast before the error propagates: no parameter or buffer is left in float32."""
    target, tensors = _bf16_target_and_its_tensors()
    floating = sum(1 for _ in target.parameters()) + sum(1 for _ in target.buffers())
    assert failing_cast < floating  # the failure comes with some tensors cast and some not
    to, calls = torch.Tensor.to, []

    def to_runningout_of_memory(tensor, *args, **kwargs):
        if torch.float32 in (*args, kwargs.get("dtype")):
            calls.append(tensor.dtype)
            if len(calls) == failing_cast:
                raise RuntimeError("out of memory (forced)")
        return to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_runningout_of_memory)
    with pytest.raises(RuntimeError, match="forced"), upcast(target):
        pytest.fail("the block must not run")
    monkeypatch.undo()
    assert len(calls) == failing_cast
    assert _is_as_before(target, tensors)
    assert all(tensor is _named_tensors(target)[name] for name, (tensor, *_) in tensors.items())


def test_upcast_leaves_the_model_as_it_was_when_the_block_fails():
    target, tensors = _bf16_target_and_its_tensors()
    with pytest.raises(KeyError), upcast(target):
        assert next(target.parameters()).dtype == torch.float32
        raise KeyError("in the block")
    assert _is_as_before(target, tensors)


def test_upcast_refuses_a_cast_that_would_round():
    target, tensors = _bf16_target_and_its_tensors()
    float16 = upcast(target, torch.float16)  # bf16 and float32 values are not all float16 values
    with pytest.raises(ValueError, match="would round tensors in torch.bfloat16, torch.float32"), float16:
        pytest.fail("the block must not run")
    assert _is_as_before(target, tensors)


def take_the_second_best(monkeypatch) -> None:
    """The failing control for a wrong decision (also in test_demo.py and test_space.py): Osprey's chain verification
    made wrong, emitting the target's second-best token after the accepted drafts instead of its argmax."""
    monkeypatch.setattr(decoding_osprey, "_verify", faults.accepts_the_second_best(decoding_osprey._verify))


def keep_the_first_tree_nodes(monkeypatch) -> None:
    """The failing control for a wrong forward: after a tree verification the cache keeps the first tree nodes rather
    than the accepted path's, so every later forward reads a wrong prefix; the forward's own inputs (tokens,
    positions, mask) stay right, so only its logits can show it."""
    keep = decoding_osprey.keep_tree_path
    monkeypatch.setattr(
        decoding_osprey, "keep_tree_path", lambda cache, num_nodes, path: keep(cache, num_nodes, list(range(len(path))))
    )


TREE = dict(num_draft_tokens=3, draft_topk=2, tree_size=6)


def _decode(target, drafter, prompt_ids, **shape):
    def rerun():
        return speculative_generate(target, drafter, prompt_ids, max_new_tokens=16, **shape)[0]

    return rerun, rerun()[0, prompt_ids.shape[1] :].tolist()


@pytest.mark.parametrize("shape", [{}, TREE], ids=["chain", "tree"])
def test_replay_explains_an_honest_difference_at_every_kind_of_position(shape):
    """An honest decoding, and a reference made to differ from it at a token the prefill decided, at the first draft
    a step accepted and at a later one: each is its verification forward's argmax, with logits a clean forward's up
    to float32 rounding."""
    target, drafter = near_copy_pair("llama")
    prompt_ids = torch.tensor([[5, 17, 33, 90, 12, 7]])
    rerun, output = _decode(target, drafter, prompt_ids, **shape)
    assert output == target_generate(target, prompt_ids, 16)[0, 6:].tolist()
    for position in (0, 1, 7, len(output) - 1):
        reference = output[:position] + [(output[position] + 1) % target.config.vocab_size] + output[position + 1 :]
        divergence = replay(target, rerun, prompt_ids, reference, output)
        assert divergence.label == ROUNDING and divergence.position == position, divergence.describe()
        assert divergence.forward_token == output[position] and divergence.forward_error <= divergence.tolerance
        assert divergence.forward_error < 1e-4 and Divergence.from_dict(divergence.to_dict()) == divergence
    assert replay(target, rerun, prompt_ids, output, output) is None


def test_replay_flags_every_wrong_decision(monkeypatch):
    target, drafter = near_copy_pair("llama")
    take_the_second_best(monkeypatch)
    for seed in range(3):
        prompt_ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
        rerun, output = _decode(target, drafter, prompt_ids)
        reference = target_generate(target, prompt_ids, 16)[0, 8:].tolist()
        divergence = replay(target, rerun, prompt_ids, reference, output)
        assert divergence.label == UNEXPLAINED and "not its verification forward's argmax" in divergence.reason
        assert divergence.forward_token == reference[divergence.position] != divergence.token


def test_replay_flags_a_wrong_forward(monkeypatch):
    target, drafter = near_copy_pair("llama")
    keep_the_first_tree_nodes(monkeypatch)
    flagged = 0
    for seed in range(6):
        prompt_ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
        rerun, output = _decode(target, drafter, prompt_ids, **TREE)
        reference = target_generate(target, prompt_ids, 16)[0, 8:].tolist()
        divergence = replay(target, rerun, prompt_ids, reference, output)
        if divergence is not None:  # the bug shows only where a step accepted a path off the first nodes
            assert divergence.label == UNEXPLAINED and "differ from a clean forward" in divergence.reason
            assert divergence.forward_error > 100 * divergence.tolerance
            flagged += 1
    assert flagged >= 2


@pytest.mark.parametrize("name", ["sibling_visible", "positions_off_by_one"])
def test_replay_flags_a_forward_whose_mask_or_positions_show_a_row_tokens_off_its_path(name):
    """A tree mask that shows a draft its sibling, or draft positions off by one, may move the logits by no more than
    rounding does; the replay holds every forward of the decoding to one visible token per position up to each row's
    own, which a correct chain or tree forward always meets, and names the row that does not."""
    target, drafter = near_copy_pair("llama")
    shape = TREE if faults.SHAPES[name] == "tree" else {}
    flagged = 0
    for seed in range(6):
        prompt_ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
        reference = target_generate(target, prompt_ids, 16)[0, 8:].tolist()
        with faults.FAULTS[name](target):
            rerun, output = _decode(target, drafter, prompt_ids, **shape)
            divergence = replay(target, rerun, prompt_ids, reference, output)
        if divergence is not None:
            assert divergence.label == UNEXPLAINED and "see new tokens at positions" in divergence.reason
            flagged += 1
    assert flagged >= 1


def test_replay_flags_what_it_cannot_reproduce_or_find():
    target, drafter = near_copy_pair("llama")
    prompt_ids = torch.tensor([[5, 17, 33, 90, 12, 7]])
    rerun, output = _decode(target, drafter, prompt_ids)
    changed = output[:3] + [(output[3] + 1) % target.config.vocab_size] + output[4:]
    another = replay(target, rerun, prompt_ids, output, changed)  # `changed` is not what decoding gives
    assert another.label == UNEXPLAINED and "another output" in another.reason
    nothing = replay(target, lambda: torch.tensor([prompt_ids[0].tolist() + changed]), prompt_ids, output, changed)
    assert nothing.label == UNEXPLAINED and "no target forward decided" in nothing.reason
    short = replay(target, rerun, prompt_ids, output + [4], output)  # the output stopped where the target's went on
    assert short.label == UNEXPLAINED and "length" in short.describe()


def test_float32_margin_is_information_from_a_float32_target():
    target = make_tiny_target("llama")
    prompt_ids = torch.tensor([[3, 17, 42, 9]])
    with torch.no_grad():
        logits = target(prompt_ids).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert float32_margin(target, prompt_ids, [best], [worst]) == pytest.approx(float(logits[best] - logits[worst]))
    assert float32_margin(target, prompt_ids, [best], [best]) is None
    with pytest.raises(ValueError, match="needs the target in float32.*bfloat16"):
        float32_margin(target.to(torch.bfloat16), prompt_ids, [best], [worst])


def test_a_near_tie_labelled_by_the_withdrawn_bound_reads_as_not_checked_and_fails():
    legacy = {"position": 3, "target_token": 5, "token": 6, "margin": 0.1, "bound": 0.3, "label": NEAR_TIE}
    divergence = Divergence.from_dict(legacy)
    assert divergence.label == NEAR_TIE and divergence.margin == 0.1 and "not checked" in divergence.describe()
    label = difference_label({"divergence": legacy})
    assert label == UNCHECKED and fails(label) and not fails(label, allow_unchecked=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_audit_passes_every_honest_output_and_checks_the_tokens_after_the_first_difference(dtype):
    """Honest decodings (chains and trees) pass the audit in float32 and in bf16. An output made wrong after its first
    difference, which the replay never looks at, is flagged by the audit, naming the token."""
    target, drafter = (model.to(dtype) for model in near_copy_pair("llama"))
    for seed in range(4):
        prompt_ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
        for shape in ({}, TREE):
            rerun, output = _decode(target, drafter, prompt_ids, **shape)
            assert audit(target, prompt_ids, output).passed, (seed, shape)
    reference = output[:4] + [(output[4] + 1) % target.config.vocab_size] + output[5:]
    assert check_difference(target, rerun, prompt_ids, reference, output).label == ROUNDING
    wrong = output[:9] + [(output[9] + 1) % target.config.vocab_size] + output[10:]
    divergence = check_difference(target, rerun, prompt_ids, reference, wrong)
    assert divergence.label == UNEXPLAINED and divergence.position == 4 and "new token 9 lies" in divergence.reason
    assert divergence.audit["position"] == 9 and divergence.forward_token is None  # the replay did not run


@pytest.mark.parametrize("name", list(faults.FAULTS))
def test_every_realistic_decoding_bug_is_flagged_where_it_changes_the_output(name):
    """Each bug of `faults.py` injected into the loop (positions off by one, a rejected draft left in the cache, a
    tree mask showing a sibling, the bonus token from the wrong row, the second-best token) changes some outputs, and
    the check flags every one it changes; with the bug taken out, the same prompts decode as the target alone."""
    target, drafter = near_copy_pair("llama")
    shape = TREE if faults.SHAPES[name] == "tree" else {}
    changed = 0
    for seed in range(12):
        prompt_ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
        reference = target_generate(target, prompt_ids, 16)[0, 8:].tolist()
        with faults.FAULTS[name](target):
            rerun, output = _decode(target, drafter, prompt_ids, **shape)
            divergence = check_difference(target, rerun, prompt_ids, reference, output)
        if divergence is not None:
            changed += 1
            assert divergence.label == UNEXPLAINED, (seed, divergence.describe())
        assert _decode(target, drafter, prompt_ids, **shape)[1] == reference
    assert changed >= 1


def _bf16_bench():
    target, drafter = near_copy_pair("llama")
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    methods = [BenchMethod("target", "target"), BenchMethod("osprey", "drafter:near-copy", drafter=drafter)]
    settings = BenchSettings(max_new_tokens=16)
    return run_benchmark(target, char_tokenizer(), methods, PROMPTS, settings, warmup=False, progress=False)


def test_a_bf16_bench_labels_every_difference_and_flags_every_wrong_decision(monkeypatch):
    honest = _bf16_bench()
    osprey_rows = [row for row in honest["requests"] if row["method"] == "osprey"]
    assert all("divergence" in row for row in osprey_rows)
    assert all(row["divergence"] is None or row["divergence"]["label"] == ROUNDING for row in osprey_rows)
    assert UNEXPLAINED not in markdown_table(honest)

    take_the_second_best(monkeypatch)
    wrong = _bf16_bench()
    labels = [row["divergence"]["label"] for row in wrong["requests"] if row["method"] == "osprey"]
    assert labels == [UNEXPLAINED] * len(PROMPTS)  # every output differs, and every one is flagged
    assert all(row["divergence"]["margin"] is not None for row in wrong["requests"] if row["method"] == "osprey")
    record = next(r for r in wrong["records"] if r["method"] == "osprey" and r["category"] == "overall")
    assert record["differences"][UNEXPLAINED] == len(PROMPTS) and record["same_output_as_target"] == 0
    table = markdown_table(wrong)
    assert DIFFERENCES_NOTE in table and f"{len(PROMPTS)} {UNEXPLAINED}" in table


def test_the_float32_margin_is_left_out_where_the_target_does_not_fit(monkeypatch):
    """The margin is information only: a float32 pass that runs out of memory (a RuntimeError on CPUs) leaves it
    None, and every difference keeps the replay's label."""

    def out_of_memory(model, dtype=torch.float32):
        raise RuntimeError("DefaultCPUAllocator: not enough memory (forced)")

    take_the_second_best(monkeypatch)
    monkeypatch.setattr(osprey.measuring.bench, "upcast", out_of_memory)
    rows = [row for row in _bf16_bench()["requests"] if row["method"] == "osprey"]
    assert [row["divergence"]["label"] for row in rows] == [UNEXPLAINED] * len(PROMPTS)
    assert all(row["divergence"]["margin"] is None for row in rows)


def test_token_ids_of_older_results_are_rebuilt_only_when_their_hash_agrees():
    """Results saved before `output_ids` keep a completion and its ids' hash: ids are rebuilt from the text (with an
    eos the text does not show) and accepted only if they hash the same (benchmarks/numerics/old_results.py)."""
    tokenizer = char_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("</s>")
    ids = tokenizer("abc abc", add_special_tokens=False)["input_ids"]
    row = {"completion": "abc abc", "output_sha256": output_sha256(ids + [eos])}
    assert output_token_ids(row, tokenizer, [eos]) == ids + [eos]
    assert output_token_ids(row | {"output_ids": [1, 2]}, tokenizer, [eos]) == [1, 2]  # saved ids are taken as they are
    assert output_token_ids(row | {"output_sha256": output_sha256([7, 7, 7])}, tokenizer, [eos]) is None


def test_differences_in_older_results_are_refused_by_the_bench_and_labelled_by_their_script(monkeypatch, tmp_path):
    """Differences between requests saved without `output_ids` are not labelled by `osprey bench`, which names the
    script that labels them; that script labels copies with the ids it rebuilds, so each request gets the label the
    run gave it, one whose ids cannot be rebuilt stays unlabelled, and the saved requests keep their fields."""
    take_the_second_best(monkeypatch)  # every output differs
    labelled = _bf16_bench()
    old = copy.deepcopy(labelled)
    for row in old["requests"]:
        del row["output_ids"]
        row.pop("divergence", None)
    target, drafter = near_copy_pair("llama")
    target, drafter = target.to(torch.bfloat16), drafter.to(torch.bfloat16)
    methods = [BenchMethod("osprey", "drafter:near-copy", drafter=drafter)]
    refused = f"hold {len(old['requests'])} differing .*without token ids.*benchmarks/numerics/label_differences.py"
    with pytest.raises(ValueError, match=refused):
        label_divergences(target, char_tokenizer(), copy.deepcopy(old), PROMPTS, methods)
    resumed = copy.deepcopy(labelled)  # a run saved before, all labelled, resumes: nothing needs its ids
    for row in resumed["requests"]:
        del row["output_ids"]
    (tmp_path / "resumed.json").write_text(json.dumps(resumed))
    settings = BenchSettings(max_new_tokens=16)
    alone = [BenchMethod("target", "target")]
    run_benchmark(target, char_tokenizer(), alone, PROMPTS, settings, tmp_path / "resumed.json", warmup=False)

    saved_ids = {id(row): new["output_ids"] for row, new in zip(old["requests"], labelled["requests"], strict=True)}
    lost = next(row for row in old["requests"] if row["method"] == "osprey")  # its completion does not give its ids
    monkeypatch.setattr(
        old_results, "output_token_ids", lambda row, *args, **kwargs: None if row is lost else saved_ids[id(row)]
    )
    old_results.label_divergences_rebuilding_ids(target, char_tokenizer(), old, PROMPTS, [], methods)
    for row, new in zip(old["requests"], labelled["requests"], strict=True):
        assert "output_ids" not in row
        if row is lost:
            assert "divergence" not in row
        elif row["method"] == "osprey":
            assert row["divergence"] == new["divergence"] and row["divergence"]["label"] == UNEXPLAINED


def test_a_difference_left_unchecked_fails_bench_and_demo_unless_allowed(monkeypatch, tmp_path, capsys):
    """One exit rule: a differing output no check examined ("not checked"; here the labelling is skipped, as for a
    method whose drafter is gone) fails `osprey bench` and `osprey demo` like UNEXPLAINED, unless --allow-unchecked
    is passed."""
    target, drafter = near_copy_pair("llama")
    tokenizer = char_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.text, "category": p.category} for p in PROMPTS])
    take_the_second_best(monkeypatch)  # every output differs
    monkeypatch.setattr(osprey.measuring.bench, "label_divergences", lambda *args: None)
    argv = ["bench", "--target", str(tmp_path / "target"), "--drafter", f"osprey={tmp_path / 'drafter'}"]
    argv += ["--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "8", "--device", "cpu"]
    assert main([*argv, "--output", str(tmp_path / "unchecked.json")]) == 1
    assert "--allow-unchecked" in capsys.readouterr().err
    results = json.loads((tmp_path / "unchecked.json").read_text())
    record = next(r for r in results["records"] if r["method"] == "osprey" and r["category"] == "overall")
    assert record["differences"][UNCHECKED] == len(PROMPTS) and f"{len(PROMPTS)} {UNCHECKED}" in markdown_table(results)
    assert main([*argv, "--output", str(tmp_path / "allowed.json"), "--allow-unchecked"]) == 0

    monkeypatch.setattr(osprey.measuring.demo, "run_demo", lambda *args, **kwargs: results)
    assert main(["demo"]) == 1
    assert main(["demo", "--allow-unchecked"]) == 0


def test_the_exit_rule_fails_unexplained_always_and_not_checked_unless_allowed():
    assert not fails(ROUNDING) and not fails(ROUNDING, allow_unchecked=True)
    assert fails(UNEXPLAINED) and fails(UNEXPLAINED, allow_unchecked=True)
    assert fails(UNCHECKED) and not fails(UNCHECKED, allow_unchecked=True)
    row = {"suite": "toy", "category": "chat", "prompt_id": "1", "output_sha256": "a"}
    base = {"methods": {"target": "target", "osprey": "drafter:x"}, "settings": {"do_sample": False}}
    target_row = row | {"method": "target"}

    def status(divergence: dict, **settings) -> int:
        osprey_row = row | {"method": "osprey", "output_sha256": "b"} | divergence
        results = base | {"requests": [target_row, osprey_row], "settings": {"do_sample": False} | settings}
        return exit_status(results)

    assert status({"divergence": {"label": ROUNDING}}) == 0
    assert status({"divergence": {"label": UNEXPLAINED}}) == 1
    assert status({}) == status({"divergence": None}) == 1  # differs, never labelled: not checked
    assert status({}, do_sample=True) == 0  # sampled outputs differ by design
