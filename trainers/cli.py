"""The training stages' `osprey` subcommands: `data`, `pretrain`, `features`, `distill` and `regenerate`.

Importing this module is cheap: each stage's module (and TRL, datasets) is imported only when its command runs.
`pretrain`, `features` and `distill` are `trl.TrlParser` scripts, so everything after the command goes to TrlParser
unchanged: `--config config.yaml` (YAML whose keys are the flags' names) and `--flag value` overrides, as in TRL.
"""

import argparse
import importlib
from pathlib import Path

from osprey.ground import CORPUS_NAMES

TRL_STAGES = {
    "pretrain": ("trainers.pretrain", "train a pruned backbone on general text (stage 2)"),
    "features": ("trainers.features.feature_cache", "precompute a target's features for distillation"),
    "distill": ("trainers.distill", "distill a converted drafter against its target with TTT (stage 4)"),
    "regenerate": ("trainers.corpora.regenerate", "answer a chat corpus with the target itself (distillation data)"),
}


def add_subcommand(subparsers) -> None:
    """Adds `osprey data` and the TrlParser stages: `pretrain`, `features`, `distill`, `regenerate` (`osprey.cli`)."""
    for name, (module, help_text) in TRL_STAGES.items():
        # No option is parsed here (`prefix_chars` avoids "-"): TrlParser gets the arguments, `--help` included.
        parser = subparsers.add_parser(name, help=help_text, add_help=False, prefix_chars="+")
        parser.add_argument("argv", nargs=argparse.REMAINDER)
        parser.set_defaults(run=lambda args, module=module: importlib.import_module(module).main(args.argv))

    parser = subparsers.add_parser(
        "data",
        help=f"build the offline training corpora ({', '.join(CORPUS_NAMES)}), or the evaluation prompts' fingerprints",
    )
    parser.add_argument(
        "corpus",
        choices=(*CORPUS_NAMES, "eval-fingerprints"),
        help="which corpus to build; eval-fingerprints: write the fingerprints of the Spec-Bench and MT-Bench prompts "
        "that sharegpt keeps out, shipped with the package, from the data folder",
    )
    parser.add_argument("--cache-dir", help="cache root (default: $OSPREY_HOME or ~/.cache/osprey)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the corpus is already built")
    parser.add_argument(
        "--exclude-prompts",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="sharegpt: JSONL files of evaluation prompts (a `turns` list per line) whose conversations are dropped "
        "in addition to Spec-Bench's and MT-Bench's, whose fingerprints ship with the package",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="eval-fingerprints: folder with spec_bench/question.jsonl and mt_bench/<lang>.jsonl (default: "
        "$OSPREY_DATA_DIR or ../shared/data beside the repository)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        metavar="FILE",
        help="eval-fingerprints: where to write them (default: the package's, trainers/eval_prompt_fingerprints.json)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="MODEL",
        help="multilingual: also count tokens per language group and split with this model's tokenizer (zoo name or "
        "directory), recorded in the manifest",
    )
    parser.add_argument(
        "--lock",
        type=Path,
        metavar="MANIFEST",
        help="multilingual: an earlier build's manifest.json; packages whose version or SHA-256 differ are reported",
    )
    parser.add_argument(
        "--max-per-language",
        type=int,
        metavar="N",
        help="multilingual-chat: training openings kept per language (default: 400)",
    )
    parser.add_argument(
        "--max-test-per-language",
        type=int,
        metavar="N",
        help="multilingual-chat: held-out openings kept per language (default: 10)",
    )
    parser.set_defaults(run=_run_data)


def _run_data(args) -> int:
    from .corpora.general import prepare_general
    from .corpora.multilingual import prepare_multilingual
    from .corpora.multilingual_chat import prepare_multilingual_chat
    from .corpora.sharegpt import EVAL_PROMPT_FINGERPRINTS, prepare_sharegpt, write_eval_fingerprints

    if args.corpus != "eval-fingerprints" and (args.data_dir or args.output):
        raise ValueError("--data-dir and --output apply to eval-fingerprints only.")
    if args.corpus == "eval-fingerprints":
        print(write_eval_fingerprints(args.data_dir, args.output or EVAL_PROMPT_FINGERPRINTS))
        return 0
    if args.corpus != "multilingual" and (args.tokenizer or args.lock):
        raise ValueError("--tokenizer and --lock apply to the multilingual corpus only.")
    caps = {"max_per_language": args.max_per_language, "max_test_per_language": args.max_test_per_language}
    caps = {name: value for name, value in caps.items() if value is not None}
    if args.corpus != "multilingual-chat" and caps:
        raise ValueError("--max-per-language and --max-test-per-language apply to the multilingual-chat corpus only.")
    if args.corpus == "general":
        print(prepare_general(args.cache_dir, force=args.force))
    elif args.corpus == "multilingual":
        print(prepare_multilingual(args.cache_dir, force=args.force, tokenizer=args.tokenizer, lock=args.lock))
    elif args.corpus == "multilingual-chat":
        print(prepare_multilingual_chat(args.cache_dir, force=args.force, **caps))
    else:
        print(prepare_sharegpt(args.cache_dir, force=args.force, exclude_prompt_files=args.exclude_prompts))
    return 0
