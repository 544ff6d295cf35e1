"""`Eagle3OspreyForCausalLM`: an Osprey drafter as a vLLM EAGLE-3 draft model.

An Osprey drafter is an EAGLE-3 drafter in everything vLLM's speculative decoding touches (`fc` over the target's tap
layers, `combine_hidden_states`, the drafter's pre-norm state fed back on later draft steps, a reduced draft vocabulary
mapped by `d2t`), except its first block: there the attention output is added to the raw **token embedding**, so the
pretrained backbone blocks keep running on the token stream they were trained on, where vLLM's EAGLE-3 layer adds it to
the fused target features. This module subclasses vLLM's `Eagle3LlamaForCausalLM` (which its EAGLE-3 proposer
requires) and changes only that residual. Weights and config come from `osprey export --format vllm`.
"""

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM, LlamaDecoderLayer

from .checks import FORMAT_VERSION, RESIDUAL_STREAMS, check_drafter

__all__ = ["FORMAT_VERSION", "RESIDUAL_STREAMS", "Eagle3OspreyForCausalLM", "OspreyFusionLayer", "check_drafter"]


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


class Eagle3OspreyForCausalLM(Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 Llama drafter with Osprey's first block (see the module docstring).

    It always drafts with its own token embedding and LM head. Block 0's residual is the token embedding, so a drafter
    as wide as its target would draft other tokens with the target's embedding in place of its own (one distilled
    without freezing its embedding, or kept from its own backbone). vLLM's EAGLE proposers (the V1 proposer's
    `_maybe_share_embeddings` / `_maybe_share_lm_head`, the V2 runner's `maybe_share_target_embed` / `_should_share`)
    replace a drafter's embedding or head by the target's only when the drafter does not declare `has_own_*`, or when
    its own tensor equals the target's (then nothing changes, and memory is saved). vLLM sets those flags while loading
    when a checkpoint tensor's name holds `embed_tokens` / `lm_head`, which every export has; declaring them here
    keeps the drafter's own whatever the loader scans.
    """

    has_own_embed_tokens = True
    has_own_lm_head = True

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        draft_config = vllm_config.speculative_config.draft_model_config.hf_config
        check_drafter(draft_config, vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if draft_config.residual_stream == "tokens":
            # Same parameters, another forward: re-classing keeps the layer's registration (its attention's name in
            # vLLM's forward context and KV-cache layout) that building a second layer 0 would duplicate.
            self.model.layers[0].__class__ = OspreyFusionLayer

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The greedy draft tokens as target ids: the argmax over the draft vocabulary, then `d2t`. vLLM's proposers
        call it in place of `compute_logits(...).argmax()` when the speculative config sets
        `use_local_argmax_reduction` (the export's `speculative_config.json` does): `compute_logits` first widens
        every row to the target's vocabulary (a row of -inf with the draft logits scattered in), which costs more
        than the drafter's own forward on a CPU. The tokens are the same: the export's `d2t` maps draft ids to
        increasing target ids, so the first maximum in draft order is the first in target order."""
        top = self.logits_processor.get_top_tokens(self.lm_head, hidden_states)
        if self.draft_id_to_target_id is not None:
            top = top + self.draft_id_to_target_id[top]
        return top
