"""Osprey in vLLM against vLLM's own speculative decoding, in interleaved rounds: vLLM alone, ngram (prompt lookup), a
draft model (the target's small sibling), an EAGLE-3 drafter (stock vLLM, `osprey export --format speculators`), an
Osprey drafter (the osprey-vllm plugin, `--format vllm`) at one draft length, and the same drafter with the draft
length per batch size that its export recommends (`osprey-schedule`: the export's `speculative_config.json`, or
`--schedule DIR` from `osprey tune`), each at every concurrency of `--concurrency`.

    python benchmarks/vllm/bench.py --target qwen2.5-coder-1.5b-instruct --drafter osprey=DIR --drafter eagle3=DIR \\
        --sps qwen2.5-coder-0.5b-instruct --per-category 1 --max-new-tokens 64 --concurrency 1 2 4 8 \\
        --output benchmarks/results/vllm-qwen2.5-coder-1.5b-instruct.json

First each speculative method's draft length (vLLM's `num_speculative_tokens`) is chosen on held-out prompts, never
the bench's (`held_out_prompts`: the next seeded prompt of each category, `--tune-prompts` of them evenly spaced), by
tokens/s at one request at a time (`osprey-schedule` keeps its schedule's); then every method decodes the bench's
prompts with its chosen length at each concurrency N: all the prompts, at most N in the engine at once. Every engine
is a subprocess in vLLM's environment (`osprey/serving/vllm_engine.py`, `--vllm-python`), vLLM's default
multi-process engine (engine core and worker in their own processes, as a server runs), without the prefix cache
(`job_of` says why), greedy, in the target's `--dtype`, eager (`enforce_eager`: an engine start without torch.compile
takes ~1 min here instead of 2-4); `--omp-threads-bind` and `--reserved-cpus` set vLLM's `VLLM_CPU_OMP_THREADS_BIND`
and `VLLM_CPU_NUM_OF_RESERVED_CPU`, and every record keeps the CPU settings its engine ran with. Each engine's result
is kept in `--work-dir`, so a rerun resumes. The bench runs `--rounds` rounds, each method's engine once per round,
vLLM alone first: a machine whose speed drifts over a run (this one's did, by more than the differences claimed)
moves every method of a round alike. tau is vLLM's mean acceptance length (1 + accepted draft tokens per draft, from
its spec-decode counters); a round's speedup is tokens/s over vLLM alone's in that round at the same concurrency, and
each record keeps the median over rounds with the rounds' minimum and maximum; "faster" or "slower" only where every
round agrees. With `--profile`, a separate in-process run at the largest concurrency times the target's and the
drafter's forward passes of those methods (where the time goes). Writes OUTPUT (`records`: method, concurrency, tau,
tokens_per_s, speedup, rounds, speedup_median / _min / _max; plus the tuning, the schedule, the profile and the
settings) and OUTPUT's .md and .png."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from osprey.decoding.decode import encode_prompt  # noqa: E402
from osprey.measuring.bench_suites import held_out_prompts, load_suite, select_subset  # noqa: E402
from osprey.models import zoo  # noqa: E402
from osprey.serving.export import SPECULATORS, VLLM, export_drafter  # noqa: E402
from osprey.serving.tune import find_vllm_python  # noqa: E402
from osprey.serving.tune import run_engine as run_engine_job  # noqa: E402
from osprey.serving.vllm_schedule import OSPREY_SPECULATIVE_OPTIONS, read_speculative_config  # noqa: E402

METHODS = ("vllm", "ngram", "draft-model", "eagle3", "osprey", "osprey-schedule")
DEFAULT_GRID = {"ngram": [3, 5], "draft-model": [3, 5], "eagle3": [2, 3, 4], "osprey": [2, 3, 4]}
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
SCHEDULE_KEYS = ("num_speculative_tokens", "num_speculative_tokens_per_batch_size")


def speculative_config(method: str, num_tokens: int, drafts: dict) -> dict | None:
    """vLLM's `speculative_config` for `method` drafting `num_tokens` tokens (None: the target alone;
    `osprey-schedule`: its schedule's config as it is)."""
    if method == "vllm":
        return None
    if method == "osprey-schedule":
        return drafts[method]
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_tokens, **NGRAM_LOOKUP}
    if method == "draft-model":
        return {"method": "draft_model", "model": drafts[method], "num_speculative_tokens": num_tokens}
    options = OSPREY_SPECULATIVE_OPTIONS if method == "osprey" else {}  # stock EAGLE-3 has no get_top_tokens
    return {"method": "eagle3", "model": drafts[method], "num_speculative_tokens": num_tokens, **options}


def engine_env(args) -> dict:
    """vLLM's CPU settings for every engine (part of each job, so a rerun with other settings reruns it)."""
    env = {}
    if args.omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_threads_bind
    if args.reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    return env


def run_engine(args, name: str, job: dict) -> dict:
    """Runs (or, when its result exists, resumes) one engine job in vLLM's environment."""
    job_path = Path(args.work_dir) / f"{name}.json"
    result_path = job_path.with_suffix(".result.json")
    if result_path.exists() and job_path.exists() and json.loads(job_path.read_text()) == job:
        return json.loads(result_path.read_text())
    print(f"[vllm bench] {name}", flush=True)
    try:
        return run_engine_job(job, job_path, args.vllm_python, env=job["env"])
    except RuntimeError as error:
        sys.exit(f"{name}: {error}")


def job_of(args, target_dir: str, config: dict | None, prompt_ids: list, concurrencies: list[int], **extra) -> dict:
    """One engine's job (osprey/serving/vllm_engine.py): the target in `--dtype`, eager, greedy, `--max-new-tokens`,
    without vLLM's prefix cache. Every phase sends the same prompts again; with the cache on, a phase after the first
    finds them cached, and vLLM resumes a resent prompt one cache block earlier with an EAGLE-style drafter (EAGLE-3,
    Osprey) than without (`v1/core/kv_cache_coordinator.py:replay_boundaries`), a 128-token block on CPUs: the bench
    would time the methods' unequal cache hits instead of the distinct requests a server sees."""
    return {
        "prefix_caching": False,
        "target": target_dir,
        "dtype": args.dtype,
        "speculative_config": config,
        "prompts": prompt_ids,
        "max_tokens": args.max_new_tokens,
        "phases": [{"concurrency": n} for n in concurrencies],
        "enforce_eager": True,
        "env": engine_env(args),
        **extra,
    }


def export_drafts(args) -> dict:
    """The draft checkpoints vLLM loads: exported Osprey and EAGLE-3 drafters, the draft model's folder; and
    `osprey-schedule`'s speculative config (the Osprey export's, with `--schedule`'s draft lengths)."""
    drafts = {"draft-model": str(zoo.resolve_model_path(args.sps))} if args.sps else {}
    for method, export_format in (("osprey", VLLM), ("eagle3", SPECULATORS)):
        if method not in args.drafters:
            continue
        source = args.drafters[method]
        output = Path(args.work_dir) / f"{method}-{export_format}"
        if not (output / "config.json").exists():
            export_drafter(source, export_format, output, target=args.target)
        drafts[method] = str(output)
    if "osprey" not in drafts:
        return drafts
    exported = Path(drafts["osprey"])
    if not (exported / "speculative_config.json").exists():
        sys.exit(f"{exported} predates speculative_config.json: delete it, and the bench exports the drafter again")
    config = read_speculative_config(exported)
    if args.schedule:
        tuned = read_speculative_config(args.schedule)
        config = {**config, **{key: tuned[key] for key in SCHEDULE_KEYS}}
    drafts["osprey-schedule"] = config
    return drafts


def encode(prompts, tokenizer) -> list[list[int]]:
    return [encode_prompt(tokenizer, prompt.text)[0].tolist() for prompt in prompts]


def tune(args, drafts, target_dir, prompt_ids) -> dict:
    """Each speculative method's tokens/s at concurrency 1 on the held-out prompts, per draft length; a method given
    one length (`--num-draft-tokens METHOD=N`) has nothing to choose and is not tuned."""
    tuning = {}
    for method, lengths in args.grid.items():
        if len(lengths) == 1:
            continue
        for num_tokens in lengths:
            job = job_of(args, target_dir, speculative_config(method, num_tokens, drafts), prompt_ids, [1])
            (phase,) = run_engine(args, f"tune-{method}-{num_tokens}", job)["phases"]
            tuning.setdefault(method, {})[num_tokens] = {"tau": phase["tau"], "tokens_per_s": phase["tokens_per_s"]}
    return tuning


def bench(args, drafts, target_dir, prompt_ids, chosen) -> list[dict]:
    """Each method's engine result, round by round: within a round every method runs once, vLLM alone first, so that
    a drift of the machine over the run reaches every method alike and each ratio pairs runs of one round."""
    rounds = []
    for round_index in range(args.rounds):
        results = {}
        for method in args.methods:
            config = speculative_config(method, chosen.get(method, 0), drafts)
            job = job_of(args, target_dir, config, prompt_ids, args.concurrency)
            name = f"bench-{method}" if round_index == 0 else f"bench-{method}-round{round_index + 1}"
            results[method] = run_engine(args, name, job)
        rounds.append(results)
    return rounds


def profile(args, drafts, target_dir, prompt_ids, chosen) -> dict:
    """Where the time goes at the largest concurrency: seconds in the target's and the drafter's forward passes, per
    method of `--profile` (engines in-process, timers around both models; a separate run from the bench's)."""
    profiles = {}
    concurrency = max(args.concurrency)
    for method in args.profile:
        config = speculative_config(method, chosen.get(method, 0), drafts)
        job = job_of(args, target_dir, config, prompt_ids, [concurrency], in_process=True, timers=True)
        (phase,) = run_engine(args, f"profile-{method}", job)["phases"]
        forward_time = {
            "target": {
                "calls": len(phase["steps"]),
                "tokens": sum(step["target_tokens"] for step in phase["steps"]),
                "seconds": sum(step["target_seconds"] for step in phase["steps"]),
            },
            "drafter": {
                "calls": sum(step["drafter_calls"] for step in phase["steps"]),
                "seconds": sum(step["drafter_seconds"] for step in phase["steps"]),
            },
        }
        steps = forward_time["target"]["calls"]
        profiles[method] = {
            "concurrency": concurrency,
            "seconds": phase["seconds"],
            "tokens_per_s": phase["tokens_per_s"],
            "tau": phase["tau"],
            "target_steps": steps,
            "target_tokens_per_step": forward_time["target"]["tokens"] / steps,
            "target_seconds_per_step": forward_time["target"]["seconds"] / steps,
            "forward_time": forward_time,
        }
    return profiles


def records_of(rounds: list[dict], chosen: dict) -> list[dict]:
    """One record per method and concurrency. Its speedup is the median over rounds of the method's tokens/s over
    vLLM alone's in the same round (`speedup_rounds`, with their minimum and maximum); tokens/s, τ and the rest are
    the median round's (by speedup)."""
    records = []
    for method in rounds[0]:
        for index, phase in enumerate(rounds[0][method]["phases"]):
            pairs = [(results[method]["phases"][index], results["vllm"]["phases"][index]) for results in rounds]
            speedups = [mine["tokens_per_s"] / alone["tokens_per_s"] for mine, alone in pairs]
            middle = sorted(range(len(pairs)), key=lambda r: speedups[r])[(len(pairs) - 1) // 2]  # lower middle
            (mine, alone), result = pairs[middle], rounds[middle][method]
            same = sum(a == b for a, b in zip(mine["outputs"], alone["outputs"]))
            records.append(
                {
                    "method": method,
                    "concurrency": phase["concurrency"],
                    "num_speculative_tokens": chosen.get(method),
                    "tau": mine["tau"],
                    "tokens_per_s": mine["tokens_per_s"],
                    "speedup": statistics.median(speedups),
                    "rounds": len(rounds),
                    "speedup_median": statistics.median(speedups),
                    "speedup_min": min(speedups),
                    "speedup_max": max(speedups),
                    "speedup_rounds": speedups,
                    "verdict": verdict(speedups) if method != "vllm" else None,
                    "new_tokens": mine["new_tokens"],
                    "seconds": mine["seconds"],
                    "accepted_per_position": mine["spec_decode"]["num_accepted_tokens_per_pos"],
                    "outputs_identical_to_vllm": f"{same}/{len(mine['outputs'])}",
                    "cpu_settings": {name: value for name, value in result.get("env", {}).items() if value is not None},
                }
            )
    return records


def verdict(speedups: list[float]) -> str:
    """A win where every round's ratio is above 1.0, a loss where every one is below, else within the spread."""
    if min(speedups) > 1.0:
        return "faster"
    if max(speedups) < 1.0:
        return "slower"
    return "within spread"


def _lengths_note(summary: dict) -> str:
    """How the static methods' draft lengths were set: tuned on held-out prompts, or given on the command line."""
    tuned = list(summary["tuning"])
    given = sorted(set(summary["chosen"]) - set(tuned) - {"osprey-schedule"})
    sentences = []
    if tuned:
        sentences.append(
            f"Draft lengths of {', '.join(tuned)} chosen on {summary['num_tune_prompts']} held-out prompts "
            "(tokens/s at concurrency 1)"
        )
    if given:
        sentences.append(f"Draft lengths of {', '.join(given)} given (--num-draft-tokens)")
    return ". ".join(sentences) or "No draft lengths"


def write_report(output: Path, summary: dict) -> None:
    lines = [
        f"# {summary['target']} in vLLM {summary['vllm_version']}: speculative methods, "
        f"{summary.get('rounds', 1)} interleaved round(s)",
        "",
        f"{summary['num_prompts']} prompts ({summary['prompts']}), greedy, {summary['max_new_tokens']} new tokens at "
        f"most, {summary['dtype']}, eager, {summary['device']}. {_lengths_note(summary)}; osprey-schedule drafts "
        f"{summary['schedule']['num_speculative_tokens_per_batch_size']} ([first batch size, last, draft length]; "
        f"{summary['schedule']['from']}). vLLM's engine: {summary['engine']}; CPU settings "
        f"{summary['cpu_settings'] or 'vLLM defaults'}.",
        "",
        "Speedup: the median over rounds of tokens/s over vLLM alone's in the same round, with the rounds' range; "
        "a method is faster or slower only where every round says so. τ, tokens/s and outputs: the median round's.",
        "",
        "| method | draft length | concurrency | τ | tokens/s | speedup (median) | rounds' range | verdict "
        "| outputs identical to vLLM alone |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in summary["records"]:
        tau = "" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(
            f"| {r['method']} | {r['num_speculative_tokens'] or ''} | {r['concurrency']} | {tau} | "
            f"{r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['speedup_min']:.2f}-{r['speedup_max']:.2f} | "
            f"{r['verdict'] or ''} | {r['outputs_identical_to_vllm']} |"
        )
    if summary.get("profile"):
        lines += [
            "",
            "Where the time goes (a separate, in-process run at the same concurrency, timers around both models):",
            "",
            "| method | tokens/s | target steps | tokens per target step | s per target step | target s | "
            "drafter s | other s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for method, p in summary["profile"].items():
            target_s = p["forward_time"]["target"]["seconds"]
            drafter_s = p["forward_time"].get("drafter", {}).get("seconds", 0.0)
            lines.append(
                f"| {method} | {p['tokens_per_s']:.2f} | {p['target_steps']} | {p['target_tokens_per_step']:.1f} | "
                f"{p['target_seconds_per_step']:.3f} | {target_s:.1f} | {drafter_s:.1f} | "
                f"{p['seconds'] - target_s - drafter_s:.1f} |"
            )
    if summary["tuning"]:
        lines += ["", "Tuning (held-out prompts, concurrency 1): tokens/s (τ) per draft length", ""]
    for method, by_length in summary["tuning"].items():
        cells = ", ".join(f"{n}: {v['tokens_per_s']:.2f} ({v['tau']:.2f})" for n, v in by_length.items())
        lines.append(f"- {method}: {cells}; chosen {summary['chosen'][method]}")
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")
    concurrencies = sorted({r["concurrency"] for r in summary["records"]})
    figure, axes = plt.subplots(1, len(concurrencies), figsize=(5 * len(concurrencies), 3.5), squeeze=False)
    for axis, concurrency in zip(axes[0], concurrencies):
        rows = [r for r in summary["records"] if r["concurrency"] == concurrency]
        spread = [[r["speedup"] - r["speedup_min"] for r in rows], [r["speedup_max"] - r["speedup"] for r in rows]]
        axis.bar([r["method"] for r in rows], [r["speedup"] for r in rows], yerr=spread, capsize=3, color="#4c72b0")
        axis.tick_params(axis="x", labelrotation=45)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(f"concurrency {concurrency}")
        axis.set_ylabel("speedup over vLLM alone (median, range)")
    figure.suptitle(f"{summary['target']} in vLLM ({summary['dtype']}, {summary['device']})")
    figure.tight_layout()
    figure.savefig(output.with_suffix(".png"), dpi=100)


def parse_grid(values: list[str]) -> dict:
    grid = dict(DEFAULT_GRID)
    for value in values:
        method, _, lengths = value.partition("=")
        if method not in DEFAULT_GRID or not lengths:
            raise SystemExit(f"--num-draft-tokens takes METHOD=N,N,... with METHOD one of {', '.join(DEFAULT_GRID)}")
        grid[method] = [int(n) for n in lengths.split(",")]
    return grid


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="zoo name or local directory of the target")
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="osprey=DIR (the Osprey drafter) and eagle3=DIR (the EAGLE-3 drafter), both in Osprey's format",
    )
    parser.add_argument("--sps", metavar="MODEL", help="the draft model: zoo name or directory")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="default: all")
    parser.add_argument("--prompts", action="append", metavar="SUITE", help="suites (default: the replication's four)")
    parser.add_argument("--per-category", type=int, default=1, help="bench prompts per category (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tune-prompts", type=int, default=8, help="held-out prompts for the tuning (default: 8)")
    parser.add_argument("--num-draft-tokens", action="append", default=[], metavar="METHOD=N,N", help="tuning grid")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds: every method once per round (default: 3)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent requests (default: 1 2 4 8)"
    )
    parser.add_argument("--schedule", metavar="DIR", help="osprey-schedule's draft lengths: `osprey tune --output DIR`")
    parser.add_argument("--omp-threads-bind", help="VLLM_CPU_OMP_THREADS_BIND for every engine (e.g. 0-1, auto)")
    parser.add_argument("--reserved-cpus", type=int, help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--profile",
        default="",
        help="methods whose time split at the largest concurrency is measured (e.g. vllm,osprey)",
    )
    parser.add_argument("--vllm-python", help="vLLM's Python (default: $OSPREY_VLLM_PYTHON, else .venv-vllm)")
    parser.add_argument("--work-dir", default=os.environ.get("RUNS", "/work/runs") + "/vllm-bench")
    parser.add_argument("--output", required=True, help="results JSON; .md and .png beside it")
    args = parser.parse_args(argv)
    try:
        args.vllm_python = args.vllm_python or str(find_vllm_python())
    except ValueError as error:
        raise SystemExit(str(error)) from None
    args.drafters = dict(value.split("=", 1) for value in args.drafter if "=" in value)
    if not set(args.drafters) <= {"eagle3", "osprey"} or len(args.drafters) != len(args.drafter):
        raise SystemExit("--drafter takes osprey=DIR and eagle3=DIR, once each")
    args.methods = [method for method in METHODS if method in args.methods or method == "vllm"]
    drafter_of = {"osprey": "osprey", "osprey-schedule": "osprey", "eagle3": "eagle3"}
    for method in args.methods:
        if method == "draft-model" and not args.sps:
            raise SystemExit("the draft-model method needs --sps MODEL (or leave it out of --methods)")
        if method in drafter_of and drafter_of[method] not in args.drafters:
            raise SystemExit(
                f"the {method} method needs --drafter {drafter_of[method]}=DIR (or leave it out of --methods)"
            )
    args.grid = {
        method: lengths for method, lengths in parse_grid(args.num_draft_tokens).items() if method in args.methods
    }
    if min(args.concurrency) < 1:
        raise SystemExit("--concurrency takes counts of at least 1")
    args.concurrency = sorted(set(args.concurrency))
    args.profile = [method for method in args.profile.split(",") if method]
    unknown = set(args.profile) - set(args.methods)
    if unknown:
        raise SystemExit(f"--profile takes methods of {', '.join(args.methods)}, not {', '.join(sorted(unknown))}")
    suites = args.prompts or ["spec_bench", "mt_bench", "humaneval", "mmath"]
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)

    target_dir = str(zoo.resolve_model_path(args.target))
    tokenizer = zoo.load_tokenizer(args.target)
    bench_prompts = [p for suite in suites for p in select_subset(load_suite(suite), args.per_category, args.seed)]
    held_out = held_out_prompts(suites, args.per_category, args.seed)
    stride = max(1, len(held_out) // args.tune_prompts)
    tune_prompts = held_out[::stride][: args.tune_prompts]
    drafts = export_drafts(args)

    tuning = tune(args, drafts, target_dir, encode(tune_prompts, tokenizer))
    chosen = {method: max(lengths, key=lambda n: lengths[n]["tokens_per_s"]) for method, lengths in tuning.items()}
    chosen |= {method: lengths[0] for method, lengths in args.grid.items() if len(lengths) == 1}
    if "osprey-schedule" in args.methods:
        chosen["osprey-schedule"] = drafts["osprey-schedule"]["num_speculative_tokens"]
    bench_ids = encode(bench_prompts, tokenizer)
    rounds = bench(args, drafts, target_dir, bench_ids, chosen)
    profiles = profile(args, drafts, target_dir, bench_ids, chosen)
    version = subprocess.run(
        [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    summary = {
        "target": args.target,
        "vllm_version": version,
        "device": f"{os.cpu_count()} CPU cores",
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "prompts": f"{', '.join(suites)}, {args.per_category} per category, seed {args.seed}",
        "num_prompts": len(bench_prompts),
        "num_tune_prompts": len(tune_prompts),
        "tune_prompt_categories": [p.category for p in tune_prompts],
        "drafts": {**args.drafters, "draft-model": args.sps},
        "engine": "multi-process (vLLM's default), prefix cache off",
        "ngram": NGRAM_LOOKUP,
        "concurrency": args.concurrency,
        "methods": args.methods,
        "schedule": {
            "num_speculative_tokens_per_batch_size": drafts.get("osprey-schedule", {}).get(
                "num_speculative_tokens_per_batch_size"
            ),
            "from": args.schedule
            or "the Osprey export's speculative_config.json (osprey.serving.vllm_schedule's default)",
        },
        "cpu_settings": engine_env(args),
        "tuning": tuning,
        "chosen": chosen,
        "rounds": args.rounds,
        "records": records_of(rounds, chosen),
        "profile": profiles,
    }
    output = Path(args.output)
    output.write_text(json.dumps(summary, indent=1) + "\n")
    write_report(output, summary)
    print(output.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
