"""`osprey demo`: the main job on an embedded default. A trained Osprey drafter ships inside the package, packed
(int8 rows, under 50 MB, `osprey.pack`); the demo fetches the target it names from the zoo and decodes a few prompts
of several categories and languages with the drafter and with the target alone, in one process, printing τ and the
speedup. `--drafter` runs any other drafter (packed or not) instead.
"""

from pathlib import Path

import torch

from .bench import BenchMethod, BenchSettings, run_benchmark
from .bench_report import markdown_table, save_report
from .bench_suites import BenchPrompt
from .pack import load_drafter
from .zoo import load_causal_lm, load_tokenizer

DEMO_DRAFTER_DIR = Path(__file__).parent / "demo_drafter"
# Early stop after an unsure draft: on the pilot it kept 98% of τ for a quarter of the draft steps (docs/results.md).
DEMO_CONFIDENCE_THRESHOLD = 0.3

# Written for this demo: short, one per category, several languages.
DEMO_PROMPTS = [
    BenchPrompt("demo", "chat", "chat", "Give me three tips for staying focused while working from home."),
    BenchPrompt("demo", "code", "code", "Write a Python function that checks whether a string is a palindrome."),
    BenchPrompt("demo", "math", "math", "A train travels 120 km in 1.5 hours. What is its average speed? Explain."),
    BenchPrompt(
        "demo",
        "summarization",
        "summarization",
        (
            "Summarize in one sentence: The city council voted on Tuesday to extend the bike lane network by 40 km "
            "over the next three years, funded by a mix of state grants and parking fees, after months of public "
            "hearings."
        ),
    ),
    BenchPrompt(
        "demo", "translation", "translation", "Translate into French: The library opens at nine every morning."
    ),
    BenchPrompt("demo", "german", "german", "Erkläre in zwei Sätzen, warum der Himmel blau ist."),
]


def run_demo(
    target_name: str | None,
    drafter_dir,
    max_new_tokens: int,
    dtype: torch.dtype,
    confidence_threshold: float,
    output=None,
) -> dict:
    """Decodes `DEMO_PROMPTS` with the target alone and with the drafter; returns `run_benchmark`'s results. The
    target defaults to the one the drafter records (`target_name_or_path`)."""
    drafter = load_drafter(drafter_dir, dtype)
    target_name = target_name or drafter.config.target_name_or_path
    if not target_name:
        raise ValueError(f"{drafter_dir} does not record the target it was converted for: pass --target.")
    target, tokenizer = load_causal_lm(target_name, dtype=dtype).eval(), load_tokenizer(target_name)
    drafter.config.check_target(target, name_or_path=target_name)
    methods = [BenchMethod("target", "target"), BenchMethod("osprey", f"drafter:{drafter_dir}", drafter=drafter)]
    settings = BenchSettings(max_new_tokens=max_new_tokens, confidence_threshold=confidence_threshold)
    results = run_benchmark(
        target, tokenizer, methods, DEMO_PROMPTS, settings, output_path=output, target_name=target_name
    )
    if output is not None:
        save_report(results, Path(output))
    return results


def add_subcommand(subparsers) -> None:
    """Adds `osprey demo` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "demo", help="speculative decoding with the packaged trained drafter vs. plain decoding: τ and speedup"
    )
    parser.add_argument("--target", help="zoo name, directory or Hub id (default: the target the drafter names)")
    parser.add_argument(
        "--drafter", default=str(DEMO_DRAFTER_DIR), help="drafter directory (default: the packaged one)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--confidence-threshold",
        type=float,
        default=DEMO_CONFIDENCE_THRESHOLD,
        help="end a draft chain after a draft the drafter gave less than this probability (0: full chains of 5)",
    )
    parser.add_argument("--output", help="also save the results JSON (and .md, .png) here")
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    results = run_demo(
        args.target,
        args.drafter,
        args.max_new_tokens,
        getattr(torch, args.dtype),
        args.confidence_threshold,
        args.output,
    )
    print(markdown_table(results))
    return 0
