"""The learning curves of Osprey and its controls (issue 17 §3, issue 54) and the sample efficiency read off them:
the share of each control's token-passes Osprey needs to reach the control's final held-out TTT accuracy and τ.

    python benchmarks/replication/full_budget_curves.py \
        --output benchmarks/results/full-budget-qwen2.5-coder-1.5b-instruct-curves
    python benchmarks/replication/full_budget_curves.py --run transfer --target smollm2-135m-instruct \
        --output benchmarks/results/transfer-smollm2-135m-instruct-curves

Everything is read from what the driver (`full_budget_qwen.sh`, `transfer_smollm2.sh`) commits, so a fresh machine
gets the same tables: held-out TTT accuracy (48 held-out conversations) at each kept step from the training record
packed with each drafter (`benchmarks/checkpoints/RUN-TARGET/DRAFTER/final/trainer_state.json`, or the resume pack's
while a run is unfinished), and τ per group of prompts (`ratios.py`'s groups) from the fixed 25-prompt benches of
each kept step (`benchmarks/results/RUN-TARGET-stepN.json`). Every drafter sees the same batches of the same data, so
token-passes are the budget's share of its steps (full budget: 5 M token-passes over 5,024 steps). A control's value
is read at its last point only once its run has finished; Osprey's token-passes to reach it are interpolated linearly
between Osprey's points (`qwen_curves.reaching`).
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
KEYS = ("heldout_ttt_acc_0", "heldout_ttt_acc_4", *(f"tau {group}" for group in GROUPS))


def training_record(packed: Path) -> dict | None:
    """The Trainer's state packed with a drafter: the final model's, else the resume checkpoint's."""
    for folder in ("final", "checkpoint"):
        path = packed / folder / "trainer_state.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def curve(drafter: str, record: dict, results: Path, run: str, token_passes: int) -> list[dict]:
    """One point per evaluation in the record, with the τ of that step's bench where it exists."""
    points = []
    for entry in record["log_history"]:
        if "eval_ttt_acc_0" not in entry:
            continue
        step = entry["step"]
        point = {
            "step": step,
            "token_passes": round(token_passes * step / record["max_steps"]),
            "heldout_ttt_acc_0": entry["eval_ttt_acc_0"],
            "heldout_ttt_acc_4": entry["eval_ttt_acc_4"],
        }
        bench = results / f"{run}-step{step}.json"
        if bench.is_file():
            table = ratios(json.loads(bench.read_text())["requests"], drafter=drafter, controls=())
            point |= {f"tau {group}": round(table[group]["tau"][drafter], 4) for group in GROUPS if group in table}
        points.append(point)
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
    lines = [
        f"Learning curves of `{report['run']}`, target `{report['target']}` "
        "(`benchmarks/replication/full_budget_curves.py`).",
        "",
        "| drafter | step | token-passes | held-out acc_0 | held-out acc_4 | "
        + " | ".join(f"τ {group}" for group in GROUPS)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(GROUPS),
    ]
    for drafter, run in report["curves"].items():
        for point in run["points"]:
            taus = " | ".join(f"{point[f'tau {g}']:.2f}" if f"tau {g}" in point else "–" for g in GROUPS)
            lines.append(
                f"| {drafter} | {point['step']:,} | {point['token_passes'] / 1e6:.2f} M | "
                f"{point['heldout_ttt_acc_0']:.3f} | {point['heldout_ttt_acc_4']:.3f} | {taus} |"
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
    figure, panels = plt.subplots(1, 2, figsize=(12, 4))
    for drafter, run in report["curves"].items():
        points = run["points"]
        panels[0].plot(
            [p["token_passes"] / 1e6 for p in points], [p["heldout_ttt_acc_0"] for p in points], "o-", label=drafter
        )
        benched = [p for p in points if "tau overall" in p]
        panels[1].plot(
            [p["token_passes"] / 1e6 for p in benched], [p["tau overall"] for p in benched], "o-", label=drafter
        )
    for axes, label in zip(panels, ("held-out TTT accuracy, first draft position", "τ, fixed 25-prompt subset")):
        axes.set_xscale("log")
        axes.set_xlabel("distillation token-passes (M)")
        axes.set_ylabel(label)
        axes.legend()
    figure.suptitle(f"Learning curves of {report['run']}, {report['target']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=("full-budget", "transfer"), default="full-budget", help="the driver's runs")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument(
        "--token-passes",
        type=int,
        help="the run's whole budget (default: the driver's, 5 M full budget, 1.25 M transfer)",
    )
    parser.add_argument("--output", type=Path, help="writes OUTPUT.json, OUTPUT.md and OUTPUT.png")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    run = f"{args.run}-{args.target}"
    token_passes = args.token_passes or {"full-budget": 5_000_000, "transfer": 1_250_000}[args.run]
    curves = {}
    for drafter in DRAFTERS:
        record = training_record(ROOT / "benchmarks" / "checkpoints" / run / drafter)
        if record is not None:
            curves[drafter] = {
                "finished": record["global_step"] >= record["max_steps"],
                "points": curve(drafter, record, results, run, token_passes),
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
