"""A saved drafter's `custom_generate/`: Osprey's loop inside `target.generate`, run where the osprey package cannot be
imported (a subprocess that blocks it), offline, from the saved folders alone."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TINY_TARGET_ARCHS, make_tiny_target
from test_decoding import (
    SAMPLES,
    chi_square_pvalue,
    exact_second_token_distribution,
    near_copy_pair,
    plain_greedy,
    prompt,
    random_drafter,
)
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer

from osprey.decoding.decode import speculative_generate

# Runs in a fresh interpreter: the osprey package, modeling_osprey and trainers are unimportable there.
ISOLATED = r"""
import json, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("osprey", "modeling_osprey", "trainers"):
            raise ImportError(f"{name} is blocked in this process")
sys.meta_path.insert(0, Blocked())
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
job = json.loads(sys.argv[1])
results = {}

def count_calls(model):
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls

for case in job.get("greedy", []):
    target = AutoModelForCausalLM.from_pretrained(case["target"]).eval()
    drafter = AutoModelForCausalLM.from_pretrained(case["drafter"], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    calls = count_calls(target)
    ids = torch.tensor([case["prompt"]])
    row = {}
    for name, extra in [("plain", {}), ("chain", dict(custom_generate=case["drafter"], trust_remote_code=True,
                        assistant_model=drafter)), ("tree", dict(custom_generate=case["drafter"],
                        trust_remote_code=True, assistant_model=drafter, draft_topk=3, tree_size=10))]:
        calls.clear()
        output = target.generate(ids, max_new_tokens=case["max_new_tokens"], do_sample=False, pad_token_id=0, **extra)
        row[name] = output[0].tolist()
        row[name + "_target_calls"] = len(calls)
    # The same folder's drafter, whose `generate` transformers replaced with the custom one, as assistant_model=
    with drafter.attached(target):
        row["assisted"] = target.generate(ids, assistant_model=drafter, max_new_tokens=case["max_new_tokens"],
                                          do_sample=False, pad_token_id=0)[0].tolist()
    results.setdefault("greedy", []).append(row)

if "sampling" in job:
    case = job["sampling"]
    target = AutoModelForCausalLM.from_pretrained(case["target"]).eval()
    drafter = AutoModelForCausalLM.from_pretrained(case["drafter"], trust_remote_code=True).eval()
    ids = torch.tensor([case["prompt"]])
    def second_tokens(**shape):
        counts = [0] * target.config.vocab_size
        for _ in range(case["samples"]):
            output = target.generate(ids, assistant_model=drafter, custom_generate=case["drafter"],
                                     trust_remote_code=True, do_sample=True, temperature=case["temperature"],
                                     top_k=0, top_p=1.0, max_new_tokens=3, pad_token_id=0, eos_token_id=None,
                                     **shape)
            counts[output[0, ids.shape[1] + 1]] += 1
        return counts
    torch.manual_seed(99)
    results["chain"] = second_tokens()
    results["tree"] = second_tokens(draft_topk=3, tree_size=6)
    # The failing control, in the remote code itself: the drafter samples from q but reports a flattened q.
    module = next(m for name, m in sys.modules.items() if name.endswith("custom_generate.generation_osprey"))
    honest = module.choose_draft_token
    module.choose_draft_token = lambda *a, **k: (lambda t, s: (t, s * 0.2))(*honest(*a, **k))
    results["control"] = second_tokens()
print("RESULTS" + json.dumps(results))
"""


def run_isolated(job: dict, tmp_path) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env |= {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", ISOLATED, json.dumps(job)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.split("RESULTS")[-1])


def test_the_isolated_process_cannot_import_osprey(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = ISOLATED.split("import torch")[0] + "import osprey\n"
    completed = subprocess.run([sys.executable, "-c", script, "{}"], cwd=tmp_path, env=env, capture_output=True)
    assert completed.returncode != 0 and b"blocked" in completed.stderr


def test_greedy_custom_generate_equals_plain_generate_without_the_package(tmp_path):
    """Every tiny architecture, chains and trees, a near-copy drafter (many drafts accepted, some rejected) and a
    random one; the same saved folder also serves as `assistant_model=` after its generate was replaced."""
    job = {"greedy": []}
    for arch in TINY_TARGET_ARCHS:
        for kind in ("near_copy", "random"):
            if kind == "near_copy":
                target, drafter = near_copy_pair(arch)
            else:
                target = make_tiny_target(arch)
                drafter = random_drafter(target)
            target.save_pretrained(tmp_path / f"{arch}-{kind}-target")
            drafter.save_pretrained(tmp_path / f"{arch}-{kind}-drafter")
            job["greedy"].append(
                {
                    "target": str(tmp_path / f"{arch}-{kind}-target"),
                    "drafter": str(tmp_path / f"{arch}-{kind}-drafter"),
                    "prompt": prompt(9, 1)[0].tolist(),
                    "max_new_tokens": 30,
                }
            )
    rows = run_isolated(job, tmp_path)["greedy"]
    for case, row in zip(job["greedy"], rows):
        assert row["plain"] == row["chain"] == row["tree"] == row["assisted"], case["drafter"]
        if "near_copy" in case["drafter"]:  # τ > 1: fewer target forwards than tokens
            for shape in ("chain", "tree"):
                new_tokens = len(row[shape]) - 9
                assert new_tokens / (row[shape + "_target_calls"] - 1) > 1.5, (case["drafter"], shape)


@pytest.fixture(scope="module")
def sampling_models(tmp_path_factory):
    target = make_tiny_target("llama", vocab_size=24, initializer_range=0.1)
    drafter = random_drafter(target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(40)  # a confident, mostly wrong drafter: q far from p
    folder = tmp_path_factory.mktemp("sampling")
    target.save_pretrained(folder / "target")
    drafter.save_pretrained(folder / "drafter")
    return target, folder


def test_sampling_through_custom_generate_is_exact_and_the_control_fails(sampling_models, tmp_path):
    target, folder = sampling_models
    input_ids, temperature = torch.tensor([[3, 7, 5]]), 1.5
    job = {
        "sampling": {
            "target": str(folder / "target"),
            "drafter": str(folder / "drafter"),
            "prompt": input_ids[0].tolist(),
            "temperature": temperature,
            "samples": SAMPLES,
        }
    }
    results = run_isolated(job, tmp_path)
    exact = exact_second_token_distribution(target, input_ids, temperature)
    for shape in ("chain", "tree"):
        pvalue = chi_square_pvalue(torch.tensor(results[shape], dtype=torch.float), exact)
        assert pvalue > 1e-3, f"custom_generate sampling ({shape}) is biased (p={pvalue:.2e})"
    pvalue = chi_square_pvalue(torch.tensor(results["control"], dtype=torch.float), exact)
    assert pvalue < 1e-6, f"the control was not caught (p={pvalue:.2e}): the test has no power"


class RecordingStreamer(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.puts, self.printed = [], []

    def put(self, value):
        self.puts.append(value.clone())
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.printed.append(text)


def one_character_per_token_tokenizer(vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Token i is the CJK character U+4E00 + i, which `TextStreamer` prints as soon as it is decoded."""
    vocab = {chr(0x4E00 + i): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=chr(0x4E00)))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_streamer_prints_the_text_as_it_is_decided(tmp_path):
    target, drafter = near_copy_pair("llama")
    drafter.save_pretrained(tmp_path)
    tokenizer = one_character_per_token_tokenizer()
    input_ids = prompt(4, 2)
    streamer = RecordingStreamer(tokenizer)
    output = target.generate(
        input_ids,
        assistant_model=drafter,
        custom_generate=str(tmp_path),
        trust_remote_code=True,
        streamer=streamer,
        max_new_tokens=40,
        pad_token_id=0,
        draft_topk=2,
        tree_size=6,
    )
    assert torch.equal(output, target.generate(input_ids, max_new_tokens=40, pad_token_id=0))  # eos 2 included
    assert torch.equal(streamer.puts[0].view(1, -1), input_ids)  # the prompt, then the decided tokens step by step
    assert torch.equal(torch.cat([put.view(1, -1) for put in streamer.puts], dim=-1), output)
    assert any(put.numel() > 1 for put in streamer.puts[1:]), "a step that accepted drafts puts them at once"
    assert "".join(streamer.printed) == tokenizer.decode(output[0, 4:])
    assert len([text for text in streamer.printed if text]) == len(streamer.puts) - 1  # printed at every step


def test_custom_generate_respects_the_generation_config(tmp_path):
    target, drafter = near_copy_pair("qwen3")
    drafter.save_pretrained(tmp_path)
    input_ids = prompt(6, 3)
    route = dict(assistant_model=drafter, custom_generate=str(tmp_path), trust_remote_code=True, pad_token_id=0)
    reference = plain_greedy(target, input_ids, 40)[0, 6:].tolist()
    eos = next(token for index, token in enumerate(reference) if index > 4 and token not in reference[:index])
    for settings in (
        dict(max_new_tokens=40, eos_token_id=eos),
        dict(max_new_tokens=17),
        dict(max_new_tokens=20, min_new_tokens=20, eos_token_id=reference[3]),
        dict(max_new_tokens=25, repetition_penalty=1.3),
    ):
        expected = target.generate(input_ids, do_sample=False, pad_token_id=0, **settings)
        for shape in (dict(draft_topk=1), dict(draft_topk=3, tree_size=9), dict(prompt_lookup_num_tokens=6)):
            assert torch.equal(target.generate(input_ids, **route, **settings, **shape), expected), (settings, shape)
    as_dict = target.generate(input_ids, **route, max_new_tokens=8, return_dict_in_generate=True)
    assert torch.equal(as_dict.sequences, plain_greedy(target, input_ids, 8))


def test_custom_generate_refuses_batches_and_a_drafter_for_another_target(tmp_path):
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    drafter.save_pretrained(tmp_path)
    route = dict(custom_generate=str(tmp_path), trust_remote_code=True, max_new_tokens=5, pad_token_id=0)
    with pytest.raises(ValueError, match="one sequence at a time"):
        target.generate(torch.cat([prompt(4, 0), prompt(4, 1)]), assistant_model=drafter, **route)
    with pytest.raises(ValueError, match=r"hidden_size 64 \(the drafter's: 48\)"):
        target.generate(prompt(4, 0), assistant_model=random_drafter(target, target_hidden_size=48), **route)
    with pytest.raises(ValueError, match="assistant_model=drafter"):
        target.generate(prompt(4, 0), **route)


def test_custom_generate_and_the_standalone_loop_are_one_loop(tmp_path):
    """Same greedy tokens and the same steps: the custom route runs `decode`, as `speculative_generate` does."""
    target, drafter = near_copy_pair("gemma3")
    drafter.save_pretrained(tmp_path)
    input_ids = prompt(9, 1)
    standalone, _ = speculative_generate(target, drafter, input_ids, max_new_tokens=30, draft_topk=3, tree_size=10)
    custom = target.generate(
        input_ids,
        assistant_model=drafter,
        custom_generate=str(tmp_path),
        trust_remote_code=True,
        max_new_tokens=30,
        draft_topk=3,
        tree_size=10,
        pad_token_id=0,
    )
    assert torch.equal(custom, standalone)
    assert {path.name for path in (tmp_path / "custom_generate").iterdir()} >= {
        "generate.py",
        "decoding_osprey.py",
        "generation_osprey.py",
        "target_features.py",
    }
