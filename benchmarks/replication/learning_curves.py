"""Training TTT accuracy against distillation step for the replication's drafters, from their `trainer_state.json`
logs: whether a drafter was still learning when the budget ran out, and how fast each one starts.

    python benchmarks/replication/learning_curves.py /work/runs/replication/smollm2-135m-instruct \
        --output benchmarks/results/learning-curves-smollm2-135m-instruct

Reads `RUN_DIR/{osprey,scratch,eagle3}/trainer_state.json` (or the newest checkpoint's, for a run still going) and
writes OUTPUT.json (step, TTT accuracy at step 0 and at the last TTT step, per drafter, and the held-out accuracies
of the run's last evaluation) and OUTPUT.png. The curves are the trainer's logged training-batch means (every
`logging_steps`), so they are noisy; the held-out numbers are the evaluation's.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DRAFTERS = ("osprey", "scratch", "eagle3")


def trainer_state(drafter_dir: Path) -> Path | None:
    """The finished run's state, else the newest checkpoint's."""
    if (drafter_dir / "trainer_state.json").is_file():
        return drafter_dir / "trainer_state.json"
    checkpoints = sorted(drafter_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    return checkpoints[-1] / "trainer_state.json" if checkpoints else None


def learning_curves(run_dir: Path) -> dict:
    curves = {}
    for drafter in DRAFTERS:
        state_path = trainer_state(run_dir / drafter)
        if state_path is None:
            continue
        history = json.loads(state_path.read_text())["log_history"]
        logs = [row for row in history if "ttt_acc_0" in row]
        evaluations = [row for row in history if "eval_ttt_acc_0" in row]
        last = max(int(key.rsplit("_", 1)[1]) for key in logs[0] if key.startswith("ttt_acc_"))
        curves[drafter] = {
            "step": [row["step"] for row in logs],
            "ttt_acc_first": [row["ttt_acc_0"] for row in logs],
            "ttt_acc_last": [row[f"ttt_acc_{last}"] for row in logs],
            "last_ttt_step": last,
            "held_out": {"step": evaluations[-1]["step"]}
            | {
                key.removeprefix("eval_"): value
                for key, value in evaluations[-1].items()
                if key.startswith("eval_ttt_")
            }
            if evaluations
            else None,
        }
    if not curves:
        raise SystemExit(f"no trainer_state.json under {run_dir}/{{{','.join(DRAFTERS)}}}: pass a replication run dir")
    return curves


def plot(curves: dict, title: str, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    for drafter, curve in curves.items():
        (line,) = axes.plot(curve["step"], curve["ttt_acc_first"], label=f"{drafter}, TTT step 0")
        axes.plot(
            curve["step"],
            curve["ttt_acc_last"],
            "--",
            color=line.get_color(),
            label=f"{drafter}, TTT step {curve['last_ttt_step']}",
        )
    axes.set(xlabel="distillation step", ylabel="training TTT accuracy", title=title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a benchmarks/replication/run.sh output folder (RUNS/replication/T)")
    parser.add_argument("--output", type=Path, required=True, help="path without suffix: writes .json and .png")
    args = parser.parse_args()
    curves = learning_curves(args.run_dir)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.output}.json").write_text(json.dumps(curves, indent=1) + "\n")  # names like qwen2.5-... hold dots
    plot(curves, args.run_dir.name, Path(f"{args.output}.png"))
    for drafter, curve in curves.items():
        held_out = curve["held_out"]
        print(
            f"{drafter}: step {curve['step'][-1]}, training TTT accuracy {curve['ttt_acc_first'][-1]:.3f} at step 0, "
            f"{curve['ttt_acc_last'][-1]:.3f} at step {curve['last_ttt_step']}; held out"
            + (f" at step {held_out['step']}: {held_out['ttt_acc_0']:.3f}" if held_out else ": not evaluated")
        )


if __name__ == "__main__":
    main()
