"""Causal attention on CPU at the drafters' training shape: PyTorch's flash kernel against the alternatives (issue 16).

    OMP_NUM_THREADS=1 python benchmarks/cpu_attention.py [--rounds 5] [--output FILE]

The TTT loss's attention (`modeling_osprey.OspreyTTTCache`, `_ChainAttention`) runs PyTorch's CPU flash-attention
kernel for its causal part; at the pilot's shape it is ~27% of a distillation step. This times, forward and backward
at 2 x 1,024 tokens, 9 heads of 64 (both distillation configs of `benchmarks/training_throughput.py`), bfloat16:

- `flash`: `_scaled_dot_product_flash_attention_for_cpu` and its backward (what the trainer uses);
- `blocked_fp32_scores`: query blocks of 128 against the keys up to the block's end (the masked upper triangle
  skipped), scores and softmax in float32 from the bf16 inputs (flash's precision), probabilities cast to bf16 for
  the value product;
- `blocked_bf16_scores`: the same with the score GEMM in bf16 (scores rounded to bf16 before the softmax);
- `compiled_blocked_*`: both under `torch.compile` (the softmax passes fused);
- `flex`: `torch.compile(flex_attention)` with a causal block mask (records the error where a pass is missing).

Each row has the median time, the causal attention's GFLOP/s (4 * B * H * D * T(T+1)/2 forward, 2.5x that backward)
and the largest error of the output and input gradients against a float64 reference. Writes
benchmarks/results/cpu-attention.json.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-attention.json"
BATCH, HEADS, SEQ, HEAD_DIM, BLOCK = 2, 9, 1024, 64, 128


def flash(query, key, value):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True)


def flash_backward(grad, query, key, value, out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, True
    )


def _scores(query, key, start, end, fp32):
    """Scaled scores of queries `start:end` against keys `:end`, masked causally, float32."""
    scale = query.shape[-1] ** -0.5
    if fp32:
        scores = torch.bmm(query[:, start:end].float() * scale, key[:, :end].float().transpose(1, 2))
    else:
        scores = torch.bmm(query[:, start:end] * scale, key[:, :end].transpose(1, 2)).float()
    above = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
    scores[:, :, start:end].masked_fill_(above, float("-inf"))
    return scores


def blocked(query, key, value, fp32=True):
    shape = query.shape
    query, key, value = query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1)
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2])
    for start in range(0, query.shape[1], BLOCK):
        end = min(start + BLOCK, query.shape[1])
        scores = _scores(query, key, start, end, fp32)
        block_lse = scores.logsumexp(-1, keepdim=True)
        lse[:, start:end] = block_lse.squeeze(-1)
        torch.bmm(scores.sub_(block_lse).exp_().to(value.dtype), value[:, :end], out=out[:, start:end])
    return out.view(shape), lse.view(shape[:3])


def blocked_backward(grad, query, key, value, out, lse, fp32=True):
    shape = query.shape
    scale = query.shape[-1] ** -0.5
    grad, query, key, value = grad.flatten(0, 1), query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1)
    lse, delta = lse.flatten(0, 1), (grad.float() * out.flatten(0, 1).float()).sum(-1)
    grad_query = torch.empty_like(query)
    grad_key, grad_value = torch.zeros(query.shape), torch.zeros(query.shape)
    for start in range(0, query.shape[1], BLOCK):
        end = min(start + BLOCK, query.shape[1])
        probs = _scores(query, key, start, end, fp32).sub_(lse[:, start:end, None]).exp_()
        grad_value[:, :end].add_(torch.bmm(probs.to(value.dtype).transpose(1, 2), grad[:, start:end]))
        if fp32:
            grad_probs = torch.bmm(grad[:, start:end].float(), value[:, :end].float().transpose(1, 2))
        else:
            grad_probs = torch.bmm(grad[:, start:end], value[:, :end].transpose(1, 2)).float()
        grad_scores = grad_probs.sub_(delta[:, start:end, None]).mul_(probs).mul_(scale).to(query.dtype)
        grad_query[:, start:end] = torch.bmm(grad_scores, key[:, :end])
        grad_key[:, :end].add_(torch.bmm(grad_scores.transpose(1, 2), query[:, start:end]))
    return grad_query.view(shape), grad_key.view(shape).to(key.dtype), grad_value.view(shape).to(value.dtype)


def median_ms(fn, rounds):
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def max_error(got, reference):
    return float((got.double() - reference).abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    query, key, value, grad = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.double().requires_grad_() for t in (query, key, value)]
    reference = F.scaled_dot_product_attention(*leaves, is_causal=True)
    reference.backward(grad.double())
    references = [reference.detach()] + [leaf.grad for leaf in leaves]
    flops = 4 * BATCH * HEADS * HEAD_DIM * SEQ * (SEQ + 1) / 2

    def row(name, forward, backward):
        out, lse = forward(query, key, value)
        forward_ms = median_ms(lambda: forward(query, key, value), args.rounds)
        backward_ms = median_ms(lambda: backward(grad, query, key, value, out, lse), args.rounds)
        outputs = [out, *backward(grad, query, key, value, out, lse)]
        names = ("out", "grad_query", "grad_key", "grad_value")
        return {
            "kernel": name,
            "forward_ms": round(forward_ms, 2),
            "backward_ms": round(backward_ms, 2),
            "forward_gflops_per_s": round(flops / forward_ms / 1e6, 1),
            "backward_gflops_per_s": round(2.5 * flops / backward_ms / 1e6, 1),
            "max_error": dict(zip(names, map(max_error, outputs, references))),
        }

    rows = [row("flash", flash, flash_backward)]
    for prefix, compile_ in (("", lambda fn: fn), ("compiled_", partial(torch.compile, dynamic=False))):
        for fp32 in (True, False):
            name = f"{prefix}blocked_{'fp32' if fp32 else 'bf16'}_scores"
            forward, backward = partial(blocked, fp32=fp32), partial(blocked_backward, fp32=fp32)
            rows.append(row(name, compile_(forward), compile_(backward)))
    flex = {"kernel": "flex"}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, SEQ, SEQ, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        with torch.no_grad():
            flex["forward_ms"] = round(median_ms(lambda: compiled(query, key, value, block_mask=mask), args.rounds), 2)
        inputs = [t.clone().requires_grad_() for t in (query, key, value)]
        compiled(*inputs, block_mask=mask).backward(grad)
        flex["backward"] = "ran"
    except Exception as error:  # noqa: BLE001 - the missing pass is the measurement
        flex["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    rows.append(flex)

    result = {
        "command": " ".join(["python benchmarks/cpu_attention.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}",
        "load_average_1min": round(os.getloadavg()[0], 2),
        "shape": {"batch": BATCH, "heads": HEADS, "seq": SEQ, "head_dim": HEAD_DIM, "block": BLOCK},
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
