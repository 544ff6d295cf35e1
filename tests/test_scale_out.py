"""The scale-out path on CPU processes: `accelerate launch` with the shipped configs, two processes over gloo.

- DDP (`trainers/configs/accelerate/ddp.yaml`, float32): distillation (from a feature cache) and pretraining on tiny
  models in two processes end bit-identical to one process with the same global batch, two sequences per optimizer
  step (one micro-batch per process against two accumulated micro-batches): every step's logged loss and every final
  weight. Bitwise, because each process computes exactly a micro-batch the single process accumulates (batch 1, one
  thread), and what differs, the gradient reduction, adds the same two float32 terms scaled by powers of two (DDP's
  average against accumulation's division by 2, or the pretraining loss's scaling by the process count): exact. (One
  process with micro-batches of 2 would not be the same distillation: its loss is a mean over each micro-batch's
  positions, averaged over micro-batches and processes; docs/training.md.)
- FSDP (`fsdp.yaml`), float32: the same distillation with the drafter sharded over the two processes gives the same
  losses and every weight within `FSDP_ATOL`. Not bitwise: FSDP reduces a unit's gradient after each of its
  backwards, once per TTT step, so the steps' float32 gradients are summed in another order (rounding, ~1e-7 of a
  gradient), which Adam's division by the gradient's root mean square magnifies where a gradient nearly cancels
  (1.3e-5 at most, measured, against updates of 2e-2). 1e-4 is 1% of one step's update at this learning rate (1e-2):
  far below what a lost gradient would leave (a whole update).
- FSDP as shipped (bf16): two processes shard the drafter, save a full state dict that loads as an ordinary drafter,
  and a new launch resumes from a checkpoint to the loss and weights of the uninterrupted run, bitwise.

Every launch is `accelerate launch --config_file CONFIG --num_processes 2` with `--use_cpu true` for the trainer
(`--cpu` would not do: without MPI, accelerate starts one process for it); workers run one thread each
(`OMP_NUM_THREADS=1`). `scale_out_driver.py` is the worker: it runs the trainers' scripts, and keeps FSDP on for CPU
processes, which accelerate otherwise silently runs as DDP.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import make_tiny_target
from safetensors.torch import load_file
from scale_out_driver import run
from test_trainers import TAPS, char_tokenizer, mixed_length_dataset, text_dataset, tiny_drafter

from osprey import OspreyForDrafting
from osprey.models.pack import load_drafter
from trainers import build_feature_cache

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).with_name("scale_out_driver.py")
CONFIGS = ROOT / "trainers" / "configs" / "accelerate"
FSDP_ATOL = 1e-4  # weights of a float32 FSDP run against one process (see above)
COMMON = ["--logging_steps", "1", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true", "--use_cpu", "true"]


def launch(config: str, runs: list[dict], tmp_path: Path, *overrides: str) -> None:
    """`accelerate launch --config_file CONFIG --num_processes 2 OVERRIDES scale_out_driver.py` over `runs`."""
    runs_file = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*.json')))}.json"
    runs_file.write_text(json.dumps(runs))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)]
    command += ["--num_processes", "2", "--main_process_port", "0", *overrides, str(DRIVER), str(runs_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def report(path: Path) -> dict:
    return json.loads(path.read_text())


def distill_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny drafter (with a tokenizer, which `osprey distill` reads for padding) and a float32 feature cache of a
    tiny Llama target over 8 sequences of different lengths, so that micro-batches count different positions."""
    target = make_tiny_target("llama")
    dataset = mixed_length_dataset([12, 9, 16, 11, 14, 10, 13, 15], seed=3)
    cache = build_feature_cache(target, {"train": dataset}, tmp_path / "cache", TAPS, dtype=torch.float32)
    drafter = tmp_path / "drafter"
    tiny_drafter(target, draft_vocab_size=100).save_pretrained(drafter)
    char_tokenizer().save_pretrained(drafter)
    return drafter, cache


def pretrain_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny 2-block Llama backbone with a character tokenizer, and a text corpus."""
    backbone = tmp_path / "backbone"
    make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).save_pretrained(backbone)
    char_tokenizer().save_pretrained(backbone)
    text_dataset(16).to_json(tmp_path / "corpus.jsonl")
    return backbone, tmp_path / "corpus.jsonl"


def assert_same_weights(left: Path, right: Path, initial: Path, atol: float = 0.0) -> None:
    """The models saved in `left` and `right` hold the same weights (to `atol`), every one trained away from
    `initial`'s."""
    expected, actual = load_file(left / "model.safetensors"), load_file(right / "model.safetensors")
    untrained = load_file(initial / "model.safetensors")
    assert expected.keys() == actual.keys() == untrained.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=atol, msg=name)
        assert not tensor.is_floating_point() or not torch.equal(tensor, untrained[name]), name


def test_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    drafter, cache = distill_inputs(tmp_path)
    backbone, corpus = pretrain_inputs(tmp_path)
    steps = ["--max_steps", "3", "--save_strategy", "no", "--per_device_train_batch_size", "1", *COMMON]
    distill = ["--drafter", str(drafter), "--feature_cache", str(cache), "--ttt_steps", "2", "--learning_rate", "1e-2"]
    pretrain = ["--backbone", str(backbone), "--dataset_name", str(corpus), "--max_length", "16"]
    pretrain += ["--learning_rate", "1e-2"]
    runs = {"distill": [*distill, *steps], "pretrain": [*pretrain, *steps]}
    initial = {"distill": drafter, "pretrain": backbone}
    # One process accumulating two micro-batches per optimizer step
    for stage, argv in runs.items():
        reference = [*argv, "--output", str(tmp_path / f"{stage}-one"), "--gradient_accumulation_steps", "2"]
        assert run(stage, reference, str(tmp_path / f"{stage}-one.json")) == 0
        assert report(tmp_path / f"{stage}-one.json")["num_processes"] == 1

    # DDP: two processes, one micro-batch each (float32: the shipped config's bf16 off, for a bitwise comparison)
    entries = [
        {
            "stage": stage,
            "argv": [*argv, "--output", str(tmp_path / f"{stage}-ddp")],
            "report": str(tmp_path / f"{stage}-ddp.json"),
        }
        for stage, argv in runs.items()
    ]
    launch("ddp.yaml", entries, tmp_path, "--mixed_precision", "no")
    for stage in runs:
        one, two = report(tmp_path / f"{stage}-one.json"), report(tmp_path / f"{stage}-ddp.json")
        assert two["distributed_type"] == "MULTI_CPU" and two["num_processes"] == 2 and not two["sharded"]
        assert one["steps"] == two["steps"] == [1, 2, 3]
        assert two["losses"] == one["losses"], stage
        assert_same_weights(tmp_path / f"{stage}-one", tmp_path / f"{stage}-ddp", initial[stage])

    # FSDP, float32: the drafter sharded over the two processes trains as in one
    entry = {
        "stage": "distill",
        "argv": [*runs["distill"], "--output", str(tmp_path / "distill-fsdp")],
        "report": str(tmp_path / "distill-fsdp.json"),
    }
    launch("fsdp.yaml", [entry], tmp_path, "--mixed_precision", "no")
    one, two = report(tmp_path / "distill-one.json"), report(tmp_path / "distill-fsdp.json")
    assert two["distributed_type"] == "FSDP" and two["num_processes"] == 2 and two["sharded"]
    assert two["steps"] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=0)
    assert_same_weights(tmp_path / "distill-one", tmp_path / "distill-fsdp", drafter, FSDP_ATOL)


def test_fsdp_config_shards_saves_a_loadable_drafter_and_resumes(tmp_path):
    drafter, cache = distill_inputs(tmp_path)
    output = tmp_path / "fsdp"
    argv = ["--drafter", str(drafter), "--feature_cache", str(cache), "--output", str(output), "--ttt_steps", "2"]
    argv += ["--per_device_train_batch_size", "2", "--bf16", "true", "--max_steps", "3", *COMMON]
    argv += ["--save_strategy", "steps", "--save_steps", "2"]
    launch("fsdp.yaml", [{"stage": "distill", "argv": argv, "report": str(tmp_path / "a.json")}], tmp_path)
    first = report(tmp_path / "a.json")
    assert first["distributed_type"] == "FSDP" and first["num_processes"] == 2 and first["sharded"]
    assert first["global_step"] == first["steps_run"] == 3 and (output / "checkpoint-2").is_dir()

    # The full state dict, saved once from the main process: an ordinary drafter
    initial = OspreyForDrafting.from_pretrained(drafter).state_dict()
    for loaded in (load_drafter(output), OspreyForDrafting.from_pretrained(output)):
        state = loaded.state_dict()
        assert state.keys() == initial.keys()
        assert all(state[name].shape == tensor.shape for name, tensor in initial.items())
        assert all(not torch.equal(state[name], initial[name]) for name in ("lm_head.weight", "model.fc.weight"))
    trained = load_drafter(output).state_dict()

    # Resumed from the step-2 checkpoint in a new launch: step 3 again, to the same loss and weights
    resume = [*argv, "--resume_from_checkpoint", str(output / "checkpoint-2")]
    launch("fsdp.yaml", [{"stage": "distill", "argv": resume, "report": str(tmp_path / "b.json")}], tmp_path)
    resumed = report(tmp_path / "b.json")
    assert resumed["global_step"] == 3 and resumed["steps_run"] == 1 and resumed["sharded"]
    assert resumed["steps"] == [1, 2, 3] and resumed["losses"] == first["losses"]
    for name, tensor in load_drafter(output).state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)
