"""Cross-entropies over large vocabularies that write their gradient during the forward.

A language-model loss over `V` columns is a handful of passes over `N x V` logits in eager PyTorch (a float32 copy,
log-softmax, the product with the targets, the backward's softmax, casts); on a CPU those passes cost about as much as
the LM head's matmuls. Here one row function computes, per row, the loss, the argmax (for accuracy) and the gradient
`softmax - target` in the logits' dtype, and backward only scales that gradient. Above a few million logits the row
function runs `torch.compile`d, which fuses each of its passes into one kernel; below, eagerly, a chunk of rows at a
time.

`linear_soft_cross_entropy` also folds the LM head into the loss: the logits of a few hundred rows at a time are
computed, reduced to loss, argmax and gradient, and dropped, so no `(rows, vocabulary)` logits tensor is ever written
out and read back (on this project's 2-core CPU the head's GEMMs also run faster in chunks of 512 rows than over
2,000 at once, and fastest on a column-major head; see docs/training.md, "Training throughput"); backward scales the
two products' small sides instead of that gradient.
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


def linear_soft_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    target_probs: torch.Tensor,
    rows: torch.LongTensor | None = None,
    compile: bool | None = None,
    chunk_size: int = 256,
    gemm_chunk_size: int = 512,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """`soft_cross_entropy(hidden_states @ weight.T, target_probs, rows)` for an LM head without bias: the logits of
    `gemm_chunk_size` rows at a time, reduced `chunk_size` rows at a time. The `(N, V)` logits never exist, only their
    gradient (kept for backward, in the logits' dtype). On a CPU thread the GEMM runs fastest in chunks of 512 rows
    and the loss kernels in chunks of 256 (docs/training.md, "Training throughput").

    The logits are computed in `compute_dtype(hidden_states)` (bfloat16 under a bf16 autocast, as `nn.Linear` would);
    the gradients come back in `hidden_states`' and `weight`'s own dtypes, the weight's in the weight's layout. All
    three GEMMs run fastest on a column-major `weight` (`w.T.contiguous().T`, see `head_for_loss`).
    """
    if compile is None:
        compile = hidden_states.shape[0] * weight.shape[0] > COMPILE_ABOVE
    function = _compiled(_soft_rows) if compile else _soft_rows
    return _FusedLinearCrossEntropy.apply(
        hidden_states, weight, target_probs, rows, function, chunk_size, gemm_chunk_size
    )


def head_for_loss(weight: torch.Tensor) -> torch.Tensor:
    """An LM head's `(V, H)` weight as `linear_soft_cross_entropy` reads it fastest: cast to `compute_dtype(weight)`
    and column-major (one strided copy, made once for every call that shares the weight). On this project's CPU
    (oneDNN bf16) the forward's `chunk @ weight.T` runs faster on it than on the row-major weight, and the weight
    gradient comes out in its layout (`benchmarks/head_gemm_layouts.py`). A differentiable view: its gradient reaches
    `weight`. A weight already column-major (`store_column_major`) is only cast."""
    # `.to` returns the transposed view itself when the dtype is already right; then `.contiguous()` copies
    return weight.T.to(compute_dtype(weight), memory_format=torch.contiguous_format).contiguous().T


def store_column_major(weight: torch.nn.Parameter) -> None:
    """Stores an LM head's `(V, H)` weight column-major in place (same values, `weight.T` contiguous), so that
    `head_for_loss` casts it without a transposed copy and its gradient arrives in that layout, which saves four
    copies of the whole head per distillation step (docs/training.md, "Training throughput"). Optimizer states
    follow the parameter's layout (`states_in_parameter_layout`)."""
    if weight.is_contiguous() and weight.dim() == 2:
        weight.data = weight.data.T.contiguous().T


def compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype an `nn.Linear` would compute in here: the autocast dtype where autocast is on, else the input's."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden_states.dtype


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


def linear_token_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.LongTensor,
    ignore_index: int = -100,
    compile: bool | None = None,
    chunk_size: int = 256,
    gemm_chunk_size: int = 512,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """`token_cross_entropy(hidden_states @ weight.T, labels)` for an LM head without bias, its row function run over
    the logits of `gemm_chunk_size` rows at a time as in `linear_soft_cross_entropy` (no `(N, V)` logits tensor, only
    its gradient; the same dtypes and head layout)."""
    labels = labels.masked_fill(labels == ignore_index, -1)
    if compile is None:
        compile = hidden_states.shape[0] * weight.shape[0] > COMPILE_ABOVE
    function = _compiled(_token_rows) if compile else _token_rows
    loss, correct = _FusedLinearCrossEntropy.apply(
        hidden_states, weight, labels, None, function, chunk_size, gemm_chunk_size
    )
    return loss, correct.sum()


def target_distribution(
    target_logits: torch.Tensor, mask: torch.BoolTensor | None = None, compile: bool | None = None
) -> torch.Tensor:
    """`target_logits[mask].float().softmax(-1)`: the target's distributions at the masked positions (every row of
    `(n, vocabulary)` logits without a mask), in float32."""
    return _at_masked_rows(_gathered_softmax, target_logits, mask, compile)


def target_distribution_and_entropy(
    target_logits: torch.Tensor, mask: torch.BoolTensor | None = None, compile: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_distribution(target_logits, mask)` and the summed entropy of its rows, `-sum p log p`, in one pass
    over the logits (`H = logsumexp(z) - sum_v p_v z_v` per row): a KL divergence's constant term, which a soft
    cross-entropy leaves out."""
    return _at_masked_rows(_gathered_softmax_entropy, target_logits, mask, compile)


def _at_masked_rows(row_function, logits: torch.Tensor, mask: torch.BoolTensor | None, compile: bool | None):
    """`row_function(rows, index)` over the rows of `logits` where `mask` is set (all of `(n, vocabulary)` logits
    without one), the gather done inside it (compiled, fused into its first pass)."""
    function, _ = _row_function(row_function, logits, compile, 0)
    if mask is None:
        return function(logits, None)
    return function(logits.flatten(0, -2), mask.flatten().nonzero().squeeze(1))


def _gathered_softmax(logits, index):
    return (logits if index is None else logits[index]).float().softmax(dim=-1)


def _gathered_softmax_entropy(logits, index):
    scores = (logits if index is None else logits[index]).float()
    log_normalizer = scores.logsumexp(dim=-1, keepdim=True)
    probs = (scores - log_normalizer).exp()
    return probs, (log_normalizer.squeeze(-1) - (probs * scores).sum(dim=-1)).sum()


def _soft_exps(logits, target_probs, rows, exps_out=None):
    """The soft cross-entropy's first pass over rows of logits: loss, argmax, `exp(scores - max)` (written into
    `exps_out` when given) and its row sums."""
    scores = logits.float()
    probs = target_probs if rows is None else target_probs[rows]
    maximum, block_maxima = _row_maxima(scores)
    # the target's terms as row sums, which the compiled kernel computes in the maxima's pass over the row
    target_mass, target_score = probs.sum(dim=-1), (probs * scores).sum(dim=-1)
    exps = (scores - maximum).exp()
    sums = exps.sum(dim=-1, keepdim=True)
    loss = ((maximum + sums.log()).squeeze(-1) * target_mass - target_score).sum()
    if exps_out is not None:
        exps = exps_out.copy_(exps)
    return loss, _argmax(scores, maximum, block_maxima), exps, sums


def _soft_gradient(exps, sums, target_probs, rows, dtype, out=None):
    """Its second pass: the gradient `softmax - target` from the first pass's exponentials, in `dtype`."""
    probs = target_probs if rows is None else target_probs[rows]
    return _written((exps / sums - probs).to(dtype), out)


class _TwoPasses:
    """A row function in two passes, each its own kernel when compiled: one fused kernel would recompute every
    exponential for the gradient (the loss is exp-bound on a CPU core, so two passes are faster: docs/training.md,
    "Training throughput")."""

    def __init__(self, first, second, reuse_exps: bool = False):
        self.first, self.second = first, second
        self.reuse_exps, self.scratch = reuse_exps, None

    def __call__(self, logits, target_probs, rows, out=None):
        if out is None or not self.reuse_exps:
            loss, argmax, exps, sums = self.first(logits, target_probs, rows)
        else:  # compiled, in chunks: every chunk's exponentials in one float32 buffer (eager, it would add a copy)
            loss, argmax, exps, sums = self.first(logits, target_probs, rows, self._scratch(logits))
        return loss, argmax, self.second(exps, sums, target_probs, rows, logits.dtype, out)

    def _scratch(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 buffer of `logits`' shape, reused by the next calls as long as they fit in it."""
        size = logits.numel()
        if self.scratch is None or self.scratch.numel() < size or self.scratch.device != logits.device:
            self.scratch = torch.empty(size, dtype=torch.float32, device=logits.device)
        return self.scratch[:size].view(logits.shape)

    def compiled(self):
        return _TwoPasses(
            torch.compile(self.first, dynamic=True), torch.compile(self.second, dynamic=True), reuse_exps=True
        )


_soft_rows = _TwoPasses(_soft_exps, _soft_gradient)
"""Loss, argmax and gradient of rows of logits; the gradient is written into `out` when given (a slice of a larger
buffer: compiled, the kernel writes it in place instead of returning a copy to be copied)."""


def _token_rows(logits, labels, rows, out=None):
    """Rows with label -1 are ignored: no loss, zero gradient, never correct. `out` as for `_soft_rows`."""
    scores = logits.float()
    valid = labels >= 0
    log_normalizer = scores.logsumexp(dim=-1, keepdim=True)
    label_scores = scores.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    loss = torch.where(valid, log_normalizer.squeeze(-1) - label_scores, 0.0).sum()
    one_hot = torch.arange(scores.shape[1], device=scores.device)[None] == labels[:, None]
    grad = torch.where(valid[:, None], (scores - log_normalizer).exp() - one_hot.float(), 0.0).to(logits.dtype)
    return loss, (_argmax(scores) == labels) & valid, _written(grad, out)


def _written(grad: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor | None:
    """A row function's gradient: returned, or copied into `out` (then None)."""
    if out is None:
        return grad
    out.copy_(grad)
    return None


ARGMAX_BLOCKS = (128, 64, 32, 16, 8, 4, 2, 1)
"""Columns per block of the argmax's first pass: the first of these that divides the row. Chosen by divisibility tests,
not computed from the width, so that a compiled kernel keeps the width symbolic (specialised to a width such as 32,000
columns, the first pass runs 2-3x slower)."""


def _row_maxima(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' maxima `(N, 1)` and their maxima per block of columns `(N, blocks)`, from one pass over `scores`."""
    block = next(block for block in ARGMAX_BLOCKS if scores.shape[-1] % block == 0)
    block_maxima = scores.unflatten(-1, (-1, block)).amax(dim=-1)
    return block_maxima.amax(dim=-1, keepdim=True), block_maxima


def _argmax(
    scores: torch.Tensor, maximum: torch.Tensor | None = None, block_maxima: torch.Tensor | None = None
) -> torch.LongTensor:
    """`scores.argmax(dim=-1)` (the first maximum of each row) from `_row_maxima`: the first block that reaches the
    row's maximum, then the first column of that block that does. Compiled, only the block maxima pass over the whole
    row: faster than a min over all the columns reaching the maximum (`benchmarks/throughput_worker.py loss-kernels`),
    which is itself about 4x faster than inductor's argmax over float32 scores read from bf16 logits. A row with a
    NaN gets its last index instead of the NaN's."""
    if maximum is None or block_maxima is None:
        maximum, block_maxima = _row_maxima(scores)
    num_blocks = block_maxima.shape[-1]
    block = scores.shape[-1] // num_blocks
    blocks = torch.arange(num_blocks, device=scores.device, dtype=torch.int32)
    first_block = torch.where(block_maxima == maximum, blocks, num_blocks).amin(dim=-1).clamp(max=num_blocks - 1)
    index = first_block.long()[:, None, None].expand(-1, 1, block)
    within = scores.unflatten(-1, (num_blocks, block)).gather(1, index).squeeze(1)
    columns = torch.arange(block, device=scores.device, dtype=torch.int32)
    first = torch.where(within == maximum, columns, block).amin(dim=-1).clamp(max=block - 1)
    return first_block.long() * block + first


_COMPILED = {}


def _row_function(row_function, logits: torch.Tensor, compile: bool | None, chunk_size: int):
    """The row function to run and its chunk size: compiled over all rows at once, or eager in chunks."""
    if compile is None:
        compile = logits.numel() > COMPILE_ABOVE
    if not compile:
        return row_function, chunk_size
    return _compiled(row_function), len(logits)


def _compiled(row_function):
    if row_function not in _COMPILED:
        if isinstance(row_function, _TwoPasses):
            _COMPILED[row_function] = row_function.compiled()
        else:
            _COMPILED[row_function] = torch.compile(row_function, dynamic=True)
    return _COMPILED[row_function]


def _in_chunks(logits_of, targets, rows, row_function, chunk_size, grad, gemm_chunk_size=None):
    """Runs `row_function` over `chunk_size` rows at a time, each chunk's gradient written into its rows of `grad`;
    `logits_of(rows)` gives the logits of `gemm_chunk_size` rows at a time (default `chunk_size`). Returns the summed
    loss and the per-row results."""
    gemm_chunk_size = gemm_chunk_size or chunk_size
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    per_row = []
    for gemm_start in range(0, len(grad), gemm_chunk_size):
        logits = logits_of(slice(gemm_start, gemm_start + gemm_chunk_size))
        for offset in range(0, len(logits), chunk_size):
            end = min(offset + chunk_size, len(logits))
            chunk = slice(gemm_start + offset, gemm_start + end)
            chunk_targets = targets[chunk] if rows is None else targets
            chunk_rows = None if rows is None else rows[chunk]
            loss, row_result, _ = row_function(logits[offset:end], chunk_targets, chunk_rows, grad[chunk])
            total += loss
            per_row.append(row_result)
    per_row = torch.cat(per_row) if per_row else torch.zeros(0, dtype=torch.long, device=grad.device)
    return total, per_row


def _scaled_once(ctx, grad: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """The saved gradient scaled in place by the loss's upstream gradient, which only one backward may do."""
    if ctx.backward_done:
        raise RuntimeError("The fused cross-entropy scales its saved gradient in place: backward runs once.")
    ctx.backward_done = True
    return grad.mul_(grad_total.to(grad.dtype))


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rows, row_function, chunk_size):
        if chunk_size >= len(logits):
            total, per_row, grad = row_function(logits, targets, rows)
        else:
            grad = torch.empty_like(logits)
            total, per_row = _in_chunks(lambda chunk: logits[chunk], targets, rows, row_function, chunk_size, grad)
        ctx.save_for_backward(grad)
        ctx.backward_done = False
        ctx.mark_non_differentiable(per_row)
        return total, per_row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, grad_per_row):
        (grad,) = ctx.saved_tensors
        return _scaled_once(ctx, grad, grad_total), None, None, None, None


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """`_FusedCrossEntropy` over `hidden_states @ weight.T`, the logits made and consumed a chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden_states, weight, targets, rows, row_function, chunk_size, gemm_chunk_size):
        dtype = compute_dtype(hidden_states)
        with torch.autocast(hidden_states.device.type, enabled=False):
            inputs, head = hidden_states.to(dtype), weight.to(dtype)
            grad = inputs.new_empty(len(inputs), len(head))
            total, per_row = _in_chunks(
                lambda chunk: inputs[chunk] @ head.T, targets, rows, row_function, chunk_size, grad, gemm_chunk_size
            )
        ctx.save_for_backward(grad, inputs, head)
        ctx.dtypes = hidden_states.dtype, weight.dtype
        ctx.mark_non_differentiable(per_row)
        return total, per_row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total, grad_per_row):
        # The upstream gradient scales the hidden gradient and the weight gradient's small operand, never the
        # (rows, vocabulary) saved gradient, which stays as saved. The weight gradient is computed transposed,
        # `inputs.T @ grad`: with the small `inputs.T` made contiguous both operands are row-major (`grad.T @ inputs`
        # reads the large gradient transposed, at about half the rate here: benchmarks/head_gemm_layouts.py), and its
        # transpose is in the layout of a column-major head.
        grad, inputs, head = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = grad_weight = None
        with torch.autocast(inputs.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad @ head).mul_(grad_total).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (inputs.T.contiguous().mul_(grad_total) @ grad).T.to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None
