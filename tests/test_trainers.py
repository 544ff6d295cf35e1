"""Stage-2 pretraining and stage-4 distillation trainers: their configs, training on the CPU (heap, bf16, compiled),
tokenized chats and corpora, the CLI; and the helpers the other trainer tests build on (tiny drafters, datasets)."""

import argparse
import json
import math
import os
import subprocess
import sys
from itertools import pairwise

import pytest
import torch
import yaml
from conftest import make_tiny_target
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import trainers.distill
from osprey import OspreyConfig, OspreyForDrafting
from trainers import (
    DatasetArguments,
    FeatureCacheDataset,
    OspreyDistillConfig,
    OspreyDistillTrainer,
    OspreyPretrainConfig,
    OspreyPretrainer,
    build_feature_cache,
    load_text_dataset,
    tokenize_example,
    ttt_loss,
)
from trainers.cli import add_subcommand
from trainers.devices import (
    MALLOC_ENVIRONMENT,
    HeapTrimCallback,
    _glibc,
    release_free_heap,
    resident_bytes,
    states_in_parameter_layout,
    unwrap,
)
from trainers.losses import compute_dtype

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


TAPS = [1, 3, 4]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (102 tokens) with a ChatML template, built offline."""
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + [chr(i) for i in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def tiny_drafter(target, seed: int = 0, **overrides) -> OspreyForDrafting:
    values = dict(
        vocab_size=target.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_hidden_size=target.config.hidden_size,
        target_layer_ids=TAPS,
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return OspreyForDrafting(OspreyConfig(**values))


def token_dataset(num_sequences: int, length: int, seed: int = 0, vocab_size: int = 256) -> Dataset:
    """Random token sequences whose first 3 tokens are an untrained prompt."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (num_sequences, length), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": input_ids, "loss_mask": [[0] * 3 + [1] * (length - 3)] * num_sequences})


def mixed_length_dataset(lengths: list[int], seed: int = 0) -> Dataset:
    """Random token sequences of the given lengths whose first 3 tokens are an untrained prompt."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]
    return Dataset.from_dict({"input_ids": input_ids, "loss_mask": [[0] * 3 + [1] * (n - 3) for n in lengths]})


def distill_config(tmp_path, **overrides) -> OspreyDistillConfig:
    values = dict(
        output_dir=str(tmp_path / "distill"),
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        ttt_steps=3,
    )
    values.update(overrides)
    return OspreyDistillConfig(**values)


def pretrain_config(tmp_path, **overrides) -> OspreyPretrainConfig:
    values = dict(
        output_dir=str(tmp_path / "pretrain"),
        per_device_train_batch_size=4,
        max_length=64,
        learning_rate=3e-3,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return OspreyPretrainConfig(**values)


def text_dataset(num_documents: int = 64) -> Dataset:
    words = ["cat", "dog", "bird", "fish"]
    return Dataset.from_dict({"text": [f"the {words[i % 4]} sat on mat {i}. " * 3 for i in range(num_documents)]})


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_config_defaults_are_cpu_safe(tmp_path):
    for config in (OspreyDistillConfig(output_dir=str(tmp_path)), OspreyPretrainConfig(output_dir=str(tmp_path))):
        assert config.bf16 is False and config.activation_checkpointing is False
        assert config.dataloader_pin_memory is False
    assert OspreyDistillConfig(output_dir=str(tmp_path)).ttt_steps == 5
    with pytest.raises(ValueError, match="checkpointing"):
        OspreyDistillConfig(output_dir=str(tmp_path), activation_checkpointing=True)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="bf16 on a machine without an accelerator")
def test_a_bf16_config_runs_on_a_cpu_without_use_cpu(tmp_path):
    """`bf16: true` alone (as a config written for any machine says it) means bf16 autocast on a CPU-only machine;
    transformers refuses it there unless `use_cpu` is set, so the configs set it."""
    for config_class in (OspreyDistillConfig, OspreyPretrainConfig):
        config = config_class(output_dir=str(tmp_path), bf16=True)
        assert config.bf16 and config.use_cpu
        assert not config_class(output_dir=str(tmp_path)).use_cpu


def predictable_target():
    """A tiny target close to a sharp bigram model (its blocks barely move the residual stream), whose next-token
    choices a tiny drafter can learn in a few dozen steps."""
    target = make_tiny_target("llama")
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.003)
            layer.mlp.down_proj.weight.mul_(0.003)
    return target


def test_distillation_loss_decreases_and_accuracy_rises(tmp_path):
    target = predictable_target()
    drafter = tiny_drafter(target)
    config = distill_config(tmp_path, max_steps=40, learning_rate=1e-2, logging_steps=10)
    trainer = OspreyDistillTrainer(drafter, config, train_dataset=token_dataset(64, 24), target_model=target)
    trainer.train()
    losses = logged(trainer, "loss")
    for step in range(3):
        accuracies = logged(trainer, f"ttt_acc_{step}")
        step_losses = logged(trainer, f"ttt_loss_{step}")
        assert accuracies[-1] > accuracies[0] + 0.3, (step, accuracies)
        assert step_losses[-1] < step_losses[0], (step, step_losses)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.skipif(_glibc() is None, reason="needs glibc's malloc_trim and Linux /proc")
def test_cpu_trainers_give_the_freed_heap_back(tmp_path):
    """Both trainers carry a `HeapTrimCallback` on a CPU; after a step that ends with resident memory past its limit,
    it gives the C heap's free holes back to the system, and not again until memory grows again."""
    target = make_tiny_target("llama", vocab_size=128)
    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2)
    drafter, dataset, text = tiny_drafter(target), token_dataset(8, 24), text_dataset(8)
    trainers = (
        OspreyDistillTrainer(drafter, distill_config(tmp_path), train_dataset=dataset, target_model=target),
        OspreyPretrainer(model, pretrain_config(tmp_path), train_dataset=text, processing_class=char_tokenizer()),
    )
    for trainer in trainers:
        assert [type(callback) for callback in trainer.callback_handler.callbacks].count(HeapTrimCallback) == 1
    # The policy is process-wide once a trainer exists: earlier tests' freed memory stays resident in the heap and
    # would absorb the blocks below without any growth, so it is given back first, and the limit is set 512 MiB above
    # what this process holds now, whatever earlier tests left in it.
    release_free_heap()
    callback = HeapTrimCallback(growth=1 + 2**29 / resident_bytes())
    callback.on_step_end(None, None, None)  # the first step sets the limit
    blocks = [torch.ones(16384) for _ in range(16384)]  # 1 GiB in 64 KiB blocks, taken from the C heap
    del blocks[::2]  # every other block freed: holes between live ones, which glibc keeps
    grown = resident_bytes()
    callback.on_step_end(None, None, None)
    assert callback.trims == 1
    assert resident_bytes() < grown - 256 * 2**20
    for _ in range(2):  # the step after a trim sets the limit again; no growth since, no trim
        callback.on_step_end(None, None, None)
    assert callback.trims == 1
    with pytest.raises(ValueError, match="above 1"):
        HeapTrimCallback(growth=1)


PAGE_FAULTS_OF_EIGHT_STEPS = """
import resource, sys, torch
from trainers.devices import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
weight = torch.ones(2**24)  # 64 MiB
def step():  # two 64 MiB tensors made and freed
    return (weight * 2 + weight).sum()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(_glibc() is None, reason="needs glibc's mallopt and Linux /proc")
def test_the_kept_heap_reuses_freed_tensors_without_page_faults():
    """With `keep_freed_heap` large tensors freed and made again mostly reuse the heap's pages; with glibc's default
    (the control) each one is mapped afresh and all its pages are faulted in: 8 x 2 x 16,384."""
    environment = {name: value for name, value in os.environ.items() if name not in MALLOC_ENVIRONMENT}
    faults = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", PAGE_FAULTS_OF_EIGHT_STEPS, mode],
                capture_output=True,
                text=True,
                check=True,
                env=environment,
            ).stdout
        )
        for mode in ("keep", "default")
    }
    assert faults["default"] >= 8 * 2 * 16384, faults
    assert faults["keep"] < faults["default"] / 2, faults


def record_logit_dtypes(monkeypatch, module, name: str, dtype_of=lambda logits: logits.dtype) -> list[torch.dtype]:
    """Wraps the loss `module.name` so that the dtype of the logits of each call (`dtype_of` its first argument) is
    appended to the returned list."""
    loss, seen = getattr(module, name), []

    def recording(logits, *args, **kwargs):
        seen.append(dtype_of(logits))
        return loss(logits, *args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


def test_bf16_distillation_keeps_the_drafter_logits_in_bf16_and_computes_the_same_loss(tmp_path, monkeypatch):
    """With bf16, accelerate's forward wrapper would hand the loss float32 copies of the drafter's logits (and cast
    their gradient back); the trainer runs the TTT loss under one autocast instead: the fused head computes bf16
    logits and the same loss, with loss and gradients equal up to bf16 rounding."""
    import trainers.ttt

    target = predictable_target()
    config = distill_config(tmp_path, bf16=True, use_cpu=True, max_steps=1, per_device_train_batch_size=2)
    trainer = OspreyDistillTrainer(
        tiny_drafter(target), config, train_dataset=token_dataset(4, 16), target_model=target
    )
    model = trainer.accelerator.prepare_model(trainer.model)  # as train() does: accelerate's autocast wrapper
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    # the fused head computes the logits in `compute_dtype` of its input: the autocast dtype inside one
    seen = record_logit_dtypes(monkeypatch, trainers.ttt, "linear_soft_cross_entropy", compute_dtype)
    features, target_logits, target_argmax = trainer._target_signals(inputs, trainer.model)
    args = (inputs["input_ids"], features, target_logits, target_argmax, inputs["loss_mask"])
    wrapped = ttt_loss(model, *args, model.draft_to_target, num_steps=config.ttt_steps).loss
    wrapped.backward()
    wrapped_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert set(seen) == {torch.float32}  # the control: accelerate's wrapper converts the logits
    model.zero_grad()
    seen.clear()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    assert set(seen) == {torch.bfloat16}
    # the wrapper's float32 hidden states make float32 logits: the same loss up to their bf16 rounding
    torch.testing.assert_close(loss, wrapped, rtol=1e-3, atol=0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(wrapped_grads)
    for grad, wrapped_grad in zip(grads, wrapped_grads):
        assert (grad - wrapped_grad).norm() <= 2e-2 * wrapped_grad.norm() + 1e-6


@pytest.mark.parametrize("arch, overrides", [("qwen2", {}), ("gemma3", {"final_logit_softcapping": 3.0})])
def test_feature_cache_trains_exactly_like_the_live_target(tmp_path, arch, overrides):
    target = make_tiny_target(arch, **overrides)
    dataset = token_dataset(10, 16, seed=1)
    cache_dir = build_feature_cache(
        target, {"train": dataset}, tmp_path / "cache", TAPS, batch_size=4, dtype=torch.float32, shard_bytes=20_000
    )
    cache = FeatureCacheDataset(cache_dir, "train")
    assert len(cache) == 10 and len(cache.shard_paths) > 1
    assert cache[3]["input_ids"].tolist() == dataset[3]["input_ids"]
    drafter = tiny_drafter(target, draft_vocab_size=100)
    live = OspreyDistillTrainer(drafter, distill_config(tmp_path), train_dataset=dataset, target_model=target)
    cached = OspreyDistillTrainer(drafter, distill_config(tmp_path, max_steps=2), train_dataset=cache)
    live_batch = live._prepare_inputs(next(iter(live.get_eval_dataloader(dataset))))  # batches in dataset order
    cached_batch = cached._prepare_inputs(next(iter(cached.get_eval_dataloader(cache))))
    assert torch.equal(live_batch["input_ids"], cached_batch["input_ids"])
    torch.testing.assert_close(live.compute_loss(drafter, live_batch), cached.compute_loss(drafter, cached_batch))
    cached.train()
    with pytest.raises(ValueError, match="target_layer_ids"):
        OspreyDistillTrainer(
            tiny_drafter(target, target_layer_ids=[0, 3, 4]), distill_config(tmp_path), train_dataset=cache
        )
    with pytest.raises(ValueError, match="already exists"):
        build_feature_cache(target, {"train": dataset}, cache_dir, TAPS)


def test_chat_examples_train_on_assistant_tokens_only():
    tokenizer = char_tokenizer()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo!"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ok"},
    ]
    example = tokenize_example({"messages": messages}, tokenizer)
    trained = [token for token, mask in zip(example["input_ids"], example["loss_mask"]) if mask]
    assert tokenizer.decode(trained) == "yo!<|im_end|>\nok<|im_end|>\n"
    assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
    everything = tokenize_example({"messages": messages}, tokenizer, assistant_only_loss=False)
    assert everything == {"input_ids": example["input_ids"], "loss_mask": [1] * len(example["input_ids"])}
    plain = tokenize_example({"text": "hello"}, tokenizer, max_length=3)
    assert plain == {"input_ids": tokenizer("hel")["input_ids"], "loss_mask": [1, 1, 1]}


def test_a_corpus_is_tokenized_once_per_tokenizer_and_settings(tmp_path, monkeypatch):
    from trainers.corpora import tokenization

    chats = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}] for i in range(6)]
    Dataset.from_dict({"messages": chats}).to_parquet(str(tmp_path / "chats.parquet"))
    dataset = load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "chats.parquet")), cache_dir=tmp_path)
    first = tokenization.tokenize_dataset(dataset["train"], char_tokenizer(), max_length=64)
    calls = []
    stub = lambda *args, **kwargs: calls.append(1) or {"input_ids": [5], "loss_mask": [0]}  # noqa: E731
    reloaded = load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "chats.parquet")), cache_dir=tmp_path)
    monkeypatch.setattr(tokenization, "tokenize_example", stub)
    again = tokenization.tokenize_dataset(reloaded["train"], char_tokenizer(), max_length=64)  # a fresh tokenizer
    assert not calls and again["input_ids"] == first["input_ids"] and again["loss_mask"] == first["loss_mask"]
    other = tokenization.tokenize_dataset(reloaded["train"], char_tokenizer(), max_length=32)  # other settings
    assert len(calls) == 6 and len(other) == 0


def test_distillation_tokenizes_chats_with_the_target_tokenizer(tmp_path):
    tokenizer = char_tokenizer()
    target = make_tiny_target("llama", vocab_size=128)
    chats = [[{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} {i}!"}] for i in range(8)]
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        distill_config(tmp_path, max_steps=2),
        train_dataset=Dataset.from_dict({"messages": chats}),
        target_model=target,
        processing_class=tokenizer,
    )
    assert trainer.train_dataset.column_names == ["input_ids", "loss_mask"]
    trainer.train()
    assert math.isfinite(logged(trainer, "train_loss")[0])


def test_pretraining_loss_decreases(tmp_path):
    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
    trainer = OspreyPretrainer(
        model, pretrain_config(tmp_path, max_steps=30), train_dataset=text_dataset(), processing_class=char_tokenizer()
    )
    trainer.train()
    losses = logged(trainer, "loss")
    assert losses[-1] < 0.5 * losses[0], losses


def test_bf16_pretraining_hands_the_fused_loss_bf16_logits_and_computes_the_same_loss(tmp_path, monkeypatch):
    """Stage 2's side of `loss_autocast`: accelerate's wrapper would give the loss float32 copies of the logits."""
    import trainers.pretrain

    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
    config = pretrain_config(tmp_path, bf16=True, use_cpu=True, max_steps=1)
    trainer = OspreyPretrainer(model, config, train_dataset=text_dataset(8), processing_class=char_tokenizer())
    wrapped_model = trainer.accelerator.prepare_model(trainer.model)
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    seen = record_logit_dtypes(monkeypatch, trainers.pretrain, "token_cross_entropy")
    model_inputs = {key: value for key, value in inputs.items() if key != "labels"}
    wrapped_logits = wrapped_model(**model_inputs, use_cache=False).logits
    assert wrapped_logits.dtype == torch.float32  # the control: accelerate's wrapper converts the logits
    loss = trainer.compute_loss(wrapped_model, inputs)
    assert seen == [torch.bfloat16]
    labels = inputs["labels"][:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(
        wrapped_logits[:, :-1].reshape(-1, wrapped_logits.shape[-1]), labels, ignore_index=-100
    )
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


def test_streamed_datasets_train(tmp_path):
    text_dataset(16).to_json(tmp_path / "corpus.jsonl")
    streamed = load_text_dataset(DatasetArguments(dataset_name=str(tmp_path / "corpus.jsonl"), dataset_streaming=True))
    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
    config = pretrain_config(tmp_path, max_steps=2)
    OspreyPretrainer(model, config, train_dataset=streamed["train"], processing_class=char_tokenizer()).train()
    target = make_tiny_target("llama", vocab_size=128)
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        distill_config(tmp_path, max_steps=2, max_length=24),
        train_dataset=streamed["train"],
        target_model=target,
        processing_class=char_tokenizer(),
    )
    trainer.train()
    assert trainer.state.global_step == 2


def test_self_distillation_on_packed_batches(tmp_path):
    tokenizer = char_tokenizer()
    parent = make_tiny_target("llama", vocab_size=128, num_hidden_layers=4)
    student = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2, seed=1).train()
    config = pretrain_config(tmp_path, max_steps=20, distill_weight=0.5, temperature=2.0, packing_strategy="bfd_split")
    trainer = OspreyPretrainer(
        student, config, train_dataset=text_dataset(), processing_class=tokenizer, parent_model=parent
    )
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert "position_ids" in batch and batch["input_ids"].shape[0] == 1  # padding-free packing
    # Reference: every packed document on its own, CE + 0.5 * T^2 * KL averaged over all trained tokens.
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    ce_sum = kl_sum = tokens = correct = 0.0
    for start, end in pairwise(starts):
        ids, labels = batch["input_ids"][:, start:end], batch["labels"][0, start + 1 : end]
        logits = student(input_ids=ids).logits[0, :-1][labels != -100]
        parent_logits = parent(input_ids=ids).logits[0, :-1][labels != -100]
        ce_sum += torch.nn.functional.cross_entropy(logits, labels[labels != -100], reduction="sum")
        correct += int((logits.argmax(-1) == labels[labels != -100]).sum())
        kl_sum += (
            parent_logits.div(2).softmax(-1) * (parent_logits.div(2).log_softmax(-1) - logits.div(2).log_softmax(-1))
        ).sum()
        tokens += int((labels != -100).sum())
    expected = (ce_sum + 0.5 * 4 * kl_sum) / tokens
    expected_grads = torch.autograd.grad(expected, list(student.parameters()))
    loss = trainer.compute_loss(student, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    # a micro-batch of an accumulated batch twice its size: half the loss, the same per-token metrics
    torch.testing.assert_close(
        trainer.compute_loss(student, batch, num_items_in_batch=2 * int(tokens)), expected / 2, rtol=1e-4, atol=1e-4
    )
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert metrics["mean_token_accuracy"] == pytest.approx(correct / tokens)
    assert metrics["lm_loss"] == pytest.approx(float(ce_sum / tokens), rel=1e-4)
    assert metrics["distill_kl"] == pytest.approx(float(kl_sum / tokens), rel=1e-4)
    # the fused losses' gradients are the formula's
    for grad, expected_grad in zip(torch.autograd.grad(loss, list(student.parameters())), expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-3)
    trainer.train()
    assert logged(trainer, "distill_kl")[-1] < logged(trainer, "distill_kl")[0]


def test_loss_is_the_models_own_and_an_identical_parent_adds_nothing(tmp_path):
    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2)
    parent = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2)
    tokenizer = char_tokenizer()
    plain = OspreyPretrainer(
        model, pretrain_config(tmp_path), train_dataset=text_dataset(8), processing_class=tokenizer
    )
    distilling = OspreyPretrainer(
        model,
        pretrain_config(tmp_path),
        train_dataset=text_dataset(8),
        processing_class=tokenizer,
        parent_model=parent,
    )
    batch = plain._prepare_inputs(next(iter(plain.get_train_dataloader())))
    expected = model(**batch, use_cache=False).loss
    torch.testing.assert_close(plain.compute_loss(model, dict(batch)), expected)
    torch.testing.assert_close(distilling.compute_loss(model, dict(batch)), expected)


def test_compiled_distillation_trains_like_eager(tmp_path):
    """`--torch_compile true` (the shipped distillation configs) traces the drafter with dynamic shapes: batches of
    three lengths train through it to the weights eager training reaches (compiled kernels fuse and round
    differently: tolerance 1e-4)."""
    target = make_tiny_target("llama")
    lengths = [10, 10, 14, 14, 18, 18]
    generator = torch.Generator().manual_seed(0)
    dataset = Dataset.from_dict(
        {
            "input_ids": [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths],
            "loss_mask": [[0] * 3 + [1] * (n - 3) for n in lengths],
        }
    )
    weights = {}
    for compiled in (False, True):
        config = distill_config(
            tmp_path,
            per_device_train_batch_size=2,
            max_steps=3,
            torch_compile=compiled,
            dataloader_drop_last=True,
        )
        trainer = OspreyDistillTrainer(tiny_drafter(target), config, train_dataset=dataset, target_model=target)
        trainer.train()
        assert trainer.accelerator.state.dynamo_plugin.dynamic is True
        weights[compiled] = {name: tensor.clone() for name, tensor in unwrap(trainer.model).state_dict().items()}
    assert weights[True].keys() == weights[False].keys()
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=1e-4, atol=1e-4, msg=name)
    changed = [
        name
        for name, tensor in weights[False].items()
        if not torch.equal(tensor, tiny_drafter(target).state_dict()[name])
    ]
    assert changed  # training moved the weights, so the comparison above compares training


def test_distillation_trains_the_column_major_head_exactly_like_a_row_major_one(tmp_path, monkeypatch):
    """The trainer stores the drafter's head column-major (`store_column_major`: no transposed copies in the TTT
    loss); the same values come out of training as with the head left row-major, and it saves and loads as usual."""
    target = make_tiny_target("llama")
    weights = {}
    for column_major in (True, False):
        if not column_major:
            monkeypatch.setattr(trainers.distill, "store_column_major", lambda weight: None)
        config = distill_config(tmp_path, max_steps=3)
        trainer = OspreyDistillTrainer(
            tiny_drafter(target), config, train_dataset=token_dataset(12, 12), target_model=target
        )
        assert trainer.model.lm_head.weight.T.is_contiguous() == column_major
        trainer.train()
        weights[column_major] = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
        if column_major:  # a resumed run's optimizer states (maybe saved row-major) take the head's layout
            hooks = trainer.optimizer.optimizer._optimizer_load_state_dict_post_hooks.values()
            assert states_in_parameter_layout in hooks
            trainer.model.save_pretrained(tmp_path / "saved")
            loaded = OspreyForDrafting.from_pretrained(tmp_path / "saved")
            torch.testing.assert_close(loaded.lm_head.weight, trainer.model.lm_head.weight, rtol=0, atol=0)
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_states_take_their_parameters_layout_on_load(fused):
    """A state saved row-major (an older checkpoint) loaded beside a column-major parameter: with
    `states_in_parameter_layout` hooked in, AdamW steps as with both row-major; without it (the control) a fused AdamW
    updates the wrong elements."""

    def two_steps(column_major: bool, state_layout_hook: bool) -> torch.Tensor:
        torch.manual_seed(0)
        weight, grads = torch.randn(64, 8), [torch.randn(64, 8) for _ in range(2)]
        param = torch.nn.Parameter(weight.T.contiguous().T if column_major else weight)
        reference = torch.nn.Parameter(weight.clone())
        saved = torch.optim.AdamW([reference], lr=0.1, fused=fused)
        reference.grad = grads[0]
        saved.step()  # a row-major optimizer state, as an older checkpoint holds
        optimizer = torch.optim.AdamW([param], lr=0.1, fused=fused)
        if state_layout_hook:
            optimizer.register_load_state_dict_post_hook(states_in_parameter_layout)
        param.data.copy_(reference.detach())
        optimizer.load_state_dict(saved.state_dict())
        param.grad = grads[1].T.contiguous().T if column_major else grads[1].clone()
        optimizer.step()
        return param.detach()

    expected = two_steps(column_major=False, state_layout_hook=False)
    torch.testing.assert_close(two_steps(column_major=True, state_layout_hook=True), expected, rtol=0, atol=0)
    if fused:
        assert not torch.allclose(two_steps(column_major=True, state_layout_hook=False), expected)


def osprey_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="osprey")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_help_lists_the_trl_flags(capsys):
    args = osprey_parser().parse_args(["pretrain", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        args.run(args)
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "osprey pretrain" in help_text and "--parent_model" in help_text and "--packing_strategy" in help_text


def test_cli_pretrain_and_distill_from_yaml_with_overrides(tmp_path):
    tokenizer = char_tokenizer()
    backbone = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2)
    backbone.save_pretrained(tmp_path / "backbone")
    tokenizer.save_pretrained(tmp_path / "backbone")
    text_dataset(16).to_json(tmp_path / "corpus.jsonl")
    config = {
        "model_name_or_path": str(tmp_path / "backbone"),
        "dataset_name": str(tmp_path / "corpus.jsonl"),
        "output_dir": str(tmp_path / "out"),
        "max_steps": 50,
        "max_length": 32,
        "report_to": "none",
    }
    (tmp_path / "pretrain.yaml").write_text(yaml.safe_dump(config))
    args = osprey_parser().parse_args(["pretrain", "--config", str(tmp_path / "pretrain.yaml"), "--max_steps", "2"])
    assert args.run(args) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2

    target = make_tiny_target("llama", vocab_size=128)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_drafter(target).save_pretrained(tmp_path / "drafter")
    (tmp_path / "drafter" / "alignment_report.json").write_text('{"target": "tiny"}')
    argv = [
        "distill",
        "--drafter",
        str(tmp_path / "drafter"),
        "--target_model",
        str(tmp_path / "target"),
        "--dataset_name",
        str(tmp_path / "corpus.jsonl"),
        "--output_dir",
        str(tmp_path / "distilled"),
        "--max_steps",
        "2",
        "--max_length",
        "24",
        "--report_to",
        "none",
    ]
    args = osprey_parser().parse_args(argv)
    assert args.run(args) == 0
    assert OspreyForDrafting.from_pretrained(tmp_path / "distilled").config.target_layer_ids == TAPS
    assert json.loads((tmp_path / "distilled" / "trainer_state.json").read_text())["global_step"] == 2
    assert json.loads((tmp_path / "distilled" / "alignment_report.json").read_text()) == {"target": "tiny"}


def test_frozen_embedding_and_lm_head_stay_copies_of_the_backbone(tmp_path):
    model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    config = pretrain_config(tmp_path, max_steps=3, freeze_embeddings=True, freeze_lm_head=True)
    OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer()).train()
    after = model.state_dict()
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])
    tied = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties its LM head"):
        OspreyPretrainer(tied, pretrain_config(tmp_path, freeze_lm_head=True), train_dataset=text_dataset(),
                         processing_class=char_tokenizer())  # fmt: skip


def test_pretraining_resumes_its_schedule_from_a_packed_checkpoint(tmp_path):
    """What a fresh machine does with a committed stage-2 pack: unpack it as a checkpoint and resume from it."""
    from osprey.models.compact import pack, unpack

    init = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2)
    init.save_pretrained(tmp_path / "init")

    def make_trainer(output_dir, max_steps, save_steps=None):
        config = pretrain_config(
            tmp_path, output_dir=str(output_dir), max_steps=max_steps, lr_scheduler_type="cosine", warmup_steps=2,
            save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, logging_steps=1,
            freeze_embeddings=True, freeze_lm_head=True,
        )  # fmt: skip
        model = type(init).from_pretrained(tmp_path / "init").train()
        return OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer())

    class Interrupt(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 3

    uninterrupted = make_trainer(tmp_path / "a", 6)
    uninterrupted.train()
    interrupted = make_trainer(tmp_path / "b", 6, save_steps=3)
    interrupted.add_callback(Interrupt())
    interrupted.train()
    packed = pack(tmp_path / "b" / "checkpoint-3", tmp_path / "packed", reference=str(tmp_path / "init"))
    unpack(packed, tmp_path / "fresh" / "checkpoint-3")
    resumed = make_trainer(tmp_path / "fresh", 6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "fresh" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    assert logged(resumed, "learning_rate") == logged(uninterrupted, "learning_rate")  # the schedule went on
    final = resumed.model.state_dict()
    assert torch.equal(final["lm_head.weight"], init.state_dict()["lm_head.weight"])
