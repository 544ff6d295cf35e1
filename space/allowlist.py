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

from osprey import OspreyConfig
from osprey.pack import load_drafter
from osprey.zoo import ZOO, load_causal_lm, load_tokenizer

logger = logging.getLogger(__name__)

TargetLoader = Callable[[], tuple[PreTrainedModel, PreTrainedTokenizerBase]]
DrafterLoader = Callable[[], PreTrainedModel]


@dataclass
class TargetChoice:
    """One selectable target: how to load it (with its tokenizer) and the drafters converted for it, by name."""

    load: TargetLoader
    drafters: dict[str, DrafterLoader]
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        left out with a warning, so a Space lists only what it can serve."""
        path = Path(path)
        spec = json.loads(path.read_text())
        dtype = getattr(torch, spec.get("dtype", "float32"))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        targets = {}
        for target_name, entry in spec["targets"].items():
            locations = {}
            for drafter_name, location in entry["drafters"].items():
                location = _resolve_location(location, path.parent)
                if isinstance(location, Path) and not location.is_dir():
                    logger.warning(f"Skipping drafter {drafter_name!r} for {target_name!r}: {location} does not exist.")
                    continue
                locations[drafter_name] = location
            if locations:
                if "model" in entry:
                    model = _resolve_location(entry["model"], path.parent)
                else:
                    model = _recorded_target(target_name, list(locations.values()))
                drafters = {
                    name: partial(load_drafter, location, dtype, device) for name, location in locations.items()
                }
                targets[target_name] = TargetChoice(partial(_load_target, model, dtype, device), drafters)
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

    def load(self, target_name: str, drafter_name: str):
        """(target, tokenizer, drafter) for two allow-listed names; a ValueError naming the choices otherwise."""
        choice = self._target(target_name)
        if drafter_name not in choice.drafters:
            raise ValueError(
                f"Unknown drafter {drafter_name!r} for {target_name!r}; choose one of: {', '.join(choice.drafters)}."
            )
        with self._loading:
            target, tokenizer = self._cached((target_name,), choice.load)
            drafter = self._cached((target_name, drafter_name), choice.drafters[drafter_name])
        _check_pair(target, drafter, target_name, drafter_name)
        return target, tokenizer, drafter

    def lock(self, target_name: str) -> threading.Lock:
        """Held while a generation runs on this target."""
        return self._target(target_name).lock

    def _target(self, target_name: str) -> TargetChoice:
        if target_name not in self.targets:
            raise ValueError(f"Unknown target {target_name!r}; choose one of: {', '.join(self.targets)}.")
        return self.targets[target_name]

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
