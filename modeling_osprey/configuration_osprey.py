"""Osprey drafter configuration."""

import re
from collections.abc import Mapping
from dataclasses import field

from transformers import PreTrainedConfig

from .generation_osprey import DRAFTING_SETTINGS

AUTO_MAP = {
    "AutoConfig": "configuration_osprey.OspreyConfig",
    "AutoModel": "modeling_osprey.OspreyModel",
    "AutoModelForCausalLM": "modeling_osprey.OspreyForDrafting",
}
# How a drafter drafts unless its generation config says otherwise (`DRAFTING_SETTINGS`' chains, in a generation
# config's names): full chains of a constant length per verification step (transformers' default for assistants, 20
# growing tokens stopped at 0.4 confidence, wastes drafter steps).
DRAFTING_DEFAULTS = {
    "num_assistant_tokens": DRAFTING_SETTINGS["num_draft_tokens"],
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": DRAFTING_SETTINGS["confidence_threshold"],
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
        target_name_or_path (`str`, *optional*):
            The target the drafter was converted for, as `osprey convert` was given it: a zoo name, a Hub id or a
            local path (compare speculators' `verifier.name_or_path`). Demos load this target, and attaching a
            target whose name differs is refused (`check_target`).
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
    target_name_or_path: str | None = None
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

    def check_target(self, target, name_or_path: str | None = None, target_layer_ids=None) -> None:
        """Raises a `ValueError` naming the fix unless this drafter reads `target`'s token ids and hidden states.

        The one rule of "this drafter fits this target", for attaching, distillation, feature caches and demos.
        `target` is a target model, its config, or a mapping of the same fields (a feature cache's record).

        Checks the vocabulary (input ids are target ids), the hidden size the taps are read at, that every tap layer
        exists, the taps themselves when `target_layer_ids` says where features were read (a feature cache), and the
        target's name: when both the drafter's `target_name_or_path` and the target's (`name_or_path`, default the
        target's own) are known, they must name the same model. Names are compared by their last path component,
        case-insensitively, so a zoo name, the zoo's cache directory and the Hub id of the same model agree
        (`qwen2.5-coder-1.5b-instruct`, `.../models/qwen2.5-coder-1.5b-instruct`, `Qwen/Qwen2.5-Coder-1.5B-Instruct`).
        """
        fields = _target_fields(target)
        name_or_path = name_or_path if name_or_path is not None else fields.get("name_or_path")
        converted_for = (
            f"{self.target_name_or_path!r} ({self.target_model_type}, hidden size {self.target_hidden_size}, "
            f"vocabulary {self.vocab_size})"
            if self.target_name_or_path
            else f"a {self.target_model_type or 'target'} with hidden size {self.target_hidden_size} and vocabulary "
            f"{self.vocab_size}"
        )
        problems = [
            f"{name} {fields[name]} (the drafter's: {ours})"
            for name, ours in (("vocab_size", self.vocab_size), ("hidden_size", self.target_hidden_size))
            if fields.get(name) is not None and fields[name] != ours
        ]
        num_layers = fields.get("num_hidden_layers")
        if num_layers is not None and max(self.target_layer_ids) >= num_layers:
            problems.append(f"{num_layers} layers (the drafter taps {self.target_layer_ids})")
        if target_layer_ids is not None and list(target_layer_ids) != self.target_layer_ids:
            problems.append(
                f"features read at layers {list(target_layer_ids)} (the drafter taps {self.target_layer_ids})"
            )
        if problems:
            raise ValueError(
                f"This drafter was converted for {converted_for}, but the target"
                f"{f' {name_or_path!r}' if name_or_path else ''} has {'; '.join(problems)}. Convert a backbone for "
                "this target with `osprey convert --target ...`, or use the target the drafter was made for."
            )
        if (
            self.target_name_or_path
            and name_or_path
            and _model_name(name_or_path) != _model_name(self.target_name_or_path)
        ):
            raise ValueError(
                f"This drafter was converted for {self.target_name_or_path!r}, not {name_or_path!r}: its acceptance "
                f"would collapse on another model of the same shape. Use {self.target_name_or_path!r}, or convert a "
                "drafter for this target with `osprey convert`. If it is the same model under another name (a local "
                f"copy), record that name: `drafter.config.target_name_or_path = {name_or_path!r}`, then save."
            )

    @property
    def fused_feature_size(self) -> int:
        """Width of the concatenated target taps that `fc` projects to `hidden_size`."""
        return len(self.target_layer_ids) * self.target_hidden_size


def _target_fields(target) -> dict:
    """vocab_size, hidden_size, num_hidden_layers and name_or_path of a target model, config or mapping."""
    if isinstance(target, Mapping):
        return dict(target)
    config = getattr(target, "config", target)  # a model, or already its config
    name_or_path = getattr(config, "name_or_path", None)
    text_config = config.get_text_config(decoder=True)
    fields = {name: getattr(text_config, name, None) for name in ("vocab_size", "hidden_size", "num_hidden_layers")}
    return fields | {"name_or_path": name_or_path}


def _model_name(name_or_path: str) -> str:
    """The model a zoo name, Hub id or path names: its last path component, lower-cased (a Hub cache snapshot
    `.../models--Org--Name/snapshots/<hash>` names `name`)."""
    name_or_path = str(name_or_path).rstrip("/\\")
    snapshot = re.search(r"models--[^/\\]+--([^/\\]+)[/\\]snapshots[/\\]", name_or_path)
    if snapshot:
        return snapshot.group(1).lower()
    return re.split(r"[/\\]", name_or_path)[-1].lower()


__all__ = ["DRAFTING_DEFAULTS", "OspreyConfig"]
