"""Is an output that differs from the target's own decoding explained by rounding at a near tie?

Greedy speculative decoding is exact in exact arithmetic. In bfloat16 it verifies several tokens per target forward,
and on a CPU a bf16 matmul rounds a row computed among k + 1 rows differently from the same row alone
(`benchmarks/numerics/bf16_row_invariance.py`), so where the target's two best tokens are nearly tied, the
verification's argmax can differ from the target-alone decoding's. A wrong verification (one that accepts a token
that is not the target's argmax) also makes outputs differ. This module tells the two apart for one differing
output: it finds the first position where it leaves the target's own output, runs the target once in float32 over
the shared prefix (the same weights, upcast) and compares the float32 logit margin there with the most rounding in
the target's dtype can move it (`rounding_bound`).

- margin: float32 logit of the best token minus that of the lower of the two tokens the decodings chose (for the usual
  case, the target's top-2 margin).
- "near tie" when margin <= bound, "UNEXPLAINED" otherwise (also when the outputs differ in length only).

`benchmarks/numerics/near_tie_bound.py` measures how far bf16 decoding really moves top-2 margins of a real target
against this bound.
"""

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

# Unit roundoff u of each dtype: a stored value is off by at most u of its magnitude (8, 11, 24 significant bits).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Standard deviations of the accumulated hidden-state rounding the bound allows (see `rounding_bound`).
SIGMAS = 6.0
NEAR_TIE, UNEXPLAINED = "near tie", "UNEXPLAINED"


@dataclass(frozen=True)
class Divergence:
    """Where a decoding first left the target's own output, and whether rounding explains it.

    `position` indexes the new tokens; `target_token` is what the target alone decoded there, `token` what the
    other decoding did (None: that output ended there). `margin` and `bound` are in logits (float32)."""

    position: int
    target_token: int | None
    token: int | None
    margin: float | None = None
    bound: float | None = None

    @property
    def label(self) -> str:
        explained = self.margin is not None and self.bound is not None and self.margin <= self.bound
        return NEAR_TIE if explained else UNEXPLAINED

    def describe(self) -> str:
        if self.margin is None:
            return f"{UNEXPLAINED} (the outputs differ in length only, from new token {self.position})"
        return f"{self.label} (margin {self.margin:.3f}, bound {self.bound:.3f}, at new token {self.position})"

    def to_dict(self) -> dict:
        return asdict(self) | {"label": self.label}

    @classmethod
    def from_dict(cls, data: dict) -> "Divergence":
        return cls(**{key: value for key, value in data.items() if key != "label"})


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """The first index where `output` differs from `reference` (one may be a prefix of the other); None if equal."""
    for position, (expected, got) in enumerate(zip(reference, output)):
        if expected != got:
            return position
    return None if len(reference) == len(output) else min(len(reference), len(output))


def rounding_bound(logits, head_input, head_weight, best: int, other: int, dtype: torch.dtype, num_layers: int):
    """The most the logit gap z[best] - z[other] of a forward in `dtype` can differ from float32's, in float32 logits.

    Derivation (u: the dtype's unit roundoff, 2^-8 for bf16). The gap is g = (w_best - w_other) . h, with h the LM
    head's input (width d) and w its rows. Two roundings move it:
    1. The logits themselves are stored in `dtype`: each is off by at most u |z|, so g by at most u (|z_best| +
       |z_other|).
    2. The hidden state is rounded wherever the residual stream is stored: after each of the 2L sublayer additions
       and after the final norm, 2L + 1 roundings of every component, each a relative error uniform in [-u, u]
       (standard deviation u / sqrt(3)). Taken as independent and each as large as relative to h itself (the
       residual stream grows with depth, so earlier ones are smaller), the relative error of h_j has standard
       deviation u sqrt((2L + 1) / 3), and g's error, a sum over d components, has standard deviation
       u sqrt((2L + 1) / 3) * sqrt(sum_j (h_j (w_best,j - w_other,j))^2), which grows as sqrt(d) with the width.
       `SIGMAS` (6) of it bound it.
    The model leaves out how a perturbation is amplified by the later sublayers that read it;
    `benchmarks/numerics/near_tie_bound.py` measures real bf16 margins against the bound to check it holds."""
    u = UNIT_ROUNDOFF[dtype]
    stored = u * (abs(float(logits[best])) + abs(float(logits[other])))
    spread = (head_input.float() * (head_weight[best].float() - head_weight[other].float())).norm()
    accumulated = SIGMAS * u * math.sqrt((2 * num_layers + 1) / 3) * float(spread)
    return stored + accumulated


@contextmanager
def upcast(model, dtype: torch.dtype = torch.float32):
    """`model` with its floating-point parameters and buffers in `dtype` inside the block, and each back in its own
    dtype after, bit-identical: only casts `dtype` holds exactly are allowed (bf16 -> float32 -> bf16 is exact), so
    casting back restores every value. Not `model.to`: a bf16 model keeps some buffers in float32 (rotary
    frequencies), which `model.to(bfloat16)` would round.

    On any exception, in the block or during the cast itself (running out of memory halfway, the likeliest failure),
    every tensor cast so far is put back before the exception propagates, so the model is never left in mixed
    dtypes. Parameters stay the same `Parameter` objects (their data is cast back rather than kept, so the original
    copy does not cost memory inside the block); buffers get their original tensor objects back."""
    tensors = [
        (module, kind, name, tensor, tensor.dtype)
        for module in model.modules()
        for kind in ("_parameters", "_buffers")
        for name, tensor in getattr(module, kind).items()
        if tensor is not None and tensor.is_floating_point()
    ]
    inexact = sorted({str(own) for *_, own in tensors if torch.promote_types(own, dtype) != dtype})
    if inexact:
        raise ValueError(f"upcast to {dtype} would round tensors in {', '.join(inexact)}: it only widens")
    cast = []
    try:
        for module, kind, name, tensor, own in tensors:
            cast.append((module, kind, name, tensor, own))  # a cast that fails leaves its tensor as it was
            _cast(module, kind, name, dtype)
        yield model
    finally:
        for module, kind, name, tensor, own in reversed(cast):
            if kind == "_parameters":
                _cast(module, kind, name, own)
            else:
                module._buffers[name] = tensor


def _cast(module, kind: str, name: str, dtype: torch.dtype) -> None:
    tensor = getattr(module, kind)[name]
    if kind == "_parameters":
        tensor.data = tensor.data.to(dtype)
    else:
        module._buffers[name] = tensor.to(dtype)


@torch.no_grad()
def explain(target, prompt_ids: torch.LongTensor, reference: list[int], output: list[int], dtype: torch.dtype):
    """The `Divergence` of `output` (new tokens) from `reference` (the target alone's new tokens, same prompt), or
    None where they are equal. The target must already be in float32 (see `upcast`; a ValueError otherwise);
    `dtype` is the one both decodings ran in (the rounding the bound allows), required because the bound depends on
    it."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"explain needs the dtype both decodings ran in, one of {list(UNIT_ROUNDOFF)}; got {dtype}")
    own = sorted(
        {str(tensor.dtype) for tensor in target.parameters() if tensor.is_floating_point()} - {"torch.float32"}
    )
    if own:
        raise ValueError(
            f"explain needs the target in float32 (see `upcast`); it has parameters in {', '.join(sorted(own))}"
        )
    position = first_divergence(reference, output)
    if position is None:
        return None
    expected = reference[position] if position < len(reference) else None
    got = output[position] if position < len(output) else None
    if expected is None or got is None:
        return Divergence(position, expected, got)
    ids = torch.cat([prompt_ids[0], torch.tensor(reference[:position], dtype=prompt_ids.dtype)])[None]
    head = target.get_output_embeddings()
    captured = {}

    def keep_input(module, args, out) -> None:  # returning nothing leaves the head's output as it is
        captured["input"] = args[0][0, -1]

    handle = head.register_forward_hook(keep_input)
    try:
        logits = target(input_ids=ids.to(target.device), logits_to_keep=1).logits[0, -1].float()
    finally:
        handle.remove()
    best = int(logits.argmax())
    lower = min((expected, got), key=lambda token: float(logits[token]))
    margin = float(logits[best] - logits[lower])
    bound = rounding_bound(logits, captured["input"], head.weight, best, lower, dtype, target.config.num_hidden_layers)
    return Divergence(position, expected, got, margin, bound)
