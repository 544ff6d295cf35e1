"""What the plugin checks when the engine starts: that an exported drafter reads this target's token ids and taps.

It imports nothing of vLLM (or torch), so the rule runs, and is tested, anywhere: `model.py` calls `check_drafter`
before building the drafter, and `tests/test_vllm_plugin.py` calls it with stand-in configs.
"""

import logging
import os

logger = logging.getLogger(__name__)

# The version of the config `osprey export --format vllm` writes; a plugin refuses versions it does not know.
FORMAT_VERSION = 1
RESIDUAL_STREAMS = ("tokens", "features")


def tap_problem(aux_layer_ids, target_layers: int) -> str | None:
    """Why vLLM cannot collect the taps `aux_layer_ids` (`eagle_aux_hidden_state_layer_ids`: Osprey's tap + 1) from a
    target of `target_layers` decoder layers, or None.

    vLLM's target models (Llama, Qwen2 and the rest, 0.30 to 0.34) collect tap `k` once the first `k` layers have run:
    `k = 0` before the first layer, then `k = i + 1` after layer `i` (`_maybe_add_hidden_state`), so `k` runs from 0
    to `target_layers`, and `k = target_layers` (Osprey's tap on the last block) is the last block's output before
    the final norm, which is also what Osprey reads there. A tap beyond it is never collected: `fc` would then get
    fewer states than it reads and fail with a shape error. Osprey's taps are block outputs (>= 0), so `k >= 1`.
    """
    aux_layer_ids = list(aux_layer_ids)
    if all(1 <= layer_id <= target_layers for layer_id in aux_layer_ids):
        return None
    taps = [layer_id - 1 for layer_id in aux_layer_ids]
    return (
        f"{target_layers} decoder layers (the drafter taps the outputs of blocks {taps}; this target has blocks 0 to "
        f"{target_layers - 1})"
    )


def check_drafter(draft_config, vllm_config) -> None:
    """Raises a `ValueError` naming the mismatch unless the exported drafter reads this target's token ids and tap
    layers; warns when it was converted for a target of another name (same shapes, but its acceptance would
    collapse). `draft_config` is the drafter's `config.json` as vLLM parsed it; `vllm_config` is vLLM's `VllmConfig`
    (only its `model_config` and `speculative_config.model` are read)."""
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
    problems = []
    if draft_config.vocab_size != target.get_vocab_size():
        problems.append(f"a vocabulary of {target.get_vocab_size()} tokens (the drafter's: {draft_config.vocab_size})")
    if draft_config.target_hidden_size != target.get_hidden_size():
        problems.append(
            f"hidden size {target.get_hidden_size()} (the drafter's fc reads {draft_config.target_hidden_size})"
        )
    taps = tap_problem(draft_config.eagle_aux_hidden_state_layer_ids, target.get_total_num_hidden_layers())
    if taps:
        problems.append(taps)
    if problems:
        raise ValueError(
            f"The Osprey drafter {vllm_config.speculative_config.model!r} was converted for "
            f"{getattr(draft_config, 'target_name_or_path', None) or 'another target'!r}, but the target "
            f"{target.model!r} has {'; '.join(problems)}. Serve it with the target it was converted for, or convert "
            "and distill a drafter for this target with `osprey convert` / `osprey distill` (taps from "
            "`--target-layers`, blocks of this target), then `osprey export --format vllm`."
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
