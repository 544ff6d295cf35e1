"""Turning plain text and chat conversations into the `input_ids` / `loss_mask` pairs the distillation trainer reads.

`loss_mask[i] = 1` means "token `i` is a training target": the loss is taken on the target's distribution *predicting*
that token. For a conversation only the assistant turns are targets (their end-of-turn marker included, so the drafter
learns to propose it); for plain text every token is.

Assistant tokens are found from the rendered text rather than from `{% generation %}` markers, which few chat templates
have: the assistant turn `i` spans the characters between the conversation rendered up to turn `i - 1` with the
generation prompt, and the conversation rendered up to turn `i`. This holds for every prefix-preserving template, and
is checked.
"""

import hashlib
import json
from bisect import bisect_right
from collections.abc import Sequence

from datasets import Dataset
from transformers import PreTrainedTokenizerBase


def assistant_character_spans(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict]
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered by the chat template and the `[start, end)` character spans of its assistant turns."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = (
            tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True) if index else ""
        )
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                "The chat template renders a conversation's prefix differently from the conversation itself (it is "
                "not prefix-preserving, e.g. it drops earlier reasoning), so assistant tokens cannot be located. Pass "
                "`assistant_only_loss=False` to train on every token, or use a prefix-preserving template."
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_example(
    example: dict,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    text_field: str = "text",
    assistant_only_loss: bool = True,
) -> dict[str, list[int]]:
    """`input_ids` and `loss_mask` of one example: its `messages` (a chat, rendered by the chat template) or text."""
    truncation = {"truncation": max_length is not None, "max_length": max_length}
    if example.get("messages") is None:
        if text_field not in example:
            raise ValueError(
                f"An example has neither `messages` (a chat) nor a {text_field!r} column (plain text): it has "
                f"{sorted(example)}. Set `dataset_text_field` to the text column."
            )
        input_ids = tokenizer(example[text_field], **truncation)["input_ids"]
        return {"input_ids": input_ids, "loss_mask": [1] * len(input_ids)}
    if not assistant_only_loss:
        text = tokenizer.apply_chat_template(example["messages"], tokenize=False)
        # The rendered template already holds any BOS it wants.
        input_ids = tokenizer(text, add_special_tokens=False, **truncation)["input_ids"]
        return {"input_ids": input_ids, "loss_mask": [1] * len(input_ids)}
    text, spans = assistant_character_spans(tokenizer, example["messages"])
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **truncation)
    starts = [start for start, _ in spans]
    loss_mask = []
    for token_start, _ in encoding["offset_mapping"]:
        span = bisect_right(starts, token_start) - 1
        loss_mask.append(int(span >= 0 and token_start < spans[span][1]))
    return {"input_ids": encoding["input_ids"], "loss_mask": loss_mask}


def has_training_targets(example: dict) -> bool:
    """Whether TTT gets any label: drafter position `t` first predicts token `t + 2`, so tokens 0 and 1 never count."""
    return any(example["loss_mask"][2:])


def tokenize_dataset(
    dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = None,
    text_field: str = "text",
    assistant_only_loss: bool = True,
):
    """A `datasets` dataset (streamed or not) of text or chats as `input_ids` / `loss_mask` examples, keeping only
    those with a training target; an already tokenized dataset is returned as is.

    A dataset read from files is tokenized once per corpus and tokenizer: the result is cached next to the dataset's
    own cache files under a fingerprint of the dataset, the tokenizer (vocabulary, merges, chat template), and the
    settings, and later calls load it instead of tokenizing again (datasets cannot fingerprint a tokenizer object
    itself reproducibly, so without this every start re-tokenized).
    """
    columns = dataset.column_names or list(next(iter(dataset)))  # streamed datasets may not know their columns
    if "input_ids" in columns:
        return dataset
    if tokenizer is None:
        raise ValueError("The dataset holds text or chats: pass the target's tokenizer (`processing_class`).")
    settings = {"max_length": max_length, "text_field": text_field, "assistant_only_loss": assistant_only_loss}
    fingerprint = {}
    if isinstance(dataset, Dataset):  # streamed datasets have no cache files
        key = tokenization_fingerprint(dataset._fingerprint, tokenizer, settings)
        fingerprint = {"new_fingerprint": key}
    dataset = dataset.map(
        tokenize_example, fn_kwargs={"tokenizer": tokenizer, **settings}, remove_columns=columns, **fingerprint
    )
    if fingerprint:
        fingerprint = {"new_fingerprint": f"{fingerprint['new_fingerprint']}-filtered"}
    return dataset.filter(has_training_targets, **fingerprint)


def tokenization_fingerprint(dataset_fingerprint: str, tokenizer: PreTrainedTokenizerBase, settings: dict) -> str:
    """What the tokenized dataset depends on: the dataset, the tokenizer's full definition and the settings."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = {
        "dataset": dataset_fingerprint,
        "tokenizer": backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())),
        "chat_template": tokenizer.chat_template,
        "special_tokens": tokenizer.special_tokens_map,
        "settings": settings,
        "version": 1,  # bump when tokenize_example changes what it returns
    }
    return hashlib.sha256(json.dumps(definition, sort_keys=True, default=str).encode()).hexdigest()[:32]
