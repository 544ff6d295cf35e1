"""How well does `osprey.decoding.near_tie.replay` tell rounding from a wrong verifier on a real target?

On 25 of the replication's 50 prompts (one of its 2 per category of Spec-Bench, MT-Bench, HumanEval and MMATH:
`select_subset` with 1 per category, seed 0), the target in bf16 decodes each prompt alone and with the shipped
drafter twice (`HONEST`: chains, and the demo's trees with a prompt-lookup branch); then once more, in chains, with a
verifier made wrong on purpose (`SecondBest`: after the accepted drafts it emits the target's second-best token).
Every output that differs from the target alone's is replayed:

- honest differences: the share labelled "rounding (shape-dependent)" (`honest_explained`, goal 100%);
- the wrong verifier's differing outputs: the share labelled UNEXPLAINED (`wrong_flagged`, goal >= 99%), against the
  share the former check flagged (`former_flagged`: the target's float32 margin at the first differing token beyond
  `near_tie_bound.rounding_bound`).

It also measures the noise `osprey.decoding.near_tie.FORWARD_NOISE` allows: during each honest decoding, hooks keep the
verification rows that decided new tokens 0, 12, 24 and 36 of the target alone's output (where the decoding still
follows it), and each is compared with a clean forward of the same prefix; the largest |difference| / (u * max|z|)
over all of them is `calibration.max_ratio`.

    python benchmarks/numerics/near_tie_replay.py \
        --output benchmarks/results/near-tie-replay-qwen2.5-coder-1.5b-instruct.json

Each prompt's result is appended to OUTPUT's `.jsonl` as it is done, so a stopped run resumes; the float32 margins
and the summary are computed at the end.
"""

import argparse
import json
import platform
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from near_tie_bound import rounding_bound

import modeling_osprey.decoding_osprey as decoding_osprey
from osprey.decoding.decode import encode_prompt, speculative_generate, target_generate
from osprey.decoding.near_tie import (
    FORWARD_NOISE,
    ROUNDING,
    UNEXPLAINED,
    UNIT_ROUNDOFF,
    DecidingForward,
    first_divergence,
    replay,
    upcast,
)
from osprey.ground import read_jsonl
from osprey.measuring.bench_suites import load_suite, select_subset
from osprey.models.pack import load_drafter
from osprey.models.zoo import load_causal_lm, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SUITES = ("spec_bench", "mt_bench", "humaneval", "mmath")
CALIBRATION_POSITIONS = (0, 12, 24, 36)
# The honest decodings: chains (the default drafting settings) and the demo's trees with a prompt-lookup branch.
HONEST = {"chain": {}, "tree-lookup": {"draft_topk": 3, "tree_size": 8, "prompt_lookup_num_tokens": 8}}


def replication_prompts(data_dir: str | None) -> list:
    return [prompt for suite in SUITES for prompt in select_subset(load_suite(suite, data_dir), 1, 0)]


class SecondBest:
    """The wrong verifier: chain verification emitting the target's second-best token after the accepted drafts."""

    def __enter__(self):
        self.verify = decoding_osprey._verify
        verify = self.verify

        def accepts_the_second_best(logits, sequence, drafts, *args):
            accepted, _ = verify(logits, sequence, drafts, *args)
            return accepted, logits[0, accepted].float().topk(2).indices[1].view(1, 1)

        decoding_osprey._verify = accepts_the_second_best
        return self

    def __exit__(self, *exc_info):
        decoding_osprey._verify = self.verify


class Calibration:
    """Hooks kept on the target during an honest decoding: the verification rows that decided `CALIBRATION_POSITIONS`
    of the target alone's output, read where the decoding still follows it (before its first difference)."""

    def __init__(self, target, prompt_ids, reference):
        prompt = prompt_ids[0].tolist()
        self.target, self.prompt, self.reference = target, prompt, reference
        positions = [p for p in CALIBRATION_POSITIONS if p < len(reference)]
        self.hooks = {p: DecidingForward(target, prompt + reference, len(prompt), p) for p in positions}

    def __enter__(self):
        self._stack = ExitStack()
        for hook in self.hooks.values():
            self._stack.enter_context(hook)
        return self

    def __exit__(self, *exc_info):
        self._stack.close()

    @torch.no_grad()
    def ratios(self, output: list[int]) -> list[float]:
        """|verification row - clean forward| / (u max|z|) at each position the decoding reached along the reference."""
        u = UNIT_ROUNDOFF[next(self.target.parameters()).dtype]
        same = first_divergence(self.reference, output)
        ratios = []
        for position, hook in self.hooks.items():
            if (same is not None and position > same) or hook.logits is None:
                continue
            ids = torch.tensor([self.prompt + self.reference[:position]])
            clean = self.target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            ratios.append(float((hook.logits - clean).abs().max()) / (u * float(clean.abs().max())))
        return ratios


@torch.no_grad()
def former_verdict(target, prompt_ids, reference, output, position) -> dict:
    """The former check at the first differing token: float32 margin against `rounding_bound` (target in float32)."""
    ids = torch.tensor([prompt_ids[0].tolist() + reference[:position]])
    head, captured = target.get_output_embeddings(), {}
    handle = head.register_forward_hook(lambda module, args, out: captured.update(input=args[0][0, -1]))
    try:
        logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    finally:
        handle.remove()
    best = int(logits.argmax())
    lower = min((reference[position], output[position]), key=lambda token: float(logits[token]))
    margin = float(logits[best] - logits[lower])
    bound = rounding_bound(
        logits, captured["input"], head.weight, best, lower, torch.bfloat16, target.config.num_hidden_layers
    )
    return {"margin": margin, "bound": bound, "flagged": margin > bound}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", default=str(ROOT / "osprey" / "demo_drafter_qwen"))
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--wrong-max-new-tokens", type=int, default=24, help="the wrong verifier differs early")
    parser.add_argument("--data-dir")
    parser.add_argument("--limit", type=int, help="only the first N prompts (a smoke run)")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    target = load_causal_lm(args.target, dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(args.target)
    drafter = load_drafter(args.drafter, torch.bfloat16, "cpu")
    eos = target.generation_config.eos_token_id
    prompts = replication_prompts(args.data_dir)[: args.limit]
    partial = args.output.with_suffix(".jsonl")
    done = read_jsonl(partial) if partial.exists() else []
    seen = {row["prompt"] for row in done}
    for prompt in prompts:
        name = f"{prompt.suite}/{prompt.category}/{prompt.prompt_id}"
        if name in seen:
            continue
        prompt_ids = encode_prompt(tokenizer, prompt.text)
        length = prompt_ids.shape[1]
        reference = target_generate(target, prompt_ids, args.max_new_tokens, eos_token_id=eos)[0, length:].tolist()

        def decode(max_new_tokens, prompt_ids=prompt_ids, **shape):
            return speculative_generate(target, drafter, prompt_ids, max_new_tokens, eos_token_id=eos, **shape)[0]

        row = {"prompt": name, "prompt_tokens": length, "reference": reference, "calibration": []}
        for method, shape in HONEST.items():
            with Calibration(target, prompt_ids, reference) as calibration:
                honest = decode(args.max_new_tokens, **shape)[0, length:].tolist()
            row["calibration"] += calibration.ratios(honest)
            row[method] = honest
            row[f"{method}_divergence"] = _replayed(
                target, lambda shape=shape: decode(args.max_new_tokens, **shape), prompt_ids, reference, honest
            )
        with SecondBest():
            wrong = decode(args.wrong_max_new_tokens)[0, length:].tolist()
            shorter = reference[: args.wrong_max_new_tokens]
            row["wrong"] = wrong
            row["wrong_divergence"] = _replayed(
                target, lambda: decode(args.wrong_max_new_tokens), prompt_ids, shorter, wrong
            )
        with partial.open("a") as file:
            file.write(json.dumps(row) + "\n")
        done.append(row)
        labels = ", ".join(f"{kind} {_label(row[f'{kind}_divergence'])}" for kind in [*HONEST, "wrong"])
        print(f"{name}: {labels}", flush=True)

    texts = {f"{p.suite}/{p.category}/{p.prompt_id}": p for p in prompts}
    with upcast(target):  # the former check, and the float32 margin kept as information
        for row in done:
            prompt_ids = encode_prompt(tokenizer, texts[row["prompt"]].text)
            for kind in [*HONEST, "wrong"]:
                divergence, reference = row[f"{kind}_divergence"], row["reference"]
                if (
                    divergence is not None
                    and divergence["token"] is not None
                    and divergence["target_token"] is not None
                ):
                    verdict = former_verdict(target, prompt_ids, reference, row[kind], divergence["position"])
                    divergence["former"] = verdict
    summary = summarize(done, args)
    args.output.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({key: value for key, value in summary.items() if key != "prompts"}, indent=1))
    return 0


def _replayed(target, rerun, prompt_ids, reference, output) -> dict | None:
    divergence = replay(target, rerun, prompt_ids, reference, output)
    return None if divergence is None else divergence.to_dict()


def _label(divergence: dict | None) -> str:
    return "same" if divergence is None else divergence["label"]


def summarize(rows: list[dict], args) -> dict:
    honest = [row[f"{kind}_divergence"] for row in rows for kind in HONEST if row[f"{kind}_divergence"] is not None]
    wrong = [row["wrong_divergence"] for row in rows if row["wrong_divergence"] is not None]
    ratios = [ratio for row in rows for ratio in row["calibration"]]
    honest_ratios = [d["forward_error"] / d["tolerance"] * FORWARD_NOISE for d in honest if d.get("tolerance")]
    return {
        "target": args.target,
        "drafter": args.drafter,
        "dtype": "bfloat16",
        "device": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "prompts_used": "1 per category of spec_bench, mt_bench, humaneval, mmath (seed 0), in the replication's 50",
        "num_prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "wrong_max_new_tokens": args.wrong_max_new_tokens,
        "decoding": {"honest": HONEST, "wrong": "chains; after the accepted drafts it emits the second-best token"},
        "forward_noise": FORWARD_NOISE,
        "calibration": {"positions": len(ratios), "max_ratio": max(ratios, default=None)},
        "honest_differences": len(honest),
        "honest_explained": sum(d["label"] == ROUNDING for d in honest) / len(honest) if honest else None,
        "honest_forward_ratio_max": max(honest_ratios, default=None),
        "wrong_differences": len(wrong),
        "wrong_flagged": sum(d["label"] == UNEXPLAINED for d in wrong) / len(wrong) if wrong else None,
        "former_flagged": _share(wrong, lambda d: d.get("former", {}).get("flagged", True)),
        "former_honest_explained": _share(honest, lambda d: not d.get("former", {}).get("flagged", True)),
        "prompts": rows,
    }


def _share(divergences: list[dict], predicate) -> float | None:
    return sum(bool(predicate(d)) for d in divergences) / len(divergences) if divergences else None


if __name__ == "__main__":
    sys.exit(main())
