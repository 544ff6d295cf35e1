"""Presets for the paper's seed targets: tap layers and end-of-turn tokens, chosen from the target's config.

A preset is matched on the target's text config (`model_type`, `num_hidden_layers`, `hidden_size`), so fine-tunes of
a seed target with the same architecture get it too. Its taps are EAGLE-3's `[1, L // 2 - 1, L - 4]` for these
depths, written out so that a drafter for a seed target always reads the same blocks whatever default the library
uses later. Its end-of-turn tokens are the ones the chat template closes an assistant turn with: a drafter that stops
drafting at them wastes no draft steps past the end of an answer, even when the target's `config.json` names only
one of them (Qwen3-8B lists `<|im_end|>` but not `<|endoftext|>`).

Token ids are looked up in the target's tokenizer, never hard-coded: a preset token the tokenizer lacks is skipped.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class TargetPreset:
    """What Osprey needs to know about one seed target beyond its config."""

    name: str
    hub_id: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    target_layer_ids: tuple[int, ...]
    end_of_turn_tokens: tuple[str, ...]

    def matches(self, config: PreTrainedConfig) -> bool:
        text = config.get_text_config()
        shape = (text.model_type, text.num_hidden_layers, text.hidden_size)
        return shape == (self.model_type, self.num_hidden_layers, self.hidden_size)


PRESETS = {
    preset.name: preset
    for preset in (
        TargetPreset(
            name="qwen3-8b",
            hub_id="Qwen/Qwen3-8B",
            model_type="qwen3",
            num_hidden_layers=36,
            hidden_size=4096,
            target_layer_ids=(1, 17, 32),
            end_of_turn_tokens=("<|im_end|>", "<|endoftext|>"),  # ChatML turn end; document end
        ),
        TargetPreset(
            name="llama-3.3-70b-instruct",
            hub_id="meta-llama/Llama-3.3-70B-Instruct",
            model_type="llama",
            num_hidden_layers=80,
            hidden_size=8192,
            target_layer_ids=(1, 39, 76),
            # turn end; end of a tool-call message (ipython); document end
            end_of_turn_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        ),
        TargetPreset(
            name="minimax-m2.5",
            hub_id="MiniMaxAI/MiniMax-M2.5",
            model_type="minimax_m2",
            num_hidden_layers=62,
            hidden_size=3072,
            target_layer_ids=(1, 30, 58),
            end_of_turn_tokens=("[e~[",),  # closes every message of the MiniMax-M2 chat template
        ),
    )
}
AUTO, NONE = "auto", "none"
PRESET_CHOICES = (AUTO, NONE, *PRESETS)


def resolve_preset(target_config: PreTrainedConfig, name: str | None = AUTO) -> TargetPreset | None:
    """The preset to use for `target_config`: the matching one for `"auto"` (or None), none for `"none"`, or the one
    named (applied whatever the config says; its taps are still checked against the target's depth)."""
    if name is None or name == AUTO:
        return next((preset for preset in PRESETS.values() if preset.matches(target_config)), None)
    if name == NONE:
        return None
    if name not in PRESETS:
        raise ValueError(
            f"Unknown target preset {name!r}: choose one of {', '.join(PRESETS)}, {AUTO!r} (match the target's config) "
            f"or {NONE!r} (EAGLE-3's default taps, the target's own special tokens)."
        )
    return PRESETS[name]


def end_of_turn_token_ids(preset: TargetPreset | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of the preset's end-of-turn tokens in `tokenizer`, skipping tokens it does not have."""
    if preset is None:
        return []
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in preset.end_of_turn_tokens if token in vocab]


def merged_eos_token_ids(eos_token_id: int | Sequence[int] | None, extra_ids: Sequence[int]) -> int | list[int] | None:
    """`eos_token_id` (the target config's) followed by the `extra_ids` it lacks; a single id stays an int."""
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    ids += [token_id for token_id in extra_ids if token_id not in ids]
    return None if not ids else ids[0] if len(ids) == 1 else ids


__all__ = [
    "PRESETS",
    "PRESET_CHOICES",
    "TargetPreset",
    "end_of_turn_token_ids",
    "merged_eos_token_ids",
    "resolve_preset",
]
