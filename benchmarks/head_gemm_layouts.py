"""The LM-head GEMMs of a distillation step, timed in each operand layout and chunk size (bfloat16, plain `torch.mm`).

The Qwen replication's shapes by default (2,046 counted positions, a 576-wide drafter, 32,000 draft-vocabulary rows, a
1,536-wide target): the drafter head's forward `hidden @ head.T` in row chunks on a row-major or a column-major head,
its backward's two products (the weight gradient directly or transposed), and the target head's logits in row chunks.
What `trainers.losses.head_for_loss` and the chunk sizes of `linear_soft_cross_entropy` and `TargetHead` were chosen
from (docs/training.md, "Training throughput").

    OMP_NUM_THREADS=1 python benchmarks/head_gemm_layouts.py [--output benchmarks/results/head-gemm-layouts.json]
"""

import argparse
import time
from pathlib import Path

import torch
from microbench import report


def rate(function, flops: float, seconds: float = 1.0) -> float:
    """GFLOP/s of `function()`, after one warm-up call, over at least `seconds` and 3 calls."""
    function()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        function()
        calls += 1
    return round(flops * calls / (time.perf_counter() - start) / 1e9, 1)


def in_chunks(left: torch.Tensor, right: torch.Tensor, rows: int):
    """`left @ right`, `rows` rows of `left` at a time."""
    return lambda: [left[start : start + rows] @ right for start in range(0, len(left), rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2046)
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--target-hidden-size", type=int, default=1536)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    n, h, v, target_h = args.positions, args.hidden_size, args.vocab_size, args.target_hidden_size
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=generator).bfloat16()
    head = torch.randn(v, h, generator=generator).bfloat16()
    column_major = head.T.contiguous().T  # what head_for_loss returns
    grad = torch.randn(n, v, generator=generator).bfloat16()
    head_flops = 2 * n * h * v
    results = {
        "threads": torch.get_num_threads(),
        "shape": {"positions": n, "hidden_size": h, "vocab_size": v, "target_hidden_size": target_h},
        "forward_gflops_per_s": {
            f"{layout}, {rows} rows": rate(in_chunks(hidden, weight.T, rows), head_flops)
            for layout, weight in (("row-major head", head), ("column-major head", column_major))
            for rows in (256, 384, 512, 640, 1024, n)
        },
        "backward_gflops_per_s": {
            "grad @ head (row-major)": rate(lambda: grad @ head, head_flops),
            "grad @ head (column-major)": rate(lambda: grad @ column_major, head_flops),
            "weight gradient grad.T @ hidden": rate(lambda: grad.T @ hidden, head_flops),
            "weight gradient (hidden.T.contiguous() @ grad).T": rate(lambda: hidden.T.contiguous() @ grad, head_flops),
        },
    }
    target_hidden = torch.randn(n, target_h, generator=generator).bfloat16()
    target_head = torch.randn(v, target_h, generator=generator).bfloat16()
    results["target_head_gflops_per_s"] = {
        f"{rows} rows": rate(in_chunks(target_hidden, target_head.T, rows), 2 * n * target_h * v)
        for rows in (256, 512, n)
    }
    report(results, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
