"""What one draft costs on a CPU: milliseconds per draft tree (depth 3, top-3, 8 nodes: the shipped Qwen drafter's
bench shape) and per chain of 5, for a drafter of the shipped Qwen drafter's shape loaded by `load_drafter` in
bfloat16, in float32 and with `quantization="int8"`.

A drafting step on a CPU runs the drafter on a handful of tokens, so it reads every weight once for little
arithmetic: its cost is about the bytes of its weights (the 32,000-row LM head, then the two MLPs). The weights are
random (cost does not depend on them); the prompt is 300 tokens, and each draft follows 2 newly verified tokens, as
in decoding with τ ~2.

    OMP_NUM_THREADS=2 python benchmarks/drafting_cost.py [--output benchmarks/results/drafting-cost-qwen.json]
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch
from microbench import report

from modeling_osprey.generation_osprey import DraftState, draft_chain, draft_tree
from osprey import OspreyConfig, OspreyForDrafting
from osprey.measuring.demo import QWEN_DEMO_DRAFTER_DIR
from osprey.models.pack import load_drafter

PROMPT_LENGTH, NEW_PER_STEP = 300, 2


def ms_per_draft(drafter, shape: str, drafts: int, seed: int = 0) -> float:
    """Median milliseconds of `drafts` drafts after a warm-up one, each after NEW_PER_STEP new tokens."""
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    sequence = torch.randint(0, config.vocab_size, (1, PROMPT_LENGTH), generator=generator)
    width = config.target_hidden_size * len(config.target_layer_ids)
    features = torch.randn(1, PROMPT_LENGTH + NEW_PER_STEP * (drafts + 1), width, generator=generator)
    state, times = DraftState(), []
    for step in range(drafts + 1):
        if step:
            sequence = torch.cat([sequence, torch.randint(0, 30000, (1, NEW_PER_STEP), generator=generator)], dim=-1)
        new = features[:, state.num_verified_positions : sequence.shape[1] - 1]
        start = time.perf_counter()
        if shape == "tree":
            draft_tree(drafter, state, sequence, new, depth=3, topk=3, tree_size=8)
        else:
            draft_chain(drafter, state, sequence, new, num_draft_tokens=5)
        times.append(time.perf_counter() - start)
    return round(sorted(times[1:])[len(times[1:]) // 2] * 1000, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafts", type=int, default=30)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = OspreyConfig.from_pretrained(QWEN_DEMO_DRAFTER_DIR)
    results = {"drafter_shape": str(QWEN_DEMO_DRAFTER_DIR.name), "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as directory, torch.inference_mode():
        OspreyForDrafting(config).to(torch.bfloat16).save_pretrained(directory)
        for name, kwargs in {
            "bfloat16": {"dtype": torch.bfloat16},
            "float32": {"dtype": torch.float32},
            "int8": {"quantization": "int8"},
        }.items():
            drafter = load_drafter(directory, **kwargs)
            results[name] = {shape: ms_per_draft(drafter, shape, args.drafts) for shape in ("tree", "chain")}
            del drafter
    report(results, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
