"""How much of the target's next token its tap features already hold: the target's own final norm and LM head applied
to each cached tap (a "logit lens"), scored against the target's greedy next token on a feature cache's test split.

    python benchmarks/replication/tap_logit_lens.py /work/runs/features-qwen2.5-coder-1.5b-sharegpt \
        --target qwen2.5-coder-1.5b-instruct --output benchmarks/results/tap-logit-lens-qwen2.5-coder-1.5b.json

It is what a drafter would score at its first draft, with no training at all, if it passed the deepest tap through
the target's own norm and head: the number to set the distilled drafters' held-out TTT accuracy against. Scored on
the first `--max-tokens` trained-on tokens (loss mask 1) of the test split's first shard, in the cache's dtype, for
targets whose final norm is `model.norm` (Llama, Qwen2).
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from osprey.zoo import load_causal_lm


def tap_logit_lens(cache_dir: Path, target_name: str, max_tokens: int) -> dict:
    cache = json.loads((cache_dir / "feature_cache.json").read_text())
    dtype = getattr(torch, cache["dtype"])
    shard = load_file(cache_dir / "test" / cache["splits"]["test"]["shards"][0]["file"])
    positions = shard["loss_mask"].bool().nonzero().squeeze(1)[:max_tokens]
    taps, greedy = shard["target_hidden_states"][positions].to(dtype), shard["target_argmax"][positions].long()
    target = load_causal_lm(target_name, dtype=dtype).eval()
    final_norm, head = target.model.norm, target.get_output_embeddings()
    width = target.config.get_text_config().hidden_size
    accuracy = {}
    with torch.no_grad():
        for index, layer in enumerate(cache["target_layer_ids"]):
            logits = head(final_norm(taps[:, index * width : (index + 1) * width]))
            accuracy[f"tap {layer}"] = round((logits.argmax(dim=-1) == greedy).float().mean().item(), 4)
        final = head(shard["target_last_hidden_state"][positions].to(dtype))  # the check: ~1 up to rounding
        accuracy["final hidden state"] = round((final.argmax(dim=-1) == greedy).float().mean().item(), 4)
    return {"target": target_name, "feature_cache": str(cache_dir), "dtype": cache["dtype"],
            "num_tokens": len(positions), "top1_agreement_with_target": accuracy}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("feature_cache", type=Path, help="an `osprey features` output directory")
    parser.add_argument("--target", required=True, help="the target the cache was built from (zoo name or directory)")
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--output", type=Path, help="also write the results JSON here")
    args = parser.parse_args()
    results = tap_logit_lens(args.feature_cache, args.target, args.max_tokens)
    text = json.dumps(results, indent=1) + "\n"
    if args.output:
        args.output.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
