"""Does `rounding_bound` hold for a real target? How far bf16 decoding moves top-2 logit margins.

`rounding_bound` is the statistical bound `osprey.decoding.near_tie` judged differences by before its exact replay.

For each held-out prompt the target decodes greedily in bf16 (one row per forward, `generate`). Then, for every
decoded position, the float32 top-2 gap g = z[best] - z[second] (the same weights upcast) is compared with the same
gap in two bf16 forwards: the one-row logits `generate` decided with, and the same sequence verified in chunks of
`--chunk` rows over the KV cache (as speculative verification does). The results JSON records, per path, how many
positions' gap error |g_bf16 - g_fp32| exceeds the bound, the largest error / bound, the error in units of the
bound's standard deviation, and every position where the two bf16 paths chose different tokens, with its float32
margin and bound.

    python benchmarks/numerics/near_tie_bound.py --target qwen2.5-coder-1.5b-instruct \
        --prompts benchmarks/trees/heldout-sharegpt.jsonl --output benchmarks/results/near-tie-bound.json
"""

import argparse
import json
import math
import platform

import torch
from transformers import DynamicCache

from osprey.decoding.decode import encode_prompt, target_generate
from osprey.decoding.near_tie import UNIT_ROUNDOFF, upcast
from osprey.measuring.bench_suites import load_suite
from osprey.models.zoo import load_causal_lm, load_tokenizer

# Standard deviations of the accumulated hidden-state rounding the bound allows (see `rounding_bound`).
SIGMAS = 6.0


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
    `main` measures real bf16 margins against the bound to check it holds."""
    u = UNIT_ROUNDOFF[dtype]
    stored = u * (abs(float(logits[best])) + abs(float(logits[other])))
    spread = (head_input.float() * (head_weight[best].float() - head_weight[other].float())).norm()
    accumulated = SIGMAS * u * math.sqrt((2 * num_layers + 1) / 3) * float(spread)
    return stored + accumulated


@torch.no_grad()
def chunked_logits(target, ids: torch.LongTensor, prompt_length: int, chunk: int) -> torch.Tensor:
    """Logits at every position from `prompt_length - 1` on, the prompt prefilled and the rest fed `chunk` at a time."""
    cache = DynamicCache()
    out = [target(input_ids=ids[:, :prompt_length], cache=cache, use_cache=True).logits[0, -1:].float()]
    for start in range(prompt_length, ids.shape[1], chunk):
        out.append(target(input_ids=ids[:, start : start + chunk], cache=cache).logits[0].float())
    return torch.cat(out)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--prompts", default="benchmarks/trees/heldout-sharegpt.jsonl")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=6, help="rows per verification forward (a chain of 5 + 1)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    target = load_causal_lm(args.target, dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(args.target)
    head = target.get_output_embeddings()
    num_layers, u = target.config.num_hidden_layers, UNIT_ROUNDOFF[torch.bfloat16]
    paths = {"one-row": [], f"chunks-of-{args.chunk}": []}
    flips = []
    for prompt in load_suite(args.prompts)[: args.num_prompts]:
        prompt_ids = encode_prompt(tokenizer, prompt.text)
        decoded = target_generate(
            target,
            prompt_ids,
            args.max_new_tokens,
            eos_token_id=target.generation_config.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ids, length = decoded.sequences, prompt_ids.shape[1]
        bf16 = {
            "one-row": torch.stack([step[0].float() for step in decoded.logits]),
            f"chunks-of-{args.chunk}": chunked_logits(target, ids, length, args.chunk)[: ids.shape[1] - length],
        }
        captured = {}
        handle = head.register_forward_hook(lambda module, inputs, out, into=captured: into.update(x=inputs[0][0]))
        with upcast(target):
            fp32 = target(input_ids=ids[:, :-1]).logits[0, length - 1 :].float()
            weight = head.weight.float()
        handle.remove()
        head_inputs = captured["x"][length - 1 :]
        for position in range(fp32.shape[0]):
            best, second = fp32[position].topk(2).indices.tolist()
            bound = rounding_bound(
                fp32[position], head_inputs[position], weight, best, second, torch.bfloat16, num_layers
            )
            stored = u * (abs(float(fp32[position, best])) + abs(float(fp32[position, second])))
            sigma = (bound - stored) / SIGMAS
            gap = float(fp32[position, best] - fp32[position, second])
            for name, logits in bf16.items():
                error = abs(float(logits[position, best] - logits[position, second]) - gap)
                paths[name].append((error, bound, max(error - stored, 0.0) / sigma))
            choices = {name: int(logits[position].argmax()) for name, logits in bf16.items()}
            if len(set(choices.values())) > 1:
                flips.append(
                    {
                        "prompt": prompt.prompt_id,
                        "position": position,
                        "choices": choices,
                        "margin": gap,
                        "bound": bound,
                    }
                )

    def summary(rows):
        ratios = sorted(error / bound for error, bound, _ in rows)
        sigmas = sorted(s for _, _, s in rows)
        return {
            "positions": len(rows),
            "over_bound": sum(error > bound for error, bound, _ in rows),
            "max_error_over_bound": ratios[-1],
            "median_error_over_bound": ratios[len(ratios) // 2],
            "max_sigmas": sigmas[-1],
            "p99_sigmas": sigmas[math.floor(0.99 * (len(sigmas) - 1))],
            "median_bound": sorted(bound for _, bound, _ in rows)[len(rows) // 2],
        }

    results = {
        "target": args.target,
        "prompts": f"{args.prompts} (first {args.num_prompts})",
        "max_new_tokens": args.max_new_tokens,
        "sigmas": SIGMAS,
        "paths": {name: summary(rows) for name, rows in paths.items()},
        "flips_between_bf16_paths": flips,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    with open(args.output, "w") as handle:
        handle.write(json.dumps(results, indent=1) + "\n")
    print(json.dumps({key: value for key, value in results.items() if key != "flips_between_bf16_paths"}, indent=1))
    print(f"{len(flips)} positions where the bf16 paths chose different tokens")


if __name__ == "__main__":
    main()
