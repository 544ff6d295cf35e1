"""Osprey drafter configuration."""

from dataclasses import field

from transformers import PreTrainedConfig


AUTO_MAP = {
    "AutoConfig": "configuration_osprey.OspreyConfig",
    "AutoModel": "modeling_osprey.OspreyModel",
    "AutoModelForCausalLM": "modeling_osprey.OspreyForDrafting",
}


class OspreyConfig(PreTrainedConfig):
    r"""
    Configuration of an [`OspreyForDrafting`] drafter: a shallow decoder (pruned from a small pretrained LM, the
    *backbone*) that drafts tokens for one *target* LLM by reading the target's hidden states at a few tap layers.

    The first decoder block is the fusion block: its attention reads `[hidden_norm(fc(target taps)) ;
    input_layernorm(token stream)]`, so q/k/v take `2 * hidden_size` inputs, while the residual stream carries the
    token embeddings. With the feature half of q/k/v zero-initialised the drafter computes exactly what the backbone
    did, which is what makes target-agnostic pretraining transferable. The same class also expresses an EAGLE-3
    drafter (one block, `residual_stream="features"`), the baseline Osprey is measured against.

    Args:
        vocab_size (`int`, *optional*, defaults to 151936):
            Vocabulary size of the *target*: input ids are target token ids, and `embed_tokens` has one row per
            target token.
        draft_vocab_size (`int`, *optional*):
            Number of tokens the LM head predicts. Defaults to `vocab_size`. A smaller value keeps only the most
            frequent target tokens (EAGLE-3's reduced draft vocabulary); the model then stores a `draft_to_target`
            id map and draft ids must be mapped back with `OspreyForDrafting.draft_ids_to_target_ids`.
        hidden_size (`int`, *optional*, defaults to 576):
            Width of the drafter's residual stream (the backbone's hidden size).
        intermediate_size (`int`, *optional*, defaults to 1536):
            Width of the SwiGLU MLP.
        num_hidden_layers (`int`, *optional*, defaults to 2):
            Number of decoder blocks kept from the backbone; block 0 is the fusion block.
        num_attention_heads (`int`, *optional*, defaults to 9):
            Number of query heads.
        num_key_value_heads (`int`, *optional*, defaults to 3):
            Number of key/value heads (grouped-query attention); must divide `num_attention_heads`.
        head_dim (`int`, *optional*):
            Size of one attention head. Defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation of the gated MLP.
        attention_bias (`bool`, *optional*, defaults to `False`):
            Whether q/k/v projections have a bias (Qwen2-family backbones do).
        use_qk_norm (`bool`, *optional*, defaults to `False`):
            Whether queries and keys are RMS-normalised per head before RoPE (Qwen3-family backbones do).
        rms_norm_eps (`float`, *optional*, defaults to 1e-5):
            Epsilon of every RMSNorm.
        rope_theta (`float`, *optional*, defaults to 100000.0):
            Base period of the rotary position embeddings (default RoPE, no scaling).
        max_position_embeddings (`int`, *optional*, defaults to 8192):
            Longest sequence the drafter is meant to see; informational, RoPE is computed on the fly.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialiser for freshly created (not converted) weights.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`):
            Whether the LM head shares the embedding matrix; only possible without a reduced draft vocabulary.
        target_hidden_size (`int`, *optional*, defaults to 1536):
            Hidden size of the target model whose tap layers feed `fc`.
        target_layer_ids (`list[int]`, *optional*, defaults to `[1, 13, 24]`):
            Target decoder blocks (0-based) whose outputs are fused; `fc` maps their concatenation
            (`len(target_layer_ids) * target_hidden_size`) to `hidden_size`. The default suits a 28-layer target;
            EAGLE-3's rule is `[1, L // 2 - 1, L - 4]`.
        target_model_type (`str`, *optional*):
            `model_type` of the target the drafter was converted for (e.g. `"qwen2"`), checked when attaching.
        backbone_model_type (`str`, *optional*):
            `model_type` of the pretrained backbone the blocks came from (e.g. `"llama"`), for provenance.
        residual_stream (`str`, *optional*, defaults to `"tokens"`):
            What the fusion block adds its attention output to. `"tokens"` (Osprey): the token embeddings, so the
            blocks keep running the backbone's computation. `"features"` (EAGLE-3): the fused features, i.e.
            `fc(target taps)` or, on later chain steps, the drafter's own previous hidden state.
    """

    model_type = "osprey"

    vocab_size: int = 151936
    draft_vocab_size: int | None = None
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    use_qk_norm: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    target_hidden_size: int = 1536
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 13, 24])
    target_model_type: str | None = None
    backbone_model_type: str | None = None
    residual_stream: str = "tokens"

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        self.target_layer_ids = [int(layer_id) for layer_id in self.target_layer_ids]
        self._validate()
        super().__post_init__(**kwargs)
        # save_pretrained fills in only the saved class's own auto class; both model classes must resolve remotely.
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}

    def _validate(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention."
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]: the draft "
                "vocabulary is a subset of the target vocabulary."
            )
        if self.tie_word_embeddings and self.draft_vocab_size != self.vocab_size:
            raise ValueError(
                "tie_word_embeddings=True needs draft_vocab_size == vocab_size (the LM head would otherwise have a "
                "different number of rows than the embedding); set tie_word_embeddings=False."
            )
        if self.residual_stream not in ("tokens", "features"):
            raise ValueError(
                f"residual_stream must be 'tokens' (Osprey) or 'features' (EAGLE-3), got {self.residual_stream!r}."
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target tap layer.")
        if sorted(set(self.target_layer_ids)) != self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must be distinct, non-negative and increasing "
                "(0-based target decoder blocks, e.g. [1, 13, 24])."
            )

    @property
    def fused_feature_size(self) -> int:
        """Width of the concatenated target taps that `fc` projects to `hidden_size`."""
        return len(self.target_layer_ids) * self.target_hidden_size


__all__ = ["OspreyConfig"]
