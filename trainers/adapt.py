"""`osprey adapt`: from a pretrained backbone to a measured drafter for any target, in one resumable command.

    osprey adapt --target TARGET --output DIR [--backbone NAME] [--prompts SOURCE ...]
                 [--token-passes 80k | --budget 20min] [--export vllm] [--push-to-hub REPO]

The stages, each writing its product to `DIR/<stage>/` and marking it done (`DIR/adapt.json` records the times):

1. `answers`: the target answers a prompt set's openings greedily, batched (`trainers.corpora.regenerate`). The default
   set mixes ShareGPT and the `multilingual-chat` corpus (28 languages) half and half: a drafter learns the text its
   target writes, in the languages it will be asked in. `--prompts` takes the user's own (a JSONL file of `messages`
   or `prompt` records, a folder, a corpus name or a Hub dataset). A target with no chat template (a base model)
   continues the openings as plain text instead, and is evaluated on plain text.
2. `drafter-init`: `osprey convert` of the backbone for the target: vocabulary alignment, the taps of the target's
   preset (or the rule), zero-initialised QKV expansion, a draft vocabulary counted on the prompts and answers.
3. `features`: the target's features of the answers (`osprey features`).
4. `distill`: distillation for a budget of token-passes (default) or minutes, with TTT (`osprey distill`).
5. `drafter`: the finished drafter as an ordinary checkpoint (with its custom-generate loop and model card).
6. `evaluate`: held-out τ (chains, greedy) per language group on prompts no stage trained on, and a short speed check
   against the target alone at the drafter's decoding shape (`osprey_decoding.json`, which `osprey demo --drafter DIR`
   reads); the table is `osprey bench`'s. Its outputs must pass the lossless check before anything leaves the folder.
7. optional `export` (`--export vllm`, or any `osprey export --format`, each into `export/<format>/`) and
   `--push-to-hub REPO`.

Every model, prompt source and budget is checked before anything is written, and what an export needs is checked
right after conversion, before any training. A rerun skips finished stages and resumes the one that was stopped
(answers line by line, the feature cache after its last shard, distillation from its last checkpoint); a rerun with
another `--export` runs that export. A directory made with other settings is refused, and nothing else is written
into a non-empty directory that `osprey adapt` did not make.

The defaults come from the project's measured curves (docs/adapt.md): the converted backbone already drafts well, and
the first ~0.1 M token-passes of distillation bring most of what longer runs reach, so the clock goes to writing
answers, kept short and read for several epochs.
"""

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from osprey.measuring.bench_suites import CORPUS_SUITES, load_suite
from osprey.measuring.demo import decoding_shape
from osprey.models.zoo import DEFAULT_BACKBONE
from osprey.serving.export import FORMATS as EXPORT_FORMATS

from .adapt_stages import (
    HELD_OUT_SUITES,
    build_features,
    convert_backbone,
    distill_drafter,
    evaluate_drafter,
    export_stage,
    finish_drafter,
    write_answers,
)

STATE_NAME = "adapt.json"
STAGES = ("answers", "drafter-init", "features", "distill", "drafter", "evaluate", "export")
DEFAULT_PROMPTS = ("sharegpt", "multilingual-chat")


@dataclass
class AdaptSettings:
    """What `osprey adapt` makes a drafter from, and how long it trains: the fields that name a run (a rerun in the
    same directory must ask for the same) and those that may change on a rerun (evaluation, export)."""

    target: str
    backbone: str = DEFAULT_BACKBONE
    # A drafter adapted earlier (for an earlier version of the target) to start from instead of the backbone.
    from_drafter: str | None = None
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    num_prompts: int = 256
    max_answer_tokens: int = 128
    max_prompt_tokens: int = 256
    answer_batch_size: int = 32
    draft_vocab_size: int | None = 32000
    token_passes: int | None = 80_000
    budget_minutes: float | None = None
    learning_rate: float = 3e-4
    pretrained_learning_rate_scale: float = 0.25
    seed: int = 0
    dtype: str = "bfloat16"
    # not part of the run's identity: they change what is measured or published, not the drafter
    evaluate: bool = True
    eval_prompts: tuple[str, ...] | None = None  # None: `HELD_OUT`
    held_out_tokens: int = 48
    export: str | None = None
    push_to_hub: str | None = None

    IDENTITY = (
        "target",
        "backbone",
        "from_drafter",
        "prompts",
        "num_prompts",
        "max_answer_tokens",
        "max_prompt_tokens",
        "answer_batch_size",  # padded batches of bfloat16 forwards round differently, and greedy answers follow
        "draft_vocab_size",
        "token_passes",
        "budget_minutes",
        "learning_rate",
        "pretrained_learning_rate_scale",
        "seed",
        "dtype",
    )

    # The flag that sets each number a user gives (Python-only fields are named as fields), for errors.
    FLAGS = {
        "num_prompts": "--num-prompts",
        "max_answer_tokens": "--max-new-tokens",
        "max_prompt_tokens": "max_prompt_tokens",
        "answer_batch_size": "answer_batch_size",
        "draft_vocab_size": "--draft-vocab-size",
        "token_passes": "--token-passes",
        "budget_minutes": "--budget",
        "learning_rate": "learning_rate",
        "held_out_tokens": "held_out_tokens",
    }

    def identity(self) -> dict:
        """The fields that name the run, as `adapt.json` records them."""
        values = {name: getattr(self, name) for name in self.IDENTITY}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}

    def check(self) -> None:
        """Refuses bad settings in one line naming the flag, before anything is written: budgets and counts, the
        export format, that the target, the backbone and every prompt source can be had, and that a drafter to start
        from can serve the target (which reads the target's config and tokenizer)."""
        from osprey.models.zoo import check_model_source

        from .corpora.loading import check_dataset_source

        for name, flag in self.FLAGS.items():
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}.")
        if self.token_passes is None and self.budget_minutes is None:
            raise ValueError("Give a distillation budget: --token-passes (e.g. 80k) or --budget (e.g. 20min).")
        if self.token_passes is not None and self.budget_minutes is not None:
            raise ValueError("Give one distillation budget: --token-passes or --budget, not both.")
        if self.export not in (None, *EXPORT_FORMATS):
            raise ValueError(f"--export takes one of {', '.join(EXPORT_FORMATS)}, not {self.export!r}.")
        if not self.evaluate and (self.export or self.push_to_hub):
            raise ValueError(
                "--export and --push-to-hub wait for the evaluation's lossless check of the drafter's outputs: drop "
                "--no-evaluate, or export later with `osprey export` / `osprey push`."
            )
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"--dtype takes bfloat16 or float32, not {self.dtype!r}.")
        if not self.prompts:
            raise ValueError("--prompts: give at least one prompt source.")
        check_model_source(self.target, "--target")
        if self.from_drafter is None:
            check_model_source(self.backbone, "--backbone")
        else:
            from osprey.stages.convert import retarget

            if not (Path(self.from_drafter) / "config.json").is_file():
                raise ValueError(f"--from-drafter {self.from_drafter}: not a drafter directory (no config.json).")
            retarget(self.from_drafter, self.target)  # refuses a drafter that cannot serve this target
        for source in self.prompts:
            check_dataset_source(source, "--prompts")
        for source in self.eval_prompts or ():
            if source in CORPUS_SUITES:  # built on first use, like the training corpora
                continue
            try:  # read the way the evaluation reads them (`osprey bench --prompts`), not as a training dataset
                prompts = load_suite(source)
            except ValueError as error:
                raise ValueError(f"--eval-prompts {source}: {error}") from error
            if not prompts:
                raise ValueError(f"--eval-prompts {source}: it holds no prompts; give a JSONL file of prompts.")


def parse_amount(text: str) -> int:
    """`80k`, `1.5M`, `80000` -> an integer count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"expected a count such as 80k, 1.5M or 80000, got {text!r}")
    return round(float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[match.group(2).lower()])


def parse_minutes(text: str) -> float:
    """`20min`, `1.5h`, `90m`, `45` (minutes) -> minutes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(min|m|h|s)?\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration such as 20min, 1.5h or 45 (minutes), got {text!r}")
    return float(match.group(1)) * {None: 1, "min": 1, "m": 1, "h": 60, "s": 1 / 60}[match.group(2)]


class AdaptRun:
    """One adaptation directory: its settings, which stages are done and how long each took."""

    def __init__(self, output_dir: str | os.PathLike, settings: AdaptSettings):
        self.dir = Path(output_dir)
        self.settings = settings
        self.state_path = self.dir / STATE_NAME
        self.state = self._open()

    def _open(self) -> dict:
        identity = self.settings.identity()
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text())
            # a setting a run recorded before it joined the identity had its default then
            saved = AdaptSettings(target="").identity() | state["settings"]
            changed = {name: (saved.get(name), value) for name, value in identity.items() if saved.get(name) != value}
            if changed:
                details = "; ".join(f"{name}: {old!r} there, {new!r} asked" for name, (old, new) in changed.items())
                raise ValueError(
                    f"{self.dir} holds an adaptation made with other settings ({details}). Pass a new --output, or "
                    "the same settings to resume it."
                )
            return state
        if self.dir.exists() and any(self.dir.iterdir()):
            raise ValueError(
                f"{self.dir} is not empty and was not made by `osprey adapt` (no {STATE_NAME}): pass a new or empty "
                "--output, so that nothing already there is overwritten."
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {"format": 1, "settings": identity, "stages": {}}
        self._save(state)
        return state

    def _save(self, state: dict | None = None) -> None:
        staging = self.state_path.with_suffix(".json.partial")
        staging.write_text(json.dumps(state or self.state, indent=2) + "\n")
        os.replace(staging, self.state_path)

    def stage_dir(self, stage: str) -> Path:
        return self.dir / stage

    def done(self, stage: str) -> bool:
        return stage in self.state["stages"] and self.state["stages"][stage].get("done", False)

    def run(self, stage: str, index: int, function) -> dict:
        """Runs `function()` (returning the stage's record) unless the stage is done; times it, across resumes."""
        total = len(STAGES)
        if self.done(stage):
            print(f"[{index}/{total}] {stage}: done ({self.state['stages'][stage]['minutes']:.1f} min), skipped")
            return self.state["stages"][stage]
        previous = self.state["stages"].get(stage, {}).get("minutes", 0.0)
        print(f"[{index}/{total}] {stage} ...", flush=True)
        start = time.perf_counter()
        try:
            record = function() or {}
        finally:  # a stopped stage keeps the time it spent, so the total stays the wall-clock of the whole adaptation
            minutes = previous + (time.perf_counter() - start) / 60
            self.state["stages"].setdefault(stage, {})["minutes"] = minutes
            self._save()
        self.state["stages"][stage] = {**record, "minutes": minutes, "done": True}
        self._save()
        print(f"[{index}/{total}] {stage}: done in {minutes:.1f} min", flush=True)
        return self.state["stages"][stage]

    @property
    def minutes(self) -> float:
        return sum(stage.get("minutes", 0.0) for stage in self.state["stages"].values())


# ------------------------------------------------------------------------------------------------------------ driver


def adapt(output_dir: str | os.PathLike, settings: AdaptSettings | None = None, **fields) -> dict:
    """Runs (or resumes) every stage of the adaptation in `output_dir`; returns `adapt.json`'s record. The Python
    API of `osprey adapt` (`from trainers.adapt import adapt`): `adapt("runs/my-drafter", target="TARGET")`, the
    fields of [`AdaptSettings`] as keywords (or an `AdaptSettings`)."""
    if settings is None:
        settings = AdaptSettings(**fields)
    elif fields:
        raise ValueError("Pass either an AdaptSettings or its fields as keywords, not both.")
    from osprey.models.model_card import drafter_card
    from osprey.models.zoo import load_causal_lm, load_tokenizer

    settings.check()
    run = AdaptRun(output_dir, settings)
    dtype = getattr(torch, settings.dtype)
    target = tokenizer = None

    def loaded_target():
        nonlocal target, tokenizer
        if target is None:
            tokenizer = load_tokenizer(settings.target)
            target = load_causal_lm(settings.target, dtype=dtype).eval()
        return target, tokenizer

    run.run("answers", 1, lambda: write_answers(run, *loaded_target()))
    converted = run.run("drafter-init", 2, lambda: convert_backbone(run))
    features = run.run("features", 3, lambda: build_features(run, *loaded_target(), converted["target_layer_ids"]))
    target = None  # distillation reads the cache: the target's memory goes back while it trains
    run.run("distill", 4, lambda: distill_drafter(run, features))
    chat = run.state["stages"]["answers"].get("format", "chat") == "chat"
    decoding = decoding_shape() | {"dtype": settings.dtype} | ({} if chat else {"chat_template": False})
    run.run("drafter", 5, lambda: finish_drafter(run, decoding))
    if settings.evaluate:
        run.run("evaluate", 6, lambda: evaluate_drafter(run, *loaded_target(), decoding))
        bench = run.stage_dir("evaluate") / "held-out.json"
        card = drafter_card(
            run.stage_dir("drafter"), f"osprey-drafter-{Path(settings.target).name}", bench_results=bench
        )
        (run.stage_dir("drafter") / "README.md").write_text(str(card), encoding="utf-8")
    # Nothing leaves the folder (export, push) unless the drafter's outputs passed the lossless check.
    if not run.state["stages"].get("evaluate", {}).get("outputs_checked", True):
        print(summary(run))
        raise RuntimeError(
            "The drafter's decoded outputs differ from the target's where rounding does not explain it (the tables "
            f"above, {run.stage_dir('evaluate')}): decoding is not lossless here, so nothing was exported or "
            "published; please report it."
        )
    if settings.export:
        if settings.export not in run.state["stages"].get("export", {}).get("formats", {}):
            run.state["stages"].get("export", {})["done"] = False  # a rerun asking for another format runs it
        run.run("export", 7, lambda: export_stage(run))
    if settings.push_to_hub:
        from osprey.models.hub import push_drafter_folder

        bench = run.stage_dir("evaluate") / "held-out.json"
        commit = push_drafter_folder(
            run.stage_dir("drafter"), settings.push_to_hub, bench_results=bench if bench.is_file() else None
        )
        print(f"published {run.stage_dir('drafter')} to {commit.repo_url}")
    print(summary(run))
    return run.state


def summary(run: AdaptRun) -> str:
    stages = run.state["stages"]
    start = run.settings.from_drafter or run.settings.backbone
    lines = [f"adapted {start} to {run.settings.target} in {run.minutes:.1f} min:"]
    for stage in STAGES:
        if stage in stages:
            lines.append(f"  {stage:<13} {stages[stage]['minutes']:6.1f} min")
    distill = stages.get("distill", {})
    if "token_passes" in distill:
        lines.append(f"  distilled for {distill['token_passes']:,} token-passes ({distill['steps']} steps)")
    evaluation = stages.get("evaluate", {})
    if "tau" in evaluation:
        taus = ", ".join(f"{name} {value:.2f}" for name, value in evaluation["tau"].items())
        lines.append(f"  held-out τ (chains): {taus}")
        lines.append(f"  speed check: {evaluation['speedup']:.2f}x the target alone (τ {evaluation['speed_tau']:.2f})")
    lines.append(f"  drafter: {run.stage_dir('drafter')}  (osprey demo --drafter {run.stage_dir('drafter')})")
    return "\n".join(lines)


def add_subcommand(subparsers) -> None:
    """Adds `osprey adapt` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "adapt",
        help="make a measured drafter for a target from the pretrained backbone, in one resumable command",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="target LLM: zoo name, local directory or Hub id")
    parser.add_argument("--output", required=True, help="new or empty directory (or one to resume)")
    parser.add_argument(
        "--backbone", default=DEFAULT_BACKBONE, help=f"pretrained backbone (default: {DEFAULT_BACKBONE})"
    )
    parser.add_argument(
        "--from-drafter",
        metavar="DIR",
        help="start from a drafter adapted earlier (`DIR/drafter` of an `osprey adapt` run for an earlier version of "
        "the target: same tokenizer, width and depth) instead of the backbone; its draft vocabulary and taps are kept",
    )
    parser.add_argument(
        "--prompts",
        action="append",
        metavar="SOURCE",
        help="a prompt set the target answers (repeatable; the openings are split evenly): corpus name, JSONL file "
        f"(`messages` or `prompt` per line), folder or Hub dataset (default: {', '.join(DEFAULT_PROMPTS)})",
    )
    parser.add_argument("--num-prompts", type=int, default=AdaptSettings.num_prompts, help="openings answered")
    parser.add_argument(
        "--max-new-tokens", type=int, default=AdaptSettings.max_answer_tokens, help="longest answer written (tokens)"
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--token-passes", type=parse_amount, help="distillation budget in token-passes, e.g. 80k (the default)"
    )
    budget.add_argument("--budget", type=parse_minutes, help="distillation budget in wall-clock, e.g. 20min")
    parser.add_argument("--draft-vocab-size", type=int, default=AdaptSettings.draft_vocab_size)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=AdaptSettings.dtype, help="target dtype")
    parser.add_argument("--seed", type=int, default=AdaptSettings.seed)
    parser.add_argument("--no-evaluate", action="store_true", help="skip the held-out τ and the speed check")
    parser.add_argument(
        "--eval-prompts",
        action="append",
        metavar="SOURCE",
        help="held-out prompts to measure τ on (repeatable): a suite name or a JSONL file or folder as `osprey bench "
        f"--prompts` takes them (default: {', '.join(HELD_OUT_SUITES)}; a suite not to be had here is left out)",
    )
    parser.add_argument("--export", choices=EXPORT_FORMATS, help="also export the drafter (`osprey export --format`)")
    parser.add_argument("--push-to-hub", metavar="REPO", help="publish the drafter with its card")
    parser.set_defaults(run=_run_adapt)


def _run_adapt(args) -> int:
    token_passes = args.token_passes  # 0 stays 0, and is refused as such
    if token_passes is None and args.budget is None:
        token_passes = AdaptSettings.token_passes
    settings = AdaptSettings(
        target=args.target,
        backbone=args.backbone,
        from_drafter=args.from_drafter,
        prompts=tuple(args.prompts or DEFAULT_PROMPTS),
        num_prompts=args.num_prompts,
        max_answer_tokens=args.max_new_tokens,
        draft_vocab_size=args.draft_vocab_size,
        token_passes=token_passes,
        budget_minutes=args.budget,
        dtype=args.dtype,
        seed=args.seed,
        evaluate=not args.no_evaluate,
        eval_prompts=tuple(args.eval_prompts) if args.eval_prompts else None,
        export=args.export,
        push_to_hub=args.push_to_hub,
    )
    try:
        adapt(args.output, settings)
    except KeyboardInterrupt as stop:
        print(f"osprey adapt: stopped: {stop or 'interrupted'}. Rerun the same command to resume.", file=sys.stderr)
        return 130
    return 0
