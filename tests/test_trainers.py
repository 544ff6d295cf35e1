"""Stage-2 pretraining and stage-4 distillation trainers: losses, TTT exactness, feature cache, resume, CLI."""

import argparse
import json
import math
import os
import subprocess
import sys
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_tiny_target
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.cache_utils import DynamicCache

import trainers.distill
from modeling_osprey.target_features import extract_target_features
from osprey import OspreyConfig, OspreyForDrafting
from trainers import (
    DatasetArguments,
    DistillDataCollator,
    FeatureCacheDataset,
    OspreyDistillConfig,
    OspreyDistillTrainer,
    OspreyPretrainConfig,
    OspreyPretrainer,
    TargetHead,
    build_feature_cache,
    head_for_loss,
    linear_soft_cross_entropy,
    load_text_dataset,
    soft_cross_entropy,
    token_cross_entropy,
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
from trainers.losses import compute_dtype, target_distribution, target_distribution_and_entropy

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


def ttt_attention_mask(num_positions: int, step: int) -> torch.Tensor:
    """The dense reference of TTT step `step`'s attention: a boolean `(1, 1, n, n * (step + 1))` mask over the keys of
    steps `0..step`, step 0's causal and each later step's the diagonal (a query sees its own position's key)."""
    causal = torch.ones(num_positions, num_positions, dtype=torch.bool).tril()
    diagonal = torch.eye(num_positions, dtype=torch.bool)
    return torch.cat([causal] + [diagonal] * step, dim=1)[None, None]


def dense_ttt_loss(drafter, input_ids, features, target_logits, target_argmax, loss_mask, num_steps, decay=0.8):
    """The TTT loss as first written: every step appends its keys to one `DynamicCache` and attends to all of them
    under `ttt_attention_mask` (O(T^2 k) per step), with the plain soft cross-entropy. `ttt_loss` must equal it."""
    num_positions = input_ids.shape[1] - 1
    label_mask = loss_mask[:, 1:].bool()
    target_probs = target_logits[:, :num_positions][label_mask].float().softmax(dim=-1)
    label_rows = torch.full(label_mask.shape, -1, dtype=torch.long)
    label_rows[label_mask] = torch.arange(len(target_probs))
    cache, hidden_states, loss, step_losses, step_correct = DynamicCache(), None, 0, [], []
    for step in range(num_steps):
        num_labelled = num_positions - 1 - step
        tokens = torch.nn.functional.pad(input_ids[:, 1 + step :], (0, step))
        labels = slice(1 + step, 1 + step + num_labelled)
        counted = torch.nn.functional.pad(label_mask[:, labels], (0, num_positions - num_labelled))
        outputs = drafter(
            tokens,
            draft_hidden_states=hidden_states,
            attention_mask=ttt_attention_mask(num_positions, step),
            position_ids=torch.arange(num_positions)[None] + step,
            cache=cache,
            use_cache=True,
            logits_to_keep=counted,
            **({"target_hidden_states": features[:, :num_positions]} if step == 0 else {}),
        )
        hidden_states = outputs.prenorm_hidden_states
        rows = label_rows[:, labels][label_mask[:, labels]]
        step_loss = torch.nn.functional.cross_entropy(outputs.logits.float(), target_probs[rows], reduction="sum")
        step_loss = step_loss / counted.sum().clamp(min=1)
        loss = loss + decay**step * step_loss
        argmax = drafter.draft_to_target[outputs.logits.argmax(dim=-1)]
        step_correct.append((argmax == target_argmax[:, labels][label_mask[:, labels]]).sum())
        step_losses.append(step_loss.detach())
    return loss, torch.stack(step_losses), torch.stack(step_correct)


def test_ttt_attention_mask_sees_prefix_then_own_chain():
    mask = ttt_attention_mask(3, step=2)[0, 0].int()
    expected = [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    assert mask.tolist() == expected


def target_signals(target, drafter, input_ids, attention_mask):
    features, logits = extract_target_features(target, input_ids, TAPS, attention_mask)
    return features, logits[..., drafter.draft_to_target], logits.argmax(dim=-1)


def reference_ttt(drafter, input_ids, lengths, features, draft_logits, loss_mask, num_steps, decay):
    """Decoding, position by position: prefill positions 0..t from real features with a cache, then chain steps
    that feed back the pre-norm hidden state (reading the true next tokens). Returns the loss and per-step logits."""
    sums, counts = torch.zeros(num_steps), torch.zeros(num_steps)
    logits = {}
    for row, length in enumerate(lengths):
        ids = input_ids[row : row + 1]
        for t in range(length - 1):
            cache = DynamicCache()
            features_t = features[row : row + 1, : t + 1]
            outputs = drafter(ids[:, 1 : t + 2], target_hidden_states=features_t, cache=cache, use_cache=True)
            for step in range(num_steps):
                logits[row, t, step] = outputs.logits[0, -1]
                label = t + 1 + step  # P[label] predicts token label + 1
                if label + 1 <= length - 1 and loss_mask[row, label + 1]:
                    target = draft_logits[row, label].softmax(-1)
                    sums[step] += -(target * outputs.logits[0, -1].log_softmax(-1)).sum()
                    counts[step] += 1
                if label + 1 > length - 1:  # no next token to read
                    break
                hidden = outputs.prenorm_hidden_states[:, -1:]
                outputs = drafter(
                    ids[:, label + 1 : label + 2], draft_hidden_states=hidden, cache=cache, use_cache=True
                )
    step_losses = sums / counts.clamp(min=1)
    return sum(decay**step * step_losses[step] for step in range(num_steps)), step_losses, logits


@pytest.mark.parametrize("draft_vocab_size", [256, 200])
def test_ttt_unroll_equals_step_by_step_decoding(draft_vocab_size):
    target = make_tiny_target("llama")
    drafter = tiny_drafter(target, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        drafter.draft_to_target.copy_(
            torch.randperm(256, generator=torch.Generator().manual_seed(0))[:draft_vocab_size]
        )
    lengths = [11, 7]
    input_ids = torch.zeros(2, 11, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(row))
        attention_mask[row, :length] = 1
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    loss_mask[0, 6] = 0
    features, draft_logits, argmax = target_signals(target, drafter, input_ids, attention_mask)
    output = ttt_loss(
        drafter,
        input_ids,
        features,
        draft_logits,
        argmax,
        loss_mask,
        drafter.draft_to_target,
        num_steps=4,
        return_logits=True,
    )
    expected_loss, expected_steps, expected_logits = reference_ttt(
        drafter, input_ids, lengths, features, draft_logits, loss_mask, num_steps=4, decay=0.8
    )
    torch.testing.assert_close(output.loss, expected_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output.step_losses, expected_steps.detach(), rtol=1e-5, atol=1e-5)
    for step, (counted, logits) in enumerate(output.step_logits):  # logits are computed where the loss needs them
        expected = torch.stack([expected_logits[row, t, step] for row, t in counted.nonzero().tolist()])
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert output.step_counts.tolist() == [11, 11, 9, 7]
    output.loss.backward()  # gradients flow through every step, the cache and the fed-back hidden states
    assert drafter.model.fc.weight.grad.abs().sum() > 0


DRAFTER_VARIANTS = {
    "osprey": {},
    "qwen2-bias-qwen3-qk-norm": {"attention_bias": True, "use_qk_norm": True},
    "eagle3": {"num_hidden_layers": 1, "residual_stream": "features"},
    "multi-head": {"num_key_value_heads": 4},
}


@pytest.mark.parametrize("variant", DRAFTER_VARIANTS)
def test_fast_ttt_loss_and_gradients_equal_the_dense_mask_reference(variant):
    """The chain attention (causal kernel + per-position chain keys, merged by log-sum-exp) and the chunked soft
    cross-entropy give the dense-mask unroll's loss, per-step losses, accuracy and parameter gradients, to float32
    rounding (1e-5 relative / absolute)."""
    target = make_tiny_target("qwen2")
    drafter = tiny_drafter(target, draft_vocab_size=200, **DRAFTER_VARIANTS[variant])
    with torch.no_grad():  # a trained-looking drafter: the fusion half and the feedback path must matter
        for parameter in drafter.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        drafter.draft_to_target.copy_(torch.randperm(256, generator=torch.Generator().manual_seed(1))[:200])
    input_ids = torch.randint(3, 256, (2, 23), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 15:] = 0
    loss_mask = attention_mask.clone()
    loss_mask[:, :4] = 0
    features, draft_logits, argmax = target_signals(target, drafter, input_ids, attention_mask)
    expected, expected_steps, expected_correct = dense_ttt_loss(
        drafter, input_ids, features, draft_logits, argmax, loss_mask, num_steps=5
    )
    expected_grads = torch.autograd.grad(expected, list(drafter.parameters()))
    output = ttt_loss(drafter, input_ids, features, draft_logits, argmax, loss_mask, drafter.draft_to_target)
    grads = torch.autograd.grad(output.loss, list(drafter.parameters()))
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output.step_losses, expected_steps, rtol=1e-5, atol=1e-5)
    assert torch.equal(output.step_correct, expected_correct)
    for (name, _), grad, expected_grad in zip(drafter.named_parameters(), grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5, msg=name)
    assert all(grad.abs().sum() > 0 for grad in grads[1:])  # the control: every weight is trained through the unroll


def test_fused_token_cross_entropy_equals_the_plain_one():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 33, generator=generator, requires_grad=True)
    labels = torch.randint(0, 33, (70,), generator=generator)
    labels[::7] = -100
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    (expected_grad,) = torch.autograd.grad(2 * expected, logits)
    valid = labels != -100
    for compile in (False, True):
        loss, correct = token_cross_entropy(logits, labels, compile=compile, chunk_size=16)
        torch.testing.assert_close(loss, expected)
        assert correct == (logits.argmax(-1) == labels)[valid].sum()
        (grad,) = torch.autograd.grad(2 * loss, logits)
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("columns", [33, 40, 384])  # blocks of 1, 8 and 128 columns
def test_fused_losses_break_argmax_ties_like_torch(columns):
    """The accuracy's argmax is the first block of columns reaching the row's maximum, then the first column in it:
    on bf16 logits full of ties, within and across blocks, it must still pick each row's first maximum, as
    `torch.argmax` does, and the last column for a row with a NaN."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (70, columns), generator=generator).bfloat16()
    logits[1, :] = 3  # every column tied
    logits[2, -1] = 5  # the maximum in the last column
    logits[3, 5] = float("nan")
    logits.requires_grad_()
    expected = logits.detach().argmax(-1)
    expected[3] = columns - 1
    labels = expected.clone()
    labels[::2] = (labels[::2] + 1) % columns  # half the rows predicted wrongly, some of them tied with the label
    target_probs = torch.randn(70, columns, generator=generator).softmax(-1)
    for compile in (False, True):
        _, argmax = soft_cross_entropy(logits, target_probs, compile=compile, chunk_size=16)
        assert torch.equal(argmax, expected), compile
        _, correct = token_cross_entropy(logits, labels, compile=compile, chunk_size=16)
        assert correct == 35


def test_chunked_soft_cross_entropy_equals_the_plain_one():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 33, generator=generator, requires_grad=True)
    target_probs = torch.randn(90, 33, generator=generator).softmax(-1)
    rows = torch.randperm(90, generator=generator)[:70]
    expected = torch.nn.functional.cross_entropy(logits, target_probs[rows], reduction="sum")
    (expected_grad,) = torch.autograd.grad(3 * expected, logits)
    for compile in (False, True):  # eager 16 rows at a time, and the fused kernel
        loss, argmax = soft_cross_entropy(logits, target_probs, rows, compile=compile, chunk_size=16)
        torch.testing.assert_close(loss, expected)
        assert torch.equal(argmax, logits.argmax(-1))
        (grad,) = torch.autograd.grad(3 * loss, logits)
        torch.testing.assert_close(grad, expected_grad)


def test_target_distribution_and_entropy_in_one_pass():
    """Stage 2's self-distillation reads the parent's distribution at the trained positions and its entropy (the KL
    divergence's constant term) from one pass; both equal softmax and `-sum p log p`, eager and compiled."""
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 30, 33, generator=generator)).bfloat16()
    mask = torch.rand(3, 30, generator=generator) > 0.3
    expected = logits[mask].float().softmax(-1)
    for compile in (False, True):
        probs, entropy = target_distribution_and_entropy(logits, mask, compile=compile)
        torch.testing.assert_close(probs, expected)
        torch.testing.assert_close(entropy, torch.special.entr(expected).sum())
        torch.testing.assert_close(probs, target_distribution(logits, mask, compile=compile))


def test_linear_soft_cross_entropy_equals_the_head_then_the_loss():
    """The LM head folded into the loss, a chunk of rows at a time (16 here, the last one short; the head's GEMM in
    chunks of 16 or of 24 rows, which do not line up with the loss's), on the head as stored or column-major as the
    TTT loss passes it: same loss, argmax and gradients for the hidden states and the head as `F.linear` then the
    plain cross-entropy."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(70, 12, generator=generator, requires_grad=True)
    weight = torch.randn(33, 12, generator=generator, requires_grad=True)
    target_probs = torch.randn(90, 33, generator=generator).softmax(-1)
    rows = torch.randperm(90, generator=generator)[:70]
    logits = torch.nn.functional.linear(hidden, weight)
    expected = torch.nn.functional.cross_entropy(logits, target_probs[rows], reduction="sum")
    expected_grads = torch.autograd.grad(3 * expected, (hidden, weight))
    for compile, gemm_chunk_size, layout in [(False, 16, None), (True, 16, None), (False, 24, head_for_loss)]:
        head = weight if layout is None else layout(weight)
        loss, argmax = linear_soft_cross_entropy(
            hidden, head, target_probs, rows, compile=compile, chunk_size=16, gemm_chunk_size=gemm_chunk_size
        )
        torch.testing.assert_close(loss, expected)
        assert torch.equal(argmax, logits.argmax(-1))
        grads = torch.autograd.grad(3 * loss, (hidden, weight))
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected_grad)
    assert not head_for_loss(weight).is_contiguous() and head_for_loss(weight).T.is_contiguous()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # logits in bf16 as `F.linear` would make them
        loss, _ = linear_soft_cross_entropy(hidden, weight, target_probs, rows, chunk_size=16)
        expected = soft_cross_entropy(torch.nn.functional.linear(hidden, weight), target_probs, rows)[0]
        grads = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    assert [grad.dtype for grad in grads] == [torch.float32, torch.float32]


def test_target_head_in_row_chunks_equals_one_linear():
    """`TargetHead` runs its GEMM a chunk of rows at a time (3 here: the last chunk short, rows of a 3-D batch split
    across chunks): the same logits as one `F.linear`, with a bias, over a subset of vocabulary rows (given per call or
    as a `restricted` head), soft-capped."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=generator)
    weight, bias = torch.randn(20, 8, generator=generator), torch.randn(20, generator=generator)
    rows = torch.tensor([3, 0, 7, 19, 11])
    expected = torch.nn.functional.linear(hidden, weight[rows], bias[rows])
    torch.testing.assert_close(TargetHead(weight, bias)(hidden, rows, chunk_size=3), expected)
    torch.testing.assert_close(TargetHead(weight, bias).restricted(rows)(hidden, chunk_size=3), expected)
    capped = TargetHead(weight, None, final_logit_softcapping=2.0)(hidden, chunk_size=3)
    torch.testing.assert_close(capped, torch.tanh(torch.nn.functional.linear(hidden, weight) / 2.0) * 2.0)


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


def test_killed_feature_cache_build_resumes_after_its_last_shard(tmp_path):
    target = make_tiny_target("llama")
    dataset = token_dataset(12, 16, seed=2)
    # About 16.5 kB per sequence: a shard every 3 sequences, so a kill at sequence 9 leaves shards of 0-2 and 3-5.
    build = partial(
        build_feature_cache,
        target,
        layer_ids=TAPS,
        batch_size=2,
        dtype=torch.float32,
        shard_bytes=40_000,
        sort_window=2,
    )
    uninterrupted = FeatureCacheDataset(build({"train": dataset}, tmp_path / "reference"))

    def killed_after(count):
        for number, example in enumerate(dataset):
            if number == count:
                raise KeyboardInterrupt
            yield example

    with pytest.raises(KeyboardInterrupt):
        build({"train": killed_after(9)}, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    calls = []
    target.register_forward_hook(lambda module, args, output: calls.append(1))
    resumed = FeatureCacheDataset(build({"train": dataset}, tmp_path / "cache"))
    assert len(uninterrupted.shard_paths) == 4 and len(calls) == 3  # sequences 6-11 only, in batches of 2
    assert len(resumed) == len(uninterrupted) == 12
    for item in range(12):
        for name, tensor in uninterrupted[item].items():
            assert torch.equal(resumed[item][name], tensor), (item, name)


def test_feature_cache_batches_similar_lengths_and_stores_the_dataset_order(tmp_path):
    target = make_tiny_target("qwen2")
    lengths = [int(n) for n in torch.randint(4, 40, (12,), generator=torch.Generator().manual_seed(3))]
    dataset = mixed_length_dataset(lengths)
    input_ids = dataset["input_ids"]
    shapes = []
    target.register_forward_hook(
        lambda module, args, kwargs, output: shapes.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    build = partial(build_feature_cache, target, layer_ids=TAPS, batch_size=3, dtype=torch.float32)
    in_order = FeatureCacheDataset(build({"train": dataset}, tmp_path / "in-order", sort_window=3))
    padded_in_order = sum(rows * length for rows, length in shapes)
    shapes.clear()
    sorted_cache = FeatureCacheDataset(build({"train": dataset}, tmp_path / "sorted", sort_window=6))
    # Each window of 6 is batched shortest first: its batches pad to the 3rd and the 6th length of the window.
    windows = [sorted(lengths[start : start + 6]) for start in (0, 6)]
    assert shapes == [(3, window[k]) for window in windows for k in (2, 5)]
    assert sum(rows * length for rows, length in shapes) < padded_in_order
    for item in range(12):  # stored in the dataset's order, with the features a forward of the sequence alone gives
        assert sorted_cache[item]["input_ids"].tolist() == input_ids[item]
        for name, tensor in in_order[item].items():
            torch.testing.assert_close(sorted_cache[item][name], tensor, rtol=1e-4, atol=1e-3, msg=name)
    features, logits = extract_target_features(target, torch.tensor([input_ids[5]]), TAPS)
    torch.testing.assert_close(sorted_cache[5]["target_hidden_states"], features[0], rtol=1e-4, atol=1e-3)
    assert sorted_cache[5]["target_argmax"].tolist() == logits[0].argmax(-1).tolist()


def test_feature_cache_refuses_a_target_whose_logits_are_not_its_head(tmp_path):
    target = make_tiny_target("llama")
    target.lm_head.register_forward_hook(lambda module, args, output: output * 2)  # an unrecorded logit scale
    with pytest.raises(ValueError, match="logit scale"):
        build_feature_cache(target, {"train": token_dataset(2, 8)}, tmp_path / "cache", TAPS)
    assert list(tmp_path.iterdir()) == []  # nothing half-built is left behind


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
    from trainers import tokenization

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


def interrupted_and_resumed(tmp_path, make_trainer, total_steps: int, interrupt_at: int):
    """Trains `total_steps` in one go, and in a run stopped after `interrupt_at` steps then resumed from its
    checkpoint by a fresh trainer; returns both final state dicts."""
    uninterrupted = make_trainer(tmp_path / "a", total_steps)
    uninterrupted.train()

    class Interrupt(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= interrupt_at

    interrupted = make_trainer(tmp_path / "b", total_steps, save_steps=interrupt_at)
    interrupted.add_callback(Interrupt())
    interrupted.train()
    assert interrupted.state.global_step == interrupt_at
    resumed = make_trainer(tmp_path / "b", total_steps)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / f"checkpoint-{interrupt_at}"))
    assert resumed.state.global_step == uninterrupted.state.global_step == total_steps
    assert not torch.equal(next(interrupted.model.parameters()), next(resumed.model.parameters()))
    return uninterrupted.model.state_dict(), resumed.model.state_dict()


def test_pretraining_resumes_exactly(tmp_path):
    def make_trainer(output_dir, max_steps, save_steps=None):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(
            tmp_path,
            output_dir=str(output_dir),
            max_steps=max_steps,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
        )
        return OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer())

    expected, resumed = interrupted_and_resumed(tmp_path, make_trainer, total_steps=8, interrupt_at=3)
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def test_sigterm_saves_the_running_step_and_stops_without_a_final_model(tmp_path):
    """`timeout` ends a chunk of a long run with SIGTERM: the step in flight is finished and checkpointed, and no
    final model is written that would pass for a finished run; a run that is not signalled ends as before."""
    import signal

    from trainers.devices import train_and_save

    class Terminate(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    def make_trainer(output_dir):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(tmp_path, output_dir=str(output_dir), max_steps=5, save_strategy="no")
        return OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer())

    handler = signal.getsignal(signal.SIGTERM)
    signalled = make_trainer(tmp_path / "signalled")
    signalled.add_callback(Terminate())
    assert train_and_save(signalled, None) == 128 + signal.SIGTERM
    assert signalled.state.global_step == 2
    assert sorted(path.name for path in (tmp_path / "signalled").iterdir() if path.name.startswith("checkpoint-")) == [
        "checkpoint-2"
    ]
    assert not (tmp_path / "signalled" / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # a second SIGTERM ends the process as usual

    plain = make_trainer(tmp_path / "plain")
    assert train_and_save(plain, None) == 0
    assert plain.state.global_step == 5
    assert (tmp_path / "plain" / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) == handler


def test_models_at_the_keep_steps_outlive_checkpoint_rotation(tmp_path):
    """A long run's learning-curve points: the model at each of `keep_steps` is evaluated and kept, whole and without
    the optimizer, in `kept/step-N` while `save_total_limit` rotates the resume checkpoints away; steps not listed are
    not kept, nor evaluated before the last."""
    from safetensors.torch import load_file

    from trainers.devices import train_and_save

    target, seen = make_tiny_target("llama"), {}

    class Snapshot(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen[state.global_step] = {name: t.detach().clone() for name, t in unwrap(model).state_dict().items()}

    config = distill_config(
        tmp_path,
        max_steps=5,
        save_strategy="steps",
        save_steps=100,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=100,
        keep_steps=[2, 4],
    )
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        config,
        train_dataset=token_dataset(32, 12),
        eval_dataset=token_dataset(4, 12, seed=1),
        target_model=target,
    )
    trainer.add_callback(Snapshot())
    assert train_and_save(trainer, None, config.keep_steps) == 0
    output = tmp_path / "distill"
    assert sorted(path.name for path in (output / "kept").iterdir()) == ["step-2", "step-4"]
    evaluated = {entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry}
    assert {2, 4} <= evaluated and not {1, 3} & evaluated  # (and the last step, as `Trainer` does)
    assert len(list(output.glob("checkpoint-*"))) == 1 and not (output / "checkpoint-2").exists()  # rotated away
    for step in (2, 4):
        kept = output / "kept" / f"step-{step}"
        assert not (kept / "optimizer.pt").exists()
        assert json.loads((kept / "trainer_state.json").read_text())["global_step"] == step
        weights = load_file(kept / "model.safetensors")
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, seen[step][name], rtol=0, atol=0, msg=name)
        assert not torch.equal(weights["model.fc.weight"], seen[5]["model.fc.weight"])  # not the final model
        OspreyForDrafting.from_pretrained(kept)  # loads as a drafter


def test_a_resumed_run_evaluates_and_saves_on_its_own_schedule(tmp_path):
    """A run resumed with other `eval_steps` and `save_steps` than its checkpoint's follows the new ones (the
    `Trainer` alone keeps the checkpoint's: stage 2 evaluated for 27 minutes at a step its config had dropped)."""
    from trainers.devices import train_and_save

    def run(max_steps, every, resume):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(
            tmp_path,
            output_dir=str(tmp_path / "run"),
            max_steps=max_steps,
            eval_strategy="steps",
            eval_steps=every,
            save_strategy="steps",
            save_steps=every,
            save_total_limit=None,
        )
        trainer = OspreyPretrainer(
            model, config, train_dataset=text_dataset(), eval_dataset=text_dataset(4), processing_class=char_tokenizer()
        )
        assert train_and_save(trainer, resume) == 0
        return trainer

    run(max_steps=2, every=2, resume=None)
    resumed = run(max_steps=6, every=3, resume=str(tmp_path / "run" / "checkpoint-2"))
    assert [entry["step"] for entry in resumed.state.log_history if "eval_loss" in entry] == [2, 3, 6]
    assert sorted(int(path.name.split("-")[1]) for path in (tmp_path / "run").glob("checkpoint-*")) == [2, 3, 6]


def assert_distillation_resumes_exactly(
    tmp_path, target, dataset, total_steps, interrupt_at, drafter_overrides=None, **settings
):
    """A distillation interrupted after `interrupt_at` steps and resumed from its checkpoint ends bit-identical to
    the same run uninterrupted."""

    def make_trainer(output_dir, max_steps, save_steps=None):
        config = distill_config(
            tmp_path,
            output_dir=str(output_dir),
            max_steps=max_steps,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
            **settings,
        )
        drafter = tiny_drafter(target, **(drafter_overrides or {}))
        return OspreyDistillTrainer(drafter, config, train_dataset=dataset, target_model=target)

    expected, resumed = interrupted_and_resumed(tmp_path, make_trainer, total_steps, interrupt_at)
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def test_distillation_resumes_exactly(tmp_path):
    target = make_tiny_target("llama")
    assert_distillation_resumes_exactly(
        tmp_path, target, token_dataset(32, 12), total_steps=6, interrupt_at=2, lr_scheduler_type="cosine"
    )


def test_length_grouped_batches_pad_less_and_resume_exactly(tmp_path):
    target = make_tiny_target("llama")
    lengths = [int(n) for n in torch.randint(5, 40, (160,), generator=torch.Generator().manual_seed(4))]
    dataset = mixed_length_dataset(lengths, seed=4)
    cache = FeatureCacheDataset(build_feature_cache(target, {"train": dataset}, tmp_path / "cache", TAPS))
    assert cache.lengths == lengths

    def padded_positions(strategy, epoch):
        trainer = OspreyDistillTrainer(
            tiny_drafter(target), distill_config(tmp_path, train_sampling_strategy=strategy), train_dataset=cache
        )
        loader = trainer.get_train_dataloader()
        loader.set_epoch(epoch)
        batches = [batch["input_ids"] for batch in loader]
        seen = sorted(tuple(row[: (row != 0).nonzero().max() + 1].tolist()) for batch in batches for row in batch)
        assert seen == sorted(tuple(ids) for ids in dataset["input_ids"])  # every sequence once an epoch
        return [batch.numel() for batch in batches]

    grouped = padded_positions("group_by_length", 0)
    assert sum(grouped) < 0.8 * sum(padded_positions("random", 0))
    assert padded_positions("group_by_length", 1) != grouped  # a new order each epoch
    assert padded_positions("group_by_length", 0) == grouped  # and the same order for the same epoch

    # 10 batches an epoch: interrupted in the second epoch, at a step the random strategy would order differently.
    assert_distillation_resumes_exactly(
        tmp_path,
        target,
        dataset.select(range(40)),
        total_steps=14,
        interrupt_at=12,
        train_sampling_strategy="group_by_length",
    )


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


# ------------------------------------------------------------------ keeping the backbone's languages


def converted_drafter(tmp_path, draft_vocab_size: int | None = 40):
    """A tiny Llama backbone, a drafter `osprey convert` made from it for a tiny Llama target (both speaking
    `char_tokenizer`, so every text token maps directly), that target, and the tokenizer."""
    from osprey.stages.convert import convert

    tokenizer = char_tokenizer()
    backbone = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    target = make_tiny_target("llama", vocab_size=128)
    corpus = tmp_path / "draft-vocab.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20 + "0123456789\n")
    drafter, _ = convert(
        backbone,
        target.config,
        target_layer_ids=TAPS,
        draft_vocab_size=draft_vocab_size,
        corpus=[corpus] if draft_vocab_size else None,
        backbone_tokenizer=tokenizer,
        target_tokenizer=tokenizer,
    )
    return backbone, drafter, target, tokenizer


def padded_text_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded random text tokens (ids 6..101 of `char_tokenizer`), every token a training target."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(6, 102, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": attention_mask.clone()}


@torch.no_grad()
def test_lm_replay_of_a_converted_drafter_is_its_backbones_cross_entropy(tmp_path):
    """The replay term reads no target features: on a freshly converted drafter it is the backbone's own next-token
    cross-entropy over the draft vocabulary (next tokens outside it ignored), and it stays so whatever the feature
    weights become in training; the control reads features and no longer computes the backbone."""
    from trainers.ttt import lm_replay_loss, target_to_draft_ids

    backbone, drafter, _, _ = converted_drafter(tmp_path)
    batch = padded_text_batch([14, 9], seed=2)
    draft_to_target = drafter.draft_to_target
    target_to_draft = target_to_draft_ids(draft_to_target, drafter.config.vocab_size)
    total, count = 0.0, 0
    for row in range(2):
        ids = batch["input_ids"][row, : int(batch["attention_mask"][row].sum())]
        logits = backbone(ids[None]).logits[0, :-1][:, draft_to_target]  # the backbone's, over the draft vocabulary
        labels = target_to_draft[ids[1:]]
        kept = labels >= 0
        total += torch.nn.functional.cross_entropy(logits[kept], labels[kept], reduction="sum")
        count += int(kept.sum())
    assert 5 < count < 21  # some next tokens are outside the 40-token draft vocabulary, and ignored
    replay, replay_count = lm_replay_loss(drafter, **batch, target_to_draft=target_to_draft)
    assert int(replay_count) == count
    torch.testing.assert_close(replay, total / count, rtol=1e-5, atol=1e-5)

    hidden = drafter.config.hidden_size
    for projection in ("q_proj", "k_proj", "v_proj"):  # distillation opens the feature half of q/k/v, and fc
        getattr(drafter.model.layers[0].self_attn, projection).weight[:, :hidden].normal_()
    drafter.model.fc.weight.normal_()
    drafter.model.layers[0].hidden_norm.weight.normal_()
    torch.testing.assert_close(lm_replay_loss(drafter, **batch, target_to_draft=target_to_draft)[0], replay)
    features = torch.randn(*batch["input_ids"].shape, drafter.config.fused_feature_size)
    with_features = drafter(batch["input_ids"], target_hidden_states=features, attention_mask=batch["attention_mask"])
    without = drafter(batch["input_ids"], draft_hidden_states=torch.zeros(*batch["input_ids"].shape, hidden),
                      attention_mask=batch["attention_mask"])  # fmt: skip
    assert not torch.allclose(with_features.logits, without.logits, atol=1e-3)


def test_linear_token_cross_entropy_equals_the_head_then_the_loss():
    from trainers.losses import linear_token_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=generator)
    labels[::5] = -100
    loss, correct = linear_token_cross_entropy(hidden, weight, labels, chunk_size=8, gemm_chunk_size=16)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert int(correct) == int(((logits.argmax(-1) == labels) & (labels >= 0)).sum())
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_replay_batches_are_a_pure_function_of_the_draw():
    from trainers.distill import replay_indices

    drawn = [replay_indices(draw, 3, 10, seed=5) for draw in range(10)]  # three epochs of 10 examples
    flat = [index for batch in drawn for index in batch]
    for epoch in range(3):
        assert sorted(flat[10 * epoch : 10 * epoch + 10]) == list(range(10))  # each epoch a permutation
    assert flat[:10] != flat[10:20]  # drawn anew per epoch
    assert drawn == [replay_indices(draw, 3, 10, seed=5) for draw in range(10)]
    assert drawn != [replay_indices(draw, 3, 10, seed=6) for draw in range(10)]


def test_replay_adds_its_weighted_cross_entropy_and_lowers_it(tmp_path):
    """The training loss is `ttt + lm_replay_weight * replay` (logged as `lm_replay_loss`, evaluation leaves it
    out), and with the term on a few steps lower the drafter's cross-entropy on the replay text well below the same
    run's without it."""
    from trainers.distill import replay_indices
    from trainers.ttt import lm_replay_loss, target_to_draft_ids, ttt_loss

    target, tokenizer = predictable_target(), char_tokenizer()
    replay_text, weight = text_dataset(16), 0.5
    settings = dict(max_steps=12, learning_rate=1e-2, logging_steps=4, lm_replay_batch_size=3)
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        distill_config(tmp_path, lm_replay_weight=weight, **settings),
        train_dataset=token_dataset(32, 12),
        target_model=target,
        processing_class=tokenizer,
        lm_replay_dataset=replay_text,
    )
    drafter = trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    loss = trainer.compute_loss(drafter, batch)
    features, target_logits, target_argmax = trainer._target_signals(batch, drafter)
    ttt = ttt_loss(drafter, batch["input_ids"], features, target_logits, target_argmax, batch["loss_mask"],
                   drafter.draft_to_target, num_steps=3).loss  # fmt: skip
    replayed = trainer.lm_replay_dataset[replay_indices(0, 3, len(replay_text), seed=0)]
    assert len(replayed["input_ids"]) == 3 and replayed["input_ids"][0][:3] == tokenizer("the")["input_ids"]
    replay_batch = DistillDataCollator()([{"input_ids": ids, "loss_mask": m} for ids, m in
                                          zip(replayed["input_ids"], replayed["loss_mask"])])  # fmt: skip
    target_to_draft = target_to_draft_ids(drafter.draft_to_target, drafter.config.vocab_size)
    replay, _ = lm_replay_loss(drafter, replay_batch["input_ids"], replay_batch["attention_mask"],
                               replay_batch["loss_mask"], target_to_draft)  # fmt: skip
    assert replay > 1.0
    torch.testing.assert_close(loss, ttt + weight * replay)
    drafter.eval()
    torch.testing.assert_close(trainer.compute_loss(drafter, batch), ttt)  # evaluation: the TTT loss alone

    trainer._replay_step = None  # the step-0 batch was drawn above: draw it again in training
    trainer.train()
    replay_losses = logged(trainer, "lm_replay_loss")
    assert len(replay_losses) == 3 and replay_losses[2] < replay_losses[1] < replay_losses[0] - 0.5, replay_losses
    plain = OspreyDistillTrainer(
        tiny_drafter(target), distill_config(tmp_path, **settings), train_dataset=token_dataset(32, 12),
        target_model=target,
    )  # fmt: skip
    plain.train()
    assert not logged(plain, "lm_replay_loss")
    with torch.no_grad():
        held = {name: lm_replay_loss(model.eval(), replay_batch["input_ids"], replay_batch["attention_mask"],
                                     replay_batch["loss_mask"], target_to_draft)[0]
                for name, model in (("replay", trainer.model), ("plain", plain.model))}  # fmt: skip
    assert held["replay"] < held["plain"] - 1.0, held  # replay keeps the LM loss well below plain distillation's


def test_distillation_with_lm_replay_resumes_exactly(tmp_path):
    """The replay corpus named by path (read by `load_text_dataset`), several replay batches per optimizer step
    (gradient accumulation) and replay epochs that end inside a batch: resumed, the run draws what it drew."""
    target = make_tiny_target("llama")
    token_dataset(10, 9, seed=3).to_json(tmp_path / "replay.jsonl")
    assert_distillation_resumes_exactly(
        tmp_path,
        target,
        token_dataset(32, 12),
        total_steps=5,
        interrupt_at=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        lm_replay_dataset=str(tmp_path / "replay.jsonl"),
        lm_replay_weight=0.5,
        lm_replay_batch_size=3,
    )


def one_step_updates(tmp_path, drafter, target, scale: float) -> dict[str, torch.Tensor]:
    """Every parameter's change in one AdamW step (weight decay on) of a distillation at `scale`."""
    import copy

    model = copy.deepcopy(drafter).train()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    config = distill_config(
        tmp_path, max_steps=1, learning_rate=1e-3, weight_decay=0.1, pretrained_learning_rate_scale=scale
    )
    trainer = OspreyDistillTrainer(
        model, config, train_dataset=token_dataset(8, 12, vocab_size=102), target_model=target
    )
    trainer.train()
    initial_rates = [group["initial_lr"] for group in trainer.optimizer.param_groups]  # (decay, no decay) x (new, old)
    assert initial_rates == ([1e-3] * 2 if scale == 1 else [1e-3, 1e-3 * scale] * 2)
    return {name: param.detach() - before[name] for name, param in model.named_parameters()}


def test_backbone_weights_train_at_the_scaled_learning_rate(tmp_path):
    """After one step, every element the backbone supplied moved `scale` times as far as with scale 1 (weight decay
    included), and the elements convert added (fc, hidden_norm, the feature columns of block 0's q/k/v) as far; both
    halves of q/k/v are checked apart, so a mask on the wrong columns (or none) fails. The feature columns start
    open (as after some distillation): at exactly zero they would pass fc and hidden_norm no gradient."""
    _, drafter, target, _ = converted_drafter(tmp_path)
    scale, hidden = 0.25, drafter.config.hidden_size
    with torch.no_grad():
        for name in "qkv":
            getattr(drafter.model.layers[0].self_attn, f"{name}_proj").weight[:, :hidden].normal_(std=0.05)
    full, scaled = one_step_updates(tmp_path, drafter, target, 1.0), one_step_updates(tmp_path, drafter, target, scale)
    close = partial(torch.testing.assert_close, rtol=1e-3, atol=3e-7)  # a few float32 ulps of the weights (~1)
    fusion_qkv = [f"model.layers.0.self_attn.{name}_proj.weight" for name in "qkv"]
    added = ["model.fc.weight", "model.layers.0.hidden_norm.weight"]
    for name, update in full.items():
        assert update.abs().sum() > 0, name
        if name in added:
            close(scaled[name], update, msg=name)
        elif name in fusion_qkv:
            features, tokens = update[:, :hidden], update[:, hidden:]
            assert features.abs().sum() > 0 and tokens.abs().sum() > 0, name
            close(scaled[name][:, :hidden], features, msg=name)
            close(scaled[name][:, hidden:], scale * tokens, msg=name)
            assert not torch.allclose(scaled[name][:, :hidden], scale * features, rtol=1e-2)
            assert not torch.allclose(scaled[name][:, hidden:], tokens, rtol=1e-2)
        else:
            close(scaled[name], scale * update, msg=name)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"} <= set(full)


def test_distillation_with_a_pretrained_learning_rate_scale_resumes_exactly(tmp_path):
    """The split param groups are saved and loaded in order (the optimizer state loads without error and the run
    trains on bit-identically); a resume that changes the scale is refused by name."""
    target = make_tiny_target("llama")
    settings = dict(pretrained_learning_rate_scale=0.5, lr_scheduler_type="cosine", weight_decay=0.1)
    assert_distillation_resumes_exactly(
        tmp_path, target, token_dataset(32, 12), total_steps=5, interrupt_at=2,
        drafter_overrides={"backbone_model_type": "llama"}, **settings,
    )  # fmt: skip
    config = distill_config(tmp_path, output_dir=str(tmp_path / "b"), max_steps=5)
    other = OspreyDistillTrainer(
        tiny_drafter(target, backbone_model_type="llama"), config, train_dataset=token_dataset(32, 12),
        target_model=target,
    )  # fmt: skip
    with pytest.raises(ValueError, match="trained with pretrained_learning_rate_scale 0.5, this run asks for 1.0"):
        other.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


def test_replay_and_learning_rate_scale_errors_name_the_fix(tmp_path):
    target = make_tiny_target("llama")
    data = token_dataset(8, 12)
    with pytest.raises(ValueError, match="lm_replay_weight must be 0 \\(off\\) or positive"):
        distill_config(tmp_path, lm_replay_weight=-0.1, lm_replay_dataset="multilingual")
    with pytest.raises(ValueError, match="corpus \\(multilingual\\).*lm_replay_weight is 0.*probably a mistake"):
        distill_config(tmp_path, lm_replay_dataset="multilingual")
    for scale in (0.0, 1.5):
        with pytest.raises(ValueError, match="pretrained_learning_rate_scale must be in \\(0, 1\\]"):
            distill_config(tmp_path, pretrained_learning_rate_scale=scale)
    assert distill_config(tmp_path, lm_replay_weight=0.1).lm_replay_batch_size == 4  # per_device_train_batch_size

    def trainer(drafter=None, **settings):
        replay = settings.pop("replay", None)
        return OspreyDistillTrainer(
            drafter or tiny_drafter(target), distill_config(tmp_path, **settings), train_dataset=data,
            target_model=target, processing_class=char_tokenizer(), lm_replay_dataset=replay,
        )  # fmt: skip

    with pytest.raises(ValueError, match="needs a corpus to replay: pass --lm-replay-dataset"):
        trainer(lm_replay_weight=0.1)
    with pytest.raises(ValueError, match="lm_replay_weight is 0.*probably a mistake"):
        trainer(replay=text_dataset(4))
    with pytest.raises(ValueError, match="is empty: no example has 3 tokens or more"):
        trainer(replay=Dataset.from_dict({"text": ["ab", "", "c"]}), lm_replay_weight=0.1)
    with pytest.raises(ValueError, match="not streamed"):
        trainer(replay=text_dataset(4).to_iterable_dataset(), lm_replay_weight=0.1)

    with pytest.raises(ValueError, match="records no backbone.*not made by `osprey convert`"):
        trainer(pretrained_learning_rate_scale=0.5)  # a drafter with no backbone_model_type
    eagle3 = tiny_drafter(target, num_hidden_layers=1, residual_stream="features")
    with pytest.raises(ValueError, match="this EAGLE-3 drafter has none"):
        trainer(eagle3, pretrained_learning_rate_scale=0.5)
    trainer(tiny_drafter(target, backbone_model_type="llama"), pretrained_learning_rate_scale=0.5)  # accepted


def test_the_controls_are_distilled_without_a_pretrained_learning_rate_scale_by_their_driver(tmp_path):
    """`osprey baseline scratch` keeps the converted config (its backbone_model_type too) but its blocks are random.
    The library reads only the config, so it takes the option for the scratch control as for any converted drafter;
    the experiment's driver (benchmarks/replication/languages_qwen.sh) refuses a control with the option (`-slow`)."""
    from osprey.stages.baselines import build_baseline

    _, drafter, target, tokenizer = converted_drafter(tmp_path, draft_vocab_size=None)
    drafter.save_pretrained(tmp_path / "osprey")
    tokenizer.save_pretrained(tmp_path / "osprey")
    build_baseline("scratch", tmp_path / "osprey", tmp_path / "scratch")
    scratch = OspreyForDrafting.from_pretrained(tmp_path / "scratch")
    assert scratch.config.backbone_model_type == "llama"
    config = distill_config(tmp_path, pretrained_learning_rate_scale=0.5)
    OspreyDistillTrainer(scratch, config, train_dataset=token_dataset(8, 12, vocab_size=102), target_model=target)
    script = Path(__file__).parents[1] / "benchmarks" / "replication" / "languages_qwen.sh"
    for variant in ("scratch-mixed-slow", "eagle3-en-vocab-replay-slow"):
        run = subprocess.run(
            ["bash", str(script), "train", variant],
            env={**os.environ, "RUNS": str(tmp_path / "runs")},
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 2
        assert f"{variant}: the controls are distilled without --pretrained-learning-rate-scale" in run.stderr
        assert f"run {variant.removesuffix('-slow')}," in run.stderr


def test_cli_takes_the_replay_and_scale_flags_hyphenated():
    from transformers import HfArgumentParser

    argv = ["--output-dir", "out", "--lm-replay-dataset", "multilingual", "--lm-replay-weight", "0.2",
            "--lm-replay-batch-size", "2", "--lm-replay-max-length", "256",
            "--pretrained-learning-rate-scale", "0.1"]  # fmt: skip
    (config,) = HfArgumentParser(OspreyDistillConfig).parse_args_into_dataclasses(argv)
    assert (config.lm_replay_dataset, config.lm_replay_weight, config.lm_replay_batch_size) == ("multilingual", 0.2, 2)
    assert (config.lm_replay_max_length, config.pretrained_learning_rate_scale) == (256, 0.1)


def test_osprey_distill_replays_and_scales_from_a_feature_cache(tmp_path):
    """The usual way: `osprey distill --feature-cache` with a text replay corpus (tokenized by the drafter's
    tokenizer) and the scale; the cached run's loss, replay term included, is the live run's."""
    target, tokenizer = make_tiny_target("llama"), char_tokenizer()
    dataset = token_dataset(8, 12, seed=1)
    cache = build_feature_cache(target, {"train": dataset}, tmp_path / "cache", TAPS, dtype=torch.float32)
    text_dataset(16).to_json(tmp_path / "replay.jsonl")
    replay = dict(lm_replay_dataset=str(tmp_path / "replay.jsonl"), lm_replay_weight=0.5)
    drafter = tiny_drafter(target, backbone_model_type="llama").train()
    live = OspreyDistillTrainer(drafter, distill_config(tmp_path, **replay), train_dataset=dataset,
                                target_model=target, processing_class=tokenizer)  # fmt: skip
    cached_dataset = FeatureCacheDataset(cache, "train")
    cached = OspreyDistillTrainer(drafter, distill_config(tmp_path, **replay), train_dataset=cached_dataset,
                                  processing_class=tokenizer)  # fmt: skip
    live_batch = live._prepare_inputs(next(iter(live.get_eval_dataloader(dataset))))
    cached_batch = cached._prepare_inputs(next(iter(cached.get_eval_dataloader(cached_dataset))))
    live_loss, cached_loss = live.compute_loss(drafter, live_batch), cached.compute_loss(drafter, cached_batch)
    torch.testing.assert_close(cached_loss, live_loss)
    assert cached._replay_metrics["batches"] == 1

    drafter.save_pretrained(tmp_path / "drafter")
    tokenizer.save_pretrained(tmp_path / "drafter")
    argv = ["--drafter", str(tmp_path / "drafter"), "--feature-cache", str(cache), "--output-dir",
            str(tmp_path / "out"), "--max-steps", "2", "--logging-steps", "1", "--report-to", "none",
            "--lm-replay-dataset", str(tmp_path / "replay.jsonl"), "--lm-replay-weight", "0.5",
            "--lm-replay-batch-size", "2", "--pretrained-learning-rate-scale", "0.5"]  # fmt: skip
    assert trainers.distill.main(argv) == 0
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "lm_replay_loss" in entry] == [1, 2]
