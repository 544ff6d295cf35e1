"""Osprey drafter model (transformers classes), registered with the auto classes on import.

The modules in this folder double as Hub remote code: they are flat and import each other relatively only, so
`save_pretrained` can copy them beside the weights.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_osprey import OspreyConfig
from .modeling_osprey import OspreyForDrafting, OspreyModel, OspreyPreTrainedModel

AutoConfig.register(OspreyConfig.model_type, OspreyConfig, exist_ok=True)
AutoModel.register(OspreyConfig, OspreyModel, exist_ok=True)
AutoModelForCausalLM.register(OspreyConfig, OspreyForDrafting, exist_ok=True)

# Makes `save_pretrained` write `auto_map` and copy the modeling files, so checkpoints load with trust_remote_code.
OspreyConfig.register_for_auto_class("AutoConfig")
OspreyModel.register_for_auto_class("AutoModel")
OspreyForDrafting.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["OspreyConfig", "OspreyForDrafting", "OspreyModel", "OspreyPreTrainedModel"]
