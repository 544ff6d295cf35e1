"""What an `osprey bench` run says: one record per method x suite x category, a Markdown table and plots.

Definitions (the `evaluate` modules under `metrics/` compute the same from users' own logs):
- τ: the mean over requests of each request's tokens per verification step (accepted drafts + the target's token).
- position acceptance: for draft position k, among all verification steps of the group that drafted a k-th token,
  the fraction where it was accepted.
- tokens/s: the group's generated tokens over its decoding time. speedup: a method's tokens/s over the target's alone
  on the same prompts, measured in the same run.
- time split: the share of decoding time in the target's prefill and verification calls, in the drafter's calls
  (SpS's assistant for SpS), and in everything else (the loop, sampling, prompt lookup).
- output = target (greedy): the share of requests whose output equals the target alone's on the same prompt; every
  other one is labelled "rounding (shape-dependent)" or "UNEXPLAINED" by the output check (an audit of every token
  and a replay of the first differing one, `osprey.decoding.near_tie.check_difference`), or "not checked" where that
  check could not run, and the table lists each. UNEXPLAINED and "not checked" fail the run (`fails`); so does the
  label results carried before the check ("near tie", by a withdrawn bound), read as "not checked".
"""

import sys
from collections import Counter, defaultdict
from pathlib import Path

from ..decoding.near_tie import NEAR_TIE, ROUNDING, UNEXPLAINED, Divergence

# A difference no check examined: saved without the token ids `osprey.decoding.near_tie` needs (older results), or its
# method was not loaded to replay it. It fails a run like UNEXPLAINED (`fails`) unless the user allows it.
UNCHECKED = "not checked"
ALLOW_UNCHECKED_FLAG = "--allow-unchecked"

OVERALL = "overall"
TIME_PARTS = ("prefill", "verify", "draft", "other")
TABLE_HEADER = (
    "| category | method | prompts | τ | acceptance at draft positions 1.. | tokens/s | speedup "
    "| time: prefill / verify / draft / other | output = target |"
)


def position_acceptance(accepted_per_step: list[int], drafted_per_step: list[int]) -> list[float]:
    """For draft position k (0-based): among steps that drafted a k-th token, the fraction that accepted it."""
    rates = []
    for position in range(max(drafted_per_step, default=0)):
        reached = sum(1 for drafted in drafted_per_step if drafted > position)
        rates.append(sum(1 for accepted in accepted_per_step if accepted > position) / reached)
    return rates


def _throughput(rows: list[dict]) -> float:
    return sum(row["new_tokens"] for row in rows) / sum(row["wall_time_s"] for row in rows)


def _record(method: str, suite: str, category: str, rows: list[dict], baseline_rows: dict, do_sample: bool) -> dict:
    request_taus = [row["tau"] for row in rows if row["tau"] is not None]
    wall_time_s = sum(row["wall_time_s"] for row in rows)
    paired = [
        (row, baseline_rows[row["suite"], row["category"], row["prompt_id"]])
        for row in rows
        if (row["suite"], row["category"], row["prompt_id"]) in baseline_rows
    ]
    speedup = matches = labels = None
    if paired:
        mine, theirs = [row for row, _ in paired], [row for _, row in paired]
        speedup = _throughput(mine) / _throughput(theirs)
        if not do_sample:
            differing = [row for row, base in paired if row["output_sha256"] != base["output_sha256"]]
            matches = 1 - len(differing) / len(paired)
            labels = {label: 0 for label in (ROUNDING, UNEXPLAINED, UNCHECKED)}
            for row in differing:
                labels[difference_label(row)] += 1
    return {
        "method": method,
        "suite": suite,
        "category": category,
        "num_prompts": len(rows),
        "prompt_ids": [row["prompt_id"] for row in rows],
        "tau": sum(request_taus) / len(request_taus) if request_taus else None,
        "position_acceptance": position_acceptance(
            [a for row in rows for a in row["accepted_per_step"]], [d for row in rows for d in row["drafted_per_step"]]
        ),
        "new_tokens": sum(row["new_tokens"] for row in rows),
        "wall_time_s": wall_time_s,
        "tokens_per_s": _throughput(rows),
        "speedup": speedup,
        "same_output_as_target": matches,
        "differences": labels,
        "time_split": {part: sum(row["time_split_s"][part] for row in rows) / wall_time_s for part in TIME_PARTS},
    }


def summarize(results: dict) -> list[dict]:
    """One record per method x suite x category, plus each suite's `overall`, in the order methods and prompts
    were given. Speedups pair each request with the one of the target alone (spec `target`) on the same prompt."""
    groups = defaultdict(list)
    for row in results["requests"]:
        groups[row["method"], row["suite"], row["category"]].append(row)
        groups[row["method"], row["suite"], OVERALL].append(row)
    baseline = next((name for name, spec in results["methods"].items() if spec == "target"), None)
    baseline_rows = {
        (row["suite"], row["category"], row["prompt_id"]): row
        for row in results["requests"]
        if row["method"] == baseline
    }
    do_sample = results["settings"]["do_sample"]
    return [
        _record(method, suite, category, groups[method, suite, category], baseline_rows, do_sample)
        for suite, categories in results["prompts"].items()
        for category in [*categories, OVERALL]
        for method in results["methods"]
        if groups[method, suite, category]
    ]


def _number(value, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _own_settings(results: dict, method: str) -> str:
    own = results.get("method_settings", {}).get(method, {})
    return f" ({', '.join(f'{key} {value}' for key, value in own.items())})" if own else ""


def markdown_table(results: dict) -> str:
    """A table per suite: one row per category and method."""
    settings = results["settings"]
    decoding = (
        f"sampling (temperature {settings['temperature']}, top-k {settings['top_k']}, top-p {settings['top_p']})"
        if settings["do_sample"]
        else "greedy"
    )
    threshold = settings.get("confidence_threshold", 0.0)
    early_stop = f" (a chain stops after a draft of probability < {threshold})" if threshold else ""
    quantization = settings.get("drafter_quantization", "none")
    drafters = f", drafters' linear layers in {quantization}" if quantization != "none" else ""
    lines = [
        f"Target `{results['target']}`, {decoding}, up to {settings['max_new_tokens']} new tokens, "
        f"{settings['num_draft_tokens']} draft tokens per step{early_stop}{drafters}. Methods: "
        + ", ".join(f"`{name}` = {spec}{_own_settings(results, name)}" for name, spec in results["methods"].items())
        + "."
    ]
    for suite in results["prompts"]:
        lines += [
            "",
            f"### {suite}",
            "",
            TABLE_HEADER,
            "|---|---|---:|---:|---|---:|---:|---|---:|",
        ]
        for record in (record for record in results["records"] if record["suite"] == suite):
            acceptance = ", ".join(f"{rate:.2f}" for rate in record["position_acceptance"]) or "–"
            split = " / ".join(f"{record['time_split'][part]:.0%}" for part in TIME_PARTS)
            lines.append(
                f"| {record['category']} | {record['method']} | {record['num_prompts']} | {_number(record['tau'])} "
                f"| {acceptance} | {_number(record['tokens_per_s'], 1)} | {_number(record['speedup'], 2, '×')} "
                f"| {split} | {_share(record)} |"
            )
    differing = [row for row in results["requests"] if row.get("divergence")]
    if differing:
        lines += ["", DIFFERENCES_NOTE, ""]
        lines += [
            f"- `{row['method']}` on {row['suite']}/{row['category']}/{row['prompt_id']}: "
            f"{Divergence.from_dict(row['divergence']).describe()}"
            for row in differing
        ]
    return "\n".join(lines) + "\n"


DIFFERENCES_NOTE = (
    "Outputs that differ from the target's own, each at its first differing new token: in half precision a "
    "verification forward over several tokens does not round like the target's one-token forwards "
    "(`benchmarks/numerics/bf16_row_invariance.py`), so a near tie can flip. Each is checked "
    f'(`osprey.decoding.near_tie.check_difference`). "{ROUNDING}": every token of the output lies within rounding '
    "of the best logit of one clean forward over it, and the first differing token is the argmax of the "
    "verification forward that decided it, whose logits agree with a clean forward's within rounding, and every "
    "forward showed each row only its own path; "
    '"UNEXPLAINED": one of these fails, which rounding cannot explain.'
    f' "{UNCHECKED}": no check examined it (a "near tie" label saved by the withdrawn bound reads as this).'
)


def difference_label(row: dict) -> str:
    """The label of a request whose output differs from the target alone's: its `divergence`'s, or UNCHECKED. A
    NEAR_TIE label, saved by the bound the replay replaced (it compared the float32 margin with a statistical bound
    and checked no forward), reads as UNCHECKED: nothing the current check ran vouches for it."""
    label = (row.get("divergence") or {}).get("label", UNCHECKED)
    return UNCHECKED if label == NEAR_TIE else label


def differing_requests(results: dict) -> list[dict]:
    """The requests of a greedy run whose output differs from the target alone's on the same prompt (none when
    sampling, where outputs differ by design, or without a target-alone method)."""
    baseline = next((name for name, spec in results["methods"].items() if spec == "target"), None)
    if baseline is None or results["settings"]["do_sample"]:
        return []
    reference = {_prompt_key(row): row["output_sha256"] for row in results["requests"] if row["method"] == baseline}
    return [
        row
        for row in results["requests"]
        if row["method"] != baseline and row["output_sha256"] != reference.get(_prompt_key(row), row["output_sha256"])
    ]


def _prompt_key(row: dict) -> tuple[str, str, str]:
    return row["suite"], row["category"], row["prompt_id"]


def fails(label: str, allow_unchecked: bool = False) -> bool:
    """The one rule for whether a differing output fails a run (`osprey bench`, `osprey demo`, the Space,
    `benchmarks/numerics/label_differences.py`): UNEXPLAINED always does; UNCHECKED does too, since a check that did
    not run cannot vouch for the output, unless the user passes `--allow-unchecked`."""
    return label == UNEXPLAINED or (label == UNCHECKED and not allow_unchecked)


def add_allow_unchecked_argument(parser) -> None:
    parser.add_argument(
        ALLOW_UNCHECKED_FLAG,
        action="store_true",
        help=f'exit 0 even if some differing output is "{UNCHECKED}" (no check could examine it); UNEXPLAINED still '
        "fails",
    )


def exit_status(results: dict, allow_unchecked: bool = False) -> int:
    """The exit status for a run: 1, saying why on stderr, when an output differs from the target alone's by more than
    rounding explains, or (unless `allow_unchecked`) when a difference could not be checked (`fails`); 0 otherwise."""
    counts = Counter(difference_label(row) for row in differing_requests(results))
    if counts[UNEXPLAINED]:
        print(
            f"{counts[UNEXPLAINED]} output(s) differ from the target alone's where no rounding explains it (a token "
            "far below a clean forward's best, one that is not its verification forward's argmax, a forward that "
            "disagrees with a clean one, or a mask or positions off the draft's path): lossless verification should "
            "never do that. See the table's list; rerun with --dtype "
            "float32 to check exactness.",
            file=sys.stderr,
        )
    if counts[UNCHECKED] and not allow_unchecked:
        print(
            f'{counts[UNCHECKED]} output(s) differ from the target alone\'s and are "{UNCHECKED}": nothing shows '
            "rounding explains them. Label them with benchmarks/numerics/label_differences.py (which needs their "
            f"methods' drafters), or pass {ALLOW_UNCHECKED_FLAG} to accept them unchecked.",
            file=sys.stderr,
        )
    return int(any(fails(label, allow_unchecked) for label in counts))


def _share(record: dict) -> str:
    matches = record["same_output_as_target"]
    if matches is None:
        return "–"
    counts = record.get("differences") or {}
    labels = ", ".join(f"{count} {label}" for label, count in counts.items() if count)
    return f"{matches:.0%}" + (f" ({labels})" if labels else "")


def plot_results(results: dict, path: Path) -> None:
    """τ (left) and speedup (right) per category, bars grouped by method, one row per suite."""
    from matplotlib.figure import Figure

    suites, methods = list(results["prompts"]), list(results["methods"])
    widest = max(len(categories) + 1 for categories in results["prompts"].values())
    figure = Figure(figsize=(min(24.0, 4.0 + 0.25 * widest * len(methods)), 3.2 * len(suites)), layout="constrained")
    axes = figure.subplots(len(suites), 2, squeeze=False)
    by_key = {(r["method"], r["suite"], r["category"]): r for r in results["records"]}
    bar_width = 0.8 / max(1, len(methods))
    for row, suite in enumerate(suites):
        categories = [*results["prompts"][suite], OVERALL]
        for column, (field, label) in enumerate((("tau", "τ"), ("speedup", "speedup over the target alone"))):
            axis = axes[row][column]
            for index, method in enumerate(methods):
                values = [(by_key.get((method, suite, category)) or {}).get(field) for category in categories]
                positions = [i + (index - (len(methods) - 1) / 2) * bar_width for i in range(len(categories))]
                axis.bar(positions, [0 if v is None else v for v in values], bar_width, label=method)
            axis.set_xticks(range(len(categories)), categories, rotation=45, ha="right")
            axis.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
            axis.set_title(f"{suite}: {label}")
    figure.legend(*axes[0][0].get_legend_handles_labels(), loc="outside upper center", ncols=len(methods))
    figure.savefig(path, dpi=100)


def save_report(results: dict, output_path: Path) -> str:
    """Writes the Markdown table and the plots beside the results JSON (`.md`, `.png`); returns the Markdown.
    Both are derived from the JSON, which keeps everything, so they are rewritten on every run."""
    markdown = markdown_table(results)
    output_path.with_suffix(".md").write_text(markdown)
    if results["records"]:
        plot_results(results, output_path.with_suffix(".png"))
    return markdown
