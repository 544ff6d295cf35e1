"""Stage 1: prune a small pretrained causal LM to a few decoder blocks, the future drafter's backbone.

The pruned model stays an ordinary transformers checkpoint of its own family (Llama, Qwen2, Qwen3 or Gemma3), so it
can be evaluated, fine-tuned or generated from like any other before `osprey convert` turns it into a drafter.

Two strategies choose the blocks:

- `"first"` keeps blocks `0 .. N-1`, as the Osprey paper does: the kept prefix computes exactly what the full model
  computes up to block `N`, so the LM head only has to read an earlier residual stream.
- `"block-influence"` is ShortGPT's importance score (Men et al., 2024): a block whose output is nearly parallel to
  its input (cosine similarity close to 1 on calibration text) changes little and is dropped first. The `N` most
  influential blocks are kept in their original order.
"""

import argparse
import copy
import math
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from modeling_osprey.target_features import decoder_layers

from ..ground import copy_notices, require_empty_output_dir
from ..models.zoo import load_causal_lm, load_tokenizer, resolve_model_path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text")
STRATEGIES = ("first", "block-influence")


def _check_supported(model: PreTrainedModel) -> None:
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Cannot prune a {model_type!r} model ({type(model).__name__}): supported families are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (their decoder blocks live in `model.model.layers` and their config "
            "lists per-layer fields we know how to renumber). Use a Llama, Qwen2, Qwen3 or Gemma3 text checkpoint."
        )


@torch.no_grad()
def block_influence(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int = 1024
) -> list[float]:
    """ShortGPT's block influence of every decoder block: `1 - mean cos(input, output)` over all calibration tokens.

    Each text is cut into windows of `max_length` tokens, so long files are scored in one pass without padding.
    """
    layers = decoder_layers(model)
    cosine_sums = torch.zeros(len(layers), dtype=torch.float64)
    num_tokens = 0
    inputs: dict[int, torch.Tensor] = {}

    def record_input(index, module, args, kwargs):
        inputs[index] = args[0] if args else kwargs["hidden_states"]

    def accumulate(index, module, args, kwargs, output):
        output = output[0] if isinstance(output, tuple) else output
        cosine = torch.nn.functional.cosine_similarity(inputs.pop(index).float(), output.float(), dim=-1)
        cosine_sums[index] += cosine.sum().double()

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(record_input, index), with_kwargs=True))
        handles.append(layer.register_forward_hook(partial(accumulate, index), with_kwargs=True))
    try:
        for window in _token_windows(tokenizer, texts, max_length):
            model(input_ids=window.to(model.device), use_cache=False)
            num_tokens += window.numel()
    finally:
        for handle in handles:
            handle.remove()
    if num_tokens == 0:
        raise ValueError("The calibration texts contain no tokens: block influence needs some real text.")
    return (1 - cosine_sums / num_tokens).tolist()


def _token_windows(tokenizer, texts: Sequence[str], max_length: int):
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        for start in range(0, len(ids), max_length):
            yield ids[None, start : start + max_length]


def prune(
    model: PreTrainedModel,
    num_layers: int,
    strategy: str = "first",
    calibration_texts: Sequence[str] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """A new model of `model`'s class with only `num_layers` decoder blocks; `model` itself is left untouched.

    The pruned model is rebuilt from an updated config (`num_hidden_layers`, `layer_types`) and loaded with the kept
    tensors under renumbered keys, so every layer-indexed attribute (attention `layer_idx` used by KV caches, sliding
    or full attention type) is consistent by construction. `config.osprey_pruning` records which blocks were kept.
    """
    _check_supported(model)
    total = model.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}] for this {total}-block model, got {num_layers}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown pruning strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}.")
    pruning = {"strategy": strategy, "source_num_hidden_layers": total}
    if strategy == "first":
        kept = list(range(num_layers))
    else:
        if not calibration_texts or tokenizer is None:
            raise ValueError(
                "strategy='block-influence' scores blocks on calibration text: pass `calibration_texts` and the "
                "model's `tokenizer` (CLI: --calibration-file FILE)."
            )
        scores = block_influence(model, tokenizer, calibration_texts)
        kept = sorted(sorted(range(total), key=lambda i: -scores[i])[:num_layers])
        pruning["block_influence"] = [round(score, 6) for score in scores]
    pruning["kept_layers"] = kept
    return _rebuild(model, kept, pruning)


def _rebuild(model: PreTrainedModel, kept: list[int], pruning: dict) -> PreTrainedModel:
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [model.config.layer_types[i] for i in kept]
    config.osprey_pruning = pruning
    new_index = {old: new for new, old in enumerate(kept)}
    state_dict = {}
    for name, tensor in model.state_dict().items():
        prefix, separator, rest = name.partition(".layers.")
        if separator:
            old, _, suffix = rest.partition(".")
            if int(old) not in new_index:
                continue
            name = f"{prefix}.layers.{new_index[int(old)]}.{suffix}"
        state_dict[name] = tensor.clone()
    with init_empty_weights(include_buffers=False):  # buffers (RoPE frequencies) are not all in the state dict
        pruned = type(model)(config)
    pruned.load_state_dict(state_dict, strict=True, assign=True)
    pruned.tie_weights()  # a no-op unless the config ties the LM head to the embeddings
    pruned.generation_config = model.generation_config
    return pruned.to(model.device).eval()


@torch.no_grad()
def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str, max_length: int = 1024) -> float:
    """Perplexity of `text` in non-overlapping windows of `max_length` tokens (every token but a window's first)."""
    total_loss, total_tokens = 0.0, 0
    for window in _token_windows(tokenizer, [text], max_length):
        if window.shape[1] < 2:
            continue
        loss = model(input_ids=window.to(model.device), labels=window.to(model.device), use_cache=False).loss
        total_loss += loss.item() * (window.shape[1] - 1)
        total_tokens += window.shape[1] - 1
    if total_tokens == 0:
        raise ValueError("The evaluation text has fewer than two tokens: perplexity is undefined.")
    return math.exp(total_loss / total_tokens)


def add_subcommand(subparsers) -> None:
    """Adds `osprey prune` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "prune",
        help="keep N decoder blocks of a small pretrained LM (stage 1)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backbone", "--model", required=True, help="the small LM to prune: zoo name, checkpoint directory or Hub id"
    )
    parser.add_argument("--num-layers", type=int, required=True, help="number of decoder blocks to keep")
    parser.add_argument("--output", required=True, help="new (or empty) directory for the pruned checkpoint")
    parser.add_argument("--strategy", choices=STRATEGIES, default="first", help="how to choose the blocks")
    parser.add_argument("--calibration-file", help="UTF-8 text file scored by --strategy block-influence")
    parser.add_argument(
        "--eval-file", nargs="+", default=[], metavar="FILE", help="print full and pruned perplexity on text file(s)"
    )
    parser.set_defaults(run=_run_prune)


def _run_prune(args) -> int:
    output = require_empty_output_dir(args.output)
    if args.strategy == "block-influence" and not args.calibration_file:
        raise ValueError("--strategy block-influence needs --calibration-file FILE (plain text to score blocks on).")
    calibration = [Path(args.calibration_file).read_text(encoding="utf-8")] if args.calibration_file else None
    source_dir = resolve_model_path(args.backbone)
    tokenizer = load_tokenizer(source_dir)
    model = load_causal_lm(source_dir).eval()
    pruned = prune(model, args.num_layers, args.strategy, calibration_texts=calibration, tokenizer=tokenizer)
    pruning = pruned.config.osprey_pruning
    print(f"kept blocks {pruning['kept_layers']} of {pruning['source_num_hidden_layers']} ({args.strategy})")
    if "block_influence" in pruning:
        print("block influence:", ", ".join(f"{i}: {s:.4f}" for i, s in enumerate(pruning["block_influence"])))
    for path in args.eval_file:
        text = Path(path).read_text(encoding="utf-8")
        full, kept = perplexity(model, tokenizer, text), perplexity(pruned, tokenizer, text)
        print(f"perplexity on {path}: full model {full:.2f}, pruned {kept:.2f}")
    pruned.save_pretrained(output)
    tokenizer.save_pretrained(output)
    copy_notices(source_dir, output)
    print(f"saved the pruned model to {output}")
    return 0
