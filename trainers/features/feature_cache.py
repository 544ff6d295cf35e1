"""Precomputed target features: one pass of the frozen target over a dataset, read by any number of drafters.

Per token the cache stores the target's tap features (what the drafter reads), its *final hidden state* (the LM head's
input, post final norm) and its greedy next token, in bfloat16 / int32, plus the target's LM head once. At train
time the logits over the draft vocabulary are recomputed from the final hidden state with that head: the exact
distribution (up to the storage rounding of one vector), for any draft vocabulary, at a storage cost of one extra
hidden-size vector next to the `len(taps)` the cache holds anyway. No full-vocabulary logits are ever stored or held
beyond one batch. That the head reproduces the target's logits is checked on the first batch when the cache is built
(a model that scales its logits other than by `final_logit_softcapping` is refused).

Layout of a cache directory:

    feature_cache.json            format, target description, taps, per-split shard list
    target_head.safetensors       `weight` (and `bias`) of the target's LM head
    <split>/shard-00000.safetensors
        input_ids (N,) int32, loss_mask (N,) uint8, target_hidden_states (N, taps * H), target_last_hidden_state
        (N, H), target_argmax (N,) int32: the split's sequences concatenated; `offsets` (S + 1,) int64 delimits them.

Shards are memory-mapped and read one sequence at a time, so datasets far larger than RAM train fine.
"""

import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from modeling_osprey.target_features import TargetFeatureCapture, default_target_layer_ids
from osprey.models.zoo import load_tokenizer

from ..corpora.loading import DatasetArguments, load_text_dataset
from ..corpora.tokenization import tokenize_dataset
from ..devices import load_target

CACHE_FORMAT = 1
INDEX_NAME = "feature_cache.json"
HEAD_NAME = "target_head.safetensors"
PROGRESS_NAME = "progress.json"  # in the staging directory: the shards a build completed so far
SEQUENCE_FIELDS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_state", "target_argmax")


class TargetHead(nn.Module):
    """A target's LM head (and final logit soft-capping), recomputing its logits from its final hidden states."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, final_logit_softcapping=None):
        super().__init__()
        self.weight = nn.Buffer(weight)
        self.bias = nn.Buffer(bias) if bias is not None else None
        self.final_logit_softcapping = final_logit_softcapping

    @classmethod
    def from_model(cls, model: nn.Module) -> "TargetHead":
        head = model.get_output_embeddings()
        softcapping = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        bias = getattr(head, "bias", None)
        return cls(head.weight.detach(), None if bias is None else bias.detach(), softcapping)

    def restricted(self, rows: torch.LongTensor) -> "TargetHead":
        """This head over vocabulary `rows` only (a drafter's draft vocabulary, `draft_to_target`), as its own head."""
        rows = rows.to(self.weight.device)
        bias = None if self.bias is None else self.bias[rows]
        return TargetHead(self.weight[rows], bias, self.final_logit_softcapping)

    def forward(
        self, hidden_states: torch.Tensor, rows: torch.LongTensor | None = None, chunk_size: int = 512
    ) -> torch.Tensor:
        """Logits in the head's dtype (float32 where soft-capped), over vocabulary `rows` only when given (the draft
        vocabulary: a fraction of the work). Consumers upcast the rows they use: a float32 copy of every logit would
        cost a pass over `(tokens, vocabulary)` for nothing. The GEMM runs `chunk_size` tokens at a time, into one
        output: faster on this project's CPU than one GEMM over a batch's ~2,000 label positions
        (`benchmarks/head_gemm_layouts.py`)."""
        weight = self.weight if rows is None else self.weight[rows]
        bias = self.bias if self.bias is None or rows is None else self.bias[rows]
        flat = hidden_states.to(weight.dtype).reshape(-1, hidden_states.shape[-1])
        logits = flat.new_empty(len(flat), len(weight))
        for start in range(0, len(flat), chunk_size):
            torch.mm(flat[start : start + chunk_size], weight.T, out=logits[start : start + chunk_size])
        if bias is not None:
            logits += bias
        logits = logits.view(*hidden_states.shape[:-1], len(weight))
        if self.final_logit_softcapping:
            logits = torch.tanh(logits.float() / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits


class _ShardWriter:
    """Buffers sequences and writes them out as safetensors shards of about `shard_bytes` each, appending each
    complete shard to `shards` and calling `on_shard()` (which records the build's progress)."""

    def __init__(self, directory: Path, shard_bytes: int, shards: list[dict], on_shard):
        self.directory = directory
        self.shard_bytes = shard_bytes
        self.shards = shards
        self.on_shard = on_shard
        self._buffer: list[dict[str, torch.Tensor]] = []
        self._buffered_bytes = 0
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, sequence: dict[str, torch.Tensor]) -> None:
        self._buffer.append(sequence)
        self._buffered_bytes += sum(tensor.nbytes for tensor in sequence.values())
        if self._buffered_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        lengths = torch.tensor([0] + [len(sequence["input_ids"]) for sequence in self._buffer])
        tensors = {name: torch.cat([sequence[name] for sequence in self._buffer]) for name in SEQUENCE_FIELDS}
        tensors["offsets"] = lengths.cumsum(0)
        name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(tensors, self.directory / f".{name}.partial")
        os.replace(self.directory / f".{name}.partial", self.directory / name)
        self.shards.append({"file": name, "num_sequences": len(self._buffer), "num_tokens": int(lengths.sum())})
        self.on_shard()
        self._buffer, self._buffered_bytes = [], 0


def _save_progress(directory: Path, progress: dict) -> None:
    (directory / f".{PROGRESS_NAME}.partial").write_text(json.dumps(progress, indent=2) + "\n")
    os.replace(directory / f".{PROGRESS_NAME}.partial", directory / PROGRESS_NAME)


def greedy_tokens(logits: torch.Tensor) -> torch.LongTensor:
    """`logits.argmax(-1)` (the first maximum), about 2x faster on CPU over a large vocabulary."""
    return logits.max(dim=-1).indices


def _check_head(head: TargetHead, hidden_states: torch.Tensor, logits: torch.Tensor) -> None:
    recomputed = head(hidden_states)
    error = (recomputed - logits.float()).abs().max().item()
    scale = logits.float().abs().max().item()
    if error > 2e-2 * scale + 1e-3:
        raise ValueError(
            f"The target's logits are not its LM head applied to its final hidden state (max error {error:.3g} for "
            f"logits up to {scale:.3g}): it transforms them in a way the feature cache does not record (a logit "
            "scale?). Distill this target live (`--target`) instead of from a feature cache."
        )


def _windows(dataset: Iterable[dict], size: int) -> Iterable[list[dict]]:
    """Consecutive lists of `size` examples (the last may be shorter)."""
    iterator = iter(dataset)
    while window := list(itertools.islice(iterator, size)):
        yield window


def build_feature_cache(
    target: nn.Module,
    splits: dict[str, Iterable[dict]],
    output_dir: str | os.PathLike,
    layer_ids: Sequence[int],
    batch_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 1 << 30,
    target_name: str | None = None,
    sort_window: int = 64,
) -> Path:
    """Runs `target` once over every split of tokenized examples (`input_ids`, `loss_mask`) and writes a feature cache.

    The cache is built in a staging directory and moved to `output_dir` when complete, so a failed or killed build
    never leaves a directory that looks usable. Building is hours of target forwards on a CPU: a killed build rerun
    with the same target, taps and dtype resumes after its last complete shard (the examples must come in the same
    order, as they do from the same dataset and arguments).

    Every `sort_window` consecutive examples are batched by length (and stored in their own order), so a batch pads
    its sequences to a similar length: on the target-written ShareGPT answers of `benchmarks/replication` (batches of
    4) the build is 1.24x faster in windows of 64 than in dataset order (docs/training.md, "Feature cache").
    """
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise ValueError(f"{output_dir} already exists: choose a new directory, or delete it to rebuild the cache.")
    staging = output_dir.with_name(f".{output_dir.name}.staging")
    name_or_path = target_name or getattr(target.config, "_name_or_path", None)
    build = {"target": name_or_path, "target_layer_ids": list(layer_ids), "dtype": str(dtype).removeprefix("torch.")}
    progress = _load_progress(staging, build)
    if progress is None:
        shutil.rmtree(staging, ignore_errors=True)  # another build's leftovers
        staging.mkdir(parents=True)
        progress = {"build": build, "splits": {}}
    try:
        index = _write_cache(target, splits, staging, layer_ids, batch_size, dtype, shard_bytes, progress, sort_window)
    except BaseException:
        if not any(progress["splits"].values()):  # nothing worth resuming from
            shutil.rmtree(staging, ignore_errors=True)
        raise
    index["target"]["name_or_path"] = name_or_path
    (staging / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (staging / PROGRESS_NAME).unlink()
    os.replace(staging, output_dir)
    return output_dir


def _load_progress(staging: Path, build: dict) -> dict | None:
    """The shards a killed build of the same `build` completed in `staging`, or None to start afresh."""
    try:
        progress = json.loads((staging / PROGRESS_NAME).read_text())
    except (OSError, ValueError):
        return None
    return progress if progress.get("build") == build else None


@torch.inference_mode()
def _write_cache(
    target, splits, directory: Path, layer_ids, batch_size, dtype, shard_bytes, progress, sort_window
) -> dict:
    """Writes the head and every split's shards to `directory`, after those `progress` lists; returns the index."""
    head = TargetHead.from_model(target)
    save_file({name: tensor.contiguous() for name, tensor in head.state_dict().items()}, directory / HEAD_NAME)
    config = target.config.get_text_config(decoder=True)
    index = {
        "format": CACHE_FORMAT,
        "target": {
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "num_hidden_layers": config.num_hidden_layers,
        },
        "target_layer_ids": list(layer_ids),
        "dtype": str(dtype).removeprefix("torch."),
        "final_logit_softcapping": head.final_logit_softcapping,
        "splits": {},
    }
    unchecked = head  # checked on the first batch: a property of the model
    final_hidden: list[torch.Tensor] = []  # the LM head's input: the final hidden state
    hook = target.get_output_embeddings().register_forward_pre_hook(lambda module, args: final_hidden.append(args[0]))
    try:
        with TargetFeatureCapture(target, layer_ids) as capture:
            for split, examples in splits.items():
                done = progress["splits"].setdefault(split, [])
                writer = _ShardWriter(
                    directory / split, shard_bytes, done, partial(_save_progress, directory, progress)
                )
                skipped = sum(shard["num_sequences"] for shard in done)
                examples = itertools.islice(examples, skipped, None)
                bar = tqdm(desc=f"Target features ({split})", unit="sequence", initial=skipped)
                for window in _windows(examples, max(sort_window, batch_size)):
                    sequences = _window_features(target, capture, final_hidden, window, batch_size, dtype, unchecked)
                    unchecked = None
                    for sequence in sequences:
                        writer.add(sequence)
                    bar.update(len(window))
                bar.close()
                writer.flush()
                index["splits"][split] = {
                    "num_sequences": sum(shard["num_sequences"] for shard in writer.shards),
                    "num_tokens": sum(shard["num_tokens"] for shard in writer.shards),
                    "shards": writer.shards,
                }
    finally:
        hook.remove()
    return index


def _window_features(target, capture, final_hidden, window, batch_size, dtype, head=None) -> list[dict]:
    """The cache's tensors of each example of `window`, in its order, from target forwards over batches of examples
    of similar length; with `head`, first checks on a few positions that it gives the target's logits."""
    device = next(target.parameters()).device
    by_length = sorted(range(len(window)), key=lambda i: len(window[i]["input_ids"]))
    sequences: list[dict] = [{}] * len(window)
    for start in range(0, len(window), batch_size):
        rows = by_length[start : start + batch_size]
        input_ids, attention_mask = _right_padded([window[i]["input_ids"] for i in rows])
        final_hidden.clear()
        inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
        logits = target(**inputs, use_cache=False).logits
        if head is not None:  # a few positions show it (the whole batch would cost ~1 s)
            _check_head(head, final_hidden[-1][:1, :16], logits[:1, :16])
            head = None
        features, hidden, argmax = capture.features, final_hidden[-1], greedy_tokens(logits)
        for row, i in enumerate(rows):
            length = len(window[i]["input_ids"])
            sequences[i] = {
                "input_ids": input_ids[row, :length].int(),
                "loss_mask": torch.as_tensor(window[i]["loss_mask"], dtype=torch.uint8),
                "target_hidden_states": features[row, :length].to("cpu", dtype),
                "target_last_hidden_state": hidden[row, :length].to("cpu", dtype),
                "target_argmax": argmax[row, :length].to("cpu", torch.int32),
            }
    return sequences


def _right_padded(sequences: list) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    input_ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : lengths[row]] = torch.as_tensor(sequence)
    return input_ids, (torch.arange(input_ids.shape[1])[None] < lengths[:, None]).long()


class FeatureCacheDataset(torch.utils.data.Dataset):
    """One split of a feature cache, as a map-style dataset of per-sequence tensors (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, split: str = "train"):
        self.path = Path(path)
        index_path = self.path / INDEX_NAME
        if not index_path.is_file():
            raise ValueError(f"{self.path} is not a feature cache (no {INDEX_NAME}): build one with `osprey features`.")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != CACHE_FORMAT:
            raise ValueError(f"{self.path} has cache format {self.index.get('format')}, expected {CACHE_FORMAT}.")
        if split not in self.index["splits"]:
            raise ValueError(
                f"Feature cache {self.path} has no split {split!r}; it has {sorted(self.index['splits'])}."
            )
        self.split = split
        self.shard_paths = [self.path / split / shard["file"] for shard in self.index["splits"][split]["shards"]]
        self._locations: list[tuple[int, int, int]] = []
        for shard_id, shard_path in enumerate(self.shard_paths):
            with safe_open(shard_path, framework="pt") as shard:
                offsets = shard.get_tensor("offsets").tolist()
            self._locations += [(shard_id, start, end) for start, end in pairwise(offsets)]
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._locations)

    @property
    def lengths(self) -> list[int]:
        """Every sequence's length in tokens, from the shard offsets (no sequence is read)."""
        return [end - start for _, start, end in self._locations]

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        shard_id, start, end = self._locations[item]
        if shard_id not in self._handles:
            self._handles[shard_id] = safe_open(self.shard_paths[shard_id], framework="pt")
        shard = self._handles[shard_id]
        return {name: shard.get_slice(name)[start:end] for name in SEQUENCE_FIELDS}

    def __getstate__(self):  # open shard handles cannot be pickled into dataloader workers; they reopen lazily
        return {**self.__dict__, "_handles": {}}

    def target_head(self) -> TargetHead:
        with safe_open(self.path / HEAD_NAME, framework="pt") as tensors:
            state = {name: tensors.get_tensor(name) for name in tensors.keys()}  # noqa: SIM118 (safe_open is no dict)
        return TargetHead(state["weight"], state.get("bias"), self.index["final_logit_softcapping"])

    def check_drafter(self, drafter_config) -> None:
        """Raises unless a drafter with `drafter_config` reads exactly the features this cache holds: the cache's
        target must fit it (`OspreyConfig.check_target`) and its taps be the drafter's."""
        try:
            drafter_config.check_target(self.index["target"], target_layer_ids=self.index["target_layer_ids"])
        except ValueError as error:
            raise ValueError(
                f"Feature cache {self.path} does not fit this drafter: {error} To distill from a cache, build one "
                "with the drafter's `target_layer_ids` for its target (`osprey features`)."
            ) from error


@dataclass
class FeatureCacheArguments(DatasetArguments):
    """`osprey features`: which target, which dataset, where to; tokenization as `osprey distill` does it."""

    target_model: str | None = field(
        default=None, metadata={"help": "Zoo name, directory or Hub id of the target.", "aliases": ["--target"]}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "New directory for the feature cache.", "aliases": ["--output"]}
    )
    target_layer_ids: list[int] | None = field(
        default=None,
        metadata={
            "help": "Tap blocks, as in the drafter's config; default [1, L//2 - 1, L - 4].",
            "aliases": ["--target-layers"],
        },
    )
    max_length: int | None = field(default=2048, metadata={"help": "Truncate sequences to this many tokens."})
    max_examples: int | None = field(default=None, metadata={"help": "Use at most this many examples per split."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per target forward."})
    sort_window: int = field(
        default=64, metadata={"help": "Consecutive sequences batched by length together (1: in dataset order)."}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding plain text."})
    assistant_only_loss: bool = field(default=True, metadata={"help": "Train on assistant tokens only (chats)."})
    target_dtype: str = field(default="auto", metadata={"help": "Target dtype: auto, bfloat16 or float32."})
    target_device_map: str | None = field(
        default=None,
        metadata={"help": "Spread a target too large for one GPU over all of them (e.g. `auto`); default: one device."},
    )
    storage_dtype: str = field(default="bfloat16", metadata={"help": "Dtype of the stored hidden states."})
    shard_size_mb: int = field(default=1024, metadata={"help": "Approximate size of one shard file."})


def main(argv: list[str] | None = None) -> int:
    """`osprey features`: `--config config.yaml` and/or flags, see `osprey features --help`."""
    from trl import TrlParser

    parser = TrlParser([FeatureCacheArguments], prog="osprey features", description=__doc__)
    (args,) = parser.parse_args_and_config(argv)
    if args.target_model is None or args.dataset_name is None or args.output_dir is None:
        raise ValueError("Pass --target, --dataset-name and --output.")
    target = load_target(args.target_model, args.target_dtype, device_map=args.target_device_map)
    if args.target_device_map is None:
        target.to("cuda" if torch.cuda.is_available() else "cpu")
    layer_ids = args.target_layer_ids or default_target_layer_ids(target.config.get_text_config().num_hidden_layers)
    tokenizer = load_tokenizer(args.target_model)
    dataset = load_text_dataset(args)
    splits = {}
    for split in (args.dataset_train_split, args.dataset_test_split):
        if split in dataset:
            examples = dataset[split]
            if args.max_examples is not None and hasattr(examples, "to_iterable_dataset"):
                examples = examples.to_iterable_dataset()  # tokenize lazily: only what the first examples need
            examples = tokenize_dataset(
                examples, tokenizer, args.max_length, args.dataset_text_field, args.assistant_only_loss
            )
            splits[split] = examples if args.max_examples is None else examples.take(args.max_examples)
    path = build_feature_cache(
        target,
        splits,
        args.output_dir,
        layer_ids,
        args.batch_size,
        getattr(torch, args.storage_dtype),
        args.shard_size_mb << 20,
        target_name=args.target_model,
        sort_window=args.sort_window,
    )
    print(f"wrote the feature cache to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
