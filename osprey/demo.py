"""`osprey demo`: the main job on an embedded default. A trained Osprey drafter ships inside the package as a compact
checkpoint (int8 rows, under 50 MB); the demo fetches its target from the zoo and decodes a few prompts of several
categories and languages with the drafter and with the target alone, in one process, printing τ and the speedup.

The compact format stores every weight matrix as int8 with one float32 scale per row (symmetric absmax), everything
else as it is: `OspreyForDrafting` weights are rebuilt by `load_compact_drafter`. Verification stays lossless with a
quantized drafter: only how often drafts are accepted can change. `osprey demo --pack DRAFTER --output DIR` makes
such a checkpoint from any saved drafter.
"""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modeling_osprey import OspreyConfig, OspreyForDrafting

from .bench import BenchMethod, BenchSettings, run_benchmark
from .bench_report import markdown_table, save_report
from .bench_suites import BenchPrompt
from .prune import require_empty_output_dir


DEMO_DRAFTER_DIR = Path(__file__).parent / "demo_drafter"
COMPACT_WEIGHTS = "drafter-int8.safetensors"
SCALE_SUFFIX = ".int8_row_scale"
# Early stop after an unsure draft: on the pilot it kept 98% of τ for a quarter of the draft steps (docs/results.md).
DEMO_CONFIDENCE_THRESHOLD = 0.3

# Written for this demo: short, one per category, several languages.
DEMO_PROMPTS = [
    BenchPrompt("demo", "chat", "chat", "Give me three tips for staying focused while working from home."),
    BenchPrompt("demo", "code", "code", "Write a Python function that checks whether a string is a palindrome."),
    BenchPrompt("demo", "math", "math", "A train travels 120 km in 1.5 hours. What is its average speed? Explain."),
    BenchPrompt("demo", "summarization", "summarization", (
        "Summarize in one sentence: The city council voted on Tuesday to extend the bike lane network by 40 km over "
        "the next three years, funded by a mix of state grants and parking fees, after months of public hearings."
    )),  # fmt: skip
    BenchPrompt("demo", "translation", "translation", "Translate into French: The library opens at nine every morning."),
    BenchPrompt("demo", "german", "german", "Erkläre in zwei Sätzen, warum der Himmel blau ist."),
]


def pack_compact_drafter(drafter_dir: str | os.PathLike, output_dir: str | os.PathLike, target: str) -> Path:
    """Writes `drafter_dir`'s weights as int8 rows + scales, its config and generation config, and `demo.json`
    naming `target` (the zoo name or Hub id the demo loads) to `output_dir`."""
    output_dir = require_empty_output_dir(output_dir)
    drafter = OspreyForDrafting.from_pretrained(drafter_dir, dtype=torch.float32)
    output_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in drafter.state_dict().items():
        if tensor.is_floating_point() and tensor.dim() == 2:  # matrices; norms and index buffers stay
            scale = tensor.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            tensors[name] = torch.round(tensor / scale).to(torch.int8)
            tensors[name + SCALE_SUFFIX] = scale.squeeze(1)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, output_dir / COMPACT_WEIGHTS, metadata={"format": "osprey-int8-rows"})
    drafter.config.to_json_file(output_dir / "config.json")  # JSON only: the package provides OspreyConfig
    drafter.generation_config.save_pretrained(output_dir)
    (output_dir / "demo.json").write_text(json.dumps({"target": target}, indent=1) + "\n")
    for name in ("alignment_report.json", "trainer_state.json"):
        if (Path(drafter_dir) / name).is_file():
            shutil.copy(Path(drafter_dir) / name, output_dir / name)
    return output_dir


def load_compact_drafter(directory: str | os.PathLike = DEMO_DRAFTER_DIR, dtype=torch.float32) -> OspreyForDrafting:
    """The `OspreyForDrafting` stored by `pack_compact_drafter` in `directory`, dequantized to `dtype`."""
    directory = Path(directory)
    weights_path = directory / COMPACT_WEIGHTS
    if not weights_path.is_file():
        raise ValueError(
            f"{directory} holds no {COMPACT_WEIGHTS}: pass a directory written by `osprey demo --pack`, or a regular "
            "drafter directory to `osprey decode` / `osprey bench`."
        )
    stored = load_file(weights_path)
    state_dict = {}
    for name, tensor in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = stored.get(name + SCALE_SUFFIX)
        state_dict[name] = tensor.float() * scale[:, None] if scale is not None else tensor
    config = OspreyConfig.from_pretrained(directory)
    drafter = OspreyForDrafting(config)
    drafter.load_state_dict(state_dict, strict=True)
    drafter.generation_config = drafter.generation_config.from_pretrained(directory)
    return drafter.to(dtype).eval()


def run_demo(
    target_name: str, drafter_dir, max_new_tokens: int, dtype: torch.dtype, confidence_threshold: float, output=None
) -> dict:
    """Decodes `DEMO_PROMPTS` with the target alone and with the compact drafter; returns `run_benchmark`'s results."""
    from .zoo import load_causal_lm, load_tokenizer

    drafter = load_compact_drafter(drafter_dir, dtype)
    target, tokenizer = load_causal_lm(target_name, dtype=dtype).eval(), load_tokenizer(target_name)
    if target.config.get_text_config().vocab_size != drafter.config.vocab_size:
        raise ValueError(
            f"The demo drafter was converted for a target with {drafter.config.vocab_size} tokens, but {target_name} "
            f"has {target.config.get_text_config().vocab_size}: pass the target it was made for (--target)."
        )
    methods = [BenchMethod("target", "target"), BenchMethod("osprey", f"drafter:{drafter_dir}", drafter=drafter)]
    settings = BenchSettings(max_new_tokens=max_new_tokens, confidence_threshold=confidence_threshold)
    results = run_benchmark(target, tokenizer, methods, DEMO_PROMPTS, settings, output_path=output, target_name=target_name)
    if output is not None:
        save_report(results, Path(output))
    return results


def add_subcommand(subparsers) -> None:
    """Adds `osprey demo` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "demo", help="speculative decoding with the packaged trained drafter vs. plain decoding: τ and speedup"
    )
    parser.add_argument("--target", help="zoo name, directory or Hub id (default: the one in the drafter's demo.json)")
    parser.add_argument("--drafter", default=str(DEMO_DRAFTER_DIR), help="compact drafter directory")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--confidence-threshold", type=float, default=DEMO_CONFIDENCE_THRESHOLD,
        help="end a draft chain after a draft the drafter gave less than this probability (0: full chains of 5)",
    )  # fmt: skip
    parser.add_argument("--output", help="also save the results JSON (and .md, .png) here")
    parser.add_argument("--pack", metavar="DRAFTER", help="instead: write DRAFTER as a compact checkpoint to --output")
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    if args.pack:
        if not args.output or not args.target:
            raise ValueError("--pack needs --output (an empty or new directory) and --target (what the demo loads).")
        output = pack_compact_drafter(args.pack, args.output, args.target)
        size = sum(path.stat().st_size for path in output.iterdir())
        print(f"compact drafter written to {output} ({size / 2**20:.1f} MiB)")
        return 0
    demo_file = Path(args.drafter) / "demo.json"
    target = args.target or (json.loads(demo_file.read_text())["target"] if demo_file.is_file() else None)
    if not target:
        raise ValueError(f"{args.drafter} has no demo.json naming its target: pass --target.")
    results = run_demo(
        target, args.drafter, args.max_new_tokens, getattr(torch, args.dtype), args.confidence_threshold, args.output
    )
    print(markdown_table(results))
    return 0
