"""The Space's allow-list of models: display names picked in the browser -> models on the server.

The browser only ever sends display names; a name not in the list is refused, so visitors cannot make the server
load arbitrary paths or Hub repos. Models load on first use and stay loaded; each target has a lock so that two
generations never share one (the drafter reads the target's hidden states through forward hooks).
"""

import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from modeling_osprey.generation_osprey import DRAFTING_SETTINGS
from osprey import OspreyConfig
from osprey.measuring.demo import DEMOS
from osprey.models.pack import load_drafter
from osprey.models.zoo import ZOO, load_causal_lm, load_tokenizer

logger = logging.getLogger(__name__)

TargetLoader = Callable[[], tuple[PreTrainedModel, PreTrainedTokenizerBase]]
DrafterLoader = Callable[[], PreTrainedModel]
DTYPES = ("float32", "bfloat16")
# The page's drafting controls, for a drafter without measured settings (every drafter but those `osprey demo`
# ships): the drafting defaults, the tree-size slider at 10 nodes (it has no "default size" position).
PAGE_SETTINGS = DRAFTING_SETTINGS | {"tree_size": 10}


@dataclass
class TargetChoice:
    """One selectable target: how to load it (with its tokenizer) and the drafters converted for it, by name."""

    load: TargetLoader
    drafters: dict[str, DrafterLoader]
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Per drafter, the decoding settings it opens with (`PAGE_SETTINGS` keys); `PAGE_SETTINGS` for those not listed.
    settings: dict[str, dict] = field(default_factory=dict)


class ModelCatalog:
    """Allow-listed targets and drafters, loaded lazily and cached. Tests build one from in-memory loaders."""

    def __init__(self, targets: dict[str, TargetChoice]):
        if not targets or any(not choice.drafters for choice in targets.values()):
            raise ValueError("The model catalog needs at least one target, and every target at least one drafter.")
        self.targets = targets
        self._loaded: dict[tuple[str, ...], object] = {}
        self._loading = threading.Lock()

    @classmethod
    def from_json(cls, path: str | os.PathLike, device: str | None = None) -> "ModelCatalog":
        """Reads an allow-list file (format in space/README.md). Drafters given as local paths that do not exist are
        left out with a warning, so a Space lists only what it can serve. A drafter given as `{"demo": ZOO_NAME}` is
        the one `osprey demo` ships for that target, with the demo's measured dtype and decoding settings
        (`osprey.measuring.demo.DEMOS`, read here, never copied)."""
        path = Path(path)
        spec = json.loads(path.read_text())
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        targets = {}
        for target_name, entry in spec["targets"].items():
            locations, demo_of = {}, {}
            for drafter_name, location in entry["drafters"].items():
                if isinstance(location, dict):
                    demo_of[drafter_name], location = _demo_drafter(location, target_name, drafter_name, path)
                else:
                    location = _resolve_location(location, path.parent)
                if isinstance(location, Path) and not location.is_dir():
                    logger.warning(f"Skipping drafter {drafter_name!r} for {target_name!r}: {location} does not exist.")
                    continue
                locations[drafter_name] = location
            if not locations:
                continue
            demo_targets = {demo_of[name] for name in locations if name in demo_of}
            if len(demo_targets) > 1:
                raise ValueError(
                    f"Target {target_name!r} in {path} lists the demo drafters of {', '.join(sorted(demo_targets))}: a "
                    "target serves the drafters made for it. Move each under its own target."
                )
            demo_target = next(iter(demo_targets), None)
            # The entry's dtype, else its shipped drafter's measured one, else the file's, else float32.
            measured = DEMOS[demo_target].dtype if demo_target else None
            dtype = _dtype(entry.get("dtype") or measured or spec.get("dtype", "float32"), target_name, path)
            if "model" in entry:
                model = _resolve_location(entry["model"], path.parent)
            else:
                model = demo_target or _recorded_target(target_name, list(locations.values()))
            settings = {name: DEMOS[demo_of[name]].settings for name in locations if name in demo_of}
            drafters = {
                name: partial(load_drafter, location, dtype, device, _quantization(settings.get(name, {}), device))
                for name, location in locations.items()
            }
            targets[target_name] = TargetChoice(
                partial(_load_target, model, dtype, device), drafters, settings=settings
            )
        if not targets:
            raise ValueError(
                f"No drafter listed in {path} exists on this machine. Build one (`osprey convert --backbone ... "
                "--target ... --output ...`) and list its directory there, or pass another file with --models."
            )
        return cls(targets)

    def target_names(self) -> list[str]:
        return list(self.targets)

    def drafter_names(self, target_name: str) -> list[str]:
        return list(self._target(target_name).drafters)

    def settings(self, target_name: str, drafter_name: str) -> dict:
        """The decoding settings the page opens with for this drafter: its measured ones where the allow-list has
        them (a drafter `osprey demo` ships), else `PAGE_SETTINGS`. `drafter_quantization` is applied when the drafter
        loads, so it is not among them."""
        measured = self._target(target_name, drafter_name).settings.get(drafter_name, {})
        return PAGE_SETTINGS | {name: value for name, value in measured.items() if name in PAGE_SETTINGS}

    def load(self, target_name: str, drafter_name: str):
        """(target, tokenizer, drafter) for two allow-listed names; a ValueError naming the choices otherwise."""
        choice = self._target(target_name, drafter_name)
        with self._loading:
            target, tokenizer = self._cached((target_name,), choice.load)
            drafter = self._cached((target_name, drafter_name), choice.drafters[drafter_name])
        _check_pair(target, drafter, target_name, drafter_name)
        return target, tokenizer, drafter

    def lock(self, target_name: str) -> threading.Lock:
        """Held while a generation runs on this target."""
        return self._target(target_name).lock

    def _target(self, target_name: str, drafter_name: str | None = None) -> TargetChoice:
        """The target's entry; a ValueError naming the choices for an unknown target (or drafter, when given)."""
        if target_name not in self.targets:
            raise ValueError(f"Unknown target {target_name!r}; choose one of: {', '.join(self.targets)}.")
        choice = self.targets[target_name]
        if drafter_name is not None and drafter_name not in choice.drafters:
            raise ValueError(
                f"Unknown drafter {drafter_name!r} for {target_name!r}; choose one of: {', '.join(choice.drafters)}."
            )
        return choice

    def _cached(self, key, loader):
        if key not in self._loaded:
            logger.info(f"Loading {' / '.join(key)}")
            self._loaded[key] = loader()
        return self._loaded[key]


def _resolve_location(location: str, base: Path) -> str | Path:
    """Zoo names and Hub ids stay as they are; paths (absolute, `~`, `./`, `../`) are taken relative to `base`."""
    if location in ZOO or not location.startswith(("/", "~", "./", "../")):
        return location
    return (base / Path(location).expanduser()).resolve()


def _demo_drafter(entry: dict, target_name: str, drafter_name: str, path: Path) -> tuple[str, Path]:
    """The zoo target and directory of a `{"demo": ZOO_NAME}` drafter entry; a clear error for anything else."""
    demo_target = entry.get("demo")
    if set(entry) != {"demo"} or demo_target not in DEMOS:
        raise ValueError(
            f"Drafter {drafter_name!r} of {target_name!r} in {path} is {json.dumps(entry)}: a drafter is a zoo name, "
            f'Hub id or path, or {{"demo": TARGET}} for the drafter `osprey demo` ships for TARGET, one of: '
            f"{', '.join(DEMOS)}."
        )
    unknown = set(DEMOS[demo_target].settings) - {*PAGE_SETTINGS, "drafter_quantization"}
    if unknown:  # osprey.measuring.demo measured a setting the page has no control for
        raise ValueError(
            f"osprey demo's settings for {demo_target} include {', '.join(sorted(unknown))}, which the Space cannot "
            "set: add a control for it (space/app.py, live_decoding.py) and to PAGE_SETTINGS (space/allowlist.py)."
        )
    return demo_target, Path(DEMOS[demo_target].drafter_dir)


def _dtype(name: str, target_name: str, path: Path) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"Target {target_name!r} in {path} has dtype {name!r}: use one of {', '.join(DTYPES)}.")
    return getattr(torch, name)


def _quantization(settings: dict, device: str) -> str:
    """The drafter's measured quantization; int8 is for CPUs only, so on a GPU the drafter runs unquantized."""
    quantization = settings.get("drafter_quantization", "none")
    if quantization != "none" and torch.device(device).type != "cpu":
        logger.info(
            f"Drafter quantization {quantization} runs on a CPU only; on {device} the drafter is not quantized."
        )
        return "none"
    return quantization


def _load_target(location, dtype, device):
    return load_causal_lm(location, dtype=dtype).to(device).eval(), load_tokenizer(location)


def _recorded_target(target_name: str, drafter_locations: list) -> str:
    """The target a target entry without `model` serves: the one its drafters were converted for (drafters converted
    before `osprey convert` recorded it name none, and are checked against that target when loaded)."""
    recorded = {OspreyConfig.from_pretrained(location).target_name_or_path for location in drafter_locations} - {None}
    if len(recorded) != 1:
        found = f"they name {', '.join(sorted(recorded))}" if recorded else "none of them names one"
        raise ValueError(
            f"Target {target_name!r} has no `model` in the allow-list, and its drafters cannot stand in: {found}. Add "
            '`"model": ZOO_NAME_OR_HUB_ID_OR_PATH` to its entry.'
        )
    return recorded.pop()


def _check_pair(target, drafter, target_name: str, drafter_name: str) -> None:
    try:
        drafter.config.check_target(target)
    except ValueError as error:
        raise ValueError(
            f"Drafter {drafter_name!r} does not fit target {target_name!r}: {error} Fix the Space's models.json."
        ) from error
