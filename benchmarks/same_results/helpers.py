"""Helpers of `run.sh`: the tiny models `osprey bench` runs on, an adapt run folder rebuilt from a committed record,
and a bench results file with its wall-clock fields masked.

    python helpers.py models CHECKOUT OUT     # a tiny Llama target (character tokenizer), its drafter, prompts
    python helpers.py run-dir RECORD OUT      # OUT/adapt.json and OUT/wall_clock_s, as `osprey adapt` wrote them
    python helpers.py mask RESULTS            # RESULTS with its timings replaced by "<timing>", to stdout
"""

import json
import sys
from pathlib import Path

# Fields a bench results file fills from the clock: they differ from run to run, everything else must not.
TIMING = {"wall_time_s", "tokens_per_s", "time_split_s", "time_split", "speedup"}
PROMPTS = [
    ("chat", "hello there, how are you"),
    ("chat", "abc abc abc abc"),
    ("code", "def f(x): return x + 1"),
    ("code", "for i in range(10): print(i)"),
]


def models(checkout: Path, out: Path) -> None:
    """The tests' near-copy pair (most drafts accepted, some not), seeded: the same files from every checkout."""
    sys.path[:0] = [str(checkout / "tests"), str(checkout)]
    from test_decoding import near_copy_pair
    from test_trainers import char_tokenizer

    target, drafter = near_copy_pair("llama")
    target.save_pretrained(out / "target")
    char_tokenizer().save_pretrained(out / "target")
    drafter.save_pretrained(out / "drafter")
    lines = [json.dumps({"prompt": prompt, "category": category}) + "\n" for category, prompt in PROMPTS]
    (out / "prompts.jsonl").write_text("".join(lines))


def run_dir(record_path: Path, out: Path) -> None:
    """What `benchmarks/adapt/record.py` reads of a run folder, from the record it wrote (its stages' minutes,
    token-passes, answers, settings and speed check)."""
    record = json.loads(record_path.read_text())
    stages = {name: {"minutes": minutes} for name, minutes in record["stages_minutes"].items()}
    stages["distill"]["token_passes"] = record["token_passes"]
    check = record["adapt_speed_check"]
    stages["evaluate"].update(decoding=record["demo_decoding"], speedup=check["speedup"], speed_tau=check["tau"])
    stages["answers"].update(answers=record["answers"], answer_tokens=record["answer_tokens"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapt.json").write_text(json.dumps({"stages": stages, "settings": record["settings"]}))
    if record.get("wall_clock_minutes") is not None:
        (out / "wall_clock_s").write_text(str(round(record["wall_clock_minutes"] * 60)))


def mask(value):
    if isinstance(value, dict):
        return {key: "<timing>" if key in TIMING else mask(item) for key, item in value.items()}
    if isinstance(value, list):
        return [mask(item) for item in value]
    return value


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "models":
        models(Path(args[0]), Path(args[1]))
    elif command == "run-dir":
        run_dir(Path(args[0]), Path(args[1]))
    else:
        print(json.dumps(mask(json.loads(Path(args[0]).read_text())), indent=1))
