"""Reading training text: any dataset the trainers read (a corpus name, a local file or folder, a Hub id), checked
before a command writes anything, and the registry of the offline corpora `osprey data NAME` builds (`CORPORA`).
"""

from dataclasses import dataclass, field
from pathlib import Path

from datasets import IterableDatasetDict, load_dataset, load_from_disk

from osprey.ground import (
    CORPUS_NAMES,
)

from .general import prepare_general
from .multilingual import prepare_multilingual
from .multilingual_chat import prepare_multilingual_chat
from .sharegpt import prepare_sharegpt


@dataclass
class DatasetArguments:
    """Which dataset to read: a corpus name (`CORPORA`), a local file or directory, or a Hub id."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "`general`, `multilingual`, `multilingual-chat` or `sharegpt` (built by `osprey data`), a "
            ".jsonl/.json/.parquet/.txt file, a directory of such files or saved with `save_to_disk`, or a Hugging "
            "Face Hub dataset id."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (Hub datasets)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of loading it."})


_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def check_dataset_source(name: str, flag: str = "--dataset-name") -> None:
    """Refuses, in one line naming the fix, a source `load_text_dataset` would not read or would find empty: checked
    before a command writes anything. Corpus names pass (they are built on first use); a Hub dataset must be one the
    Hub (or its local cache) gives."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            kind = path.suffix or "suffix-less"
            raise ValueError(f"{flag} {name}: cannot read a {kind} file; give one of {', '.join(_FILE_BUILDERS)}.")
        with path.open("rb") as handle:
            if not any(line.strip() for line in handle):
                raise ValueError(f"{flag} {name}: the file is empty; give a file with one record per line.")
        return
    if path.is_dir():
        if not any(path.iterdir()):
            raise ValueError(f"{flag} {name}: the folder is empty; give a folder of data files.")
        return
    if name in CORPORA:
        return
    looks_local = path.suffix in _FILE_BUILDERS or name.startswith((".", "/", "~")) or name.count("/") > 1
    if not looks_local:
        from datasets import load_dataset_builder

        try:
            load_dataset_builder(name)
            return
        except Exception:  # noqa: BLE001 - any failure to reach or read it gets the same advice
            pass
    raise ValueError(
        f"{flag} {name!r} is not a corpus ({', '.join(CORPUS_NAMES)}), no such file or folder exists, and the "
        "Hugging Face Hub did not give it as a dataset: check the path, or give a reachable Hub dataset id."
    )


def load_text_dataset(args: DatasetArguments, cache_dir: str | None = None):
    """The `DatasetDict` (`IterableDatasetDict` when streaming) that `args.dataset_name` names."""
    name = args.dataset_name
    path = Path(name).expanduser()
    if not path.exists() and name in CORPORA:
        path = CORPORA[name](cache_dir=cache_dir)
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        dataset = load_from_disk(str(path))
        if args.dataset_streaming:
            return IterableDatasetDict({split: part.to_iterable_dataset() for split, part in dataset.items()})
        return dataset
    if path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(f"Cannot read {path}: expected one of {', '.join(_FILE_BUILDERS)}.")
        return load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), streaming=args.dataset_streaming)
    return load_dataset(str(path) if path.is_dir() else name, args.dataset_config, streaming=args.dataset_streaming)


# `osprey data NAME` builds the corpus named NAME (`CORPUS_NAMES`) with `prepare_NAME`, hyphens as underscores.
BUILDERS = {
    "general": prepare_general,
    "multilingual": prepare_multilingual,
    "multilingual-chat": prepare_multilingual_chat,
    "sharegpt": prepare_sharegpt,
}
CORPORA = {name: BUILDERS[name] for name in CORPUS_NAMES}
