"""Stage 3: turn a pruned backbone into a function-preserving Osprey drafter for one target LLM.

The drafter reads target token ids, so its embedding and LM head are re-indexed to the target vocabulary
(`osprey.stages.vocab_alignment`). Its fusion block reads `[hidden_norm(fc(target taps)) ; input_layernorm(tokens)]`:
the q/k/v columns over the target features start at zero, so before any training the drafter computes exactly what the
backbone computes, whatever the target's hidden states are. `fc` starts as the identity on the deepest tap, so the first
gradient steps see meaningful target features instead of noise.

Only the target's config and tokenizer are read, never its weights.
"""

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from modeling_osprey import OspreyConfig, OspreyForDrafting
from modeling_osprey.configuration_osprey import DRAFTING_DEFAULTS
from modeling_osprey.target_features import default_target_layer_ids, validate_target_layer_ids

from ..ground import copy_notices, require_empty_output_dir
from ..models import zoo
from ..models.pack import load_drafter
from .presets import AUTO, PRESET_CHOICES, TargetPreset, end_of_turn_token_ids, merged_eos_token_ids, resolve_preset
from .vocab_alignment import align_vocabularies, select_draft_vocab

SUPPORTED_BACKBONES = ("llama", "qwen2", "qwen3")


def drafter_config(
    backbone_config: PreTrainedConfig,
    target_config: PreTrainedConfig,
    target_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    preset: TargetPreset | None = None,
    target_name_or_path: str | None = None,
) -> OspreyConfig:
    """The drafter's config: block shapes from the backbone, vocabulary, tap layers and special ids from the target.
    Taps are `target_layer_ids`, else the `preset`'s, else EAGLE-3's default. `target_name_or_path` (default: the
    target config's own) is recorded as the target the drafter is for."""
    _check_backbone(backbone_config)
    target = target_config.get_text_config()
    num_target_layers = target.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = preset.target_layer_ids if preset else default_target_layer_ids(num_target_layers)
    target_layer_ids = list(validate_target_layer_ids(list(target_layer_ids), num_target_layers))
    return OspreyConfig(
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size,
        hidden_size=backbone_config.hidden_size,
        intermediate_size=backbone_config.intermediate_size,
        num_hidden_layers=backbone_config.num_hidden_layers,
        num_attention_heads=backbone_config.num_attention_heads,
        num_key_value_heads=backbone_config.num_key_value_heads,
        head_dim=getattr(backbone_config, "head_dim", None),
        hidden_act=backbone_config.hidden_act,
        attention_bias=backbone_config.model_type == "qwen2",
        use_qk_norm=backbone_config.model_type == "qwen3",
        rms_norm_eps=backbone_config.rms_norm_eps,
        rope_theta=backbone_config.rope_parameters["rope_theta"],
        max_position_embeddings=backbone_config.max_position_embeddings,
        tie_word_embeddings=False,
        target_hidden_size=target.hidden_size,
        target_layer_ids=target_layer_ids,
        target_model_type=target_config.model_type,
        target_name_or_path=target_name_or_path or target_config.name_or_path or None,
        backbone_model_type=backbone_config.model_type,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
    )


def _check_backbone(config: PreTrainedConfig) -> None:
    """Refuses backbones whose blocks `OspreyForDrafting` cannot reproduce exactly (function preservation)."""
    model_type = config.model_type
    if model_type.startswith("gemma"):
        raise ValueError(
            f"A {model_type!r} backbone cannot be converted: Gemma blocks scale embeddings by sqrt(hidden_size), use "
            "sandwich norms, (1 + w) RMSNorm and GeLU, while OspreyForDrafting implements Llama/Qwen-style blocks. "
            f"Prune a {'/'.join(SUPPORTED_BACKBONES)} model as the backbone (e.g. smollm2-135m-instruct); Gemma3 "
            "models are fine as targets."
        )
    if model_type not in SUPPORTED_BACKBONES:
        raise ValueError(
            f"Unsupported backbone architecture {model_type!r}: supported are {', '.join(SUPPORTED_BACKBONES)}. "
            "Prune one of those with `osprey prune` and convert that."
        )
    unsupported = []
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported.append(f"RoPE {rope} (only unscaled, full-width default RoPE)")
    if model_type != "qwen2" and getattr(config, "attention_bias", False):
        unsupported.append("attention_bias=True (biases on o_proj)")
    if getattr(config, "mlp_bias", False):
        unsupported.append("mlp_bias=True")
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        unsupported.append("sliding-window attention layers")
    if unsupported:
        raise ValueError(
            f"This {model_type} backbone uses {'; '.join(unsupported)}, which OspreyForDrafting does not implement, so "
            "the converted drafter would not compute what the backbone does. Use a backbone without them."
        )


@torch.no_grad()
def drafter_state_dict(backbone: PreTrainedModel, config: OspreyConfig, alignment, draft_to_target) -> dict:
    """The drafter's tensors from the backbone's, re-indexed to the target vocabulary (see the module docstring)."""
    source = dict(backbone.state_dict())
    embeddings = source.pop("model.embed_tokens.weight")
    lm_head = source.pop("lm_head.weight", embeddings)  # tied backbones share one matrix
    hidden = config.hidden_size
    fc = torch.zeros(hidden, config.fused_feature_size, dtype=embeddings.dtype)
    width = min(hidden, config.target_hidden_size)
    deepest = (len(config.target_layer_ids) - 1) * config.target_hidden_size
    fc[:width, deepest : deepest + width] = torch.eye(width, dtype=fc.dtype)
    state = {
        "model.embed_tokens.weight": alignment.project(embeddings),
        "lm_head.weight": alignment.project(lm_head, draft_to_target.tolist()),
        "model.fc.weight": fc,
        "model.layers.0.hidden_norm.weight": source["model.layers.0.input_layernorm.weight"].clone(),
        "draft_to_target": draft_to_target,
    }
    fusion_qkv = tuple(f"model.layers.0.self_attn.{name}_proj.weight" for name in "qkv")
    for name, tensor in source.items():
        if name in fusion_qkv:
            tensor = torch.cat([torch.zeros_like(tensor), tensor], dim=1)  # [0 | W]: target features start unread
        state[name] = tensor.clone()
    with init_empty_weights(include_buffers=False):
        expected = OspreyForDrafting(config).state_dict().keys()
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(
            f"The backbone has tensors the drafter has no place for: {unexpected[:8]}. It is not a plain "
            f"{config.backbone_model_type} checkpoint; convert an unmodified (only pruned) one."
        )
    return state


def convert(
    backbone: str | os.PathLike | PreTrainedModel,
    target: str | os.PathLike | PreTrainedConfig,
    target_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    corpus: Sequence[str | os.PathLike] | None = None,
    *,
    backbone_tokenizer: PreTrainedTokenizerBase | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    output_dir: str | os.PathLike | None = None,
    preset: str | None = AUTO,
    draft_vocab_from: str | os.PathLike | None = None,
) -> tuple[OspreyForDrafting, dict]:
    """Converts a (pruned) backbone into a drafter for `target`; returns it with the conversion report.

    `backbone` is a zoo name, checkpoint directory or Hub id, or a loaded model (then pass `backbone_tokenizer`);
    `target` likewise, or a config (then pass `target_tokenizer`). With `draft_vocab_size`, the LM head predicts only
    the most frequent target tokens of the `corpus` text files. With `output_dir` (new or empty), the drafter is saved
    there with the target's tokenizer, `alignment_report.json` and a generation config drafting 5 tokens per step.
    `preset` (`osprey.stages.presets`: a name, `"auto"` or `"none"`) supplies the taps when `target_layer_ids` is None
    and adds a seed target's end-of-turn tokens to the generation config's eos ids. `draft_vocab_from` (a drafter for
    the same target, anything `load_drafter` accepts) gives the drafter exactly that drafter's draft vocabulary instead
    of counting a corpus: to compare backbones, or to rebuild a drafter whose corpus cannot be rebuilt.
    """
    output_dir = None if output_dir is None else require_empty_output_dir(output_dir)
    target_config, target_tokenizer, target_dir = _load_target(target, target_tokenizer)
    taken_vocab = None
    if draft_vocab_from is not None:
        if corpus:
            raise ValueError(
                "Pass either draft-vocabulary corpus files (--draft-vocab-corpus) or a drafter whose draft vocabulary "
                "to take (--draft-vocab-from), not both."
            )
        taken_vocab = draft_vocabulary_of(draft_vocab_from, target_config.vocab_size)
        if draft_vocab_size not in (None, len(taken_vocab)):
            raise ValueError(
                f"{draft_vocab_from} predicts {len(taken_vocab)} target tokens, not the {draft_vocab_size} asked for: "
                "drop --draft-vocab-size (it is taken from that drafter)."
            )
        draft_vocab_size = len(taken_vocab)
    target_preset = resolve_preset(target_config, preset)
    if isinstance(backbone, PreTrainedModel):
        if backbone_tokenizer is None:
            raise ValueError("Pass `backbone_tokenizer` with a loaded backbone: the alignment needs its vocabulary.")
        backbone_dir, backbone_config = None, backbone.config
    else:
        backbone_dir = zoo.resolve_model_path(backbone)
        backbone_config = AutoConfig.from_pretrained(backbone_dir)
    # The target as the user named it (zoo name, Hub id, path), which demos and the Space load again.
    target_name = None if isinstance(target, PreTrainedConfig) else os.fspath(target)
    config = drafter_config(
        backbone_config, target_config, target_layer_ids, draft_vocab_size, target_preset, target_name
    )
    if backbone_dir is not None:
        backbone_tokenizer = backbone_tokenizer or zoo.load_tokenizer(backbone_dir)
        backbone = zoo.load_causal_lm(backbone_dir)
    alignment = align_vocabularies(backbone_tokenizer, target_tokenizer, config.vocab_size)
    draft_vocab = None
    if taken_vocab is not None:
        draft_to_target, draft_vocab = taken_vocab, {"size": len(taken_vocab), "from": os.fspath(draft_vocab_from)}
    elif config.draft_vocab_size == config.vocab_size:
        draft_to_target = torch.arange(config.vocab_size)
    else:
        draft_to_target, draft_vocab = select_draft_vocab(
            target_tokenizer, corpus or [], config.draft_vocab_size, config.vocab_size
        )
    with init_empty_weights(include_buffers=False):
        drafter = OspreyForDrafting(config)
    drafter.load_state_dict(drafter_state_dict(backbone, config, alignment, draft_to_target), strict=True, assign=True)
    drafter.eval()
    drafter.generation_config = GenerationConfig(
        **DRAFTING_DEFAULTS,
        bos_token_id=config.bos_token_id,
        eos_token_id=merged_eos_token_ids(config.eos_token_id, end_of_turn_token_ids(target_preset, target_tokenizer)),
        pad_token_id=config.pad_token_id,
    )
    report = {
        "backbone": getattr(backbone.config, "name_or_path", None) or str(backbone_dir),
        "target": target_config.name_or_path,
        "backbone_model_type": config.backbone_model_type,
        "target_model_type": config.target_model_type,
        "preset": None if target_preset is None else target_preset.name,
        "num_hidden_layers": config.num_hidden_layers,
        "pruning": getattr(backbone.config, "osprey_pruning", None),
        "target_layer_ids": config.target_layer_ids,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "draft_vocab": draft_vocab,
        "alignment": alignment.report(),
    }
    if output_dir is not None:
        drafter.save_pretrained(output_dir)
        target_tokenizer.save_pretrained(output_dir)
        (output_dir / "alignment_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        for directory in (backbone_dir, target_dir):
            if directory is not None:
                copy_notices(directory, output_dir)
    return drafter, report


def retarget(
    drafter: str | os.PathLike, target: str | os.PathLike, output_dir: str | os.PathLike | None = None
) -> tuple[OspreyForDrafting, dict]:
    """A drafter made for one target, as the starting point for another of the same shape (its fine-tune, its next
    version): weights, draft vocabulary and taps are kept, and the drafter records the new target. Returns it with a
    report naming its parent; with `output_dir` (new or empty) it is saved there like `convert`'s output.

    Refuses, naming why, a target the drafter cannot serve: another vocabulary or tokenizer (its token ids would mean
    other text), another hidden size (its `fc` reads the taps at that width), or another layer count or preset (the
    taps it was trained on would not be the ones this target is tapped at)."""
    output_dir = None if output_dir is None else require_empty_output_dir(output_dir)
    parent = load_drafter(drafter)
    config = parent.config
    target_config, target_tokenizer, target_dir = _load_target(target, None)
    text_config = target_config.get_text_config()
    config.check_target(
        {name: getattr(text_config, name) for name in ("vocab_size", "hidden_size", "num_hidden_layers")},
        name_or_path="",  # another target than the one it was made for is the point
    )
    preset = resolve_preset(target_config)
    taps = preset.target_layer_ids if preset else default_target_layer_ids(text_config.num_hidden_layers)
    if list(taps) != config.target_layer_ids:
        raise ValueError(
            f"{drafter} taps blocks {config.target_layer_ids}, and {os.fspath(target)} "
            f"({text_config.num_hidden_layers} blocks) would be tapped at {list(taps)}: another layer count or family, "
            "so the drafter's taps would read other features. Adapt from the backbone instead (drop --from-drafter)."
        )
    parent_vocabulary = zoo.load_tokenizer(drafter).get_vocab()
    if parent_vocabulary != target_tokenizer.get_vocab():
        differ = len(set(parent_vocabulary.items()) ^ set(target_tokenizer.get_vocab().items()))
        raise ValueError(
            f"{drafter} speaks its target's tokenizer, and {os.fspath(target)}'s differs ({differ} token-id pairs): "
            "its token ids would mean other text. Adapt from the backbone instead (drop --from-drafter)."
        )
    config.target_name_or_path = os.fspath(target)
    config.target_model_type = text_config.model_type
    parent_report = Path(drafter) / "alignment_report.json"
    report = {
        **(json.loads(parent_report.read_text()) if parent_report.is_file() else {}),
        "target": target_config.name_or_path,
        "target_model_type": config.target_model_type,
        "parent": os.fspath(drafter),
    }
    if output_dir is not None:
        parent.save_pretrained(output_dir)
        target_tokenizer.save_pretrained(output_dir)
        (output_dir / "alignment_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        for directory in (drafter, target_dir):
            if directory is not None and os.path.isdir(directory):
                copy_notices(directory, output_dir)
    return parent, report


def draft_vocabulary_of(drafter: str | os.PathLike, vocab_size: int) -> torch.LongTensor:
    """The ascending target ids that `drafter` (anything `load_drafter` accepts) predicts; it must have been
    converted for a target with `vocab_size` rows."""
    model = load_drafter(drafter)
    if model.config.vocab_size != vocab_size:
        raise ValueError(
            f"{drafter} was converted for a target with {model.config.vocab_size} vocabulary rows, this target has "
            f"{vocab_size}: take the draft vocabulary from a drafter for the same target (or its tokenizer)."
        )
    return model.draft_to_target.clone()


def _load_target(target, tokenizer) -> tuple[PreTrainedConfig, PreTrainedTokenizerBase, str | None]:
    """The target's config and tokenizer, without its weights (a zoo name is built once, like any zoo fetch)."""
    if isinstance(target, PreTrainedConfig):
        if tokenizer is None:
            raise ValueError("Pass `target_tokenizer` with a target config: the drafter's vocabulary is the target's.")
        return target, tokenizer, None
    location = str(zoo.fetch(target)) if zoo.is_zoo_name(target) else str(target)
    config = AutoConfig.from_pretrained(location)
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(location)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"Could not load the tokenizer of target {location}: the drafter speaks the target's vocabulary, so "
                "the target checkpoint must include its tokenizer files (tokenizer.json or tokenizer.model). Save "
                f"them there with `tokenizer.save_pretrained`. ({type(error).__name__}: {error})"
            ) from error
    return config, tokenizer, location if os.path.isdir(location) else None


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated block indices such as 1,13,24, got {text!r}"
        ) from None


def add_subcommand(subparsers) -> None:
    """Adds `osprey convert` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "convert",
        help="turn a pruned backbone into a drafter for a target LLM (stage 3)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backbone", required=True, help="pruned backbone: zoo name, checkpoint directory or Hub id")
    parser.add_argument("--target", required=True, help="target LLM (only its config and tokenizer are read)")
    parser.add_argument("--output", required=True, help="new (or empty) directory for the drafter")
    parser.add_argument(
        "--target-layers",
        type=_layer_ids,
        help="target blocks to tap, e.g. 1,13,24 (default: the preset's, else [1, L//2-1, L-4])",
    )
    parser.add_argument(
        "--preset",
        default=AUTO,
        choices=PRESET_CHOICES,
        help="seed-target preset (taps, end-of-turn tokens); auto: the one matching the target's config",
    )
    parser.add_argument("--draft-vocab-size", type=int, help="predict only the K most frequent target tokens")
    parser.add_argument("--draft-vocab-corpus", nargs="+", metavar="FILE", help="text file(s) to count tokens on")
    parser.add_argument(
        "--draft-vocab-from",
        metavar="DRAFTER",
        help="take the draft vocabulary of this drafter for the same target (directory, packed directory or Hub id) "
        "instead of counting a corpus",
    )
    parser.set_defaults(run=_run_convert)


def _run_convert(args) -> int:
    _, report = convert(
        args.backbone,
        args.target,
        target_layer_ids=args.target_layers,
        draft_vocab_size=args.draft_vocab_size,
        corpus=args.draft_vocab_corpus,
        output_dir=args.output,
        preset=args.preset,
        draft_vocab_from=args.draft_vocab_from,
    )
    alignment = report["alignment"]
    print(f"target rows: {alignment['target_rows']}; " + ", ".join(f"{k} {v}" for k, v in alignment["counts"].items()))
    print("special tokens:", ", ".join(f"{t} -> {s}" for t, s in alignment["special_tokens"].items()))
    draft_vocab = report["draft_vocab"] or {}
    if "from" in draft_vocab:
        print(f"draft vocabulary: the {draft_vocab['size']} tokens of {draft_vocab['from']}")
    elif draft_vocab:
        size, coverage = draft_vocab["size"], draft_vocab["corpus_coverage"]
        print(f"draft vocabulary: {size} tokens cover {coverage:.2%} of the corpus")
    print(f"target preset: {report['preset'] or 'none'}; taps {report['target_layer_ids']}")
    print(f"saved the drafter to {args.output} (report: alignment_report.json)")
    return 0
