"""The replication's headline ratios from an `osprey bench` results JSON: Osprey's mean acceptance length τ over each
control's, overall, on non-English prompts and on prompts out of the distillation data's domain (chat).

    python benchmarks/replication/ratios.py benchmarks/results/replication-smollm2-135m-instruct.json

Groups (issue 6): out of domain = Spec-Bench translation and math_reasoning, HumanEval, MMATH, and MT-Bench in
languages other than English; non-English = MT-Bench and MMATH in other languages than English. τ of a group is the
mean over its requests (per-request τ, as everywhere in `osprey bench`).
"""

import argparse
import json
import statistics


def group_of(row: dict) -> set[str]:
    suite, category = row["suite"], row["category"]
    groups = {"overall"}
    non_english = suite in ("mt_bench", "mmath") and category != "en"
    if non_english:
        groups.add("non-English")
    if non_english or suite in ("humaneval", "mmath") or category in ("translation", "math_reasoning"):
        groups.add("out of domain")
    else:
        groups.add("in domain")
    return groups


def ratios(results: dict, drafter: str = "osprey", controls=("scratch", "eagle3")) -> dict:
    taus: dict[tuple[str, str], list[float]] = {}
    for row in results["requests"]:
        if row["tau"] is None:
            continue
        for group in group_of(row):
            taus.setdefault((row["method"], group), []).append(row["tau"])
    table = {}
    for group in ("overall", "in domain", "out of domain", "non-English"):
        if (drafter, group) not in taus:
            continue
        entry = {"num_prompts": len(taus[drafter, group]), "tau": {}}
        for method in (drafter, *controls):
            if (method, group) in taus:
                entry["tau"][method] = statistics.mean(taus[method, group])
        for control in controls:
            if control in entry["tau"]:
                entry[f"{drafter}/{control}"] = entry["tau"][drafter] / entry["tau"][control]
        table[group] = entry
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--drafter", default="osprey")
    parser.add_argument("--controls", nargs="+", default=["scratch", "eagle3"])
    args = parser.parse_args()
    with open(args.results) as file:
        table = ratios(json.load(file), args.drafter, tuple(args.controls))
    methods = [args.drafter, *args.controls]
    print("| group | prompts | " + " | ".join(f"τ {m}" for m in methods) + " | "
          + " | ".join(f"{args.drafter} / {c}" for c in args.controls) + " |")  # fmt: skip
    print("|---|---:|" + "---:|" * (len(methods) + len(args.controls)))
    for group, entry in table.items():
        cells = [f"{entry['tau'].get(m, float('nan')):.2f}" for m in methods]
        cells += [f"{entry.get(f'{args.drafter}/{c}', float('nan')):.2f}x" for c in args.controls]
        print(f"| {group} | {entry['num_prompts']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
