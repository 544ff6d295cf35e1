"""The distillation objective: training-time test (TTT), the drafter drafting several steps ahead on its own
outputs against the target's distribution, and the plain language-modelling replay term that keeps the backbone's
other languages (`lm_replay_weight`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from modeling_osprey.modeling_osprey import OspreyTTTCache

from .devices import (
    unwrap,
)
from .losses import (
    head_for_loss,
    linear_soft_cross_entropy,
    linear_token_cross_entropy,
    target_distribution,
)


@dataclass
class TTTOutput:
    """Result of [`ttt_loss`]; per-step tensors have one entry per step."""

    loss: torch.Tensor
    step_losses: torch.Tensor
    step_correct: torch.Tensor
    step_counts: torch.Tensor
    step_logits: list[tuple[torch.BoolTensor, torch.Tensor]] | None = None  # (positions counted, their logits)


def label_positions(loss_mask: torch.Tensor) -> torch.BoolTensor:
    """Where the target's next-token distribution is a TTT label: position `j` predicts token `j + 1`, and that
    token is one to train on (`loss_mask[:, j + 1]`)."""
    return F.pad(loss_mask[:, 1:].bool(), (0, 1))


def ttt_loss(
    drafter,
    input_ids: torch.LongTensor,
    target_hidden_states: torch.Tensor,
    target_logits: torch.Tensor,
    target_argmax: torch.LongTensor,
    loss_mask: torch.Tensor,
    draft_to_target: torch.LongTensor,
    num_steps: int = 5,
    decay: float = 0.8,
    return_logits: bool = False,
) -> TTTOutput:
    r"""The training-time-test loss of a drafter on a right-padded batch of sequences `x_0 .. x_{T-1}`.

    Args:
        target_hidden_states: the target's tap features `F`, `(batch, T, fused_feature_size)`.
        target_logits: the target's logits restricted to the draft vocabulary (columns `draft_to_target`),
            `(batch, T, draft_vocab_size)`, or only their rows at `label_positions(loss_mask)` in order,
            `(n, draft_vocab_size)` (the only rows the loss reads); their softmax is the target distribution
            renormalised over the draft vocabulary, the only part a drafter can put probability on.
        target_argmax: the target's greedy next token over its whole vocabulary, `(batch, T)`, for the accuracy.
        loss_mask: `(batch, T)`, 1 on tokens to train on predicting, 0 on prompt tokens and padding.

    Step `k` (0-based) runs drafter position `t` on token `x_{t+1+k}` at RoPE position `t + k`, reading
    `target_hidden_states=F[t]` at step 0 and, after, `draft_hidden_states` = its own step-`k-1` pre-norm state at `t`.
    Its label is the target distribution `P[t+1+k]`, which predicts `x_{t+2+k}`: it counts where that token exists and
    has `loss_mask` 1. Each step is one forward over all positions that appends its keys to a shared `OspreyTTTCache`,
    whose attention is the chain's (step-0 keys causally, then one key per later step at the query's own position).
    The loss is `sum_k decay**k * CE_k`, `CE_k` the soft cross-entropy
    `-sum_v P log q` averaged over step `k`'s counted positions of the batch.
    """
    num_positions = input_ids.shape[1] - 1
    device = input_ids.device
    # label_mask[:, j]: P[j] is a label, i.e. the token x_{j+1} it predicts is one to train on. Distributions and
    # drafter logits are computed at labels only: prompt tokens and padding would be most of the head's work.
    label_mask = label_positions(loss_mask)[:, :-1]
    if target_logits.dim() == 2:  # given at the label positions only
        target_probs = target_distribution(target_logits)
    else:
        target_probs = target_distribution(target_logits, label_positions(loss_mask))
    label_rows = torch.full(label_mask.shape, -1, dtype=torch.long, device=device)
    label_rows[label_mask] = torch.arange(len(target_probs), device=device)
    position_ids = torch.arange(num_positions, device=device)[None]
    cache = OspreyTTTCache()
    # The tokens of every step embedded at once (step k reads x_{t+1+k}, padding past the end): one embedding
    # gradient per batch, not one dense vocabulary-sized gradient per step.
    padded_ids = F.pad(input_ids, (0, num_steps))
    # Under FSDP each step's forward embeds its own tokens and the head is read after each forward instead: FSDP
    # gathers a unit's parameters for its forwards and reduces their gradients after its backwards, so a weight read
    # before the first forward is still a shard, and a gradient reaching it after that unit's last backward is lost.
    per_step = isinstance(drafter, FSDPModule)
    embeddings = None if per_step else unwrap(drafter).get_input_embeddings()(padded_ids)
    # The LM head, applied by the loss a chunk of rows at a time; cast (and laid out column-major) once for the five
    # steps, as autocast's cache would cast it for `nn.Linear`, its five gradients summed in that dtype and layout
    # before the one copy back.
    head = None if per_step else head_for_loss(unwrap(drafter).lm_head.weight)
    loss = torch.zeros((), device=device)
    step_losses, step_correct, step_counts, step_logits = [], [], [], []
    hidden_states = None
    for step in range(num_steps):
        # Positions t < num_labelled have a label P[t+1+step] whose predicted token x_{t+2+step} exists.
        num_labelled = num_positions - 1 - step
        if num_labelled <= 0:  # the sequence is too short for this step (and every later one)
            step_losses.append(loss.new_zeros(()))
            step_correct.append(torch.zeros((), dtype=torch.long, device=device))
            step_counts.append(torch.zeros((), dtype=torch.long, device=device))
            continue
        # Token x_{t+1+step}; positions past the sequence read padding and are never labels.
        tokens = padded_ids[:, 1 + step : 1 + step + num_positions]
        features = {"target_hidden_states": target_hidden_states[:, :num_positions]} if step == 0 else {}
        labels = slice(1 + step, 1 + step + num_labelled)
        # Drafter position t is counted where its label P[t+1+step] is one.
        counted = F.pad(label_mask[:, labels], (0, num_positions - num_labelled))
        outputs = drafter(
            tokens,
            draft_hidden_states=hidden_states,
            position_ids=position_ids + step,
            cache=cache,
            use_cache=True,
            logits_to_keep=counted,
            inputs_embeds=None if per_step else embeddings[:, 1 + step : 1 + step + num_positions],
            skip_logits=True,
            **features,
        )
        hidden_states = outputs.prenorm_hidden_states
        if per_step:
            head = head_for_loss(unwrap(drafter).lm_head.weight)
        rows = label_rows[:, labels][label_mask[:, labels]]
        cross_entropy, draft_argmax = linear_soft_cross_entropy(outputs.last_hidden_state, head, target_probs, rows)
        count = counted.sum()
        step_loss = cross_entropy / count.clamp(min=1)
        loss = loss + decay**step * step_loss
        correct = draft_to_target[draft_argmax] == target_argmax[:, labels][label_mask[:, labels]]
        step_losses.append(step_loss.detach())
        step_correct.append(correct.sum())
        step_counts.append(count)
        if return_logits:
            with torch.no_grad():
                step_logits.append((counted, unwrap(drafter).lm_head(outputs.last_hidden_state)))
    return TTTOutput(
        loss=loss,
        step_losses=torch.stack(step_losses),
        step_correct=torch.stack(step_correct),
        step_counts=torch.stack(step_counts),
        step_logits=step_logits if return_logits else None,
    )


def target_to_draft_ids(draft_to_target: torch.LongTensor, vocab_size: int) -> torch.LongTensor:
    """The inverse of a drafter's `draft_to_target`: each target id's row of the draft vocabulary, -100 (ignored by
    the cross-entropies) for target tokens outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.long, device=draft_to_target.device)
    index[draft_to_target] = torch.arange(len(draft_to_target), device=draft_to_target.device)
    return index


def lm_replay_loss(
    drafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    target_to_draft: torch.LongTensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The drafter's next-token cross-entropy on a right-padded batch of text read *without target features*:
    `draft_hidden_states` is zero, so `fc` is bypassed and `hidden_norm(0) = 0`, and the fusion block's q/k/v read
    nothing through their feature half. A drafter freshly converted from a backbone therefore computes exactly the
    backbone here (over the draft vocabulary), and the term trains the computation the backbone's languages live in.

    Position `j` is labelled with token `j + 1` mapped into the draft vocabulary (`target_to_draft`, see
    `target_to_draft_ids`), where that token exists, has `loss_mask` 1 and is in the draft vocabulary (the others
    are ignored). Returns the mean cross-entropy over the labelled positions and their number. The LM head is applied
    by the fused `trainers.losses.linear_token_cross_entropy`, a chunk of rows at a time.
    """
    inner = unwrap(drafter)
    next_tokens = target_to_draft[F.pad(input_ids[:, 1:], (0, 1))]
    counted = label_positions(loss_mask * attention_mask) & (next_tokens >= 0)
    features = torch.zeros(*input_ids.shape, inner.config.hidden_size, dtype=inner.dtype, device=input_ids.device)
    outputs = drafter(
        input_ids,
        draft_hidden_states=features,
        attention_mask=attention_mask,
        use_cache=False,
        logits_to_keep=counted,
        skip_logits=True,
    )
    head = head_for_loss(inner.lm_head.weight)
    cross_entropy, _ = linear_token_cross_entropy(outputs.last_hidden_state, head, next_tokens[counted])
    count = counted.sum()
    return cross_entropy / count.clamp(min=1), count
