"""Osprey: target-agnostic pretrained drafters for lossless speculative decoding.

Importing the package registers `OspreyConfig` / `OspreyForDrafting` with transformers' auto classes, so
`AutoModelForCausalLM.from_pretrained(drafter_dir)` works in-process without `trust_remote_code`. `load_drafter` is the
loader every command uses: checkpoint directories, Hub ids and packed drafters alike, as the installed classes.
"""

from modeling_osprey import OspreyConfig, OspreyForDrafting, OspreyModel

from .models.pack import load_drafter

__all__ = ["OspreyConfig", "OspreyForDrafting", "OspreyModel", "load_drafter"]
