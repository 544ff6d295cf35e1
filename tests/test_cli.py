"""One command-line vocabulary: hyphenated flags, the same name for the same thing in every command (README's
table), TRL's underscore spellings as aliases, and `--debug` for the traceback a one-line error hides."""

import argparse

import pytest
from trl import TrlParser

from osprey.cli import build_parser, main
from trainers.corpora.regenerate import RegenerateArguments
from trainers.distill import DistillScriptArguments, OspreyDistillConfig
from trainers.features.feature_cache import FeatureCacheArguments
from trainers.pretrain import OspreyPretrainConfig, PretrainScriptArguments

# The things several commands take, and the one flag each is spelled with.
SHARED = {
    "target": "--target",
    "drafter": "--drafter",
    "backbone": "--backbone",
    "output": "--output",
    "prompts": "--prompts",
}
TRL_COMMANDS = ("pretrain", "features", "distill", "regenerate")


def argparse_commands() -> dict[str, argparse.ArgumentParser]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: parser for name, parser in subparsers.choices.items() if name not in TRL_COMMANDS}


def test_argparse_commands_speak_one_vocabulary():
    commands = argparse_commands()
    expected = {"prune", "convert", "decode", "bench", "export", "push", "baseline", "demo", "pack", "unpack", "adapt"}
    assert expected <= set(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            flags = [flag for flag in action.option_strings if flag.startswith("--")]
            assert all("_" not in flag for flag in flags), (name, flags)
            if action.dest in SHARED:
                assert flags and flags[0] == SHARED[action.dest], (name, action.dest, flags)  # never positional


@pytest.mark.parametrize(
    "dataclasses, argv, expected",
    [
        (
            (DistillScriptArguments, OspreyDistillConfig),
            ["--drafter", "d", "--target", "t", "--output", "o", "--feature-cache", "f"],
            {"drafter": "d", "target_model": "t", "output_dir": "o", "feature_cache": "f"},
        ),
        (
            (DistillScriptArguments, OspreyDistillConfig),
            ["--drafter", "d", "--target_model", "t", "--output_dir", "o", "--feature_cache", "f"],  # TRL's spelling
            {"drafter": "d", "target_model": "t", "output_dir": "o", "feature_cache": "f"},
        ),
        (
            (PretrainScriptArguments, OspreyPretrainConfig),
            ["--backbone", "b", "--output", "o", "--dataset-name", "general", "--max-steps", "3"],
            {"model_name_or_path": "b", "output_dir": "o", "dataset_name": "general", "max_steps": 3},
        ),
        (
            (RegenerateArguments,),
            ["--target", "t", "--output", "o", "--dataset-name", "sharegpt"],
            {"target_model": "t", "output_dir": "o", "dataset_name": "sharegpt"},
        ),
        (
            (FeatureCacheArguments,),
            ["--target", "t", "--output", "o", "--target-layers", "1", "5", "9"],
            {"target_model": "t", "output_dir": "o", "target_layer_ids": [1, 5, 9]},
        ),
    ],
)
def test_trl_commands_take_the_same_flags_and_trl_spellings(dataclasses, argv, expected):
    parsed = TrlParser(dataclasses).parse_args_and_config(argv)
    values = {name: getattr(part, name) for part in parsed for name in expected if hasattr(part, name)}
    assert values == expected


def test_debug_shows_the_traceback_a_usage_error_hides(tmp_path, capsys):
    argv = ["unpack", "--drafter", str(tmp_path), "--output", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "not a packed drafter" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a packed drafter"):
        main(["--debug", *argv])
