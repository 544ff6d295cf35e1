"""How well does the output check (`osprey.decoding.near_tie.check_difference`: the audit of every token and the replay
of the first differing one) tell rounding from realistic decoding bugs on a real target in bf16?

Two disjoint prompt sets of the replication's 50 (2 per category of Spec-Bench, MT-Bench, HumanEval and MMATH):
- calibration, the one per category that `select_subset(..., 1, seed 0)` picks (25 prompts): the tolerances
  (`FORWARD_NOISE`, `AUDIT_NOISE`) are chosen from these;
- evaluation, the other one per category (25 prompts): no choice looks at them; the results are reported on them.

On each prompt the target in bf16 decodes alone (the reference) and with the shipped drafter in the two honest shapes
(`HONEST`: chains, and the demo's trees with a prompt-lookup branch). On the calibration prompts, hooks also keep the
verification rows that decided new tokens 0, 12, 24 and 36 of the reference, each compared with a clean forward of
the same prefix (`calibration.forward_max_ratio`, what `FORWARD_NOISE` must exceed); every honest output and the
reference itself is audited (`calibration.audit_max_ratio`: the largest gap below a clean forward's best logit, what
`AUDIT_NOISE` must exceed; both in units of u * max|z|). On the evaluation prompts each honest output that differs from
the reference is checked (`honest_differences`, `honest_explained`), every honest output is audited
(`honest_audits_passed`), and then the prompt is decoded once more with each realistic bug of `faults.py` injected into
the loop, in the honest shape it shows in. An output the bug changed (it differs from that shape's honest output and
from the reference) must be flagged UNEXPLAINED (`controls`: changed, flagged, and by which check).

    python benchmarks/numerics/near_tie_replay.py \
        --output benchmarks/results/near-tie-replay-qwen2.5-coder-1.5b-instruct.json

Each prompt's result is saved in OUTPUT's `.jsonl` as it is done, so a stopped run resumes (`--phase calibration`
runs only the calibration prompts; `--recheck` checks every saved output again, after a change to the check); the
audits' ratios and the summary are computed at the end.
"""

import argparse
import json
import platform
import sys
from contextlib import ExitStack
from pathlib import Path

import torch
from faults import FAULTS, SHAPES

from osprey.decoding.decode import encode_prompt, speculative_generate, target_generate
from osprey.decoding.near_tie import (
    AUDIT_NOISE,
    FORWARD_NOISE,
    ROUNDING,
    UNEXPLAINED,
    DecidingForward,
    audit,
    check_difference,
    first_divergence,
    unit_roundoff,
)
from osprey.ground import read_jsonl
from osprey.measuring.bench_suites import load_suite, select_subset
from osprey.models.pack import load_drafter
from osprey.models.zoo import load_causal_lm, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_DRAFTER = "osprey/demo_drafter_qwen"
SUITES = ("spec_bench", "mt_bench", "humaneval", "mmath")
CALIBRATION_POSITIONS = (0, 12, 24, 36)
# The honest decodings: chains (the default drafting settings) and the demo's trees with a prompt-lookup branch.
HONEST = {"chain": {}, "tree-lookup": {"draft_topk": 3, "tree_size": 8, "prompt_lookup_num_tokens": 8}}
# Each bug decodes in the honest shape it shows in (the tree mask in the demo's trees, the others in chains), so that
# what it changes is read against the honest output of that shape.
FAULT_SHAPES = {"chain": "chain", "tree": "tree-lookup"}


def prompt_sets(data_dir: str | None) -> dict[str, list]:
    """The calibration and evaluation prompts: the replication's one and two per category, the second one apart."""
    every = {suite: load_suite(suite, data_dir) for suite in SUITES}
    calibration = [prompt for suite in SUITES for prompt in select_subset(every[suite], 1, 0)]
    both = [prompt for suite in SUITES for prompt in select_subset(every[suite], 2, 0)]
    return {"calibration": calibration, "evaluation": [prompt for prompt in both if prompt not in calibration]}


def prompt_name(prompt) -> str:
    return f"{prompt.suite}/{prompt.category}/{prompt.prompt_id}"


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
        u = unit_roundoff(self.target)
        same = first_divergence(self.reference, output)
        ratios = []
        for position, hook in self.hooks.items():
            if (same is not None and position > same) or hook.logits is None:
                continue
            ids = torch.tensor([self.prompt + self.reference[:position]])
            clean = self.target(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            ratios.append(float((hook.logits - clean).abs().max()) / (u * float(clean.abs().max())))
        return ratios


def audit_ratio(target, prompt_ids, output: list[int]) -> float:
    """The largest gap of `output`'s tokens below a clean forward's best logit, in units of u * max|z|."""
    checked = audit(target, prompt_ids, output)
    return checked.gap / checked.tolerance * AUDIT_NOISE


def decode_prompt(target, drafter, tokenizer, prompt, kind: str, args, row: dict | None = None) -> dict:
    """The row of one prompt: the reference and the honest outputs (kept from `row` where it has them), and on an
    evaluation prompt each bug's output; then `check_row`."""
    eos = target.generation_config.eos_token_id
    prompt_ids = encode_prompt(tokenizer, prompt.text)
    length = prompt_ids.shape[1]

    def decode(**shape):
        return decode_in(shape, target, drafter, prompt_ids, args)

    if row is None:
        reference = target_generate(target, prompt_ids, args.max_new_tokens, eos_token_id=eos)[0, length:].tolist()
        row = {"prompt": prompt_name(prompt), "set": kind, "prompt_tokens": length, "reference": reference}
        if kind == "calibration":
            row["calibration"] = []
        for method, shape in HONEST.items():
            if kind == "calibration":
                with Calibration(target, prompt_ids, reference) as calibration:
                    row[method] = decode(**shape)[0, length:].tolist()
                row["calibration"] += calibration.ratios(row[method])
            else:
                row[method] = decode(**shape)[0, length:].tolist()
    if kind == "evaluation" and "controls" not in row:
        row["controls"] = {}
        for name, fault in FAULTS.items():
            honest = FAULT_SHAPES[SHAPES[name]]
            with fault(target):
                output = decode(**HONEST[honest])[0, length:].tolist()
            # what the bug changed: the output differs from the same shape's honest one and from the reference
            row["controls"][name] = {"output": output, "changed": output not in (row[honest], row["reference"])}
    return check_row(target, drafter, prompt_ids, row, args)


def decode_in(shape: dict, target, drafter, prompt_ids, args) -> torch.LongTensor:
    """The full sequence Osprey decodes for `prompt_ids` in drafting `shape` (every decoding here, and its replay)."""
    eos = target.generation_config.eos_token_id
    return speculative_generate(target, drafter, prompt_ids, args.max_new_tokens, eos_token_id=eos, **shape)[0]


def check_row(target, drafter, prompt_ids, row: dict, args) -> dict:
    """Gives each output of `row` (honest, and each bug's with the bug in place) that lacks one its verdict against
    the reference: `check_difference`, decoding again in the output's shape where the replay runs."""

    def checked(output, shape):
        def rerun():
            return decode_in(shape, target, drafter, prompt_ids, args)

        divergence = check_difference(target, rerun, prompt_ids, row["reference"], output)
        return None if divergence is None else divergence.to_dict()

    for method, shape in HONEST.items():
        if f"{method}_divergence" not in row:
            row[f"{method}_divergence"] = checked(row[method], shape)
    for name, control in row.get("controls", {}).items():
        if "divergence" not in control:
            with FAULTS[name](target):
                control["divergence"] = checked(control["output"], HONEST[FAULT_SHAPES[SHAPES[name]]])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--drafter", help=f"a drafter directory (default: the shipped one, {SHIPPED_DRAFTER})")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--phase", choices=["calibration", "evaluation", "both"], default="both")
    parser.add_argument("--data-dir")
    parser.add_argument("--limit", type=int, help="only the first N prompts of each set (a smoke run)")
    parser.add_argument(
        "--recheck", action="store_true", help="check every saved output again (after a change to the check)"
    )
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    target = load_causal_lm(args.target, dtype=torch.bfloat16).eval()
    tokenizer = load_tokenizer(args.target)
    drafter = load_drafter(args.drafter or ROOT / SHIPPED_DRAFTER, torch.bfloat16, "cpu")
    sets = {kind: prompts[: args.limit] for kind, prompts in prompt_sets(args.data_dir).items()}
    partial = args.output.with_suffix(".jsonl")
    rows = {(row["set"], row["prompt"]): row for row in (read_jsonl(partial) if partial.exists() else [])}
    if args.recheck:
        for row in rows.values():
            for key in [f"{method}_divergence" for method in HONEST]:
                row.pop(key, None)
            for control in row.get("controls", {}).values():
                control.pop("divergence", None)
    for kind in ("calibration", "evaluation") if args.phase == "both" else (args.phase,):
        for prompt in sets[kind]:
            row = rows.get((kind, prompt_name(prompt)))
            if row is not None and (kind == "calibration" or "controls" in row) and _checked(row):
                continue
            row = rows[kind, prompt_name(prompt)] = decode_prompt(target, drafter, tokenizer, prompt, kind, args, row)
            _write_rows(partial, rows.values())
            print(f"{kind} {row['prompt']}: {_labels(row)}", flush=True)
    done = list(rows.values())

    texts = {prompt_name(prompt): prompt for prompts in sets.values() for prompt in prompts}
    for row in done:  # the audits' ratios, for the calibration and the honest audit rate
        if "audit_ratios" in row or row["prompt"] not in texts:
            continue
        prompt_ids = encode_prompt(tokenizer, texts[row["prompt"]].text)
        row["audit_ratios"] = {
            name: audit_ratio(target, prompt_ids, row[name]) for name in ["reference", *HONEST] if row[name]
        }
    _write_rows(partial, done)  # with the ratios, kept for a rerun
    summary = summarize([row for row in done if row["prompt"] in texts], sets, args)
    args.output.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({key: value for key, value in summary.items() if key != "prompts"}, indent=1))
    return 0


def _checked(row: dict) -> bool:
    return all(f"{method}_divergence" in row for method in HONEST) and all(
        "divergence" in control for control in row.get("controls", {}).values()
    )


def _write_rows(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _labels(row: dict) -> str:
    labels = [f"{method} {_label(row[f'{method}_divergence'])}" for method in HONEST]
    labels += [f"{name} {_label(control['divergence'])}" for name, control in row.get("controls", {}).items()]
    return ", ".join(labels)


def _label(divergence: dict | None) -> str:
    return "same" if divergence is None else divergence["label"]


def _flagged_by(divergence: dict) -> str:
    """Which check flagged an UNEXPLAINED output: the audit (which runs first), or the replay."""
    audited = divergence.get("audit")
    return "audit" if audited is not None and audited["gap"] > audited["tolerance"] else "replay"


def summarize(rows: list[dict], sets: dict, args) -> dict:
    calibration = [row for row in rows if row["set"] == "calibration"]
    evaluation = [row for row in rows if row["set"] == "evaluation"]
    honest = [row[f"{m}_divergence"] for row in evaluation for m in HONEST if row[f"{m}_divergence"] is not None]
    controls = {}
    for name in FAULTS:
        changed = [row["controls"][name]["divergence"] for row in evaluation if row["controls"][name]["changed"]]
        flagged = [d for d in changed if d["label"] == UNEXPLAINED]
        controls[name] = {
            "shape": HONEST[FAULT_SHAPES[SHAPES[name]]],
            "changed": len(changed),
            "flagged": len(flagged),
            "flagged_by_audit": sum(_flagged_by(d) == "audit" for d in flagged),
            "flagged_by_replay": sum(_flagged_by(d) == "replay" for d in flagged),
        }
    honest_audits = [ratio for row in evaluation for name, ratio in row["audit_ratios"].items() if name in HONEST]
    return {
        "target": args.target,
        "drafter": args.drafter or SHIPPED_DRAFTER,
        "dtype": "bfloat16",
        "device": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens,
        "honest": HONEST,
        "forward_noise": FORWARD_NOISE,
        "audit_noise": AUDIT_NOISE,
        "calibration_prompts": [prompt_name(prompt) for prompt in sets["calibration"]],
        "evaluation_prompts": [prompt_name(prompt) for prompt in sets["evaluation"]],
        "calibration": {
            "forward_rows": sum(len(row["calibration"]) for row in calibration),
            "forward_max_ratio": max((r for row in calibration for r in row["calibration"]), default=None),
            "honest_forward_max_ratio": max(
                (
                    d["forward_error"] / d["tolerance"] * FORWARD_NOISE
                    for row in calibration
                    for m in HONEST
                    if (d := row[f"{m}_divergence"]) is not None and d.get("tolerance")
                ),
                default=None,
            ),
            "outputs_audited": sum(len(row["audit_ratios"]) for row in calibration),
            "audit_max_ratio": max((r for row in calibration for r in row["audit_ratios"].values()), default=None),
        },
        "honest_differences": len(honest),
        "honest_explained": sum(d["label"] == ROUNDING for d in honest),
        "honest_outputs_audited": len(honest_audits),
        "honest_audits_passed": sum(ratio <= AUDIT_NOISE for ratio in honest_audits),
        "honest_audit_max_ratio": max(honest_audits, default=None),
        "controls": controls,
        "prompts": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
