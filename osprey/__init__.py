"""Osprey: target-agnostic pretrained drafters for lossless speculative decoding.

Importing the package registers `OspreyConfig` / `OspreyForDrafting` with transformers' auto classes, so
`AutoModelForCausalLM.from_pretrained(drafter_dir)` works in-process without `trust_remote_code`.
"""

from modeling_osprey import OspreyConfig, OspreyForDrafting, OspreyModel

__all__ = ["OspreyConfig", "OspreyForDrafting", "OspreyModel"]
