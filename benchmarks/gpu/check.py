"""GPU check (run on a CUDA machine; see benchmarks/gpu/README.md): lossless decoding on CUDA, and what one drafter
step costs next to one target forward at the replication's and the seed targets' real shapes.

Weights are random: acceptance is meaningless here, but the cost of a forward does not depend on the weights. Each
timing is the median of `--repeats` CUDA-synchronised calls after warm-up, with a KV cache of `--context` tokens.
Writes a JSON report to `--output`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from conftest import make_tiny_target  # noqa: E402
from test_decoding import assisted_greedy, near_copy_pair, plain_greedy, prompt, random_drafter  # noqa: E402

from modeling_osprey.generation_osprey import DraftState, crop_cache, draft_chain  # noqa: E402
from osprey import OspreyConfig, OspreyForDrafting  # noqa: E402
from osprey.decoding.decode import speculative_generate  # noqa: E402

# Target shapes (public configs); the drafter taps are the defaults [1, L//2-1, L-4].
TARGETS = {
    "qwen2.5-coder-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}

# The replication's drafters: Osprey (2 SmolLM2 blocks) and the EAGLE-3 control (1 block at the target's width),
# both with a 32k draft vocabulary.
SMOLLM2_BLOCKS = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)


def greedy_exactness(device) -> dict:
    """Greedy `generate(assistant_model=drafter)` and `speculative_generate` equal plain greedy decoding on the
    device, in float32, with random and near-copy drafters (acceptance and rollback both exercised)."""
    results = {}
    for arch in ("llama", "qwen2", "qwen3", "gemma3", "minimax_m2"):
        for kind in ("random", "near_copy"):
            if kind == "random":
                target = make_tiny_target(arch)
                drafter = random_drafter(target)
            else:
                target, drafter = near_copy_pair(arch)
            target, drafter = target.to(device), drafter.to(device)
            drafter.attach_target(target)
            equal, accepted = True, 0
            for length, seed, max_new_tokens in [(1, 0, 3), (9, 1, 23), (5, 2, 40)]:
                input_ids = prompt(length, seed).to(device)
                expected = plain_greedy(target, input_ids, max_new_tokens)
                equal &= torch.equal(assisted_greedy(target, drafter, input_ids, max_new_tokens), expected)
                output, stats = speculative_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens)
                equal &= torch.equal(output, expected)
                accepted += sum(stats.accepted_per_step)
            drafter.detach_target()
            results[f"{arch}/{kind}"] = {"equal": bool(equal), "accepted_drafts": accepted}
    return results


def median_ms(function, device, repeats: int) -> float:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        function()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def drafter_for(target_config, kind: str) -> OspreyForDrafting:
    layers = target_config.num_hidden_layers
    common = dict(
        vocab_size=target_config.vocab_size,
        draft_vocab_size=32000,
        target_hidden_size=target_config.hidden_size,
        target_layer_ids=[1, layers // 2 - 1, layers - 4],
    )
    if kind == "osprey":
        config = OspreyConfig(**SMOLLM2_BLOCKS, **common)
    else:
        config = OspreyConfig(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None),
            residual_stream="features",
            **common,
        )
    drafter = OspreyForDrafting(config)
    drafter.draft_to_target.copy_(torch.arange(32000))
    return drafter


@torch.no_grad()
def step_costs(name: str, device, context: int, repeats: int) -> dict:
    """Target forward over 1 and 6 new tokens (a verify step of 5 drafts) vs. one chain of 5 drafter steps."""
    spec = dict(TARGETS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with device:  # initialised where it runs: an 8B model's random init on the CPU alone takes minutes
        target = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    input_ids = torch.randint(0, config.vocab_size, (1, context + 6), device=device)
    cache = DynamicCache(config=config)
    target(input_ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)

    def target_forward(num_tokens):
        def run():
            target(input_ids[:, context : context + num_tokens], cache=cache, use_cache=True, logits_to_keep=num_tokens)
            crop_cache(cache, context)

        return run

    result = {"target_params": sum(p.numel() for p in target.parameters()), "context": context}
    for num_tokens in (1, 6):
        result[f"target_forward_{num_tokens}_ms"] = median_ms(target_forward(num_tokens), device, repeats)
    features = torch.randn(1, context, 3 * config.hidden_size, device=device, dtype=torch.bfloat16)
    for kind in ("osprey", "eagle3"):
        with device:
            drafter = drafter_for(config, kind).to(dtype=torch.bfloat16).eval()
        state = DraftState()
        sequence = input_ids[:, : context + 1]
        draft_chain(drafter, state, sequence, features, 5)  # prefill the drafter's cache over the context

        def chain(drafter=drafter, state=state, sequence=sequence):
            state.num_verified_positions = context - 1  # re-draft from the last verified position each call
            draft_chain(drafter, state, sequence, features[:, -1:], 5)

        chain_ms = median_ms(chain, device, repeats)
        result[kind] = {
            "params_besides_embedding": sum(p.numel() for p in drafter.parameters())
            - drafter.model.embed_tokens.weight.numel(),
            "chain_of_5_ms": chain_ms,
            "per_draft_step_ms": chain_ms / 5,
            "per_draft_step_over_target_forward": chain_ms / 5 / result["target_forward_6_ms"],
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--device", default="cuda", help="`cpu` for a smoke run of the script itself")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run this on a GPU machine, or pass --device cpu.")
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    report["exactness_float32"] = greedy_exactness(device)
    print(json.dumps(report["exactness_float32"], indent=1), flush=True)
    report["step_costs_bfloat16"] = {}
    for name in args.targets:
        report["step_costs_bfloat16"][name] = step_costs(name, device, args.context, args.repeats)
        print(name, json.dumps(report["step_costs_bfloat16"][name], indent=1), flush=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(case["equal"] for case in report["exactness_float32"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
