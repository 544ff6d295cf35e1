"""`Eagle3OspreyForCausalLM`: an Osprey drafter as a vLLM EAGLE-3 draft model.

An Osprey drafter is an EAGLE-3 drafter in everything vLLM's speculative decoding touches (`fc` over the target's tap
layers, `combine_hidden_states`, the drafter's pre-norm state fed back on later draft steps, a reduced draft vocabulary
mapped by `d2t`), except its first block: there the attention output is added to the raw **token embedding**, so the
pretrained backbone blocks keep running on the token stream they were trained on, where vLLM's EAGLE-3 layer adds it to
the fused target features. This module subclasses vLLM's `Eagle3LlamaForCausalLM` (which its EAGLE-3 proposer
requires) and changes only that residual. Weights and config come from `osprey export --format vllm`.
"""

import logging
import os

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM, LlamaDecoderLayer

logger = logging.getLogger(__name__)

# The version of the config `osprey export --format vllm` writes; a plugin refuses versions it does not know.
FORMAT_VERSION = 1
RESIDUAL_STREAMS = ("tokens", "features")


class OspreyFusionLayer(LlamaDecoderLayer):
    """Block 0 of an Osprey drafter: attention over `[input_layernorm(embeds) ; hidden_norm(features)]` (vLLM's column
    order, which the export writes), added to the token embedding `embeds`; then the block's MLP."""

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attention_input = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden_states)], dim=-1)
        hidden_states = self.self_attn(positions=positions, hidden_states=attention_input)
        # The fused add-and-norm: residual = attention + embeds, hidden = post_attention_layernorm(residual).
        hidden_states, residual = self.post_attention_layernorm(hidden_states, embeds)
        return self.mlp(hidden_states), residual


def check_drafter(draft_config, vllm_config: VllmConfig) -> None:
    """Raises a `ValueError` naming the mismatch unless the exported drafter reads this target's token ids and tap
    layers; warns when it was converted for a target of another name (same shapes, but its acceptance would
    collapse)."""
    version = getattr(draft_config, "osprey_format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(
            f"This Osprey drafter was exported in format version {version!r}; this osprey-vllm plugin reads version "
            f"{FORMAT_VERSION}. Export it again with `osprey export --format vllm` from the osprey release that "
            "matches this plugin."
        )
    residual_stream = getattr(draft_config, "residual_stream", None)
    if residual_stream not in RESIDUAL_STREAMS:
        raise ValueError(f"residual_stream must be one of {RESIDUAL_STREAMS}, got {residual_stream!r}.")
    target = vllm_config.model_config
    target_layers = target.get_total_num_hidden_layers()
    problems = []
    if draft_config.vocab_size != target.get_vocab_size():
        problems.append(f"a vocabulary of {target.get_vocab_size()} tokens (the drafter's: {draft_config.vocab_size})")
    if draft_config.target_hidden_size != target.get_hidden_size():
        problems.append(
            f"hidden size {target.get_hidden_size()} (the drafter's fc reads {draft_config.target_hidden_size})"
        )
    aux_layer_ids = list(draft_config.eagle_aux_hidden_state_layer_ids)
    if not all(1 <= layer_id <= target_layers for layer_id in aux_layer_ids):
        taps = [layer_id - 1 for layer_id in aux_layer_ids]
        problems.append(f"{target_layers} decoder layers (the drafter taps the outputs of blocks {taps})")
    if problems:
        raise ValueError(
            f"The Osprey drafter {vllm_config.speculative_config.model!r} was converted for "
            f"{getattr(draft_config, 'target_name_or_path', None) or 'another target'!r}, but the target "
            f"{target.model!r} has {'; '.join(problems)}. Serve it with the target it was converted for, or convert "
            "and distill a drafter for this target with `osprey convert` / `osprey distill`, then `osprey export "
            "--format vllm`."
        )
    converted_for = getattr(draft_config, "target_name_or_path", None)
    if converted_for and _model_name(converted_for) != _model_name(target.model):
        logger.warning(
            "The Osprey drafter was converted for %r but is serving %r: same shapes, but unless they are the same "
            "model its drafts will rarely be accepted.",
            converted_for,
            target.model,
        )


def _model_name(name_or_path: str) -> str:
    return os.path.basename(str(name_or_path).rstrip("/\\")).lower()


class Eagle3OspreyForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 Llama drafter with Osprey's first block (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        draft_config = vllm_config.speculative_config.draft_model_config.hf_config
        check_drafter(draft_config, vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if draft_config.residual_stream == "tokens":
            # Same parameters, another forward: re-classing keeps the layer's registration (its attention's name in
            # vLLM's forward context and KV-cache layout) that building a second layer 0 would duplicate.
            self.model.layers[0].__class__ = OspreyFusionLayer
