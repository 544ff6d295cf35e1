"""Vocabulary alignment on small hand-built tokenizers: a GPT-2-style byte-level BPE (`Ġ` spaces) as the backbone and
a SentencePiece-style BPE (`▁` spaces, `<0xNN>` byte fallback) as the target, so every rule is exercised on tokens
whose fate is known in advance. `tests/test_convert.py` reuses the builders."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from osprey.stages.vocab_alignment import align_vocabularies, select_draft_vocab, token_bytes

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>")
GEMMA_STYLE = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<|file_sep|>")
SOURCE_WORDS = (" hello", "hello", " world", " the", " wonder", "fi", "\n\n", "你")
TARGET_WORDS = (" hello", "hello", " world", " the", " wonderful", "ﬁ", " 你好")


def _merged_vocab(vocab: dict[str, int], spellings) -> list[tuple[str, str]]:
    """Adds every spelling to `vocab` through left-to-right merges (so all its prefixes become tokens too)."""
    merges = []
    for spelling in spellings:
        for end in range(2, len(spelling) + 1):
            if spelling[:end] not in vocab:
                merges.append((spelling[: end - 1], spelling[end - 1]))
                vocab[spelling[:end]] = len(vocab)
    return merges


def byte_level_tokenizer(words=SOURCE_WORDS, specials=CHATML, missing_bytes=(), normalizer=None):
    """A GPT-2-style byte-level BPE over `words` (plain text), lacking the stand-ins of `missing_bytes`.

    GPT-2's alphabet maps printable Latin-1 bytes to themselves, so `chr(byte)` is the stand-in of such a byte.
    """
    to_stand_ins = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    spellings = [to_stand_ins.pre_tokenize_str(word)[0][0] for word in words]
    missing = {to_stand_ins.pre_tokenize_str(chr(byte))[0][0] if byte < 0x80 else chr(byte) for byte in missing_bytes}
    vocab = {token: index for index, token in enumerate(specials)}
    for char in sorted(set(pre_tokenizers.ByteLevel.alphabet()) - missing):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merged_vocab(vocab, spellings)))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=specials[1], eos_token=specials[2], unk_token=specials[0]
    )


def metaspace_tokenizer(words=TARGET_WORDS, specials=GEMMA_STYLE):
    """A SentencePiece-style BPE: spaces read `▁`, bytes outside the vocabulary fall back to `<0xNN>` tokens."""
    spellings = [word.replace(" ", "▁") for word in words]
    vocab = {token: index for index, token in enumerate(specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in sorted({char for spelling in spellings for char in spelling} | set("abcdefghijklmnopqrstuvwxyz")):
        vocab.setdefault(char, len(vocab))
    merges = _merged_vocab(vocab, spellings)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def source():
    return byte_level_tokenizer(missing_bytes=(0x04, 0xFF))


@pytest.fixture(scope="module")
def target():
    return metaspace_tokenizer()


@pytest.fixture(scope="module")
def alignment(source, target):
    return align_vocabularies(source, target, len(target) + 3)


def _kind_and_pieces(alignment, source, target, token):
    index = target.convert_tokens_to_ids(token)
    return alignment.kinds[index], source.convert_ids_to_tokens(list(alignment.source_ids[index]))


def test_token_bytes_reads_both_spelling_schemes(source, target):
    source_bytes, target_bytes = token_bytes(source), token_bytes(target)
    assert source_bytes[source.convert_tokens_to_ids("Ġhello")] == b" hello"
    assert source_bytes[source.convert_tokens_to_ids("ĊĊ")] == b"\n\n"
    assert target_bytes[target.convert_tokens_to_ids("▁hello")] == b" hello"
    assert target_bytes[target.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert target_bytes[target.convert_tokens_to_ids("<eos>")] == b"<eos>"
    assert token_bytes(target, len(target) + 2)[-2:] == [None, None]


@pytest.mark.parametrize(
    "token, pieces",
    [
        ("▁hello", ["Ġhello"]),  # space markers normalised
        ("hello", ["hello"]),
        ("▁world", ["Ġworld"]),
        ("<0x0A>", ["Ċ"]),  # byte fallback
        ("<0xE4>", ["ä"]),  # a lone byte of a multi-byte character, present in both vocabularies
        ("▁", ["Ġ"]),
    ],
)
def test_same_text_is_mapped_directly(alignment, source, target, token, pieces):
    assert _kind_and_pieces(alignment, source, target, token) == ("direct", pieces)


def test_text_unknown_to_the_backbone_is_retokenised_and_averaged(alignment, source, target):
    assert _kind_and_pieces(alignment, source, target, "▁wonderful") == ("averaged", ["Ġwonder", "f", "u", "l"])
    # " 你好" is valid text the backbone splits; "你" has its own backbone token but "好" is three byte tokens.
    kind, pieces = _kind_and_pieces(alignment, source, target, "▁你好")
    assert kind == "averaged" and pieces[0] == "Ġ" and len(pieces) == 5


def test_partial_characters_are_mapped_byte_by_byte(source):
    target = byte_level_tokenizer(words=("好",), specials=CHATML)  # its merges create the 2-byte prefix of 好
    prefix = target.convert_tokens_to_ids("å¥")  # b"\xe5\xa5": not valid UTF-8 on its own, unknown to the backbone
    alignment = align_vocabularies(source, target, len(target))
    assert alignment.kinds[prefix] == "averaged"
    assert source.convert_ids_to_tokens(list(alignment.source_ids[prefix])) == ["å", "¥"]


def test_text_the_backbone_normalises_to_one_token_is_single(target):
    nfkc_source = byte_level_tokenizer(normalizer=normalizers.NFKC())  # "ﬁ" (one ligature) normalises to "fi"
    alignment = align_vocabularies(nfkc_source, target, len(target))
    assert _kind_and_pieces(alignment, nfkc_source, target, "ﬁ") == ("single", ["fi"])


def test_bytes_the_backbone_cannot_encode_are_unmappable(alignment, source, target):
    assert _kind_and_pieces(alignment, source, target, "<0x04>") == ("unmappable", [])  # valid text, no token
    assert _kind_and_pieces(alignment, source, target, "<0xFF>") == ("unmappable", [])  # never valid UTF-8
    assert alignment.report()["examples"]["unmappable"][:2] == [["<0x04>", []], ["<0xFF>", []]]


def test_control_tokens_are_mapped_by_rule(alignment, source, target):
    assert alignment.special_tokens == {
        "<pad>": None,  # the backbone has no pad token
        "<eos>": "<|im_end|>",  # role: eos -> eos
        "<bos>": "<|im_start|>",
        "<unk>": "<|endoftext|>",
        "<mask>": None,
        "<start_of_turn>": "<|im_start|>",  # equivalent chat marker
        "<end_of_turn>": "<|im_end|>",
        "<|file_sep|>": "<file_sep>",  # same name, other brackets
    }
    assert _kind_and_pieces(alignment, source, target, "<end_of_turn>") == ("special", ["<|im_end|>"])
    assert _kind_and_pieces(alignment, source, target, "<mask>") == ("unmappable", [])


def test_same_spelled_control_tokens_win_and_backbone_controls_never_match_text(source):
    target = byte_level_tokenizer(words=("<file_sep>", " hello"), specials=("<|im_end|>", "<|im_start|>", "<s>"))
    alignment = align_vocabularies(source, target, len(target))
    # The builder makes the third control token the eos: "<s>" reaches the backbone's eos by role.
    assert alignment.special_tokens == {"<|im_end|>": "<|im_end|>", "<|im_start|>": "<|im_start|>", "<s>": "<|im_end|>"}
    # Plain text that happens to spell a backbone control token is text: it never borrows the control token's rows.
    kind, pieces = _kind_and_pieces(alignment, source, target, "<file_sep>")
    assert kind == "averaged" and "<file_sep>" not in pieces


def test_rows_without_a_token_are_unused(alignment, source, target):
    assert alignment.kinds[len(target) :] == ["unused"] * 3
    padded = metaspace_tokenizer()
    padded.add_tokens([f"[PAD{len(padded)}]", "[PAD999]"])  # llama.cpp's filler names its own id; text otherwise
    assert align_vocabularies(source, padded, len(padded)).kinds[-2:] == ["unused", "averaged"]


def test_report_counts_every_row_once_and_is_json(alignment, target):
    report = json.loads(json.dumps(alignment.report()))
    assert sum(report["counts"].values()) == report["target_rows"] == len(target) + 3
    assert report["counts"]["special"] == 6 and report["unmapped_special_tokens"] == {
        "count": 2,
        "examples": ["<pad>", "<mask>"],
    }


def test_project_copies_averages_and_fills_with_the_mean(alignment, source, target):
    rows = torch.randn(len(source), 8, dtype=torch.float64)
    projected = alignment.project(rows)
    assert projected.shape == (len(target) + 3, 8)
    for index, (kind, pieces) in enumerate(zip(alignment.kinds, alignment.source_ids)):
        expected = rows[list(pieces)].mean(0) if pieces else rows.mean(0)
        if kind == "direct":
            assert torch.equal(projected[index], rows[pieces[0]])
        torch.testing.assert_close(projected[index], expected)
    subset = [target.convert_tokens_to_ids("▁hello"), len(target) + 1]
    torch.testing.assert_close(alignment.project(rows, subset), projected[subset])


def test_a_tokenizer_without_vocabulary_is_refused(target):
    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="no vocabulary"):
        align_vocabularies(empty, target, len(target))
    controls_only = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<eos>")
    with pytest.raises(ValueError, match=r"no vocabulary to align \(only 1 control tokens\)"):
        align_vocabularies(byte_level_tokenizer(), controls_only, 8)


# --- reduced draft vocabulary ------------------------------------------------------------------------------------


def test_draft_vocab_keeps_the_named_control_tokens_then_the_most_frequent(target, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" hello hello hello world world\n")  # ▁hello x3, ▁world x2, <0x0A> x1
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    for size, frequent in [(8, ["▁hello", "▁world"]), (9, ["▁hello", "▁world", "<0x0A>"])]:
        ids, stats = select_draft_vocab(target, [corpus], size=size, num_target_rows=len(target))
        assert ids.tolist() == sorted(target.convert_tokens_to_ids(controls + frequent))  # `draft_to_target` order
    assert stats == {"size": 9, "corpus": [str(corpus)], "corpus_tokens": 6, "corpus_coverage": 1.0}
    ids, stats = select_draft_vocab(target, [corpus], size=7, num_target_rows=len(target))
    assert target.convert_ids_to_tokens(ids.tolist())[-1] == "▁hello" and stats["corpus_coverage"] == 0.5


def test_draft_vocab_fills_with_text_tokens_before_unseen_control_tokens(target, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    ids, stats = select_draft_vocab(target, [corpus], size=len(target) - 2, num_target_rows=len(target))
    assert stats["corpus_coverage"] == 1.0
    left_out = set(range(len(target))) - set(ids.tolist())
    assert target.convert_ids_to_tokens(sorted(left_out)) == ["<mask>", "<|file_sep|>"]


def test_draft_vocab_needs_a_corpus_and_a_sensible_size(target, tmp_path):
    with pytest.raises(ValueError, match="--draft-vocab-corpus"):
        select_draft_vocab(target, [], size=8, num_target_rows=len(target))
    with pytest.raises(ValueError, match=r"must be in \[1,"):
        select_draft_vocab(target, [tmp_path], size=0, num_target_rows=len(target))
    (tmp_path / "corpus.txt").write_text("hello")
    with pytest.raises(ValueError, match="cannot hold"):
        select_draft_vocab(target, [tmp_path / "corpus.txt"], size=3, num_target_rows=len(target))
