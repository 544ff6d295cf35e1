"""Where a distillation step's time goes: one optimizer step of a `benchmarks/training_throughput.py` config under
`torch.profiler`, after one warm-up step (allocations, `torch.compile`), on one thread by default.

    python benchmarks/profile_distill.py [--config distill-qwen2.5-coder-1.5b] [--threads 1] [--rows 30]

Prints the step's wall time, the ops by self CPU time, and the step's split into matmuls (`aten::mm`/`bmm`), the
compiled loss kernels, the chain attention (forward and backward) and the rest, with each part's milliseconds per
trained token. The profiler adds a few percent to small ops; the throughput script times the same step without it.
"""

import argparse
import time

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

from trainers import throughput_worker

PARTS = {  # part: substrings of the op names it sums
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm"),
    "loss kernels (compiled)": ("CompiledFxGraph",),
    "attention": ("scaled_dot_product",),
}


class ProfileOneStep(transformers.TrainerCallback):
    """Profiles the trainer's second optimizer step (the first warms up)."""

    def __init__(self):
        self.profiler, self.wall = None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.wall = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            self.profiler.__exit__(None, None, None)
            self.wall = time.perf_counter() - self.wall


def split(events, tokens: int) -> dict[str, float]:
    """Self CPU milliseconds per trained token of each part in PARTS, and of everything else."""
    totals = dict.fromkeys([*PARTS, "rest"], 0.0)
    for event in events:
        part = next((name for name, keys in PARTS.items() if any(key in event.key for key in keys)), "rest")
        totals[part] += event.self_cpu_time_total / 1000 / tokens  # microseconds to ms
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default="distill-qwen2.5-coder-1.5b", choices=list(throughput_worker.DISTILL_CONFIGS)
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=30, help="ops listed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    callback = ProfileOneStep()
    original_init = transformers.Trainer.__init__

    def init_with_profiler(self, *init_args, callbacks=None, **kwargs):
        original_init(self, *init_args, callbacks=[*(callbacks or []), callback], **kwargs)

    transformers.Trainer.__init__ = init_with_profiler  # the worker builds its own trainer
    throughput_worker.distill_worker(args.config, steps=1)
    spec = throughput_worker.DISTILL_CONFIGS[args.config]
    tokens = spec["batch_size"] * spec["seq_len"] * spec["accumulation"]
    events = callback.profiler.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    print(f"{args.config}, {args.threads} thread(s): step {callback.wall:.2f} s for {tokens} tokens")
    for part, ms in split(events, tokens).items():
        print(f"  {part:<24} {ms:.3f} ms per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
