"""The stages of `osprey adapt` (`trainers.adapt`), each a function of the run that writes its product to
`DIR/<stage>/` and returns its record: the target's answers, the converted (or retargeted) drafter, the target's
features, distillation, the finished drafter, its evaluation and its export. The driver, the settings and the run's
state (the `run` every stage takes: a `trainers.adapt.AdaptRun`) are `trainers.adapt`, which imports this module.
"""

import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from osprey.measuring.demo import DECODING_NAME
from osprey.models.model_card import ADAPTATION_RECORD

# Held-out prompts of the evaluation, with how many of each category: the test split of multilingual-chat (per
# language group) and Spec-Bench's categories, which no stage trains on. Spec-Bench is not to be had offline: where
# its file is not found, the evaluation goes on without it and says so.
HELD_OUT = (("multilingual_chat", 2), ("spec_bench", 1))
HELD_OUT_SUITES = tuple(suite for suite, _ in HELD_OUT)
SPEED_PROMPTS = 3
VOCABULARY_CHARACTERS = 4_000_000


def _prompt_records(source: str, split: str = "train"):
    """The records of a prompt source: a corpus name, folder, JSONL file or Hub dataset; `prompt` / `text` records
    become one user message."""
    from .corpora.loading import DatasetArguments, load_text_dataset

    dataset = load_text_dataset(DatasetArguments(dataset_name=source))
    if split not in dataset:
        raise ValueError(f"The prompt source {source!r} has no {split!r} split (it has {sorted(dataset)}).")
    records = dataset[split]
    if len(records) == 0:
        raise ValueError(f"The prompt source {source!r} is empty: its {split!r} split holds no records.")
    columns = set(records.column_names)
    if "messages" in columns:
        return records
    for column in ("prompt", "text", "question", "instruction"):
        if column in columns:
            return records.map(
                lambda row, column=column: {"messages": [{"role": "user", "content": row[column]}]},
                remove_columns=list(columns - {"id"}),
            )
    raise ValueError(
        f"The prompt source {source!r} has no `messages`, `prompt` or `text` column (it has {sorted(columns)}): give "
        "one chat (`messages`) or one prompt per record."
    )


def answer_text(record: dict) -> str:
    """The target-written part of an `answers/train.jsonl` record, chat or plain text."""
    return record["answer"] if "answer" in record else record["messages"][-1]["content"]


def record_text(record: dict) -> str:
    """The whole text of an `answers/train.jsonl` record, chat or plain text."""
    return record["text"] if "text" in record else "\n".join(message["content"] for message in record["messages"])


def write_answers(run, target, tokenizer) -> dict:
    """The target's greedy answers to `num_prompts` openings split evenly over the prompt sources, appended line by
    line to `answers/<i>-<source>.jsonl` (a stopped run resumes), then joined into `answers/train.jsonl`. A target
    without a chat template continues each opening as plain text (`trainers.corpora.regenerate`)."""
    from .corpora.regenerate import RegenerateArguments, regenerate_split, text_format

    settings = run.settings
    folder = run.stage_dir("answers")
    folder.mkdir(exist_ok=True)
    sources = settings.prompts
    share = [
        settings.num_prompts // len(sources) + (i < settings.num_prompts % len(sources)) for i in range(len(sources))
    ]
    written, parts = 0, []
    for i, (source, count) in enumerate(zip(sources, share)):
        arguments = RegenerateArguments(
            dataset_name=source,
            target_model=settings.target,
            output_dir=str(folder),
            max_new_tokens=settings.max_answer_tokens,
            max_prompt_tokens=settings.max_prompt_tokens,
            batch_size=settings.answer_batch_size,
            seed=settings.seed,
        )
        path = folder / f"{i}-{Path(source).name or source}.jsonl"
        written += regenerate_split(target, tokenizer, _prompt_records(source), path, arguments, count)
        parts.append(path)
    lines = [line for path in parts for line in path.read_text(encoding="utf-8").splitlines(keepends=True)]
    if not lines:
        raise ValueError(
            f"No opening of {list(sources)} is at most {settings.max_prompt_tokens} tokens long (max_prompt_tokens): "
            "pass shorter prompts."
        )
    (folder / "train.jsonl").write_text("".join(lines), encoding="utf-8")
    tokens = sum(len(tokenizer(answer_text(json.loads(line)))["input_ids"]) for line in lines)
    return {"answers": len(lines), "answer_tokens": tokens, "written_now": written, "format": text_format(tokenizer)}


def convert_backbone(run) -> dict:
    """`osprey convert` into `drafter-init/` (rebuilt whole if a previous attempt stopped). The draft vocabulary is
    counted on the target's answers and on up to `VOCABULARY_CHARACTERS` of each prompt set's conversations: the
    answers alone are too few tokens to rank a 32k vocabulary, and a chain ends at every token outside it. With
    `from_drafter`, the earlier drafter is taken as it is instead, its draft vocabulary and taps kept
    (`osprey.stages.convert.retarget`)."""
    from osprey.stages.convert import convert, retarget

    settings = run.settings
    folder = run.stage_dir("drafter-init")
    shutil.rmtree(folder, ignore_errors=True)
    if settings.from_drafter is not None:
        _, report = retarget(settings.from_drafter, settings.target, output_dir=folder)
        _check_export(settings, folder)
        return {
            "target_layer_ids": report["target_layer_ids"],
            "draft_vocab": report.get("draft_vocab"),
            "parent": settings.from_drafter,
        }
    corpus = run.stage_dir("answers") / "vocabulary.txt"
    with corpus.open("w", encoding="utf-8") as handle:
        for line in (run.stage_dir("answers") / "train.jsonl").read_text(encoding="utf-8").splitlines():
            handle.write(record_text(json.loads(line)) + "\n")
        for source in settings.prompts:
            written = 0
            for messages in _prompt_records(source)["messages"]:
                text = "\n".join(message["content"] for message in messages) + "\n"
                handle.write(text)
                written += len(text)
                if written >= VOCABULARY_CHARACTERS:
                    break
    _, report = convert(
        settings.backbone,
        settings.target,
        draft_vocab_size=settings.draft_vocab_size,
        corpus=[corpus] if settings.draft_vocab_size else None,
        output_dir=folder,
    )
    _check_export(settings, folder)
    return {"target_layer_ids": report["target_layer_ids"], "draft_vocab": report["draft_vocab"]}


def _check_export(settings, drafter_dir: Path) -> None:
    """What the requested export needs is known once the drafter is converted: a refusal costs seconds here, not the
    whole run (training changes nothing it checks)."""
    if settings.export:
        from osprey.serving.export import check_exportable

        check_exportable(drafter_dir, settings.export, settings.target)


def build_features(run, target, tokenizer, layer_ids) -> dict:
    from .corpora.loading import DatasetArguments, load_text_dataset
    from .corpora.tokenization import tokenize_dataset
    from .features.feature_cache import build_feature_cache

    dataset = load_text_dataset(DatasetArguments(dataset_name=str(run.stage_dir("answers") / "train.jsonl")))
    max_length = run.settings.max_prompt_tokens + run.settings.max_answer_tokens + 16
    examples = tokenize_dataset(dataset["train"], tokenizer, max_length, "text", True)
    path = build_feature_cache(
        target,
        {"train": examples},
        run.stage_dir("features"),
        layer_ids,
        batch_size=4,
        target_name=run.settings.target,
    )
    index = json.loads((path / "feature_cache.json").read_text())
    train = index["splits"]["train"]
    return {"sequences": train["num_sequences"], "tokens": train["num_tokens"]}


class StopAtDeadline(TrainerCallback):
    """Ends training (the model is saved as finished) at the first step end after `minutes` from now."""

    def __init__(self, minutes: float):
        self.deadline = time.perf_counter() + minutes * 60

    def on_step_end(self, args, state, control, **kwargs):
        if time.perf_counter() >= self.deadline:
            control.should_training_stop = True
        return control


def distill_drafter(run, features: dict) -> dict:
    """Distillation into `distill/` for the budget: steps of 4 sequences that make `token_passes` token-passes of the
    feature cache (tokens read once per pass, prompt and answer), or until `budget_minutes` have passed (a constant
    learning rate after warm-up then, as the end is not known in steps)."""
    from osprey.models.pack import load_drafter
    from osprey.models.zoo import load_tokenizer

    from .devices import train_and_save
    from .distill import OspreyDistillConfig, OspreyDistillTrainer
    from .features.feature_cache import FeatureCacheDataset

    settings = run.settings
    batch = 4
    per_sequence = features["tokens"] / features["sequences"]
    if settings.budget_minutes is not None:
        max_steps, schedule = 1_000_000, "constant_with_warmup"
    else:
        max_steps, schedule = max(1, math.ceil(settings.token_passes / (batch * per_sequence))), "cosine"
    output = run.stage_dir("distill")
    resume = any(output.glob("checkpoint-*"))
    config = OspreyDistillConfig(
        output_dir=str(output),
        feature_cache=str(run.stage_dir("features")),
        ttt_steps=5,
        ttt_decay=0.8,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        learning_rate=settings.learning_rate,
        pretrained_learning_rate_scale=settings.pretrained_learning_rate_scale,
        lr_scheduler_type=schedule,
        warmup_steps=min(50, max(1, max_steps // 10)),
        max_grad_norm=0.5,
        max_steps=max_steps,
        logging_steps=10,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=50,
        save_total_limit=1,
        report_to="none",
        seed=settings.seed,
        bf16=not torch.cuda.is_available() or torch.cuda.is_bf16_supported(),
        use_cpu=not torch.cuda.is_available(),
        freeze_embeddings=True,
        train_sampling_strategy="group_by_length",
        disable_tqdm=False,
    )
    drafter = load_drafter(run.stage_dir("drafter-init"))
    trainer = OspreyDistillTrainer(
        drafter,
        config,
        train_dataset=FeatureCacheDataset(run.stage_dir("features"), "train"),
        processing_class=load_tokenizer(run.stage_dir("drafter-init")),
    )
    if settings.budget_minutes is not None:
        already = run.state["stages"].get("distill", {}).get("minutes", 0.0)  # spent before a resume
        trainer.add_callback(StopAtDeadline(settings.budget_minutes - already))
    status = train_and_save(trainer, True if resume else None)
    if status:
        raise KeyboardInterrupt(f"distillation stopped (exit {status}); rerun the same command to resume it")
    trainer.save_state()
    steps = trainer.state.global_step
    return {"steps": steps, "token_passes": round(steps * batch * per_sequence)}


def finish_drafter(run, decoding: dict) -> dict:
    """The distilled drafter as an ordinary checkpoint in `drafter/`, with the target's tokenizer, its alignment
    report, training record, the decoding shape it is measured and served with, and how it was adapted (its card
    says on what kind of text)."""
    from osprey.models.pack import copy_companions, load_drafter
    from osprey.models.zoo import load_tokenizer

    folder = run.stage_dir("drafter")
    shutil.rmtree(folder, ignore_errors=True)
    drafter = load_drafter(run.stage_dir("distill"))
    drafter.save_pretrained(folder)
    load_tokenizer(run.stage_dir("drafter-init")).save_pretrained(folder)
    copy_companions(run.stage_dir("drafter-init"), folder)  # the alignment report
    copy_companions(run.stage_dir("distill"), folder)  # the training record
    (folder / DECODING_NAME).write_text(json.dumps(decoding, indent=2) + "\n")
    answers = run.state["stages"]["answers"]
    adaptation = {
        "target": run.settings.target,
        "backbone": run.settings.backbone,
        "parent": run.settings.from_drafter,
        "prompts": list(run.settings.prompts),
        "format": answers.get("format", "chat"),
        "answers": answers["answers"],
        "answer_tokens": answers["answer_tokens"],
        "token_passes": run.state["stages"]["distill"]["token_passes"],
    }
    (folder / ADAPTATION_RECORD).write_text(json.dumps(adaptation, indent=2) + "\n")
    return {"path": str(folder)}


def evaluation_prompts(settings) -> tuple[list, list[str]]:
    """The evaluation's prompts (`--eval-prompts`, else `HELD_OUT`'s) and a line for each default suite that could
    not be had here (Spec-Bench, without a data folder) and was left out."""
    from osprey.measuring.bench_suites import available_suites, load_suite, select_subset

    per_category = dict(HELD_OUT)
    if settings.eval_prompts:
        suites, skipped = {source: load_suite(source) for source in settings.eval_prompts}, []
    else:
        suites, skipped = available_suites(HELD_OUT_SUITES)
    prompts = [prompt for name, suite in suites.items() for prompt in select_subset(suite, per_category.get(name), 0)]
    if not prompts:
        raise ValueError(f"No held-out prompts to evaluate on ({' '.join(skipped)}): pass --eval-prompts FILE.")
    return prompts, skipped


def evaluate_drafter(run, target, tokenizer, decoding: dict) -> dict:
    """Held-out τ (chains, greedy, float drafter) per language group, and the speed check against the target alone
    at the drafter's decoding shape; both `osprey bench` runs saved in `evaluate/` with their tables."""
    from osprey.measuring.bench import run_benchmark
    from osprey.measuring.bench_report import exit_status, markdown_table, save_report, summarize
    from osprey.measuring.demo import DEMO_PROMPTS, against_target_alone
    from osprey.measuring.methods import BenchMethod, BenchSettings
    from osprey.models.pack import load_drafter

    folder = run.stage_dir("evaluate")
    folder.mkdir(exist_ok=True)
    drafter_dir = run.stage_dir("drafter")
    dtype = getattr(torch, run.settings.dtype)
    prompts, skipped = evaluation_prompts(run.settings)
    for line in skipped:
        print(f"evaluate: left out: {line}", file=sys.stderr)
    chat = decoding.get("chat_template", True)  # a base model is measured on plain text, as it was adapted
    drafter = load_drafter(drafter_dir, dtype)
    held_out = run_benchmark(
        target,
        tokenizer,
        [BenchMethod("osprey", f"drafter:{drafter_dir}", drafter=drafter)],
        prompts,
        BenchSettings(max_new_tokens=run.settings.held_out_tokens, confidence_threshold=0.0, chat_template=chat),
        output_path=folder / "held-out.json",
        target_name=run.settings.target,
    )
    save_report(held_out, folder / "held-out.json")
    tau = {}
    for record in summarize(held_out):
        if record["method"] == "osprey" and (record["category"] == "overall" or record["suite"] == "multilingual_chat"):
            tau[record["suite"] if record["category"] == "overall" else record["category"]] = record["tau"]
    shape = dict(decoding)
    shape.pop("dtype", None)  # the target's, as in the held-out run
    settings = BenchSettings(max_new_tokens=64, **shape)  # the shape records whether prompts go through a template
    fast = load_drafter(drafter_dir, dtype, quantization=settings.drafter_quantization)
    speed = against_target_alone(
        target,
        tokenizer,
        fast,
        drafter_dir,
        DEMO_PROMPTS[:SPEED_PROMPTS],
        settings,
        folder / "speed.json",
        run.settings.target,
    )
    save_report(speed, folder / "speed.json")
    overall = next(r for r in summarize(speed) if r["method"] != "target" and r["category"] == "overall")
    print(markdown_table(held_out))
    print(markdown_table(speed))
    failed = exit_status(held_out) or exit_status(speed)
    return {
        "tau": tau,
        "speedup": overall["speedup"],
        "speed_tau": overall["tau"],
        "decoding": decoding,
        "format": "chat" if chat else "text",
        "left_out": skipped,
        "outputs_checked": not failed,
    }


def export_stage(run) -> dict:
    """`osprey export` of the drafter into `export/<format>/`; each format asked for on a run or a rerun is kept."""
    from osprey.serving.export import export_drafter

    export_format = run.settings.export
    folder = run.stage_dir("export") / export_format
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(exist_ok=True)
    export_drafter(run.stage_dir("drafter"), export_format, folder, target=run.settings.target)
    formats = run.state["stages"].get("export", {}).get("formats", {})
    return {"formats": formats | {export_format: str(folder)}}
