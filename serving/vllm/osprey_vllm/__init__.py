"""vLLM plugin for Osprey drafters: registers `Eagle3OspreyForCausalLM` with vLLM's model registry.

vLLM calls `register` in every process it starts (entry point group `vllm.general_plugins`); the model class is
registered lazily, by name, so that importing the plugin imports nothing heavy.
"""

ARCHITECTURE = "Eagle3OspreyForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "osprey_vllm.model:Eagle3OspreyForCausalLM")


__all__ = ["ARCHITECTURE", "register"]
