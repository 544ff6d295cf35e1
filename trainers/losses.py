"""Cross-entropies over large vocabularies that write their gradient during the forward.

A language-model loss over `V` columns is a handful of passes over `N x V` logits in eager PyTorch (a float32 copy,
log-softmax, the product with the targets, the backward's softmax, casts); on a CPU those passes cost about as much as
the LM head's matmuls. Here one function computes, per row, the loss, the argmax (for accuracy) and the gradient
`softmax - target` in the logits' dtype, and backward only scales that gradient. Above a few million logits the row
function runs `torch.compile`d, which fuses it into one kernel; below, eagerly, a chunk of rows at a time.
"""

import torch

COMPILE_ABOVE = 4_000_000  # logits; smaller calls (tests, tiny models) do not pay for the compilation


def soft_cross_entropy(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    rows: torch.LongTensor | None = None,
    compile: bool | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """`sum_i -sum_v target_probs[rows[i], v] * log_softmax(logits[i])[v]` and each row's argmax.

    Equal to `F.cross_entropy(logits.float(), target_probs[rows], reduction="sum")` (`rows` defaults to all rows in
    order), without a float32 copy of the logits, a gathered copy of the targets or log-probabilities kept for backward.
    """
    function, chunk_size = _row_function(_soft_rows, logits, compile, chunk_size)
    return _FusedCrossEntropy.apply(logits, target_probs, rows, function, chunk_size)


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.LongTensor,
    ignore_index: int = -100,
    compile: bool | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """`F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=ignore_index)` over `(N, V)` logits
    and `(N,)` labels, and the number of rows whose argmax is their label."""
    labels = labels.masked_fill(labels == ignore_index, -1)
    function, chunk_size = _row_function(_token_rows, logits, compile, chunk_size)
    loss, correct = _FusedCrossEntropy.apply(logits, labels, None, function, chunk_size)
    return loss, correct.sum()


def target_distribution(target_logits: torch.Tensor, mask: torch.BoolTensor, compile: bool | None = None):
    """`target_logits[mask].float().softmax(-1)`: the target's distributions at the masked positions, in float32."""
    function, _ = _row_function(_gathered_softmax, target_logits, compile, 0)
    return function(target_logits.flatten(0, -2), mask.flatten().nonzero().squeeze(1))


def _gathered_softmax(logits, index):
    return logits[index].float().softmax(dim=-1)


def _soft_rows(logits, target_probs, rows):
    scores = logits.float()
    probs = target_probs if rows is None else target_probs[rows]
    log_normalizer = scores.logsumexp(dim=-1, keepdim=True)
    loss = (log_normalizer.squeeze(-1) * probs.sum(dim=-1)).sum() - (probs * scores).sum()
    grad = (scores - log_normalizer).exp() - probs
    return loss, _argmax(scores), grad.to(logits.dtype)


def _token_rows(logits, labels, rows):
    """Rows with label -1 are ignored: no loss, zero gradient, never correct."""
    scores = logits.float()
    valid = labels >= 0
    log_normalizer = scores.logsumexp(dim=-1, keepdim=True)
    label_scores = scores.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    loss = torch.where(valid, log_normalizer.squeeze(-1) - label_scores, 0.0).sum()
    one_hot = torch.arange(scores.shape[1], device=scores.device)[None] == labels[:, None]
    grad = torch.where(valid[:, None], (scores - log_normalizer).exp() - one_hot.float(), 0.0)
    return loss, (_argmax(scores) == labels) & valid, grad.to(logits.dtype)


def _argmax(scores: torch.Tensor) -> torch.LongTensor:
    """`scores.argmax(dim=-1)` (the first maximum of each row) as a max and a min over the indices that reach it:
    compiled, 4x faster than inductor's argmax over float32 scores read from bf16 logits (36 vs 158 ms for 1,000 x
    32,000 on one core). A row with a NaN gets its last index instead of the NaN's."""
    columns = torch.arange(scores.shape[-1], device=scores.device)
    first = torch.where(scores == scores.amax(dim=-1, keepdim=True), columns, scores.shape[-1]).amin(dim=-1)
    return first.clamp(max=scores.shape[-1] - 1)


_COMPILED = {}


def _row_function(row_function, logits: torch.Tensor, compile: bool | None, chunk_size: int):
    """The row function to run and its chunk size: compiled over all rows at once, or eager in chunks."""
    if compile is None:
        compile = logits.numel() > COMPILE_ABOVE
    if not compile:
        return row_function, chunk_size
    if row_function not in _COMPILED:
        _COMPILED[row_function] = torch.compile(row_function, dynamic=True)
    return _COMPILED[row_function], len(logits)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rows, row_function, chunk_size):
        if chunk_size >= len(logits):
            total, per_row, grad = row_function(logits, targets, rows)
        else:
            total = torch.zeros((), dtype=torch.float32, device=logits.device)
            per_row, grad = [], torch.empty_like(logits)
            for start in range(0, len(logits), chunk_size):
                chunk = slice(start, start + chunk_size)
                chunk_targets = targets[chunk] if rows is None else targets
                chunk_rows = None if rows is None else rows[chunk]
                loss, row_result, grad[chunk] = row_function(logits[chunk], chunk_targets, chunk_rows)
                total += loss
                per_row.append(row_result)
            per_row = torch.cat(per_row)
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        ctx.mark_non_differentiable(per_row)
        return total, per_row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, grad_per_row):
        (grad,) = ctx.saved_tensors
        if ctx.backward_done:
            raise RuntimeError("The fused cross-entropy scales its saved gradient in place: backward runs once.")
        ctx.backward_done = True
        return grad.mul_(grad_total.to(grad.dtype)), None, None, None, None
