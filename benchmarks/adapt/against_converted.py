"""The record of an `osprey adapt` run for a target with no committed controls (a base model such as Gemma-3-270M):
its minutes per stage, the adapted drafter's held-out τ against the converted backbone before distillation on the same
prompts, per prompt with a standard error, and the speed check against the target alone.

    osprey adapt --target gemma-3-270m --output RUNS/adapt-gemma-3-270m          # defaults, empty directory
    python benchmarks/adapt/against_converted.py gemma-3-270m RUNS/adapt-gemma-3-270m \
        --results benchmarks/results/adapt-gemma-3-270m [--setup-minutes fetch=0.8 ...]

The comparison runs `osprey bench` once over the held-out prompts of the adapt run's own evaluation (`evaluate/
held-out.json`: the same ids, fed the same way, chat template or raw text), with the adapted drafter
(`RUN/drafter`) and the converted one (`RUN/drafter-init`) as two methods beside the target alone; chains, greedy,
48 new tokens, as `osprey adapt` evaluates. `--setup-minutes` records first-run work outside the run (model fetches,
corpus builds) so the record gives the minutes with and without it.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from record import mean_taus, paired_difference  # noqa: E402


def held_out_file(run_dir: Path, results: str) -> Path:
    """The adapt run's held-out prompts as a JSONL file `osprey bench` reads (one suite, the run's categories)."""
    held_out = json.loads((run_dir / "evaluate" / "held-out.json").read_text())
    keys = dict.fromkeys((row["suite"], row["category"], row["prompt_id"]) for row in held_out["requests"])
    path = Path(f"{results}-heldout-prompts.jsonl")
    sources = _prompt_texts(held_out)
    with path.open("w", encoding="utf-8") as handle:
        for suite, category, prompt_id in keys:
            text = sources[suite, category, prompt_id]
            record = {"question_id": f"{suite}/{prompt_id}", "category": f"{suite}/{category}", "turns": [text]}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def _prompt_texts(held_out: dict) -> dict:
    """The text of every prompt id the held-out results name, from the suites they were drawn from."""
    from osprey.measuring.bench_suites import load_suite

    texts = {}
    for suite in {row["suite"] for row in held_out["requests"]}:
        for prompt in load_suite(suite):
            texts[suite, prompt.category, prompt.prompt_id] = prompt.text
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--results", required=True, help="prefix of the results files")
    parser.add_argument("--setup-minutes", nargs="*", default=[], metavar="WHAT=MIN", help="first-run work outside")
    parser.add_argument("--osprey", default=str(Path(sys.executable).parent / "osprey"))
    args = parser.parse_args()
    state = json.loads((args.run_dir / "adapt.json").read_text())
    stages = state["stages"]
    evaluation = stages["evaluate"]
    prompts = held_out_file(args.run_dir, args.results)
    bench = Path(f"{args.results}-heldout-converted.json")
    command = [
        args.osprey, "bench", "--target", args.target, "--prompts", str(prompts),
        "--drafter", f"adapted={args.run_dir / 'drafter'}", "--drafter", f"converted={args.run_dir / 'drafter-init'}",
        "--max-new-tokens", str(48), "--confidence-threshold", "0", "--dtype", state["settings"]["dtype"],
        "--output", str(bench),
    ]  # fmt: skip
    if evaluation.get("format") == "text":
        command.append("--no-chat-template")
    subprocess.run(command, check=True)
    setup = {what: float(minutes) for what, minutes in (item.split("=") for item in args.setup_minutes)}
    minutes = sum(stage["minutes"] for stage in stages.values())
    taus = mean_taus(bench)
    record = {
        "target": args.target,
        "command": f"osprey adapt --target {args.target} --output DIR (defaults, empty directory, no data folder)",
        "settings": state["settings"],
        "format": evaluation.get("format", "chat"),
        "minutes": {
            "adapt": round(minutes, 2),
            "stages": {name: round(stage["minutes"], 2) for name, stage in stages.items()},
            "first_run_setup": setup,
            "with_first_run_setup": round(minutes + sum(setup.values()), 2),
        },
        "token_passes": stages["distill"]["token_passes"],
        "held_out": {
            "prompts": paired_difference(bench, "adapted", "converted")["prompts"],
            "left_out": evaluation.get("left_out", []),
            "tau": {"adapted": round(taus["adapted"], 4), "converted": round(taus["converted"], 4)},
            "adapted_minus_converted": paired_difference(bench, "adapted", "converted"),
            "results": bench.name,
        },
        "speed_check": {"speedup": evaluation["speedup"], "tau": evaluation["speed_tau"]},
        "outputs_checked": evaluation["outputs_checked"],
    }
    output = Path(f"{args.results}.json")
    output.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(record, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
