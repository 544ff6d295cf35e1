"""The replication's headline ratios from an `osprey bench` results JSON: Osprey's mean acceptance length τ over each
control's, overall, on non-English prompts and on prompts out of the distillation data's domain (chat); then each
method's acceptance at each draft position in each group; then, per method over all requests, the speedup from summed
tokens and time, the mean chain length and the cost of a draft token and of a verification step.

    python benchmarks/replication/ratios.py benchmarks/results/replication-smollm2-135m-instruct.json

Groups (issue 6): out of domain = Spec-Bench translation and math_reasoning, HumanEval, MMATH, and MT-Bench in
languages other than English; non-English = MT-Bench and MMATH in other languages than English, and the held-out
`multilingual_chat` openings (issue 54); non-English prompts are split again by the script most letters of the
target's answer are in (Latin or another: the per-script τ of issue 54; greedy outputs equal the target's, so the
split is the same for every method). τ of a group is the mean over its requests (per-request τ, as everywhere in
`osprey bench`). Only prompts that every method finished are compared, so a bench that was stopped early still
compares like with like (the script says how many it left out). The costs table lists the compared methods (and the
target alone).

`--also OTHER.json` (repeatable) adds the drafters of another greedy bench on the same prompts to the τ table (not to
the costs: times from two runs do not compare), chains and trees alike. Greedy τ does not depend on the run, but only
if both decoded alike, so the target-alone outputs of the two runs must be identical.
"""

import argparse
import json
import statistics

from osprey.ground import text_script
from osprey.measuring.bench import saved_settings
from osprey.measuring.bench_report import position_acceptance
from osprey.measuring.methods import DRAFTER_KINDS

GROUPS = (
    "overall",
    "in domain",
    "out of domain",
    "non-English",
    "non-English, Latin script",
    "non-English, other scripts",
)


def _prompt_key(row: dict) -> tuple[str, str, str]:
    return row["suite"], row["category"], row["prompt_id"]


def complete_requests(results: dict) -> list[dict]:
    """The requests of the prompts that every method of the bench has finished."""
    prompts_by_method: dict[str, set] = {method: set() for method in results["methods"]}
    for row in results["requests"]:
        prompts_by_method[row["method"]].add(_prompt_key(row))
    complete = set.intersection(*prompts_by_method.values())
    return [row for row in results["requests"] if _prompt_key(row) in complete]


def with_drafters_from(results: dict, other: dict) -> dict:
    """`results` plus the drafter methods (and their requests) of `other`, a greedy bench with the same settings
    whose target-alone outputs equal those of `results` on every shared prompt."""
    settings = [saved_settings(bench) for bench in (results, other)]
    if settings[0] != settings[1] or settings[0]["do_sample"] or results.get("target") != other.get("target"):
        raise ValueError("Only greedy benches of one target with identical settings can be compared across runs.")
    target_outputs = [
        {_prompt_key(row): row["output_sha256"] for row in bench["requests"] if row["method"] == "target"}
        for bench in (results, other)
    ]
    shared = target_outputs[0].keys() & target_outputs[1].keys()
    if not shared or any(target_outputs[0][key] != target_outputs[1][key] for key in shared):
        raise ValueError(
            "The two benches' target-alone outputs differ (or were not both run): they did not decode "
            "alike, so their τ do not compare. Rerun both with the same --dtype and target."
        )
    drafters = {name: spec for name, spec in other["methods"].items() if spec.partition(":")[0] in DRAFTER_KINDS}
    if drafters.keys() & results["methods"].keys():
        raise ValueError(f"Both benches have a method named {sorted(drafters.keys() & results['methods'].keys())}.")
    return {
        **results,
        "methods": {**results["methods"], **drafters},
        "requests": results["requests"] + [row for row in other["requests"] if row["method"] in drafters],
    }


def group_of(row: dict, script: str | None = None) -> set[str]:
    """The groups of a request; `script`, that of its prompt's answer, splits the non-English ones (none: no split)."""
    suite, category = row["suite"], row["category"]
    groups = {"overall"}
    # multilingual_chat: the held-out openings of the multilingual-chat corpus, all in languages other than English
    non_english = (suite in ("mt_bench", "mmath") and category != "en") or suite == "multilingual_chat"
    if non_english:
        groups.add("non-English")
        if script is not None:
            groups.add("non-English, Latin script" if script == "LATIN" else "non-English, other scripts")
    if non_english or suite in ("humaneval", "mmath") or category in ("translation", "math_reasoning"):
        groups.add("out of domain")
    else:
        groups.add("in domain")
    return groups


def ratios(requests: list[dict], drafter: str = "osprey", controls=("scratch", "eagle3")) -> dict:
    """Per group: each method's mean τ and acceptance at each draft position (`osprey bench`'s: among the steps
    that drafted a k-th token, the share that accepted it, over all the group's steps), and the drafter's τ ratios.
    A prompt's answer script is read from its first request with a `completion` (greedy: every method's is the same)."""
    scripts: dict[tuple[str, str, str], str | None] = {}
    for row in requests:
        if row.get("completion") is not None:
            scripts.setdefault(_prompt_key(row), text_script(row["completion"]))
    taus: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    for row in requests:
        if row["tau"] is None:
            continue
        for group in group_of(row, scripts.get(_prompt_key(row))):
            taus.setdefault((row["method"], group), []).append(row["tau"])
            accepted, drafted = steps.setdefault((row["method"], group), ([], []))
            accepted += row["accepted_per_step"]
            drafted += row["drafted_per_step"]
    table = {}
    for group in GROUPS:
        if (drafter, group) not in taus:
            continue
        entry = {"num_prompts": len(taus[drafter, group]), "tau": {}, "position_acceptance": {}}
        for method in (drafter, *controls):
            if (method, group) in taus:
                entry["tau"][method] = statistics.mean(taus[method, group])
                entry["position_acceptance"][method] = position_acceptance(*steps[method, group])
        for control in controls:
            if control in entry["tau"]:
                entry[f"{drafter}/{control}"] = entry["tau"][drafter] / entry["tau"][control]
        table[group] = entry
    return table


def costs(requests: list[dict]) -> dict:
    """Per method, over all its requests: speedup = summed tokens / summed wall time over the target alone's (when
    a `target` method ran), mean drafts per verification step, ms per draft token and per verification step (from the
    bench's time split), and how many outputs equal the target's."""
    target_hashes = {_prompt_key(row): row["output_sha256"] for row in requests if row["method"] == "target"}
    totals: dict[str, dict] = {}
    for row in requests:
        total = totals.setdefault(
            row["method"],
            dict.fromkeys(("tokens", "seconds", "drafted", "steps", "draft_s", "verify_s", "same", "requests"), 0),
        )
        total["tokens"] += row["new_tokens"]
        total["seconds"] += row["wall_time_s"]
        total["drafted"] += sum(row["drafted_per_step"])
        total["steps"] += len(row["drafted_per_step"])
        total["draft_s"] += row["time_split_s"]["draft"]
        total["verify_s"] += row["time_split_s"]["verify"]
        total["same"] += target_hashes.get(_prompt_key(row)) == row["output_sha256"]
        total["requests"] += 1
    baseline = totals.get("target")
    table = {}
    for method, total in totals.items():
        tokens_per_s = total["tokens"] / total["seconds"]
        table[method] = {
            "speedup": tokens_per_s / (baseline["tokens"] / baseline["seconds"]) if baseline else None,
            "mean_drafts_per_step": total["drafted"] / total["steps"] if total["steps"] else 0.0,
            "draft_ms_per_token": 1000 * total["draft_s"] / total["drafted"] if total["drafted"] else None,
            "verify_ms_per_step": 1000 * total["verify_s"] / total["steps"] if total["steps"] else None,
            "same_output_as_target": f"{total['same']} / {total['requests']}" if target_hashes else None,
        }
    return table


def _cell(value, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--drafter", default="osprey")
    parser.add_argument("--controls", nargs="+", default=["scratch", "eagle3"])
    parser.add_argument(
        "--also", action="append", default=[], help="another greedy bench's results JSON whose drafters join τ's table"
    )
    args = parser.parse_args()
    with open(args.results) as file:
        results = json.load(file)
    own_methods = set(results["methods"])
    for other in args.also:
        with open(other) as file:
            results = with_drafters_from(results, json.load(file))
    requests = complete_requests(results)
    left_out = len(results["requests"]) - len(requests)
    if left_out:
        print(f"Left out {left_out} requests of prompts that not every method finished.\n")
    table = ratios(requests, args.drafter, tuple(args.controls))
    methods = [args.drafter, *args.controls]
    print(
        "| group | prompts | "
        + " | ".join(f"τ {m}" for m in methods)
        + " | "
        + " | ".join(f"{args.drafter} / {c}" for c in args.controls)
        + " |"
    )
    print("|---|---:|" + "---:|" * (len(methods) + len(args.controls)))
    for group, entry in table.items():
        cells = [_cell(entry["tau"].get(m), "{:.2f}") for m in methods]  # –: a control not in this bench
        cells += [_cell(entry.get(f"{args.drafter}/{c}"), "{:.2f}x") for c in args.controls]
        print(f"| {group} | {entry['num_prompts']} | " + " | ".join(cells) + " |")
    print()
    print("| group | method | acceptance at draft positions 1.. |\n|---|---|---|")
    for group, entry in table.items():
        for method, rates in entry["position_acceptance"].items():
            print(f"| {group} | {method} | " + ", ".join(f"{rate:.2f}" for rate in rates) + " |")
    print()
    print(
        "| method | speedup (summed tokens and time) | drafts per step | ms per draft token | ms per verify step "
        "| output = target |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for method, entry in costs([row for row in requests if row["method"] in own_methods]).items():
        if method not in (*methods, "target"):  # the other shape's drafters and the baselines: their own call
            continue
        cells = [
            _cell(entry["speedup"], "{:.2f}x"),
            f"{entry['mean_drafts_per_step']:.2f}",
            _cell(entry["draft_ms_per_token"], "{:.1f}"),
            _cell(entry["verify_ms_per_step"], "{:.1f}"),
            _cell(entry["same_output_as_target"], "{}"),
        ]
        print(f"| {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
