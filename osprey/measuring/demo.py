"""`osprey demo`: the main job on an embedded default. A trained Osprey drafter ships inside the package, packed under
50 MB (`osprey.models.pack`): for Qwen2.5-Coder-1.5B-Instruct, its 2-block Qwen2.5-Coder-0.5B backbone packed against
that zoo model. The demo fetches the target (and the packed drafter's reference model) from the zoo on first use, then
decodes a few prompts of several categories and languages with the drafter and with the target alone, in one process,
printing τ and the speedup with the decoding settings measured best for that drafter on held-out prompts. `--drafter`
runs any other drafter (packed or not) instead, e.g. the SmolLM2 pilot kept in the repository (`REPOSITORY_DRAFTERS`).
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modeling_osprey.generation_osprey import DRAFTING_SETTINGS

from ..models.compact import PACK_MANIFEST, read_manifest
from ..models.pack import DRAFTER_QUANTIZATIONS, load_drafter
from ..models.zoo import ZOO, is_cached, load_causal_lm, load_tokenizer
from .bench import run_benchmark
from .bench_report import add_allow_unchecked_argument, exit_status, markdown_table, save_report
from .bench_suites import BenchPrompt
from .methods import BenchMethod, BenchSettings

QWEN_DEMO_DRAFTER_DIR = Path(__file__).parent.parent / "demo_drafter_qwen"
# Drafters kept in the repository, not shipped (paths in a clone): the SmolLM2 pilot is slower than its target alone.
REPOSITORY_DRAFTERS = {"smollm2-135m-instruct": "benchmarks/checkpoints/pilot-smollm2-135m-instruct"}
# Early stop after an unsure draft, for a --drafter the user gives (chains): it keeps nearly all of τ and skips most
# draft steps (docs/results.md, "Early stop").
DEMO_CONFIDENCE_THRESHOLD = 0.3


@dataclass(frozen=True)
class DemoChoice:
    """A shipped drafter and how the demo decodes with it: dtype and `BenchSettings` fields, measured."""

    drafter_dir: Path
    dtype: str = "float32"
    settings: dict = field(default_factory=dict)


DEMO_TARGET = "qwen2.5-coder-1.5b-instruct"
# The decoding shape measured best on held-out prompts for a drafter from the Qwen2.5 backbone on a CPU: a tree of
# depth 5, branching 3, 8 nodes, with a prompt-lookup branch of up to 8 tokens, the drafter's linear layers in int8,
# the target in bfloat16 (the grid and its figures: docs/results.md, "Figures moved out of code comments").
TREE_DECODING = dict(
    dtype="bfloat16",
    num_draft_tokens=5,
    draft_topk=3,
    tree_size=8,
    prompt_lookup_num_tokens=8,
    drafter_quantization="int8",
)
# A drafter folder may record the shape it was measured with (`osprey adapt` writes it): `osprey demo --drafter`
# decodes with it.
DECODING_NAME = "osprey_decoding.json"


def decoding_shape(device: str | None = None) -> dict:
    """The decoding shape a new drafter is measured and demonstrated with: `TREE_DECODING`, without int8 (a CPU-only
    kernel) on a GPU."""
    shape = dict(TREE_DECODING)
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu":
        shape["drafter_quantization"] = "none"
    return shape


def _choice(shape: dict, drafter_dir: Path) -> DemoChoice:
    settings = dict(shape)
    return DemoChoice(drafter_dir, settings.pop("dtype", "float32"), settings)


DEMOS = {"qwen2.5-coder-1.5b-instruct": _choice(TREE_DECODING, QWEN_DEMO_DRAFTER_DIR)}


def demo_choice(drafter_dir) -> DemoChoice:
    """How the demo decodes with a drafter the user gives: the shape recorded beside it (`DECODING_NAME`), else
    chains that stop early after an unsure draft."""
    recorded = Path(drafter_dir) / DECODING_NAME
    if recorded.is_file():
        return _choice(json.loads(recorded.read_text()), Path(drafter_dir))
    return DemoChoice(Path(drafter_dir), settings=dict(confidence_threshold=DEMO_CONFIDENCE_THRESHOLD))


# The settings `osprey demo` takes as flags: the drafting settings, and how the drafter runs.
SETTING_FLAGS = (*DRAFTING_SETTINGS, "drafter_quantization")

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
    target_name: str | None = None,
    drafter_dir=None,
    max_new_tokens: int = 96,
    dtype: torch.dtype | None = None,
    output=None,
    **overrides,
) -> dict:
    """Decodes `DEMO_PROMPTS` with the target alone and with the drafter; returns `run_benchmark`'s results.

    Without `drafter_dir` the drafter shipped for `target_name` (default `DEMO_TARGET`) runs with its measured
    settings (`DEMOS`); a given drafter decodes for the target it records unless `target_name` says otherwise, with
    chains stopping early. `overrides` (`SETTING_FLAGS`, None = the default) change the decoding settings."""
    if drafter_dir is None:
        target_name = target_name or DEMO_TARGET
        if target_name not in DEMOS:
            kept = REPOSITORY_DRAFTERS.get(target_name)
            hint = f"--drafter {kept} (in a clone of the repository), or " if kept else "--drafter DIR, "
            raise ValueError(
                f"No drafter ships for {target_name!r} (shipped: {', '.join(DEMOS)}): pass {hint}one made for it "
                "with `osprey convert` and `osprey distill`."
            )
        choice = DEMOS[target_name]
    else:
        choice = demo_choice(drafter_dir)
    dtype = dtype or getattr(torch, choice.dtype)
    chosen = choice.settings | {name: value for name, value in overrides.items() if value is not None}
    _announce_fetches(choice.drafter_dir, target_name)
    drafter = load_drafter(choice.drafter_dir, dtype, quantization=chosen.get("drafter_quantization", "none"))
    target_name = target_name or drafter.config.target_name_or_path
    if not target_name:
        raise ValueError(f"{choice.drafter_dir} does not record the target it was converted for: pass --target.")
    _announce_fetches(None, target_name)
    target, tokenizer = load_causal_lm(target_name, dtype=dtype).eval(), load_tokenizer(target_name)
    drafter.config.check_target(target, name_or_path=target_name)
    shape = DRAFTING_SETTINGS | chosen
    drafts_trees = shape["draft_topk"] > 1 or shape["prompt_lookup_num_tokens"] > 0
    if drafts_trees and overrides.get("confidence_threshold") is None:
        chosen["confidence_threshold"] = 0.0  # early stop is for chains; a tree is pruned by its size
    settings = BenchSettings(max_new_tokens=max_new_tokens, **chosen)
    results = against_target_alone(
        target, tokenizer, drafter, choice.drafter_dir, DEMO_PROMPTS, settings, output, target_name
    )
    if output is not None:
        save_report(results, Path(output))
    return results


def against_target_alone(
    target, tokenizer, drafter, drafter_dir, prompts, settings: BenchSettings, output=None, target_name=None
) -> dict:
    """`run_benchmark` of the target alone and of `drafter` (trees and a prompt-lookup branch as `settings` say), the
    two interleaved per prompt: the demo's comparison, and `osprey adapt`'s speed check."""
    osprey = BenchMethod(
        "osprey",
        f"drafter:{drafter_dir}",
        drafter=drafter,
        tree=settings.draft_topk > 1,
        lookup=settings.prompt_lookup_num_tokens > 0,
    )
    methods = [BenchMethod("target", "target"), osprey]
    return run_benchmark(target, tokenizer, methods, prompts, settings, output_path=output, target_name=target_name)


def _announce_fetches(drafter_dir: Path | None, target_name: str | None) -> None:
    """Says which zoo models the first run builds (minutes each on 2 cores): the target, and the model a drafter
    packed against a reference rebuilds its frozen tensors from."""
    names = [target_name] if drafter_dir is None else []
    if drafter_dir is not None and (Path(drafter_dir) / PACK_MANIFEST).is_file():
        names.append(read_manifest(Path(drafter_dir))["reference"])
    for name in names:
        if name in ZOO and not is_cached(name):
            print(f"Fetching {name} from the model zoo (first run only; ~1-3 min on 2 cores) ...", file=sys.stderr)


def add_subcommand(subparsers) -> None:
    """Adds `osprey demo` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "demo", help="speculative decoding with a packaged trained drafter vs. plain decoding: τ and speedup"
    )
    parser.add_argument(
        "--target",
        help=f"zoo name, directory or Hub id (default: {DEMO_TARGET}, or the target --drafter names); shipped "
        f"drafters: {', '.join(DEMOS)}",
    )
    parser.add_argument("--drafter", help="drafter directory (default: the one shipped for the target)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the shipped drafter's (or float32)")
    parser.add_argument(
        "--num-draft-tokens", type=int, help="chain length / tree depth (default: measured per drafter)"
    )
    parser.add_argument("--draft-topk", type=int, help="tree branching, 1 for chains (default: measured per drafter)")
    parser.add_argument("--tree-size", type=int, help="draft tree nodes verified per step (default: measured)")
    parser.add_argument(
        "--prompt-lookup-num-tokens", type=int, help="prompt-lookup branch length, 0 for none (default: measured)"
    )
    parser.add_argument(
        "--confidence-threshold",
        type=float,
        help=f"end a draft chain after a draft below this probability (default: {DEMO_CONFIDENCE_THRESHOLD} for "
        "chains, 0 for trees)",
    )
    parser.add_argument(
        "--drafter-quantization",
        choices=DRAFTER_QUANTIZATIONS,
        help="int8: the drafter's linear layers as dynamic int8, on a CPU (default: measured per drafter)",
    )
    parser.add_argument("--output", help="also save the results JSON (and .md, .png) here")
    add_allow_unchecked_argument(parser)
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    results = run_demo(
        args.target,
        args.drafter,
        args.max_new_tokens,
        getattr(torch, args.dtype) if args.dtype else None,
        args.output,
        **{name: getattr(args, name) for name in SETTING_FLAGS},
    )
    print(markdown_table(results))
    return exit_status(results, args.allow_unchecked)  # 1 on a difference rounding does not explain, or unchecked
