"""Is an output that differs from the target's own decoding explained by rounding? Two checks decide; both must pass.

Greedy speculative decoding is exact in exact arithmetic. In bfloat16 it verifies several tokens per target forward,
and on a CPU a bf16 matmul rounds a row computed among k + 1 rows differently from the same row alone
(`benchmarks/numerics/bf16_row_invariance.py`), so where the target's two best tokens are nearly tied, the
verification's argmax can differ from the target-alone decoding's. A wrong verification (one that accepts a token
that is not the target's argmax) or a wrong verification forward (tree mask, positions, cache) also makes outputs
differ. `check_difference` tells them apart for one differing output:

- The audit (`audit`), of every emitted token: one clean target forward over the prompt and the whole output (no
  cache, no tree, the same dtype). Each new token must be that forward's argmax given the output's own prefix, or lie
  within the rounding tolerance (`AUDIT_NOISE`) of its row's best logit. It covers the tokens after the first
  difference, which the replay never sees.
- The replay (`replay`), of the first differing token:
  1. It decodes again, exactly as the run did (decoding is deterministic for the same inputs, shapes and threads),
     with hooks on the target that keep the verification forward that decided that token: the one whose row for it
     sits at its position and sees exactly the output's tokens before it (read off the forward's own inputs,
     positions and attention mask, not the decoder's bookkeeping).
  2. The decision: the token the output has there must be that forward's argmax.
  3. The forward: its logits there must agree with a clean forward of the same prefix within the noise this dtype
     shows on honest runs (`FORWARD_NOISE`).
  4. Every forward of the decoding: each row sees exactly one of the new tokens at each position up to its own (a
     correct mask and positions, whose errors may move logits by no more than rounding does).

All hold: "rounding (shape-dependent)". Anything fails, the replay does not reproduce the output, or no forward
decided that token: "UNEXPLAINED", which fails the bench, the demo and the Space
(`osprey.measuring.bench_report.fails`). The
target's float32 top-2 margin there (`float32_margin`) is kept as information only. Greedy decodings only: sampled
outputs differ from the target alone's by design.

Both tolerances are in units of `u * max|z|` (u: the dtype's unit roundoff, z: the clean forward's logits row), chosen
on calibration prompts and measured on disjoint evaluation prompts with realistic decoding bugs injected
(`benchmarks/numerics/near_tie_replay.py`, docs/results/numerics.md).
"""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace

import torch

from ..ground import ForwardHooks

# Unit roundoff u of each dtype: a stored value is off by at most u of its magnitude (8, 11, 24 significant bits).
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# How far an honest verification forward's logits may lie from a clean forward's of the same prefix, in units of
# u * max|z| (z: the clean forward's logits, u: the dtype's unit roundoff): well above the largest distance measured
# on a real target's honest bf16 decodings of the calibration prompts (`benchmarks/numerics/near_tie_replay.py`). A
# wrong forward (a stale cache entry, a wrong mask or position) moves logits by whole units, far beyond it.
FORWARD_NOISE = 8.0
# How far below the best logit of its row in a clean teacher-forced forward an honest token's logit may lie, in the
# same units: about twice the largest gap measured on the calibration prompts' honest bf16 outputs (two bf16 steps of
# the logits there; `benchmarks/numerics/near_tie_replay.py`). The bugs of its failing controls leave gaps of whole
# logits.
AUDIT_NOISE = 4.0
ROUNDING, UNEXPLAINED = "rounding (shape-dependent)", "UNEXPLAINED"


def unit_roundoff(model) -> float:
    """The unit roundoff of the dtype `model` runs in (float32's for a dtype not listed)."""
    return UNIT_ROUNDOFF.get(next(model.parameters()).dtype, UNIT_ROUNDOFF[torch.float32])


# The label results labelled before the replay existed carry (the float32 margin against a statistical bound, which
# checked no forward): read, never given now, and counted as not checked (`osprey.measuring.bench_report`).
NEAR_TIE = "near tie"


@dataclass(frozen=True)
class Divergence:
    """Where a decoding first left the target's own output, and what the replay found there.

    `position` indexes the new tokens; `target_token` is what the target alone decoded there, `token` what the
    other decoding did (None: that output ended there). `forward_token` is the argmax of the replayed verification
    forward that decided the position, `forward_error` the largest difference between its logits there and a clean
    forward's, `tolerance` what honest rounding allows (`FORWARD_NOISE`); `audit` is the `Audit` of the whole output
    (as a dict; None where it did not run); `reason` says why a difference is UNEXPLAINED. `margin` is the target's
    float32 logit margin there (best minus the lower of the two tokens; None where it was not computed), information
    only."""

    position: int
    target_token: int | None
    token: int | None
    label: str = UNEXPLAINED
    forward_token: int | None = None
    forward_error: float | None = None
    tolerance: float | None = None
    margin: float | None = None
    reason: str | None = None
    audit: dict | None = None

    def describe(self) -> str:
        where = f"at new token {self.position}"
        if self.label == ROUNDING:
            audited = "" if self.audit is None else f"; {Audit(**self.audit).describe()}"
            return (
                f"{ROUNDING} ({where}: the verification forward's argmax, its logits {self.forward_error:.3f} from a "
                f"clean forward's, within {self.tolerance:.3f}{audited}{self._margin()})"
            )
        if self.label == NEAR_TIE:
            return f"not checked: labelled {NEAR_TIE} by the withdrawn bound ({where}{self._margin()})"
        if self.reason is not None:
            return f"{self.label} ({where}: {self.reason}{self._margin()})"
        return f"{self.label} ({where}{self._margin()})"

    def _margin(self) -> str:
        return "" if self.margin is None else f"; float32 margin {self.margin:.3f}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Divergence":
        """Also reads divergences saved before the replay (label NEAR_TIE or UNEXPLAINED by margin and bound)."""
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """The first index where `output` differs from `reference` (one may be a prefix of the other); None if equal."""
    for position, (expected, got) in enumerate(zip(reference, output)):
        if expected != got:
            return position
    return None if len(reference) == len(output) else min(len(reference), len(output))


def _tokens_at(position: int, *outputs: list[int]) -> list[int | None]:
    """Each output's token at `position` (None where it ended before)."""
    return [output[position] if position < len(output) else None for output in outputs]


class DecidingForward(ForwardHooks):
    """Hooks on `target` that keep the logits of the forward row that decided the new token at `position` of
    `sequence` (prompt and output, `prompt_length` tokens of prompt): the row at absolute position
    `prompt_length + position - 1` that sees, among the forward's new tokens, exactly `sequence`'s tokens from the
    cache's end up to its own. The last such row wins (a later step re-deciding a position supersedes an earlier
    one). Rows are read off the forward's inputs: `position_ids` (else `cache_position`, else the cache's length
    onwards) and a 4-D attention mask (else causal).

    Every forward is also held to what any correct verification forward is, whatever its rounding: each row sees, among
    the forward's new tokens, exactly one token at each position from the cache's end up to its own, and nothing else
    (a chain's causal mask, a tree's ancestors). `off_path` keeps the first row that does not (its position and the
    positions it sees): a mask that shows a row its sibling, or positions that skip or repeat, whose effect on the
    logits may be as small as rounding's."""

    def __init__(self, target, sequence: list[int], prompt_length: int, position: int):
        super().__init__(target)
        self.sequence = sequence
        self.decided_at = prompt_length + position - 1  # the absolute position of the row that predicts `position`
        self.logits, self._pending, self.off_path = None, None, None

    def _before(self, module, args, kwargs):
        input_ids, cached = self.fed(args, kwargs)
        fed = input_ids.shape[1]
        positions = self.positions(kwargs, fed, cached).cpu()
        self._pending = None
        seen = _seen_new_tokens(kwargs.get("attention_mask"), fed)
        given = kwargs.get("attention_mask") is not None or kwargs.get("position_ids") is not None
        if self.off_path is None and given:  # without either, the forward is causal over consecutive positions
            for row in range(fed):
                visible = sorted(int(positions[column]) for column in seen[row].nonzero().view(-1).tolist())
                if visible != list(range(cached, int(positions[row]) + 1)):
                    self.off_path = (int(positions[row]), visible)
                    break
        rows = (positions == self.decided_at).nonzero().view(-1).tolist()
        if not rows:
            return
        tokens = input_ids[0].tolist()
        for row in rows:
            path = sorted((int(positions[column]), tokens[column]) for column in seen[row].nonzero().view(-1).tolist())
            if [p for p, _ in path] == list(range(cached, self.decided_at + 1)) and [t for _, t in path] == (
                self.sequence[cached : self.decided_at + 1]
            ):
                self._pending = (row, fed)

    def _after(self, module, args, output):
        if self._pending is None:
            return
        row, fed = self._pending
        logits = output.logits[0]
        kept = row - (fed - logits.shape[0])  # the forward keeps logits of its last rows only (`logits_to_keep`)
        if kept >= 0:
            self.logits = logits[kept].float().clone()


def _seen_new_tokens(mask, fed: int) -> torch.Tensor:
    """(fed, fed) booleans: which of a forward's new tokens each of its rows attends to."""
    if isinstance(mask, dict):  # hybrid models: the full-attention layers' mask
        mask = mask.get("full_attention", next(iter(mask.values())))
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        block = mask[0, 0, -fed:, -fed:].cpu()
        return block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min / 2
    return torch.ones(fed, fed, dtype=torch.bool).tril()


@torch.no_grad()
def replay(
    target,
    rerun: Callable[[], torch.LongTensor],
    prompt_ids: torch.LongTensor,
    reference: list[int],
    output: list[int],
) -> Divergence | None:
    """The `Divergence` of greedy `output` (new tokens) from `reference` (the target alone's new tokens, same prompt),
    or None where they are equal. `rerun()` decodes `prompt_ids` again exactly as `output` was decoded (same models,
    settings and seed) and returns the full sequence; the target must be the one it calls, in the dtype it ran in."""
    position = first_divergence(reference, output)
    if position is None:
        return None
    expected, got = _tokens_at(position, reference, output)
    if expected is None or got is None:
        return Divergence(position, expected, got, reason="the outputs differ in length only")
    prompt = prompt_ids[0].tolist()
    with DecidingForward(target, prompt + output, len(prompt), position) as deciding:
        replayed = rerun()[0, len(prompt) :].tolist()
    if replayed != output:
        return Divergence(position, expected, got, reason="decoding again gave another output (not deterministic)")
    if deciding.off_path is not None:
        row_position, visible = deciding.off_path
        return Divergence(
            position,
            expected,
            got,
            reason=f"a verification forward let its row at position {row_position} see new tokens at positions "
            f"{visible}, not one at each position up to its own",
        )
    if deciding.logits is None:
        return Divergence(position, expected, got, reason="no target forward decided this token")
    row = deciding.logits
    ids = torch.tensor([prompt + output[:position]], device=target.device)
    clean = target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    forward_token, error = int(row.argmax()), float((row - clean).abs().max())
    tolerance = FORWARD_NOISE * unit_roundoff(target) * float(clean.abs().max())
    found = dict(forward_token=forward_token, forward_error=error, tolerance=tolerance)
    if forward_token != got:
        return Divergence(position, expected, got, **found, reason="the token is not its verification forward's argmax")
    if error > tolerance:
        return Divergence(
            position, expected, got, **found, reason="its verification forward's logits differ from a clean forward's"
        )
    return Divergence(position, expected, got, ROUNDING, **found)


@dataclass(frozen=True)
class Audit:
    """Every new token of an output against one clean teacher-forced forward of the target over the prompt and the
    output: `checked` tokens, and the one whose logit lies furthest below its row's best relative to its row's
    tolerance (`AUDIT_NOISE * u * max|z|`): its index among the new tokens (`position`), that gap (`gap`, 0 for an
    argmax) and that tolerance."""

    checked: int
    position: int
    gap: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.gap <= self.tolerance

    def describe(self) -> str:
        if self.gap == 0:
            return f"each of its {self.checked} tokens a clean forward's argmax"
        if self.passed:
            return (
                f"each of its {self.checked} tokens within rounding of a clean forward's best (the closest, new token "
                f"{self.position}, {self.gap:.3f} below it, within {self.tolerance:.3f})"
            )
        return (
            f"new token {self.position} lies {self.gap:.3f} below the best logit of a clean forward over the output, "
            f"beyond the {self.tolerance:.3f} rounding allows"
        )


@torch.no_grad()
def audit(target, prompt_ids: torch.LongTensor, output: list[int]) -> Audit:
    """The `Audit` of greedy `output` (new tokens, at least one) after `prompt_ids`: one forward of `target` over the
    prompt and the output but its last token, in the dtype it runs in, with no cache; row `i` of its last
    `len(output)` rows predicts new token `i`."""
    if not output:
        raise ValueError("audit needs at least one new token")
    ids = torch.cat([prompt_ids[0].cpu(), torch.tensor(output[:-1], dtype=prompt_ids.dtype)])[None]
    logits = target(input_ids=ids.to(target.device), use_cache=False, logits_to_keep=len(output)).logits[0].float()
    tokens = torch.tensor(output, device=logits.device)[:, None]
    gaps = logits.max(dim=-1).values - logits.gather(1, tokens)[:, 0]
    tolerances = AUDIT_NOISE * unit_roundoff(target) * logits.abs().max(dim=-1).values
    worst = int((gaps / tolerances).argmax())
    return Audit(len(output), worst, float(gaps[worst]), float(tolerances[worst]))


@torch.no_grad()
def check_difference(
    target,
    rerun: Callable[[], torch.LongTensor],
    prompt_ids: torch.LongTensor,
    reference: list[int],
    output: list[int],
) -> Divergence | None:
    """The verdict on greedy `output` (new tokens) against `reference` (the target alone's, same prompt): None where
    they are equal; else the `Divergence` at the first differing token, ROUNDING only where the audit of every token
    (`audit`) and the replay of the first differing one (`replay`) both pass. The audit runs first: where it fails,
    the output is UNEXPLAINED without the replay's second decoding."""
    position = first_divergence(reference, output)
    if position is None:
        return None
    if output:
        audited = audit(target, prompt_ids, output)
        if not audited.passed:
            return Divergence(
                position, *_tokens_at(position, reference, output), audit=asdict(audited), reason=audited.describe()
            )
    divergence = replay(target, rerun, prompt_ids, reference, output)
    return divergence if not output else replace(divergence, audit=asdict(audited))


@torch.no_grad()
def float32_margin(target, prompt_ids: torch.LongTensor, reference: list[int], output: list[int]) -> float | None:
    """The target's float32 logit margin at the first token where `output` leaves `reference`: its best token's logit
    minus the lower of the two tokens', over the shared prefix (None where the outputs are equal or differ in length
    only). The target must be in float32 (`upcast`; a ValueError otherwise)."""
    own = sorted({str(p.dtype) for p in target.parameters() if p.is_floating_point()} - {"torch.float32"})
    if own:
        raise ValueError(f"float32_margin needs the target in float32 (see `upcast`); it has parameters in {own}")
    position = first_divergence(reference, output)
    if position is None or position >= min(len(reference), len(output)):
        return None
    ids = torch.cat([prompt_ids[0].cpu(), torch.tensor(reference[:position], dtype=prompt_ids.dtype)])[None]
    logits = target(input_ids=ids.to(target.device), logits_to_keep=1).logits[0, -1].float()
    lower = min(float(logits[reference[position]]), float(logits[output[position]]))
    return float(logits.max()) - lower


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
