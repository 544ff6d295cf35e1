"""Why a bf16 speculative decoder on this CPU cannot always reproduce the target's own bf16 greedy output.

Speculative verification runs the target on k + 1 rows at once; the target alone runs one row per step. The output
is identical only if a row's numbers do not depend on how many rows share the forward. This script measures that for
`nn.Linear` at a target's own GEMM shapes (random weights of the config's sizes, inputs at activation scale): for
each row count M it counts the output elements of every row that differ bitwise from the same row computed with M=1
and with M=2, and times one call, with oneDNN (torch's default CPU bf16 path) and without it.

    python benchmarks/numerics/bf16_row_invariance.py --target qwen2.5-coder-1.5b-instruct \
        --output benchmarks/results/bf16-row-invariance.json
"""

import argparse
import json
import platform
import time

import torch
from transformers import AutoConfig

from osprey.models.zoo import resolve_model_path

ROW_COUNTS = (1, 2, 4, 8, 13, 16, 32, 64)


def _rows(linear: torch.nn.Linear, x: torch.Tensor, m: int) -> tuple[torch.Tensor, float]:
    """All rows of `x`, computed m at a time; and the seconds of one m-row call."""
    with torch.no_grad():
        out = torch.cat([linear(x[i : i + m]) for i in range(0, x.shape[0], m)])
        start = time.perf_counter()
        for _ in range(5):
            linear(x[:m])
        return out, (time.perf_counter() - start) / 5


def measure(in_features: int, out_features: int, onednn: bool, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    x = (torch.randn(max(ROW_COUNTS), in_features) * 0.5).to(torch.bfloat16)
    torch.backends.mkldnn.enabled = onednn
    try:
        results = {m: _rows(linear, x, m) for m in ROW_COUNTS}
    finally:
        torch.backends.mkldnn.enabled = True
    one, two = results[1][0], results[2][0]
    return {
        "shape": f"{in_features}->{out_features}",
        "onednn": onednn,
        "elements": one.numel(),
        "differ_from_1_row": {m: int((out != one).sum()) for m, (out, _) in results.items()},
        "differ_from_2_rows": {m: int((out != two).sum()) for m, (out, _) in results.items()},
        "ms_per_call": {m: round(seconds * 1e3, 3) for m, (_, seconds) in results.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(resolve_model_path(args.target))
    hidden, intermediate = config.hidden_size, config.intermediate_size
    shapes = [(hidden, hidden), (hidden, intermediate), (intermediate, hidden)]
    records = [measure(i, o, onednn) for onednn in (True, False) for i, o in shapes]
    report = {
        "command": "python benchmarks/numerics/bf16_row_invariance.py --target " + args.target,
        "target": args.target,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s)",
        "records": records,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
