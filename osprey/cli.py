"""The `osprey` command line: one subcommand per pipeline stage, each defined by the module that implements it.

A stage joins the CLI by adding its module to `SUBCOMMAND_MODULES` and defining `add_subcommand(subparsers)` there,
which adds its parser and sets a `run` default: a callable taking the parsed arguments and returning the exit code.
A `ValueError` from a stage means bad input: it is reported in one line on stderr with exit code 2, like argparse's
own usage errors, rather than as a traceback; an `OSError` (a file, the network, the Hub) is one line too, with exit
code 1. `osprey --debug COMMAND ...` shows the traceback instead.

This is the one module that may import every floor (`trainers` included); see the layout in README.md.
"""

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "osprey.models.zoo",  # fetch
    "osprey.stages.prune",  # stage 1
    "trainers.cli",  # stages 2 and 4: data, pretrain, features, distill
    "osprey.stages.convert",  # stage 3
    "osprey.stages.baselines",  # the controls Osprey is measured against
    "osprey.decoding.decode",  # stage 5
    "osprey.measuring.bench",
    "osprey.serving.export",  # to vLLM / SGLang
    "osprey.serving.tune",  # the draft length per batch size for vLLM
    "osprey.models.hub",  # push
    "osprey.measuring.demo",  # the main job on the packaged drafter
    "trainers.adapt",  # stages 3 to 5 for a user's target, in one command
    "osprey.models.pack",  # pack, unpack
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="osprey", description="Target-agnostic pretrained drafters for lossless speculative decoding."
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_subcommand(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        if args.debug:
            raise
        print(f"osprey {args.command}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if args.debug:
            raise
        print(f"osprey {args.command}: error: {' '.join(str(error).split())} (--debug shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
