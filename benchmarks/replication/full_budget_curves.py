"""The learning curves of Osprey and its controls (issue 17 §3, issue 54) and the sample efficiency read off them:
the share of each control's token-passes Osprey needs to reach the control's final held-out TTT accuracy and τ.

    python benchmarks/replication/full_budget_curves.py \
        --output benchmarks/results/full-budget-qwen2.5-coder-1.5b-instruct-curves
    python benchmarks/replication/full_budget_curves.py --run transfer --target smollm2-135m-instruct \
        --output benchmarks/results/transfer-smollm2-135m-instruct-curves
    python benchmarks/replication/full_budget_curves.py --run languages --pack osprey=mixed-slow \
        --pack scratch=scratch-mixed --pack eagle3=eagle3-mixed \
        --output benchmarks/results/languages-qwen2.5-coder-1.5b-instruct-curves

Everything is read from what the driver (`full_budget_qwen.sh`, `transfer_smollm2.sh`, `languages_qwen.sh`) commits, so
a fresh machine gets the same tables: held-out TTT accuracy (the run's held-out conversations) at each kept step from
the training record packed with each drafter (`benchmarks/checkpoints/RUN-TARGET/PACK/final/trainer_state.json`, PACK
the drafter's name unless `--pack` names another folder, or the resume pack's while a run is unfinished), and τ per
group of prompts (`ratios.py`'s groups) on the fixed 25-prompt subset at each kept step: each step's own bench
(`benchmarks/results/RUN-TARGET-stepN.json`), or for `languages` the rows of method `PACK-stepN` in
`languages-TARGET-english.json`, with the τ on the held-out multilingual-chat openings
(`languages-TARGET-multilingual.json`) beside them (`languages_qwen.sh curves` names the variant's and its controls'
packs). Every drafter sees the same batches of the same data, so token-passes are the budget's share of its steps (full
budget: 5 M token-passes over 5,024 steps). A control's value is read at its last point only once its run has finished;
Osprey's token-passes to reach it are interpolated linearly between Osprey's points (`qwen_curves.reaching`).
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from qwen_curves import reaching  # noqa: E402
from ratios import ratios  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DRAFTERS = ("osprey", "scratch", "eagle3")
GROUPS = ("overall", "out of domain", "non-English")
HELD_OUT = "tau held-out non-English"  # languages: the held-out multilingual-chat openings, all scripts
TAU_KEYS = (*(f"tau {group}" for group in GROUPS), HELD_OUT)
KEYS = ("heldout_ttt_acc_0", "heldout_ttt_acc_4", *TAU_KEYS)


def training_record(packed: Path) -> dict | None:
    """The Trainer's state packed with a drafter: the final model's, else the resume checkpoint's."""
    for folder in ("final", "checkpoint"):
        path = packed / folder / "trainer_state.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def group_taus(requests: list[dict], method: str) -> dict:
    """`method`'s τ per group (`ratios.py`'s) among `requests`, keyed as the curves' points are."""
    table = ratios(requests, drafter=method, controls=())
    return {f"tau {group}": round(table[group]["tau"][method], 4) for group in GROUPS if group in table}


def requests_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["requests"] if path.is_file() else []


def step_benches(results: Path, run: str, drafter: str):
    """τ at a step from that step's own bench, `RESULTS/RUN-stepN.json` (full-budget, transfer)."""
    return lambda step: group_taus(requests_of(results / f"{run}-step{step}.json"), drafter)


def held_out_benches(results: Path, run: str, pack: str):
    """τ at a step from the rows of method `PACK-stepN` (languages): the English subset's groups, and the mean over
    the held-out multilingual-chat openings."""
    english, multilingual = (requests_of(results / f"{run}-{suite}.json") for suite in ("english", "multilingual"))

    def taus(step: int) -> dict:
        method = f"{pack}-step{step}"
        point = group_taus(english, method)
        if held_out := group_taus(multilingual, method).get("tau non-English"):
            point[HELD_OUT] = held_out
        return point

    return taus


def curve(record: dict, taus_at, token_passes: int) -> list[dict]:
    """One point per evaluation in the record, with `taus_at(step)`, its τ where that step was benched."""
    points = []
    for entry in record["log_history"]:
        if "eval_ttt_acc_0" not in entry:
            continue
        step = entry["step"]
        points.append(
            {
                "step": step,
                "token_passes": round(token_passes * step / record["max_steps"]),
                "heldout_ttt_acc_0": entry["eval_ttt_acc_0"],
                "heldout_ttt_acc_4": entry["eval_ttt_acc_4"],
            }
            | taus_at(step)
        )
    return points


def sample_efficiency(curves: dict[str, dict]) -> dict:
    """Per finished control and measure: its final value, and the share of its token-passes Osprey needs for it."""
    osprey = curves["osprey"]["points"]
    efficiency = {}
    for control, run in curves.items():
        if control == "osprey" or not run["finished"]:
            continue
        final = run["points"][-1]
        for key in KEYS:
            if key not in final:
                continue
            efficiency.setdefault(control, {})[key] = {
                "control_final": final[key],
                **reaching([point for point in osprey if key in point], final, key),
            }
    return efficiency


def markdown(report: dict) -> str:
    points = [point for run in report["curves"].values() for point in run["points"]]
    taus = [key for key in TAU_KEYS if any(key in point for point in points)]
    lines = [
        f"Learning curves of `{report['run']}`, target `{report['target']}` "
        "(`benchmarks/replication/full_budget_curves.py`).",
        "",
        "| drafter | step | token-passes | held-out acc_0 | held-out acc_4 | "
        + " | ".join(key.replace("tau ", "τ ") for key in taus)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(taus),
    ]
    for drafter, run in report["curves"].items():
        for point in run["points"]:
            cells = " | ".join(f"{point[key]:.2f}" if key in point else "–" for key in taus)
            lines.append(
                f"| {drafter} | {point['step']:,} | {point['token_passes'] / 1e6:.2f} M | "
                f"{point['heldout_ttt_acc_0']:.3f} | {point['heldout_ttt_acc_4']:.3f} | {cells} |"
            )
    lines += [
        "",
        "Sample efficiency: the token-passes Osprey needs to reach each finished control's final value (goal: ≤ 25%).",
        "",
        "| control | measure | control's final | Osprey reaches it at | share of the control's tokens |",
        "|---|---|---:|---:|---:|",
    ]
    for control, measures in report["sample_efficiency"].items():
        for key, entry in measures.items():
            passes = entry["osprey_token_passes_to_reach"]
            reach = "not reached" if passes is None else f"{entry['bound']} {passes / 1e6:.2f} M"
            share = "–" if entry["share_of_control_tokens"] is None else f"{entry['share_of_control_tokens']:.0%}"
            lines.append(f"| {control} | {key} | {entry['control_final']:.3f} | {reach} | {share} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    panels_of = {
        "heldout_ttt_acc_0": "held-out TTT accuracy, first draft position",
        "tau overall": "τ, fixed 25-prompt subset",
    }
    if any(HELD_OUT in point for run in report["curves"].values() for point in run["points"]):
        panels_of[HELD_OUT] = "τ, held-out multilingual-chat openings"
    figure, panels = plt.subplots(1, len(panels_of), figsize=(6 * len(panels_of), 4))
    for drafter, run in report["curves"].items():
        for axes, key in zip(panels, panels_of):
            points = [point for point in run["points"] if key in point]
            axes.plot([p["token_passes"] / 1e6 for p in points], [p[key] for p in points], "o-", label=drafter)
    for axes, label in zip(panels, panels_of.values()):
        axes.set_xscale("log")
        axes.set_xlabel("distillation token-passes (M)")
        axes.set_ylabel(label)
        axes.legend()
    figure.suptitle(f"Learning curves of {report['run']}, {report['target']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def drafter_pack(text: str) -> tuple[str, str]:
    drafter, _, folder = text.partition("=")
    if drafter not in DRAFTERS or not folder:
        raise argparse.ArgumentTypeError(f"expected DRAFTER=FOLDER with DRAFTER one of {', '.join(DRAFTERS)}: {text!r}")
    return drafter, folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", choices=("full-budget", "transfer", "languages"), default="full-budget", help="the driver's runs"
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument(
        "--pack",
        action="append",
        default=[],
        type=drafter_pack,
        metavar="DRAFTER=FOLDER",
        help="a drafter's pack folder under benchmarks/checkpoints/RUN-TARGET when not named DRAFTER (repeatable)",
    )
    parser.add_argument(
        "--token-passes",
        type=int,
        help="the run's whole budget (default: the driver's, 5 M full budget, 1.25 M transfer and languages)",
    )
    parser.add_argument("--output", type=Path, help="writes OUTPUT.json, OUTPUT.md and OUTPUT.png")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    run = f"{args.run}-{args.target}"
    token_passes = args.token_passes or {"full-budget": 5_000_000}.get(args.run, 1_250_000)
    folders = dict(args.pack)
    curves = {}
    for drafter in DRAFTERS:
        pack = folders.get(drafter, drafter)
        record = training_record(ROOT / "benchmarks" / "checkpoints" / run / pack)
        if record is not None:
            taus_at = (held_out_benches if args.run == "languages" else step_benches)(results, run, pack)
            curves[drafter] = {
                "finished": record["global_step"] >= record["max_steps"],
                "points": curve(record, taus_at, token_passes),
            }
    if "osprey" not in curves:
        raise SystemExit(f"no packed Osprey run in benchmarks/checkpoints/{run}: train its osprey drafter first")
    report = {"run": run, "target": args.target, "curves": curves, "sample_efficiency": sample_efficiency(curves)}
    table = markdown(report)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.output}.json").write_text(json.dumps(report, indent=2) + "\n")
        Path(f"{args.output}.md").write_text(table)
        plot(report, Path(f"{args.output}.png"))


if __name__ == "__main__":
    main()
