"""Export a drafter as an EAGLE-3 checkpoint for serving engines: vLLM with the `osprey-vllm` plugin (`vllm`),
vLLM's `speculators` format, or SGLang's `LlamaForCausalLMEagle3`.

An export is refused unless the engine computes exactly what the drafter computes. Osprey's own drafters, whose block 0
adds its attention output to the token embedding (`residual_stream="tokens"`), need the `vllm` format: the plugin in
`serving/vllm` (`pip install ./serving/vllm` in vLLM's environment) registers `Eagle3OspreyForCausalLM`, vLLM's EAGLE-3
drafter with that residual. No stock engine implements it, and no weight mapping emulates it, so `speculators` and
`sglang-eagle3` take only EAGLE-3-style drafters (`residual_stream="features"`: block 0 adds its attention output to the
fused target features). Every format needs Llama-style blocks and three taps.

A drafter as wide as its target may carry an embedding other than the target's (its own backbone's, or one trained
while distilling). SGLang, and the vLLM releases before vLLM checked for a drafter's own embedding, replace an EAGLE-3
drafter's embedding by the target's whenever both are equally wide, so `speculators` (which any vLLM may load) and
`sglang-eagle3` export it only when the two are equal (`--target` checks). The `vllm` format takes it: the plugin's
drafter declares its own embedding and LM head, and the vLLM releases the plugin accepts replace them by the target's
only where they are equal.

What changes on the way out, and why it is exact:

- block 0's q/k/v read `[hidden_norm(features) ; input_layernorm(tokens)]` here and `[embeds ; hidden]` in the engines:
  their two column halves are swapped;
- the draft vocabulary is written in increasing target-id order (a relabelling of draft ids, which changes no
  probability), with `d2t` = target id - draft id and `t2d` = the draft tokens' mask over the target vocabulary;
- the taps keep their blocks: vLLM's `eagle_aux_hidden_state_layer_ids` counts the *input* of a block (tap + 1),
  SGLang's `eagle_config` counts outputs, as Osprey does. vLLM collects tap + 1 after block tap has run, up to the
  last block's output (before the final norm, what Osprey reads there); SGLang collects each tap at the input of
  block tap + 1, so it never reads the last block's output, and `--target` refuses that tap for `sglang-eagle3`.

Layouts follow the loaders' code as read (not copied) at: vllm-project/vllm
`vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e8 and `vllm/transformers_utils/configs/speculators/algos.py`;
vllm-project/speculators `src/speculators/models/eagle3/` @ c05b95b3; sgl-project/sglang
`python/sglang/srt/models/llama_eagle3.py` @ 03d5a7771f60 and d737979cbd17, `python/sglang/srt/models/llama.py` @
00239548f1cd (where the taps are collected).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from modeling_osprey import OspreyConfig, OspreyForDrafting

from ..ground import copy_notices, read_input_embedding, require_empty_output_dir
from ..models import zoo
from ..models.pack import load_drafter
from .vllm_schedule import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SCHEDULE_SOURCE,
    SPECULATIVE_CONFIG_FILE,
    read_speculative_config,
    serve_command,
    speculative_config,
)

VLLM, SPECULATORS, SGLANG = "vllm", "speculators", "sglang-eagle3"
FORMATS = (VLLM, SPECULATORS, SGLANG)
# What the osprey-vllm plugin (serving/vllm/osprey_vllm) loads: its architecture and the config version it reads.
VLLM_ARCHITECTURE, VLLM_FORMAT_VERSION = "Eagle3OspreyForCausalLM", 1
FUSION_QKV = tuple(f"self_attn.{name}_proj.weight" for name in "qkv")
TOKEN_RESIDUAL = (
    "its first block adds its attention output to the token embedding (residual_stream='tokens', Osprey's fusion "
    "block), while the EAGLE-3 first layer of vLLM and SGLang adds it to the fused target features; no weight mapping "
    "turns one into the other, so the engine would draft different tokens. Export it with --format vllm and serve it "
    "with vLLM and the osprey-vllm plugin (`pip install ./serving/vllm` in vLLM's environment; docs/serving.md), or "
    "with transformers (`target.generate(..., assistant_model=drafter)`, `osprey decode`)"
)


def export_problems(config: OspreyConfig, export_format: str, target_num_layers: int | None = None) -> list[str]:
    """Why `export_format`'s engine would not compute exactly what a drafter with `config` computes (empty: it
    would). `target_num_layers`, the target's decoder layer count when known, bounds the taps the engine collects."""
    problems = []
    if config.residual_stream != "features" and export_format != VLLM:
        problems.append(TOKEN_RESIDUAL)
    if len(config.target_layer_ids) != 3:
        problems.append(f"it reads {len(config.target_layer_ids)} target taps; the engines' fc reads exactly 3")
    if config.use_qk_norm:
        problems.append(
            "its attention normalises queries and keys (Qwen3-style q/k norm); Llama-style EAGLE-3 layers don't"
        )
    if config.hidden_act != "silu":
        problems.append(f"its MLP uses {config.hidden_act!r}; the engines' Llama MLP implements only silu")
    if export_format == SGLANG:
        if config.attention_bias:
            problems.append("its q/k/v have biases; SGLang builds the EAGLE-3 layer's q/k/v without bias")
        if config.num_hidden_layers != 1:
            problems.append(
                f"it has {config.num_hidden_layers} decoder blocks; SGLang's EAGLE-3 model runs one (newer versions "
                "add layers that drop the first layer's residual); use --format speculators (vLLM)"
            )
        if 3 * config.target_hidden_size == config.hidden_size:
            problems.append("3 x target_hidden_size == hidden_size, which SGLang takes for features already past fc")
        if target_num_layers is not None and max(config.target_layer_ids) >= target_num_layers - 1:
            problems.append(
                f"it taps block {max(config.target_layer_ids)}, the last of the target's {target_num_layers} "
                "blocks, and SGLang collects each tap at the next block's input, so it never reads the last block's "
                "output; use --format speculators (vLLM collects it), or convert the drafter with taps below block "
                f"{target_num_layers - 1} (`osprey convert --target-layers`)"
            )
    return problems


def _check_target_embedding(drafter: OspreyForDrafting, target) -> str | None:
    """SGLang, and vLLM releases before it checked for a drafter's own embedding, replace an EAGLE-3 drafter's
    embedding by the target's whenever both are equally wide: a `speculators` or `sglang-eagle3` export is exact only if
    they are equal. Returns the problem, if any. The `vllm` format needs no check: the osprey-vllm plugin keeps the
    drafter's own embedding (its model declares `has_own_embed_tokens`, which every vLLM release it accepts honours)."""
    if target is None:
        return (
            f"its hidden size equals the target's ({drafter.config.hidden_size}), so the engine may use the target's "
            "embedding instead of the drafter's; pass --target to check that they are the same"
        )
    embedding = read_input_embedding(zoo.resolve_model_path(target))
    own = drafter.get_input_embeddings().weight
    if embedding.shape != own.shape or not torch.equal(embedding.to(own.dtype), own.detach().cpu()):
        return (
            "the engine may replace its embedding by the target's (both are equally wide), and they differ; keep the "
            "target's embedding frozen when distilling (`freeze_embeddings`, as for `osprey baseline eagle3`)"
        )
    return None


@torch.no_grad()
def eagle3_tensors(drafter: OspreyForDrafting, export_format: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the engine's names (see the module docstring for what changes)."""
    config = drafter.config
    state = {name: tensor.detach().cpu() for name, tensor in drafter.state_dict().items()}
    order = torch.argsort(state["draft_to_target"])
    draft_to_target = state["draft_to_target"][order]
    tensors = {
        "embed_tokens.weight": state["model.embed_tokens.weight"],
        "fc.weight": state["model.fc.weight"],
        "norm.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"][order],
    }
    hidden = config.hidden_size
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            continue
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        if index == "0" and rest in FUSION_QKV:
            tensor = torch.cat([tensor[:, hidden:], tensor[:, :hidden]], dim=1)  # [features ; tokens] -> [tokens ; ...]
        tensors[_layer_prefix(int(index), export_format) + rest] = tensor
        if config.attention_bias and rest == "self_attn.o_proj.weight":
            # vLLM gives o_proj a bias whenever q/k/v have one; a zero bias keeps the function.
            tensors[_layer_prefix(int(index), export_format) + "self_attn.o_proj.bias"] = tensor.new_zeros(hidden)
    if config.draft_vocab_size < config.vocab_size:
        tensors["d2t"] = draft_to_target - torch.arange(config.draft_vocab_size)
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_to_target, True)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def _layer_prefix(index: int, export_format: str) -> str:
    return "midlayer." if export_format == SGLANG else f"layers.{index}."


def _llama_fields(drafter: OspreyForDrafting) -> dict:
    """The Llama config the engines build their EAGLE-3 blocks from; RoPE is written in both the old (`rope_theta`)
    and the new (`rope_parameters`) transformers spelling, which agree."""
    config = drafter.config
    return {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
    }


def speculators_config(drafter: OspreyForDrafting, verifier: str | None, verifier_architectures: list[str]) -> dict:
    """config.json of a `speculators` EAGLE-3 checkpoint, as vLLM's speculators config adapter reads it."""
    config = drafter.config
    greedy = {
        "proposal_type": "greedy",
        "speculative_tokens": drafter.generation_config.num_assistant_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [greedy],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": _llama_fields(drafter),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,  # vLLM assumes True when the key is missing
        "eagle_aux_hidden_state_layer_ids": [layer_id + 1 for layer_id in config.target_layer_ids],
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
    }


def vllm_config(drafter: OspreyForDrafting, verifier: str | None) -> dict:
    """config.json of a drafter for vLLM with the osprey-vllm plugin: a Llama config (which vLLM's transformers parses
    without remote code) naming the plugin's architecture, with EAGLE-3's fields and Osprey's residual."""
    config = drafter.config
    return {
        "architectures": [VLLM_ARCHITECTURE],
        **_llama_fields(drafter),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [layer_id + 1 for layer_id in config.target_layer_ids],
        "osprey_format_version": VLLM_FORMAT_VERSION,
        "residual_stream": config.residual_stream,
        "target_layer_ids": list(config.target_layer_ids),
        "target_name_or_path": verifier,
    }


def sglang_config(drafter: OspreyForDrafting) -> dict:
    """config.json of an SGLang `LlamaForCausalLMEagle3` draft model."""
    config = drafter.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_fields(drafter),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def check_exportable(
    drafter: OspreyForDrafting | str | os.PathLike, export_format: str, target: str | os.PathLike | None = None
):
    """Raises `ValueError` listing every reason the engine of `export_format` would compute something other than
    `drafter` (a model or a drafter directory) for `target`; returns the target's config (None without a target).
    `osprey adapt` calls it on the converted drafter, before training: what it checks does not change in training."""
    if not isinstance(drafter, OspreyForDrafting):
        drafter = load_drafter(Path(drafter))
    target_config = None if target is None else AutoConfig.from_pretrained(zoo.resolve_model_path(target))
    if target_config is not None:
        drafter.config.check_target(target_config, name_or_path=None)
    target_num_layers = None if target_config is None else getattr(target_config, "num_hidden_layers", None)
    problems = export_problems(drafter.config, export_format, target_num_layers)
    if export_format != VLLM and drafter.config.hidden_size == drafter.config.target_hidden_size:
        problems += filter(None, [_check_target_embedding(drafter, target)])
    if problems:
        raise ValueError(
            f"This drafter cannot be exported as {export_format}, the engine would not compute what it computes: "
            + "; ".join(problems)
            + "."
        )
    return target_config


def export_drafter(
    drafter: OspreyForDrafting | str | os.PathLike,
    export_format: str,
    output_dir: str | os.PathLike,
    target: str | os.PathLike | None = None,
    verifier: str | None = None,
    schedule: str | os.PathLike | None = None,
) -> Path:
    """Writes `drafter` (a model or a drafter directory) to the new or empty `output_dir` as `config.json` and
    `model.safetensors` in `export_format` (one of `FORMATS`), with its license files; raises `ValueError` listing
    every reason the engine would compute something else. `target` (zoo name, directory or Hub id) fills the
    verifier of a `speculators` config and, for `speculators` and `sglang-eagle3`, checks an embedding the engine would
    share with the target (the `vllm` format keeps the drafter's own); `verifier` overrides the verifier's name
    (default: the target the drafter was converted for, from its `alignment_report.json`).

    `vllm` also writes `speculative_config.json`, vLLM's speculative config for this export with a draft length per
    batch size: `schedule`'s (an `osprey tune` output folder or its `speculative_config.json`), else
    `osprey.serving.vllm_schedule.DEFAULT_SCHEDULE`."""
    if export_format not in FORMATS:
        raise ValueError(f"Unknown export format {export_format!r}: choose one of {', '.join(FORMATS)}.")
    if schedule is not None and export_format != VLLM:
        raise ValueError(f"--schedule is vLLM's draft length per batch size: export with --format {VLLM}, or drop it.")
    tuned = None if schedule is None else read_speculative_config(schedule)
    output_dir = require_empty_output_dir(output_dir)
    source_dir = None
    if not isinstance(drafter, OspreyForDrafting):
        source_dir = Path(drafter)
        drafter = load_drafter(source_dir)
    target_config = check_exportable(drafter, export_format, target)
    if export_format in (SPECULATORS, VLLM):
        verifier = (
            verifier or _verifier_name(target) or _converted_for(source_dir) or drafter.config.target_name_or_path
        )
    if export_format == SPECULATORS:
        architectures = None if target_config is None else target_config.architectures
        config = speculators_config(drafter, verifier, architectures or [])
    elif export_format == VLLM:
        config = vllm_config(drafter, verifier)
    else:
        config = sglang_config(drafter)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(eagle3_tensors(drafter, export_format), output_dir / "model.safetensors", metadata={"format": "pt"})
    (output_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if export_format == VLLM:
        k_max = DEFAULT_NUM_SPECULATIVE_TOKENS if tuned is None else tuned["num_speculative_tokens"]
        serving = speculative_config(output_dir, k_max, tuned and tuned["num_speculative_tokens_per_batch_size"])
        (output_dir / SPECULATIVE_CONFIG_FILE).write_text(json.dumps(serving, indent=1) + "\n")
    if source_dir is not None:
        copy_notices(source_dir, output_dir)
    return output_dir


def _verifier_name(target) -> str | None:
    """What vLLM can load the target from: a zoo name is only meaningful to Osprey, so it becomes its directory."""
    if target is None:
        return None
    return zoo.resolve_model_path(target) if zoo.is_zoo_name(target) else str(target)


def _converted_for(drafter_dir: Path | None) -> str | None:
    """The target recorded by `osprey convert` in the drafter's `alignment_report.json`, if any."""
    report = None if drafter_dir is None else drafter_dir / "alignment_report.json"
    return json.loads(report.read_text()).get("target") if report is not None and report.exists() else None


def add_subcommand(subparsers) -> None:
    """Adds `osprey export` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "export",
        help="write a drafter for a serving engine: vLLM with the osprey-vllm plugin, vLLM speculators, SGLang",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--drafter", required=True, help="drafter directory (osprey convert / distill / baseline)")
    parser.add_argument("--format", required=True, choices=FORMATS, dest="export_format")
    parser.add_argument("--output", required=True, help="new (or empty) directory for the exported checkpoint")
    parser.add_argument("--target", help="the target (zoo name, directory or Hub id): verifier name, embedding check")
    parser.add_argument("--verifier", help="target name_or_path to record (vllm, speculators; default: the target)")
    parser.add_argument(
        "--schedule",
        metavar="DIR",
        help=f"vllm: the draft length per batch size `osprey tune --output DIR` found (default: measured on "
        f"{DEFAULT_SCHEDULE_SOURCE})",
    )
    parser.set_defaults(run=_run_export)


def _run_export(args) -> int:
    output = export_drafter(
        args.drafter,
        args.export_format,
        args.output,
        target=args.target,
        verifier=args.verifier,
        schedule=args.schedule,
    )
    print(f"exported {args.drafter} as {args.export_format} to {output}")
    if args.export_format == VLLM:
        source = args.schedule or f"the default, measured on {DEFAULT_SCHEDULE_SOURCE}; `osprey tune` measures yours"
        print(f"draft length per batch size in {output / SPECULATIVE_CONFIG_FILE} ({source}); serve with:")
        print(
            serve_command(
                json.loads((output / "config.json").read_text()).get("target_name_or_path") or "TARGET", output
            )
        )
    return 0
