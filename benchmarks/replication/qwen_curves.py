"""Held-out learning curves of the Qwen-backbone Osprey drafter and its two controls at equal budget (issue 17 §3),
and the sample efficiency read off them: how many token-passes Osprey needs to reach each control's final held-out
TTT accuracy, and its final τ on the equal-budget benches' 25 prompts.

    python benchmarks/replication/qwen_curves.py /work/runs/qwen-drafter \
        --output benchmarks/results/learning-curves-qwen-controls

The controls are the runs of `qwen_drafter.sh controls`
(`RUN_DIR/{scratch,eagle3}-{round1-epoch1,round1,round2,round3}`): Osprey's rounds 1 to 3 (same configs, data, order
and seeds) from `osprey baseline {scratch,eagle3} --like osprey-init`. Osprey's points are the committed record of its
own runs (`learning-curve-qwen-drafter.json`, rounds 1 to 3). A point is one evaluation of a run on the 48 held-out
conversations; token-passes count the training tokens seen, epochs x the round's tokens, summed over the runs before
it. The τ curves are the greedy benches that `qwen_drafter.sh controls` runs after round 1's first 60 steps and after
each round
(`benchmarks/results/equal-budget-qwen2.5-coder-1.5b-instruct-RUN.json`, whichever exist), τ the mean over a bench's
requests.
"""

import argparse
import ast
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
OSPREY_RECORD = RESULTS / "learning-curve-qwen-drafter.json"
# (run suffix, training tokens of its feature cache): rounds 1 (two runs on 240 conversations), 2 (816) and 3 (1,616)
RUNS = (("round1-epoch1", 72_749), ("round1", 72_749), ("round2", 209_006), ("round3", 411_703))
CONTROLS = ("scratch", "eagle3")
TTT_STEPS = 5
TARGET = "qwen2.5-coder-1.5b-instruct"
# the equal-budget benches: (run, total optimizer steps at its end); every drafter sees the same steps and data
BENCHED_RUNS = (("round1-epoch1", 60), ("round1", 180), ("round2", 680), ("round3", 1480))


def last_logged_evaluation(log_path: Path) -> dict | None:
    """The last evaluation the Trainer printed to a run's log (`{'eval_loss': '21.1', ..., 'epoch': '1.2'}`)."""
    if not log_path.is_file():
        return None
    printed = re.findall(r"\{'eval_loss'[^}]*\}", log_path.read_text(errors="replace"))
    return {key: float(value) for key, value in ast.literal_eval(printed[-1]).items()} if printed else None


def control_curve(run_dir: Path, control: str) -> list[dict]:
    """The evaluation points of a control's runs, in order. A run still going (or stopped) is read from its
    newest checkpoint, plus the last evaluation in `RUN_DIR/CONTROL.log` when that came after the checkpoint: a run
    stopped right after an evaluation keeps it."""
    points, steps_before, passes_before = [], 0, 0
    for suffix, num_tokens in RUNS:
        folder = run_dir / f"{control}-{suffix}"
        state_path = folder / "trainer_state.json"
        finished = state_path.is_file()
        if not finished:
            checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
            if not checkpoints:
                break
            state_path = checkpoints[-1] / "trainer_state.json"
        state = json.loads(state_path.read_text())
        if not finished:
            logged = last_logged_evaluation(run_dir / f"{control}.log")
            step = 0 if logged is None else round(logged["epoch"] * state["global_step"] / state["epoch"])
            # only an evaluation of this run, after its checkpoint and before the next one would have been written
            if 0 < step - state["global_step"] < state["save_steps"] and step % state["eval_steps"] == 0:
                state["log_history"].append({"step": step} | logged)
        for entry in state["log_history"]:
            if "eval_ttt_acc_0" in entry:
                points.append(
                    {
                        "run": suffix,
                        "total_steps": steps_before + entry["step"],
                        "token_passes": passes_before + round(entry["epoch"] * num_tokens),
                    }
                    | {f"heldout_ttt_acc_{k}": round(entry[f"eval_ttt_acc_{k}"], 4) for k in range(TTT_STEPS)}
                )
        if not finished:
            break
        steps_before += state["global_step"]
        passes_before += round(state["epoch"] * num_tokens)
    return points


def tokens_to_reach(curve: list[dict], accuracy: float, key: str = "heldout_ttt_acc_0") -> dict:
    """The token-passes at which `curve` first reaches `accuracy`, linearly interpolated between its points; before
    its first point only an upper bound is known (the first point's token-passes)."""
    previous = None
    for point in curve:
        if point[key] >= accuracy:
            if previous is None:
                return {"token_passes": point["token_passes"], "bound": "at most"}
            share = (accuracy - previous[key]) / (point[key] - previous[key])
            passes = previous["token_passes"] + share * (point["token_passes"] - previous["token_passes"])
            return {"token_passes": round(passes), "bound": "interpolated"}
        previous = point
    return {"token_passes": None, "bound": "not reached"}


def tau_curves(token_passes_at: dict[int, int]) -> dict[str, list[dict]]:
    """Per drafter of the equal-budget benches, its τ after each benched run; `token_passes_at` maps total optimizer
    steps to token-passes."""
    curves: dict[str, list[dict]] = {}
    for run, total_steps in BENCHED_RUNS:
        path = RESULTS / f"equal-budget-{TARGET}-{run}.json"
        if not path.is_file():
            continue
        taus: dict[str, list[float]] = {}
        for request in json.loads(path.read_text())["requests"]:
            taus.setdefault(request["method"], []).append(request["tau"])
        for method, values in taus.items():
            curves.setdefault(method, []).append(
                {
                    "run": run,
                    "total_steps": total_steps,
                    "token_passes": token_passes_at[total_steps],
                    "prompts": len(values),
                    "tau": round(statistics.mean(values), 4),
                }
            )
    return curves


def with_mean(point: dict) -> dict:
    """`point` plus the mean held-out accuracy over the TTT steps: what a whole chain's acceptance follows."""
    steps = [point[f"heldout_ttt_acc_{k}"] for k in range(TTT_STEPS)]
    return point | {"heldout_ttt_acc_mean": round(sum(steps) / TTT_STEPS, 4)}


def reaching(osprey: list[dict], final: dict, key: str) -> dict:
    """How Osprey's curve reaches a control's `final` point in `key`: its token-passes and their share of the
    control's."""
    reach = tokens_to_reach(osprey, final[key], key)
    return {
        "control_token_passes": final["token_passes"],
        "osprey_token_passes_to_reach": reach["token_passes"],
        "bound": reach["bound"],
        "share_of_control_tokens": None
        if reach["token_passes"] is None
        else round(reach["token_passes"] / final["token_passes"], 3),
    }


def sample_efficiency(osprey: list[dict], controls: dict[str, list[dict]], key: str = "heldout_ttt_acc_0") -> dict:
    """Per control: its last point's accuracy (`key`) and the share of its token-passes Osprey needs to reach it."""
    efficiency = {}
    for control, curve in controls.items():
        if not curve:
            continue
        final = curve[-1]
        efficiency[control] = {
            f"control_final_{key}": final[key],
            **reaching(osprey, final, key),
            f"osprey_{key}_at_equal_budget": next(
                (p[key] for p in osprey if p["total_steps"] == final["total_steps"]), None
            ),
        }
    return efficiency


def plot(curves: dict[str, list[dict]], taus: dict[str, list[dict]], path: Path) -> None:
    figure, (axes, tau_axes) = plt.subplots(1, 2, figsize=(12, 4))
    for name, curve in taus.items():
        passes = [point["token_passes"] / 1e6 for point in curve]
        tau_axes.plot(passes, [point["tau"] for point in curve], "o-", label=name)
    tau_axes.set(xlabel="distillation token-passes (M)", ylabel="τ, greedy, 25 prompts", title="Mean acceptance length")
    tau_axes.legend(fontsize="small")
    for name, curve in curves.items():
        passes = [point["token_passes"] / 1e6 for point in curve]
        (line,) = axes.plot(passes, [point["heldout_ttt_acc_0"] for point in curve], "o-", label=f"{name}, step 0")
        axes.plot(
            passes,
            [point[f"heldout_ttt_acc_{TTT_STEPS - 1}"] for point in curve],
            "x--",
            color=line.get_color(),
            label=f"{name}, step {TTT_STEPS - 1}",
        )
    axes.set(
        xlabel="distillation token-passes (M)",
        ylabel="held-out TTT accuracy",
        title="Qwen2.5-Coder-1.5B drafters, equal data and budget",
    )
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the qwen_drafter.sh output folder (RUNS/qwen-drafter)")
    parser.add_argument("--output", type=Path, required=True, help="path without suffix: writes .json and .png")
    args = parser.parse_args()
    osprey_points = json.loads(OSPREY_RECORD.read_text())["points"]
    osprey = [with_mean({key: value for key, value in point.items() if key != "round"}) for point in osprey_points]
    taus = tau_curves({point["total_steps"]: point["token_passes"] for point in osprey_points})
    controls = {control: [with_mean(point) for point in control_curve(args.run_dir, control)] for control in CONTROLS}
    if not any(controls.values()):
        raise SystemExit(f"no evaluated control run under {args.run_dir}: run qwen_drafter.sh controls first")
    curves = {"osprey": osprey} | controls
    results = {
        "target": TARGET,
        "heldout": "48 held-out regenerated ShareGPT conversations; TTT accuracy at draft positions 1..5",
        "budget": "Osprey's rounds 1 and 2 for every drafter: distill-qwen-q05b-epoch1.yaml (60 steps), "
        "-epochs2-3.yaml (120, --seed 1) on 240 conversations, -regen816.yaml (500) on 816; batches of 4",
        "curves": curves,
        "sample_efficiency": {
            "first_draft_position": sample_efficiency(osprey, controls),
            "mean_over_ttt_steps": sample_efficiency(osprey, controls, "heldout_ttt_acc_mean"),
        },
        "tau_curves": taus,
        "tau_sample_efficiency": sample_efficiency(
            taus.get("osprey", []), {control: taus.get(control, []) for control in CONTROLS}, "tau"
        ),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.output}.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(curves, taus, Path(f"{args.output}.png"))
    for name, curve in curves.items():
        print(
            name,
            " ".join(
                f"{p['token_passes']}:{p['heldout_ttt_acc_0']:.3f}/{p['heldout_ttt_acc_mean']:.3f}" for p in curve
            ),
        )
    for name, curve in taus.items():
        print(f"τ {name}", " ".join(f"{p['token_passes']}:{p['tau']:.3f}" for p in curve))
    print(json.dumps({key: results[key] for key in ("sample_efficiency", "tau_sample_efficiency")}, indent=1))


if __name__ == "__main__":
    main()
