"""The record of one target update: benchmarks/results/update-TARGET.json and a plot of τ against minutes.

    python benchmarks/update/record.py TARGET --update RUNS/v2 --v1 RUNS/adapt-TARGET \
        --backbone RUNS/update-backbone --warm RUNS/update-warm --bench RUNS/update-bench.json \
        --output benchmarks/results/update-TARGET

`benchmarks/update/run.sh` makes the inputs: V2 (`make_target_update.py train`, and `differ` for how many held-out
answers the update changed), V1's adapted drafter, and on V2 (b) `osprey adapt` from the backbone with the defaults
and (c) `osprey adapt --from-drafter` of V1's drafter at a quarter of (b)'s budget, then one `osprey bench` of (a) V1's
drafter unchanged (as `--from-drafter` takes it: `update-warm/drafter-init`), (b) and (c) beside V2 alone on V2's
held-out prompts. τ is the mean of the per-prompt τ (chains, greedy), with its standard error; the paired rows give
per-prompt differences (mean, standard error, higher / lower counts). Minutes are each run's own `adapt.json` total.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "adapt"))
from record import paired_difference  # noqa: E402

METHODS = {"old": "old", "backbone": "backbone", "warm": "warm"}


def per_prompt_tau(bench: Path, method: str) -> list[float]:
    results = json.loads(bench.read_text())
    return [row["tau"] for row in results["requests"] if row["method"] == method and row["tau"] is not None]


def speedups(bench: Path) -> dict[str, float]:
    """Each method's tokens/s over the target alone's, overall (one run, so the target decoded the same prompts)."""
    results = json.loads(bench.read_text())
    overall = {r["method"]: r for r in results["records"] if r["category"] == "overall"}
    return {name: round(overall[name]["speedup"], 3) for name in METHODS if name in overall}


def adapt_minutes(run_dir: Path) -> float:
    stages = json.loads((run_dir / "adapt.json").read_text())["stages"]
    return round(sum(stage["minutes"] for stage in stages.values()), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    for flag in ("--update", "--v1", "--backbone", "--warm", "--bench", "--output"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    bench = Path(args.bench)
    differ = json.loads((Path(args.update) / "differ.json").read_text())
    update = json.loads((Path(args.update) / "update.json").read_text())
    rows = {}
    for name, method in METHODS.items():
        taus = per_prompt_tau(bench, method)
        rows[name] = {
            "tau": round(statistics.mean(taus), 4),
            "tau_se": round(statistics.stdev(taus) / len(taus) ** 0.5, 4),
            "prompts": len(taus),
        }
    rows["old"]["minutes"] = 0.0  # V1's drafter as it is: nothing is spent on V2
    rows["old"]["v1_adapt_minutes"] = adapt_minutes(Path(args.v1))
    for name, run in (("backbone", args.backbone), ("warm", args.warm)):
        rows[name]["minutes"] = adapt_minutes(Path(run))
        state = json.loads((Path(run) / "adapt.json").read_text())
        rows[name]["token_passes"] = state["stages"]["distill"]["token_passes"]
        rows[name]["answers"] = state["stages"]["answers"]["answers"]
    for name, speedup in speedups(bench).items():
        rows[name]["speedup_over_v2_alone"] = speedup
    record = {
        "target": args.target,
        "update": {
            key: update.get(key)
            for key in ("base", "method", "steps", "examples_seen", "learning_rate", "train_minutes", "seed")
        },
        "answers_differ_fraction": differ["answers_differ_fraction"],
        "answers_differ": {key: differ[key] for key in ("differ", "prompts", "by_category", "decoding")},
        "rows": rows,
        "paired": {
            "backbone_minus_old": paired_difference(bench, "backbone", "old"),
            "warm_minus_old": paired_difference(bench, "warm", "old"),
            "warm_minus_backbone": paired_difference(bench, "warm", "backbone"),
        },
        "bench": bench.name,
    }
    # the output is a prefix: a target's name has dots of its own (qwen2.5-coder-0.5b-instruct)
    Path(f"{args.output}.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    plot(rows, Path(f"{args.output}.png"), args.target)
    print(json.dumps(record, indent=2, ensure_ascii=False))


def plot(rows: dict, path: Path, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for name, row in rows.items():
        axes.errorbar(row["minutes"], row["tau"], yerr=row["tau_se"], fmt="o", capsize=4, label=name)
        axes.annotate(name, (row["minutes"], row["tau"]), textcoords="offset points", xytext=(6, 6))
    axes.set_xlabel("minutes of adaptation for V2 (2 CPU cores)")
    axes.set_ylabel("held-out τ on V2 (chains, greedy)")
    axes.set_title(f"{target}, updated: old and re-adapted drafters", fontsize=10)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
