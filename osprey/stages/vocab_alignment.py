"""Give every token of a target vocabulary an embedding row and an LM-head row taken from a backbone's vocabulary.

Tokenizers spell the same text differently: GPT-2 byte-level BPE writes a leading space as `Ġ` and bytes as printable
stand-ins, SentencePiece writes `▁` and falls back to `<0x0A>`-style byte tokens. Tokens are therefore compared by the
*bytes of text* they stand for. Each target token is then, in order:

- `"direct"`: the backbone has a token for the same bytes; its rows are copied, so the drafter starts out computing
  exactly what the backbone computes on such tokens;
- `"single"` / `"averaged"`: the backbone tokenizer splits the text into one / several tokens, whose rows are averaged;
- `"special"`: a control token, mapped by rule (`map_special_tokens`) rather than by its spelling, which is not text;
- `"unmappable"`: nothing to map to (a control token without counterpart, text the backbone cannot encode); it gets
  the mean row, a neutral start that training moves;
- `"unused"`: an id without a real token (embedding rows beyond the tokenizer, llama.cpp's `[PAD<id>]` fillers).
"""

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

KINDS = ("direct", "single", "averaged", "special", "unmappable", "unused")
# Chat-turn markers that play the same role across families (ChatML, Gemma, Llama 3).
CHAT_MARKERS = (
    ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>"),
    ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"),
)
ROLES = ("eos_token", "bos_token", "pad_token", "unk_token")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_LLAMA_CPP_PADDING = re.compile(r"\[PAD(\d+)\]")
_NUM_EXAMPLES = 8


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for every byte, inverted (stand-in -> byte).

    Bytes that print as themselves (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) keep their code point; the others (controls,
    space, ...) take code points 256, 257, ... in byte order, which is why a space reads `Ġ` and a newline `Ċ`.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, shifted = {}, 256
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(shifted)] = byte
            shifted += 1
    return alphabet


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def token_bytes(tokenizer: PreTrainedTokenizerBase, num_ids: int | None = None) -> list[bytes | None]:
    """The bytes of text each id `0 .. num_ids-1` stands for, `None` for ids without a real token.

    The spelling scheme is read from the tokenizer's pipeline: byte-level BPE if a `ByteLevel` component is present,
    else `▁` stands for a space when a component mentions it, with `<0xNN>` byte tokens under byte fallback. Added
    tokens are stored verbatim.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not backed by the `tokenizers` library, whose pipeline tells how tokens "
            "spell text: load the tokenizer with `AutoTokenizer.from_pretrained(path)` (the default backend)."
        )
    vocab_size = len(tokenizer)
    added = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}
    if vocab_size <= len(added):  # e.g. the empty tokenizer transformers builds from a config when files are missing
        raise ValueError(
            f"{type(tokenizer).__name__} has no vocabulary to align (only {len(added)} control tokens): vocabulary "
            "alignment needs a `tokenizers`-backed tokenizer loaded from its files (tokenizer.json or "
            "tokenizer.model). Check that the checkpoint directory holds them."
        )
    pipeline = " ".join(repr(part) for part in (backend.normalizer, backend.pre_tokenizer, backend.decoder))
    byte_level = "ByteLevel" in pipeline
    space_marker = "▁" in pipeline
    byte_fallback = getattr(backend.model, "byte_fallback", False) or "ByteFallback" in pipeline
    num_ids = vocab_size if num_ids is None else num_ids
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(num_ids, vocab_size))))
    spellings = []
    for index, token in enumerate(tokens + [None] * (num_ids - len(tokens))):
        padding = token is not None and _LLAMA_CPP_PADDING.fullmatch(token)
        if token is None or (padding and int(padding.group(1)) == index):
            spellings.append(None)
        elif index in added:
            spellings.append(added[index].encode())
        elif byte_level and all(char in _BYTE_LEVEL_ALPHABET for char in token):
            spellings.append(bytes(_BYTE_LEVEL_ALPHABET[char] for char in token))
        elif byte_fallback and _BYTE_TOKEN.fullmatch(token):
            spellings.append(bytes([int(token[3:5], 16)]))
        else:
            spellings.append((token.replace("▁", " ") if space_marker else token).encode())
    return spellings


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of control tokens: the named special tokens and every added token flagged `special`."""
    flagged = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return flagged | set(tokenizer.all_special_ids)


def map_special_tokens(
    tokens: Sequence[str], target_tokenizer: PreTrainedTokenizerBase, source_tokenizer: PreTrainedTokenizerBase
) -> dict[str, int | None]:
    """The backbone id each target control token starts from, or `None`. Rules, first match wins:

    1. the backbone has a token spelled the same (`<|im_end|>` in both ChatML families);
    2. the token plays a role the backbone also fills (target eos -> backbone eos; likewise bos, pad, unk);
    3. it is a chat-turn marker and the backbone has the equivalent one (`<start_of_turn>` -> `<|im_start|>`);
    4. the backbone has a control token of the same name in other brackets (`<|file_sep|>` -> `<file_sep>`);
    otherwise `None`: its spelling is not text, so re-tokenising it would borrow the rows of unrelated characters.
    """
    source_vocab = source_tokenizer.get_vocab()
    by_role = {
        getattr(target_tokenizer, role): source_vocab[getattr(source_tokenizer, role)]
        for role in reversed(ROLES)  # eos wins when a target token fills several roles
        if getattr(target_tokenizer, role, None) is not None and getattr(source_tokenizer, role, None) in source_vocab
    }
    by_marker = {}
    for group in CHAT_MARKERS:
        equivalents = [source_vocab[marker] for marker in group if marker in source_vocab]
        by_marker.update({marker: equivalents[0] for marker in group if equivalents})
    by_name = {}
    for source_id in sorted(special_token_ids(source_tokenizer), reverse=True):
        by_name[_marker_name(source_tokenizer.convert_ids_to_tokens(source_id))] = source_id
    mapping = {}
    for token in tokens:
        for rule in (source_vocab, by_role, by_marker):
            if token in rule:
                mapping[token] = rule[token]
                break
        else:
            mapping[token] = by_name.get(_marker_name(token))
    return mapping


def _marker_name(token: str) -> str:
    return token.strip("<|>")


@dataclass
class VocabAlignment:
    """Per target id: the backbone ids whose rows it starts from (empty: the mean row) and how they were found."""

    source_ids: list[tuple[int, ...]]
    kinds: list[str]
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    examples: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.kinds)

    def counts(self) -> dict[str, int]:
        return {kind: self.kinds.count(kind) for kind in KINDS}

    def report(self) -> dict:
        mapped = {token: source for token, source in self.special_tokens.items() if source is not None}
        unmapped = [token for token, source in self.special_tokens.items() if source is None]
        return {
            "target_rows": len(self),
            "counts": self.counts(),
            "special_tokens": mapped,
            "unmapped_special_tokens": {"count": len(unmapped), "examples": unmapped[:_NUM_EXAMPLES]},
            "examples": self.examples,
        }

    @torch.no_grad()
    def project(self, source_rows: torch.Tensor, target_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Rows for `target_ids` (default: every target id) from a backbone matrix with one row per backbone id:
        the mean of each token's source rows (a direct token's row is copied exactly), the mean row when empty."""
        target_ids = range(len(self)) if target_ids is None else [int(index) for index in target_ids]
        bags = [self.source_ids[index] for index in target_ids]
        flat = torch.tensor([index for bag in bags for index in bag], dtype=torch.long, device=source_rows.device)
        lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.long, device=source_rows.device)
        offsets = torch.cumsum(lengths, 0) - lengths
        rows = F.embedding_bag(flat, source_rows, offsets, mode="mean")  # empty bags come out as zeros
        rows[lengths == 0] = source_rows.mean(0)
        return rows


def align_vocabularies(
    source_tokenizer: PreTrainedTokenizerBase, target_tokenizer: PreTrainedTokenizerBase, num_target_rows: int
) -> VocabAlignment:
    """Aligns target ids `0 .. num_target_rows-1` (the target's embedding rows, which may outnumber its tokens) to the
    backbone vocabulary; see the module docstring for the rules."""
    source_spellings = token_bytes(source_tokenizer)
    target_spellings = token_bytes(target_tokenizer, num_target_rows)
    source_specials, target_specials = special_token_ids(source_tokenizer), special_token_ids(target_tokenizer)
    source_tokens = source_tokenizer.convert_ids_to_tokens(list(range(len(source_spellings))))
    by_bytes: dict[bytes, int] = {}
    for fallback_pass in (False, True):  # a regular token beats a byte-fallback token spelling the same byte
        for index, (token, spelling) in enumerate(zip(source_tokens, source_spellings)):
            is_fallback = _BYTE_TOKEN.fullmatch(token or "") is not None
            if spelling and index not in source_specials and is_fallback == fallback_pass:
                by_bytes.setdefault(spelling, index)

    source_ids: list[tuple[int, ...]] = [()] * num_target_rows
    kinds = ["unmappable"] * num_target_rows
    specials = {index: target_tokenizer.convert_ids_to_tokens(index) for index in sorted(target_specials)}
    special_sources = map_special_tokens(list(specials.values()), target_tokenizer, source_tokenizer)
    special_tokens, to_encode = {}, []
    for index, spelling in enumerate(target_spellings):
        if spelling is None:
            kinds[index] = "unused"
        elif index in specials:
            source_id = special_sources[specials[index]]
            special_tokens[specials[index]] = None if source_id is None else source_tokens[source_id]
            if source_id is not None:
                source_ids[index], kinds[index] = (source_id,), "special"
        elif spelling in by_bytes:
            source_ids[index], kinds[index] = (by_bytes[spelling],), "direct"
        else:
            to_encode.append(index)

    texts, byte_wise = [], []
    for index in to_encode:
        try:
            texts.append((index, target_spellings[index].decode("utf-8")))
        except UnicodeDecodeError:  # part of a multi-byte character: map byte by byte
            byte_wise.append(index)
    encoded = (
        source_tokenizer([text for _, text in texts], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if texts
        else []
    )
    pieces_of = {index: tuple(ids) for (index, _), ids in zip(texts, encoded)}
    for index in byte_wise:
        pieces = [by_bytes.get(bytes([byte])) for byte in target_spellings[index]]
        pieces_of[index] = () if None in pieces else tuple(pieces)
    unknown = source_tokenizer.unk_token_id
    for index, pieces in pieces_of.items():
        pieces = tuple(piece for piece in pieces if piece != unknown)
        if pieces:
            source_ids[index], kinds[index] = pieces, "single" if len(pieces) == 1 else "averaged"

    examples = {kind: [] for kind in ("single", "averaged", "unmappable")}
    for index in to_encode:
        if kinds[index] in examples and len(examples[kinds[index]]) < _NUM_EXAMPLES:
            pieces = source_tokenizer.convert_ids_to_tokens(list(source_ids[index]))
            examples[kinds[index]].append([target_tokenizer.convert_ids_to_tokens(index), pieces])
    return VocabAlignment(source_ids, kinds, special_tokens, examples)


def select_draft_vocab(
    tokenizer: PreTrainedTokenizerBase, corpus: Sequence[str | os.PathLike], size: int, num_target_rows: int
) -> tuple[torch.LongTensor, dict]:
    """The `size` target ids the drafter's LM head predicts (EAGLE-3's reduced draft vocabulary), ascending.

    The named special tokens (eos, bos, pad, ...) and chat-turn markers are always kept, as a drafter that cannot
    propose eos or a turn end cannot end a sequence. The rest are the most frequent tokens of the corpus files, ties
    going to lower ids; if the corpus has fewer distinct tokens than needed, never-seen text tokens fill up, lower ids
    first, and never-seen control tokens (Gemma has 6k `<unusedN>`) last. Also returns how much of the corpus the
    selection covers.
    """
    if not 0 < size <= num_target_rows:
        raise ValueError(f"The draft vocabulary size must be in [1, {num_target_rows}], got {size}.")
    if not corpus:
        raise ValueError(
            "A reduced draft vocabulary is chosen by token frequency: pass corpus text file(s) (CLI: "
            "--draft-vocab-corpus FILE)."
        )
    counts = torch.zeros(num_target_rows, dtype=torch.long)
    for path in corpus:
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        chunks = ["".join(lines[start : start + 64]) for start in range(0, len(lines), 64)]
        encoded = tokenizer(chunks, add_special_tokens=False)["input_ids"] if chunks else []
        ids = torch.tensor([index for chunk in encoded for index in chunk], dtype=torch.long)
        counts += torch.bincount(ids, minlength=num_target_rows)
    if counts.sum() == 0:
        raise ValueError(f"The draft-vocabulary corpus {list(map(str, corpus))} contains no tokens.")
    vocab = tokenizer.get_vocab()
    markers = {vocab[marker] for group in CHAT_MARKERS for marker in group if marker in vocab}
    specials = sorted(index for index in markers | set(tokenizer.all_special_ids) if index < num_target_rows)
    if len(specials) > size:
        raise ValueError(f"A draft vocabulary of {size} cannot hold the {len(specials)} special tokens {specials}.")
    priority = counts.clone()
    unseen_controls = [index for index in special_token_ids(tokenizer) if index < num_target_rows and not counts[index]]
    priority[unseen_controls] = -1
    priority[specials] = counts.sum() + 1  # ahead of every corpus token
    chosen = torch.sort(priority, descending=True, stable=True).indices[:size].sort().values
    stats = {
        "size": size,
        "corpus": [str(path) for path in corpus],
        "corpus_tokens": int(counts.sum()),
        "corpus_coverage": round(counts[chosen].sum().item() / counts.sum().item(), 6),
    }
    return chosen, stats
