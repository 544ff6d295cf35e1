"""Hidden-state features of a frozen target LLM, read at its "tap" decoder layers.

Tap ``i`` is the output of decoder block ``i`` (0-based): entry ``i + 1`` of the ``hidden_states`` tuple returned with
``output_hidden_states=True``, whose entry 0 is the embedding output. This is the EAGLE-3 / SpecForge convention. The
final block is the one exception: transformers replaces the tuple's last entry with the *normed* last hidden state,
while a tap on block ``L - 1`` sees the block's raw output.

Taps are read with forward hooks on exactly the tap blocks. transformers 5.24 can also select hidden states with
``output_hidden_states=[i + 1, ...]`` (indexed like the tuple; unselected entries are ``None``, not kept, though every
block still runs), but only on models whose forward uses its ``capture_outputs`` decorator (remote-code targets may
not) and only for calls that pass the argument. Hooks see every forward of the target whoever makes it, ``generate``
included.
"""

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn


def default_target_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's taps ``[1, L // 2 - 1, L - 4]``: a low, a middle and a high block of an ``L``-block target."""
    layer_ids = [1, num_hidden_layers // 2 - 1, num_hidden_layers - 4]
    if not layer_ids[0] < layer_ids[1] < layer_ids[2]:
        raise ValueError(
            f"A target with {num_hidden_layers} decoder layers is too shallow for the default taps "
            f"[1, L // 2 - 1, L - 4] = {layer_ids}, which need L >= 7 to be distinct and increasing. Pass explicit "
            f"`target_layer_ids`: increasing decoder block indices in [0, {num_hidden_layers})."
        )
    return layer_ids


def validate_target_layer_ids(layer_ids: Sequence[int], num_hidden_layers: int) -> tuple[int, ...]:
    """`layer_ids` as a tuple, after checking they are distinct, increasing block indices of an ``L``-block target.

    Increasing order is required rather than applied, because the order fixes the layout of the concatenated features
    a drafter was trained on.
    """
    if isinstance(layer_ids, (str, bytes)) or not isinstance(layer_ids, Sequence) or len(layer_ids) == 0:
        raise ValueError(f"`target_layer_ids` must be a non-empty list of decoder block indices, got {layer_ids!r}.")
    not_ints = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int)]
    if not_ints:
        raise ValueError(f"`target_layer_ids` must hold ints (decoder block indices), got {not_ints} in {layer_ids}.")
    out_of_range = [i for i in layer_ids if not 0 <= i < num_hidden_layers]
    if out_of_range:
        raise ValueError(
            f"`target_layer_ids` {list(layer_ids)} has {out_of_range} outside [0, {num_hidden_layers}) for a target "
            f"with {num_hidden_layers} decoder layers. Tap i is the output of block i (0-based, negative indices are "
            f"not supported): pass indices from 0 to {num_hidden_layers - 1}."
        )
    if len(set(layer_ids)) != len(layer_ids):
        repeated = sorted({i for i in layer_ids if list(layer_ids).count(i) > 1})
        raise ValueError(f"`target_layer_ids` {list(layer_ids)} repeats {repeated}: pass distinct block indices.")
    if list(layer_ids) != sorted(layer_ids):
        raise ValueError(
            f"`target_layer_ids` {list(layer_ids)} must be increasing, as features are concatenated in that order: "
            f"pass {sorted(layer_ids)}."
        )
    return tuple(layer_ids)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM, found through ``get_decoder()`` so multimodal wrappers (e.g.
    ``Gemma3ForConditionalGeneration``) resolve to their language model."""
    get_decoder = getattr(model, "get_decoder", None)
    candidates = [get_decoder()] if callable(get_decoder) else []
    candidates += [getattr(model, "base_model", model), model]
    for module in candidates:
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"Could not find the decoder layers of {type(model).__name__}: expected an `nn.ModuleList` named `layers` on "
        f"`model.get_decoder()` or on the base model, as transformers' decoder-only LLMs have."
    )


class TargetFeatureCapture:
    """Records the tap outputs of every forward of a target model, until `remove()` or the end of a ``with`` block.

    A decoding loop runs the target on new positions only (the prefill, then each verification step with a KV cache),
    so `features` holds those of the latest forward, shaped ``(batch, new_positions, len(layer_ids) * hidden_size)``.
    The capture can stay attached across calls (as a drafter does between ``generate`` calls); the features of the last
    forward remain readable after removal.

    Example:

    ```python
    >>> with TargetFeatureCapture(target, default_target_layer_ids(target.config.num_hidden_layers)) as capture:
    ...     logits = target(input_ids).logits
    >>> capture.features.shape  # (batch, seq, 3 * hidden_size)
    ```
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        layers = decoder_layers(model)
        self.layer_ids = validate_target_layer_ids(layer_ids, len(layers))
        self._tap_outputs: dict[int, torch.Tensor] = {}
        self._hook_handles = [layers[i].register_forward_hook(partial(self._record, i)) for i in self.layer_ids]

    def _record(self, layer_id: int, module: nn.Module, args: tuple, output) -> None:
        if layer_id == self.layer_ids[0]:
            # Blocks run in order, so the first tap starts a new forward: never mix taps of two forwards.
            self._tap_outputs.clear()
        self._tap_outputs[layer_id] = output[0] if isinstance(output, tuple) else output

    @property
    def features(self) -> torch.Tensor:
        """The tap outputs of the latest forward, concatenated on the last dim in `layer_ids` order."""
        missing = [i for i in self.layer_ids if i not in self._tap_outputs]
        if missing:
            raise RuntimeError(
                f"No complete target forward was captured (taps {missing} missing): run the target while the capture "
                f"is attached, after any `clear()`."
            )
        taps = [self._tap_outputs[i] for i in self.layer_ids]
        # A target spread over devices (`device_map="auto"`) yields taps on several devices.
        return torch.cat([tap.to(taps[0].device) for tap in taps], dim=-1)

    def clear(self) -> None:
        """Drops the captured features, so a stale forward's can never be read as the next one's."""
        self._tap_outputs.clear()

    def remove(self) -> None:
        """Detaches the hooks from the target; safe to call more than once."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def __enter__(self) -> "TargetFeatureCapture":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


@torch.no_grad()
def extract_target_features(
    model: nn.Module,
    input_ids: torch.LongTensor,
    layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tap features and logits of `input_ids` from one forward of the frozen target, to distill a drafter or cache
    its training data: ``(batch, seq, len(layer_ids) * hidden_size)`` and ``(batch, seq, vocab_size)``."""
    with TargetFeatureCapture(model, layer_ids) as capture:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return capture.features, logits
