"""The controls Osprey is measured against, built in the Osprey drafter format so that one distillation and one
decoding path serve all three drafters and only what the paper says matters differs between them.

- `scratch` (the paper's "body-random" control): an Osprey drafter whose decoder blocks are re-initialised at random.
  Vocabulary alignment, embedding, LM head, taps and draft vocabulary stay; only the pretrained body is gone.
- `eagle3`: an EAGLE-3 drafter for the target: one block at the target's hidden size whose residual is the fused
  feature stream (`residual_stream="features"`), the target's own input embedding (kept frozen during distillation:
  `freeze_embeddings` in `osprey distill`), a randomly initialised body and LM head, and the same taps and draft
  vocabulary as a reference Osprey drafter.
"""

import argparse
import copy
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from modeling_osprey import OspreyConfig, OspreyForDrafting
from modeling_osprey.modeling_osprey import OspreyRMSNorm

from ..ground import read_input_embedding, require_empty_output_dir
from ..models import zoo
from ..models.pack import load_drafter

BASELINES = ("scratch", "eagle3")


@torch.no_grad()
def scratch_drafter(drafter: OspreyForDrafting, seed: int = 0) -> OspreyForDrafting:
    """A copy of `drafter` with every decoder block re-initialised (normal(0, initializer_range) linears, unit
    norms), the feature half of the fusion block's q/k/v included: a random body has no function to preserve."""
    scratch = copy.deepcopy(drafter)
    generator = torch.Generator().manual_seed(seed)
    for module in scratch.model.layers.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(
                torch.randn(module.weight.shape, generator=generator) * drafter.config.initializer_range
            )
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, OspreyRMSNorm):
            module.weight.fill_(1.0)
    return scratch


def eagle3_config(reference: OspreyConfig, target_config) -> OspreyConfig:
    """One Llama-style block at the target's width, reading the reference drafter's taps and draft vocabulary."""
    target = target_config.get_text_config()
    rope = getattr(target, "rope_parameters", None) or {}
    return OspreyConfig(
        vocab_size=reference.vocab_size,
        draft_vocab_size=reference.draft_vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=getattr(target, "head_dim", None),
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=rope.get("rope_theta", reference.rope_theta),
        max_position_embeddings=target.max_position_embeddings,
        target_hidden_size=reference.target_hidden_size,
        target_layer_ids=reference.target_layer_ids,
        target_model_type=reference.target_model_type,
        target_name_or_path=reference.target_name_or_path,
        residual_stream="features",
        bos_token_id=reference.bos_token_id,
        eos_token_id=reference.eos_token_id,
        pad_token_id=reference.pad_token_id,
    )


@torch.no_grad()
def eagle3_drafter(reference: OspreyForDrafting, target_dir: str | os.PathLike, seed: int = 0) -> OspreyForDrafting:
    """An EAGLE-3 drafter for the target in `target_dir`, sharing `reference`'s taps and draft vocabulary."""
    config = eagle3_config(reference.config, AutoConfig.from_pretrained(target_dir))
    embedding = read_input_embedding(target_dir)
    if embedding.shape != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"The target's embedding has shape {tuple(embedding.shape)}, but the reference drafter was converted for a "
            f"target with vocab_size={config.vocab_size} and the target config says hidden_size={config.hidden_size}: "
            "pass the target the reference drafter was converted for."
        )
    torch.manual_seed(seed)
    drafter = OspreyForDrafting(config)
    drafter.model.embed_tokens.weight.copy_(embedding)
    drafter.draft_to_target.copy_(reference.draft_to_target)
    drafter.generation_config = copy.deepcopy(reference.generation_config)
    return drafter.eval()


def build_baseline(
    kind: str, reference_dir: str | os.PathLike, output_dir: str | os.PathLike, target=None, seed: int = 0
) -> OspreyForDrafting:
    """Builds the `kind` control from the Osprey drafter in `reference_dir` and saves it with the target tokenizer."""
    if kind not in BASELINES:
        raise ValueError(f"Unknown baseline {kind!r}: choose one of {', '.join(BASELINES)}.")
    output_dir = require_empty_output_dir(output_dir)
    reference = load_drafter(reference_dir)
    if kind == "scratch":
        drafter = scratch_drafter(reference, seed)
    else:
        target = target or reference.config.target_name_or_path
        if target is None:
            raise ValueError("The eagle3 baseline copies the target's embedding: pass the target (`--target`).")
        drafter = eagle3_drafter(reference, zoo.resolve_model_path(target), seed)
    drafter.save_pretrained(output_dir)
    AutoTokenizer.from_pretrained(reference_dir).save_pretrained(output_dir)
    GenerationConfig.from_pretrained(reference_dir).save_pretrained(output_dir)
    report = {"baseline": kind, "reference_drafter": os.fspath(reference_dir), "target": target, "seed": seed}
    (output_dir / "baseline_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if (Path(reference_dir) / "alignment_report.json").exists():
        shutil.copy2(Path(reference_dir) / "alignment_report.json", output_dir / "alignment_report.json")
    return drafter


def add_subcommand(subparsers) -> None:
    """Adds `osprey baseline` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "baseline",
        help="build the scratch (body-random) or EAGLE-3 control for an Osprey drafter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kind", choices=BASELINES)
    parser.add_argument(
        "--drafter", "--like", required=True, help="the Osprey drafter directory the control is matched to"
    )
    parser.add_argument(
        "--target", help="the target (zoo name or directory) whose embedding eagle3 copies (default: the drafter's)"
    )
    parser.add_argument("--output", required=True, help="new (or empty) directory for the control drafter")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run_baseline)


def _run_baseline(args) -> int:
    drafter = build_baseline(args.kind, args.drafter, args.output, target=args.target, seed=args.seed)
    trainable = sum(p.numel() for name, p in drafter.named_parameters() if "embed_tokens" not in name)
    print(f"saved the {args.kind} control to {args.output} ({trainable / 1e6:.1f}M parameters besides the embedding)")
    return 0
