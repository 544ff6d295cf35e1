"""Osprey drafter: a shallow pretrained decoder that drafts tokens for a target LLM from the target's hidden states.

Self-contained remote code: `save_pretrained` copies this file and `configuration_osprey.py` next to the weights, so
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` works without the `osprey` package installed.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from .configuration_osprey import DRAFTING_DEFAULTS, OspreyConfig
from .decoding_osprey import write_custom_generate
from .generation_osprey import OspreyAssistantMixin

# The weights file of a packed drafter (`osprey pack`: int8 rows), which only the osprey package reads.
PACKED_WEIGHTS_NAME = "drafter-int8.safetensors"


class OspreyRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class OspreyRotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE; inverse frequencies are a non-persistent buffer recomputed at init."""

    def __init__(self, config: OspreyConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / (self.rope_theta**exponents)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class OspreyAttention(nn.Module):
    """Grouped-query attention; in the fusion block q/k/v read `2 * hidden_size` inputs."""

    def __init__(self, config: OspreyConfig, layer_idx: int, input_size: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(input_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(input_size, self.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if config.use_qk_norm:
            self.q_norm = OspreyRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = OspreyRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, hidden_states, position_embeddings, attention_mask, cache: Cache | None):
        batch_size, seq_len, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim)
        key = self.k_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim)
        value = self.v_proj(hidden_states).view(batch_size, seq_len, -1, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if isinstance(cache, OspreyTTTCache):
            attn_output = cache.attend(self.layer_idx, query, key, value)
        else:
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            attn_output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_key_value_heads
            )
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_len, -1)
        return self.o_proj(attn_output)


class OspreyTTTCache:
    """The drafter's keys and values during a training-time-test unroll, which its attention reads without a mask.

    The first forward (TTT step 0) runs every position `t` over the target's features; its keys are attended causally.
    Each later forward (step `k`) adds one key per position that only the same position's later queries attend to:
    a step-`k` query at `t` sees the step-0 keys at positions `<= t` and the keys of steps `1..k` at `t`, exactly the
    cache of a chain drafted after verified position `t`. Step `k` therefore costs a causal attention plus `k`
    per-position dot products (O(T·k) beyond the causal part), where one dense mask over all `T·(k + 1)` keys would
    cost O(T²·k). Pass it as `cache` with explicit `position_ids`; it is not a generation cache.
    """

    def __init__(self):
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, list, list]] = {}

    def attend(self, layer_idx: int, query, key, value) -> torch.Tensor:
        """Attention output `(batch, heads, seq, head_dim)` of `query` after appending this step's `key`/`value`."""
        groups = query.shape[1] // key.shape[1]
        # The projections' dtype (under autocast RoPE may have promoted query and key to float32).
        query, key = query.to(value.dtype), key.to(value.dtype)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        if layer_idx not in self._layers:
            self._layers[layer_idx] = (key, value, [], [])
            return F.scaled_dot_product_attention(query, key, value, is_causal=True)
        prefix_key, prefix_value, chain_keys, chain_values = self._layers[layer_idx]
        chain_keys.append(key)
        chain_values.append(value)
        return chain_attention(
            query, prefix_key, prefix_value, torch.stack(chain_keys, 3), torch.stack(chain_values, 3)
        )


# Kept out of `torch.compile` graphs: traced under bf16 autocast (training with `torch_compile`), it computed wrong
# values on a real drafter (TTT step 1's loss 4.27 against 1.27 eager; `trainers/throughput_worker.py compiled-ttt`).
@torch.compiler.disable
def chain_attention(query, prefix_key, prefix_value, chain_keys, chain_values) -> torch.Tensor:
    """One softmax per query `t` over the prefix keys `<= t` (causal) and its own `chain_keys[..., t, :, :]`.

    Shapes: query and prefix `(batch, heads, seq, head_dim)`, chain `(batch, heads, seq, steps, head_dim)`. The causal
    part is a fused attention kernel whose log-sum-exp is merged with the chain scores' (on CPU; elsewhere the causal
    scores are materialised once, still without the `steps * seq` masked-out keys of a dense mask).
    """
    if query.device.type == "cpu":
        return _ChainAttention.apply(query, prefix_key, prefix_value, chain_keys, chain_values)
    scale = query.shape[-1] ** -0.5
    seq_len = query.shape[2]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()
    prefix_scores = (query @ prefix_key.transpose(-1, -2)).float().masked_fill(~causal, float("-inf"))
    chain_scores = torch.einsum("bhtd,bhtsd->bhts", query, chain_keys).float()
    probs = torch.cat([prefix_scores, chain_scores], dim=-1).mul(scale).softmax(dim=-1).to(query.dtype)
    prefix_probs, chain_probs = probs.split([seq_len, chain_keys.shape[3]], dim=-1)
    return prefix_probs @ prefix_value + torch.einsum("bhts,bhtsd->bhtd", chain_probs, chain_values)


class _ChainAttention(torch.autograd.Function):
    """`chain_attention` on CPU: the causal part by the flash-attention kernel, merged with the chain terms through
    their log-sum-exps; backward runs the kernel's backward with the merged output and log-sum-exp, which gives the
    exact gradients of the joint softmax, and adds the chain terms' by hand."""

    @staticmethod
    def forward(ctx, query, prefix_key, prefix_value, chain_keys, chain_values):
        scale = query.shape[-1] ** -0.5
        prefix_out, prefix_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, prefix_key, prefix_value, 0.0, True
        )
        chain_scores = torch.einsum("bhtd,bhtsd->bhts", query, chain_keys).float() * scale
        lse = torch.logaddexp(prefix_lse, chain_scores.logsumexp(dim=-1))
        chain_probs = (chain_scores - lse[..., None]).exp()
        out = (prefix_lse - lse).exp()[..., None] * prefix_out.float()
        out = (out + torch.einsum("bhts,bhtsd->bhtd", chain_probs, chain_values.float())).to(query.dtype)
        ctx.save_for_backward(query, prefix_key, prefix_value, chain_keys, chain_values, out, lse, chain_probs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, prefix_key, prefix_value, chain_keys, chain_values, out, lse, chain_probs = ctx.saved_tensors
        scale = query.shape[-1] ** -0.5
        grad_out = grad_out.contiguous()
        grad_query, grad_prefix_key, grad_prefix_value = (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, prefix_key, prefix_value, out, lse, 0.0, True
            )
        )
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(dim=-1, keepdim=True)
        grad_chain_values = chain_probs[..., None] * grad_out[..., None, :]
        grad_scores = chain_probs * (torch.einsum("bhtd,bhtsd->bhts", grad_out, chain_values.float()) - delta) * scale
        grad_query = grad_query.float() + torch.einsum("bhts,bhtsd->bhtd", grad_scores, chain_keys.float())
        grad_chain_keys = grad_scores[..., None] * query.float()[..., None, :]
        return (
            grad_query.to(query.dtype),
            grad_prefix_key,
            grad_prefix_value,
            grad_chain_keys.to(chain_keys.dtype),
            grad_chain_values.to(chain_values.dtype),
        )


class OspreyMLP(nn.Module):
    def __init__(self, config: OspreyConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class OspreyDecoderLayer(GradientCheckpointingLayer):
    """A Llama/Qwen pre-norm block. Block 0 additionally fuses the (projected) target features into its attention
    input: `attn(cat([hidden_norm(features), input_layernorm(tokens)]))`. Its residual is the token stream (Osprey)
    or the features (EAGLE-3), per `config.residual_stream`."""

    def __init__(self, config: OspreyConfig, layer_idx: int):
        super().__init__()
        self.fuses_features = layer_idx == 0
        self.features_are_residual = self.fuses_features and config.residual_stream == "features"
        attention_input_size = 2 * config.hidden_size if self.fuses_features else config.hidden_size
        self.self_attn = OspreyAttention(config, layer_idx, attention_input_size)
        self.mlp = OspreyMLP(config)
        self.input_layernorm = OspreyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OspreyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = OspreyRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.fuses_features else None

    def forward(self, hidden_states, features, position_embeddings, attention_mask, cache):
        attention_input = self.input_layernorm(hidden_states)
        if self.fuses_features:
            attention_input = torch.cat([self.hidden_norm(features), attention_input], dim=-1)
        residual = features if self.features_are_residual else hidden_states
        hidden_states = residual + self.self_attn(attention_input, position_embeddings, attention_mask, cache)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class OspreyModelOutput(ModelOutput):
    """
    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
            Output of the final norm, the LM head's input.
        prenorm_hidden_states (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
            Output of the last block before the final norm: what the drafter feeds itself as `draft_hidden_states`
            when it drafts past the target's last verified position (training-time test, chain drafting).
        cache (`Cache`, *optional*):
            The drafter's KV cache, returned when `use_cache=True`.
    """

    last_hidden_state: torch.FloatTensor | None = None
    prenorm_hidden_states: torch.FloatTensor | None = None
    cache: Cache | None = None


@dataclass
class OspreyDrafterOutput(ModelOutput):
    """
    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, sequence_length, draft_vocab_size)`):
            Next-token scores over the *draft* vocabulary; map ids back with `draft_ids_to_target_ids`. None with
            `skip_logits=True`.
        last_hidden_state (`torch.FloatTensor`, *optional*):
            With `skip_logits=True`: the LM head's input at the positions `logits_to_keep` selects.
        prenorm_hidden_states (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
            See [`OspreyModelOutput`].
        cache (`Cache`, *optional*):
            The drafter's KV cache, returned when `use_cache=True`.
    """

    logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    prenorm_hidden_states: torch.FloatTensor | None = None
    cache: Cache | None = None


class OspreyPreTrainedModel(PreTrainedModel):
    config_class = OspreyConfig
    config: OspreyConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OspreyDecoderLayer"]
    _supports_sdpa = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Loads safetensors weights only, and refuses checkpoints with missing tensors instead of silently
        initialising them at random (a drafter with random rows drafts garbage without failing)."""
        local_dir = os.fspath(pretrained_model_name_or_path)
        if os.path.isfile(os.path.join(local_dir, PACKED_WEIGHTS_NAME)):
            raise ValueError(
                f"{local_dir} holds a packed drafter ({PACKED_WEIGHTS_NAME}): load it with `osprey.load_drafter`, or "
                "write it as an ordinary checkpoint with `osprey unpack --drafter DIR --output NEW_DIR`."
            )
        if os.path.isdir(local_dir):
            check_safetensors_checkpoint(local_dir)
        wants_loading_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("use_safetensors", True)
        try:
            model, loading_info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except SafetensorError as error:
            raise OSError(
                f"The safetensors weights of {local_dir} are corrupted ({error}): the file was truncated or "
                "overwritten. Download or save the checkpoint again."
            ) from error
        if loading_info["missing_keys"]:
            raise ValueError(
                f"Checkpoint {local_dir} is missing tensors {sorted(loading_info['missing_keys'])}: it is incomplete "
                "or was saved from another architecture. Re-save the drafter with `save_pretrained`, or rebuild it "
                "with `osprey convert`."
            )
        return (model, loading_info) if wants_loading_info else model

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, OspreyRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())
        elif isinstance(module, OspreyForDrafting):
            init.copy_(module.draft_to_target, torch.arange(self.config.draft_vocab_size))


def check_safetensors_checkpoint(directory: str | os.PathLike) -> None:
    """Osprey loads weights from safetensors only: pickle checkpoints can execute code when loaded."""
    files = os.listdir(directory)
    if any(name.endswith(".safetensors") for name in files):
        return
    pickles = sorted(name for name in files if name.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickles:
        raise ValueError(
            f"{directory} holds only pickle weights ({', '.join(pickles)}); Osprey loads only safetensors. Convert it "
            "once with the code that wrote it, e.g. `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir)`, "
            "which writes model.safetensors."
        )
    raise ValueError(f"{directory} holds no safetensors weights (*.safetensors).")


class OspreyModel(OspreyPreTrainedModel):
    """The drafter body: token embedding, `fc` over the target taps, the decoder blocks and the final norm."""

    def __init__(self, config: OspreyConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(config.fused_feature_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(OspreyDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = OspreyRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OspreyRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        draft_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> OspreyModelOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`):
                Target-vocabulary token ids; position `i` pairs token `i` with the features of position `i`.
            target_hidden_states (`torch.Tensor` of shape `(batch_size, sequence_length, config.fused_feature_size)`):
                The target's tap-layer outputs, concatenated in `config.target_layer_ids` order (`fused_feature_size`
                is `len(target_layer_ids) * target_hidden_size`); projected by `fc`.
            draft_hidden_states (`torch.Tensor` of shape `(batch_size, sequence_length, hidden_size)`):
                Features already in drafter space, used instead of `target_hidden_states` (bypassing `fc`): the
                drafter's own `prenorm_hidden_states` from its previous step. Pass exactly one of the two.
            attention_mask (`torch.Tensor`, *optional*):
                Either a `(batch_size, past_length + sequence_length)` padding mask (1 = attend), combined with the
                causal mask, or a full `(batch_size, 1, sequence_length, past_length + sequence_length)` mask
                (boolean, True = attend, or additive float) used as is, e.g. for training-time test.
            position_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
                Defaults to positions following the cached ones.
            cache (`Cache` or `OspreyTTTCache`, *optional*):
                The drafter's own KV cache; created when `use_cache=True` and none is given. An `OspreyTTTCache`
                (training-time test) replaces the attention mask.
            inputs_embeds (`torch.Tensor` of shape `(batch_size, sequence_length, hidden_size)`, *optional*):
                `embed_tokens(input_ids)`, computed by the caller (training-time test embeds the tokens of all its
                steps at once: one embedding gradient instead of one per step); `input_ids` is still passed.
        """
        features = self._project_features(input_ids, target_hidden_states, draft_hidden_states)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        seq_len = input_ids.shape[1]
        if isinstance(cache, OspreyTTTCache):  # the cache is the mask (see OspreyTTTCache)
            if position_ids is None or attention_mask is not None:
                raise ValueError("With an OspreyTTTCache pass `position_ids` and no `attention_mask`.")
            mask = None
        else:
            past_length = cache.get_seq_length() if cache is not None else 0
            if position_ids is None:
                position_ids = torch.arange(past_length, past_length + seq_len, device=input_ids.device)[None]
            mask = _attention_mask(attention_mask, seq_len, past_length, input_ids.device)
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, features, position_embeddings, mask, cache)
        return OspreyModelOutput(
            last_hidden_state=self.norm(hidden_states),
            prenorm_hidden_states=hidden_states,
            cache=cache if use_cache else None,
        )

    def _project_features(self, input_ids, target_hidden_states, draft_hidden_states) -> torch.Tensor:
        if (target_hidden_states is None) == (draft_hidden_states is None):
            raise ValueError(
                "Pass exactly one of `target_hidden_states` (the target's tap-layer outputs, concatenated) or "
                "`draft_hidden_states` (the drafter's own previous `prenorm_hidden_states`)."
            )
        features = target_hidden_states if draft_hidden_states is None else draft_hidden_states
        expected = self.config.fused_feature_size if draft_hidden_states is None else self.config.hidden_size
        if features.shape[:2] != input_ids.shape or features.shape[-1] != expected:
            what = (
                f"len(target_layer_ids)={len(self.config.target_layer_ids)} taps x target_hidden_size="
                f"{self.config.target_hidden_size}"
                if draft_hidden_states is None
                else "the drafter's hidden_size"
            )
            raise ValueError(
                f"Features of shape {tuple(features.shape)} do not fit input_ids of shape {tuple(input_ids.shape)}: "
                f"expected (batch, seq, {expected}) from {what}. A drafter converted for another target "
                f"(target_model_type={self.config.target_model_type!r}) cannot read this target's hidden states."
            )
        return features if draft_hidden_states is not None else self.fc(features)


def _attention_mask(attention_mask, query_length: int, past_length: int, device) -> torch.Tensor | None:
    """Boolean (batch, 1, query, key) mask, True = attend; a 4D mask passes through unchanged."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    key_length = past_length + query_length
    if attention_mask is None and query_length == 1:
        return None
    causal = torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(diagonal=past_length)
    if attention_mask is None:
        return causal[None, None]
    if attention_mask.shape[-1] != key_length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} positions but cache + input cover {key_length}."
        )
    mask = causal[None, None] & attention_mask[:, None, None, :].bool()
    # A padding query attends to nothing; letting it see itself keeps its (ignored) output finite instead of NaN.
    diagonal = torch.arange(query_length, device=device)
    mask[:, :, diagonal, past_length + diagonal] = True
    return mask


class OspreyForDrafting(OspreyAssistantMixin, OspreyPreTrainedModel, GenerationMixin):
    """An Osprey drafter: [`OspreyModel`] plus an LM head over the (optionally reduced) draft vocabulary.

    Speculative decoding with transformers:

    ```python
    >>> with drafter.attached(target):  # hooks the target's tap layers, removed at the end of the block
    ...     target.generate(input_ids, assistant_model=drafter, max_new_tokens=128)
    >>> # Osprey's own loop, chains or draft trees, from the folder `save_pretrained` wrote:
    >>> target.generate(
    ...     input_ids, assistant_model=drafter, custom_generate=FOLDER, trust_remote_code=True, draft_topk=3
    ... )
    ```

    The target calls the drafter's `generate` before each verification step; it drafts a chain of
    `generation_config.num_assistant_tokens` tokens from the target features the hooks captured, stopping early after
    a draft whose probability is below `generation_config.assistant_confidence_threshold` (0: never).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OspreyConfig):
        super().__init__(config)
        self.model = OspreyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.draft_to_target = nn.Buffer(torch.arange(config.draft_vocab_size), persistent=True)
        self.generation_config.update(**DRAFTING_DEFAULTS)
        self._target_capture = None
        self._draft_state = None
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, plus `custom_generate/` (Osprey's decoding loop as remote code), so the
        folder or its Hub repo also works as `target.generate(..., custom_generate=FOLDER, trust_remote_code=True)`."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_custom_generate(save_directory)

    def draft_ids_to_target_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """Maps ids over the draft vocabulary (LM-head rows) to target-vocabulary ids."""
        return self.draft_to_target[draft_ids]

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        draft_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.BoolTensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        skip_logits: bool = False,
    ) -> OspreyDrafterOutput:
        r"""
        Arguments are those of [`OspreyModel.forward`], plus:

            logits_to_keep (`int` or `torch.BoolTensor` of shape `(batch_size, sequence_length)`, *optional*):
                Defaults to 0. An int computes logits for only the last `logits_to_keep` positions (0 = all):
                drafting needs one, and with a 150k-row head that is most of a drafter step. A boolean mask computes
                them only where it is True and returns them flattened, `(mask.sum(), draft_vocab_size)`: training
                needs no logits on prompt tokens and padding.
            skip_logits (`bool`, *optional*, defaults to `False`):
                Return the LM head's input at those positions as `last_hidden_state` instead of logits, for a loss
                that applies the head itself a chunk of rows at a time (a training loss over a large vocabulary never
                needs all the logits at once).
        """
        outputs = self.model(
            input_ids,
            target_hidden_states=target_hidden_states,
            draft_hidden_states=draft_hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[logits_to_keep]
        elif logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        return OspreyDrafterOutput(
            logits=None if skip_logits else self.lm_head(hidden_states),
            last_hidden_state=hidden_states if skip_logits else None,
            prenorm_hidden_states=outputs.prenorm_hidden_states,
            cache=outputs.cache,
        )


__all__ = ["OspreyForDrafting", "OspreyModel", "OspreyPreTrainedModel", "OspreyTTTCache"]
