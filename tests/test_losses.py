"""The trainers' losses against plain references: the TTT unroll (step by step, the dense-mask reference, its
gradients) and the fused and chunked cross-entropies."""

import pytest
import torch
from conftest import make_tiny_target
from test_trainers import TAPS, tiny_drafter
from transformers.cache_utils import DynamicCache

from modeling_osprey.target_features import extract_target_features
from trainers import (
    TargetHead,
    head_for_loss,
    linear_soft_cross_entropy,
    soft_cross_entropy,
    token_cross_entropy,
    ttt_loss,
)
from trainers.losses import target_distribution, target_distribution_and_entropy


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
