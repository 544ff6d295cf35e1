"""Compact checkpoints that reference a zoo model: stage products small enough to commit (tens of MB, not GB).

`osprey pack --checkpoint DIR --reference ZOO_NAME --output PACKED` / `osprey unpack --checkpoint PACKED --output DIR`
(the CLI lives with the packed drafter format in `osprey.models.pack`). Unlike a packed drafter, any transformers
checkpoint can be packed this way: a pruned backbone, a trainer's checkpoint folder, a drafter.

A pruned backbone, a stage-2 checkpoint or a drafter made from a zoo model holds large tensors that are copies of
that model's: the embedding and LM head of a Qwen2.5 backbone alone are 2 x 136 M parameters. `pack` stores each
tensor of a checkpoint in the cheapest exact-enough form:

- `ref`: most rows equal rows of a reference matrix, value for value (a frozen copy, the rows of a draft vocabulary,
  a converted drafter's embedding; the sign of a zero is not kept): the reference's name, the row indices and the
  few rows that are no copy are stored, plus the SHA-256 of the whole tensor; `unpack` rebuilds it from the zoo
  model and refuses a mismatch.
- `delta`: a tensor of the same name and shape exists in the reference (a fine-tuned block; a pruned backbone's block
  `j` is matched to the parent block it was copied from, from `config.osprey_pruning`), or the tensor is a trained
  LM head over a draft vocabulary whose rows started as the reference's rows of its `draft_to_target` ids (a
  converted drafter's head, while its change is under half its norm): the difference is stored as int8 rows (absmax
  scale per row), so the error is 1/254 of each row's *change*, not of its weights; with `delta_bits=4` as int4 rows
  (two per byte, error 1/28 of the change), half the size; with `delta_bits=3` as 3-bit rows (eight per three
  bytes, saturating at twice each row's RMS: error about a quarter of the change's norm), for drafters whose int4
  pack would pass 50 MB (an EAGLE-3 drafter, 106 M trained parameters).
- otherwise int8 rows (`--dtype int8`, matrices only: norms and vectors stay as they are) or bfloat16.

Files other than tensors travel in the pack: copied, or gzipped from 1 MiB on (the 11 MB Qwen tokenizer in a
trainer's checkpoint becomes 2 MB) and checked by SHA-256 at unpack. They are never rebuilt from the reference,
because the library that writes them changes their bytes: a config's `transformers_version`, a re-saved tokenizer,
a drafter init's remote code, rebuilt on a later machine. (Packs written before 2026-12-04 may still record such a
file as taken from the reference, `"from": "file"` or `"tokenizer"`; `unpack` reads them as before.) A trainer's
`optimizer.pt` keeps its parameter groups but not its moments, so `Trainer` can still resume the learning-rate
schedule from a packed checkpoint (Adam's moments restart from zero). `unpack` writes an ordinary
checkpoint directory back.
"""

import gzip
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..ground import cache_root, require_empty_output_dir

PACK_MANIFEST = "osprey_pack.json"
PACK_WEIGHTS = "packed.safetensors"
PACK_FORMAT = 1
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
SKIPPED_FILES = ("optimizer.pt",)  # rewritten without its moments, see `_strip_optimizer`
MAX_COPIED_FILE_BYTES = 32 * 2**20
MIN_GZIPPED_FILE_BYTES = 2**20  # smaller files are copied as they are
PACK_DTYPES = ("int8", "bfloat16")
DRAFT_ROWS = "draft_to_target"  # a drafter's draft-vocabulary ids: its LM head's rows in the target's vocabulary
# A matrix is stored by reference when at least this share of its rows are copies of one reference matrix's rows.
MIN_REFERENCED_ROWS = 0.5


def _canonical(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with -0.0 as +0.0: equal values compare equal (a conversion that copies rows arithmetically can flip
    the sign of a zero, which changes no result of a matrix product)."""
    return (tensor + 0.0 if tensor.is_floating_point() else tensor).contiguous()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (zeros taken as +0.0)."""
    return hashlib.sha256(_canonical(tensor).reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no model*.safetensors: pass a checkpoint directory saved by transformers.")
    state_dict = {}
    for path in files:
        state_dict.update(load_file(path))
    return state_dict


def int8_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows rounded to -127..127 times an absmax scale per row, and that scale."""
    scale = tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(tensor.float() / scale).to(torch.int8), scale.squeeze(1)


def _from_int8_rows(packed: torch.Tensor, scale: torch.Tensor, columns: int) -> torch.Tensor:
    return packed.float() * scale[:, None]


def _int4_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows rounded to -7..7 times an absmax scale per row, two per byte (low nibble first; a row of odd length is
    padded)."""
    scale = tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 7
    levels = (torch.round(tensor.float() / scale) + 8).to(torch.uint8)
    if levels.shape[1] % 2:
        levels = torch.cat([levels, levels.new_full((levels.shape[0], 1), 8)], dim=1)
    return levels[:, 0::2] | (levels[:, 1::2] << 4), scale.squeeze(1)


def _from_int4_rows(packed: torch.Tensor, scale: torch.Tensor, columns: int) -> torch.Tensor:
    levels = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :columns]
    return (levels.float() - 8) * scale[:, None]


def int3_clip(tensor: torch.Tensor) -> torch.Tensor:
    """Per row, the magnitude 3-bit rows saturate at: twice the row's RMS (or its absmax, if smaller). With only
    seven levels an absmax scale rounds most of a bell-shaped row to zero; clipped at 2 RMS, a trained drafter's
    change keeps far less error (docs/results.md, "Figures moved out of code comments")."""
    rows = tensor.float()
    return torch.minimum(rows.abs().amax(dim=1, keepdim=True), 2 * rows.pow(2).mean(dim=1, keepdim=True).sqrt())


def _int3_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows rounded to -3..3 times a scale per row (`int3_clip` / 3; larger values saturate), eight per three bytes
    (little-endian 24-bit groups, the first value in the lowest bits; a row is padded to a multiple of eight)."""
    scale = int3_clip(tensor).clamp(min=1e-12) / 3
    levels = (torch.round(tensor.float() / scale).clamp(-3, 3) + 4).to(torch.int32)
    if levels.shape[1] % 8:
        levels = torch.cat([levels, levels.new_full((levels.shape[0], 8 - levels.shape[1] % 8), 4)], dim=1)
    groups = levels.reshape(levels.shape[0], -1, 8)
    words = sum(groups[..., i] << (3 * i) for i in range(8))
    packed = torch.stack([(words >> (8 * b)) & 255 for b in range(3)], dim=-1).to(torch.uint8)
    return packed.reshape(levels.shape[0], -1), scale.squeeze(1)


def _from_int3_rows(packed: torch.Tensor, scale: torch.Tensor, columns: int) -> torch.Tensor:
    triples = packed.reshape(packed.shape[0], -1, 3).to(torch.int32)
    words = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    levels = torch.stack([(words >> (3 * i)) & 7 for i in range(8)], dim=-1).reshape(packed.shape[0], -1)
    return (levels[:, :columns].float() - 4) * scale[:, None]


# Bits per stored value -> (rows to codes and a scale per row, and back): the delta widths `pack` offers; int8 also
# stores a matrix without a reference (`dtype="int8"`).
ROW_CODECS = {8: (int8_rows, _from_int8_rows), 4: (_int4_rows, _from_int4_rows), 3: (_int3_rows, _from_int3_rows)}
DELTA_BITS = tuple(sorted(ROW_CODECS))


def _dequantized_rows(stored: dict, name: str, entry: dict) -> torch.Tensor:
    """A stored int8 or delta matrix in float32 (`entry`'s bits, 8 when it records none)."""
    return ROW_CODECS[entry.get("bits", 8)][1](stored[name], stored[name + ".scale"], entry["shape"][1])


def _reference_name_map(config: dict) -> dict[str, str]:
    """Layer prefixes of a pruned model -> the parent's (`model.layers.0.` -> `model.layers.5.`)."""
    kept = (config.get("osprey_pruning") or {}).get("kept_layers") or []
    return {f".layers.{new}.": f".layers.{old}." for new, old in enumerate(kept)}


def _parent_name(name: str, layer_map: dict[str, str]) -> str:
    for new, old in layer_map.items():
        if new in name:
            return name.replace(new, old, 1)
    return name


def _row_digests(tensor: torch.Tensor) -> list[bytes]:
    rows = _canonical(tensor).view(torch.uint8).numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in rows]


class _Reference:
    """Lazy access to a reference checkpoint's tensors, and an index of all its matrix rows by content."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files = {}
        for path in sorted(directory.glob("model*.safetensors")):
            with safe_open(path, "pt") as file:
                for name in file.keys():  # noqa: SIM118 (safe_open is no dict)
                    self.files[name] = path
        if not self.files:
            raise ValueError(f"The reference {directory} holds no model*.safetensors weights.")
        self._shapes = {}
        self._rows: dict[torch.dtype, dict[bytes, tuple[str, int]]] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            with safe_open(self.files[name], "pt") as file:
                self._shapes[name] = tuple(file.get_slice(name).get_shape())
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as file:
            return file.get_tensor(name)

    def draft_rows_base(self, tensor: torch.Tensor, draft_rows: torch.Tensor | None) -> str | None:
        """The reference matrix a draft-vocabulary LM head started from (its rows `draft_rows`), when `tensor` is
        still near those rows (changed by less than half its norm: a delta is then the cheaper exact-enough form);
        else None."""
        if draft_rows is None or tensor.dim() != 2 or tensor.shape[0] != draft_rows.shape[0]:
            return None
        for name in sorted(self.files):
            shape = self.shape(name)
            if len(shape) == 2 and shape[1] == tensor.shape[1] and shape[0] > int(draft_rows.max()):
                change = tensor.float() - self.get(name).float()[draft_rows]
                if change.norm() < 0.5 * tensor.float().norm():
                    return name
        return None

    def match_rows(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The reference matrix whose rows equal most of `tensor`'s rows bit for bit (in its dtype), and for each row
        the index of its copy there or -1; None when fewer than `MIN_REFERENCED_ROWS` of the rows are copies."""
        if tensor.dim() != 2 or not tensor.is_floating_point():
            return None
        if tensor.dtype not in self._rows:  # every row of every matrix, first occurrence in name order
            index = {}
            for name in sorted(self.files):
                if len(self.shape(name)) == 2:
                    for i, digest in enumerate(_row_digests(self.get(name).to(tensor.dtype))):
                        index.setdefault(digest, (name, i))
            self._rows[tensor.dtype] = index
        found = [self._rows[tensor.dtype].get(digest) for digest in _row_digests(tensor)]
        names = Counter(hit[0] for hit in found if hit is not None)
        if not names:
            return None
        name, hits = names.most_common(1)[0]
        if hits < MIN_REFERENCED_ROWS * len(found) or self.shape(name)[1] != tensor.shape[1]:
            return None
        rows = torch.tensor([hit[1] if hit is not None and hit[0] == name else -1 for hit in found])
        copied = rows >= 0
        if not torch.equal(self.get(name).to(tensor.dtype)[rows[copied]], tensor[copied]):
            return None
        return name, rows


def pack_tensors(
    state_dict: dict[str, torch.Tensor],
    reference: str | None = None,
    config: dict | None = None,
    dtype: str = "int8",
    delta_bits: int = 8,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors to store for `state_dict` in the compact form of the module docstring, and the manifest describing
    them (without its `files`). `reference` is a zoo name or checkpoint directory whose tensors are stored by
    reference or as deltas (int8 rows, or int4 / 3-bit with `delta_bits=4` / `3`); `config` (the checkpoint's, as a
    dict) maps a pruned model's blocks to its parent's. Without a reference every matrix is stored in `dtype` (`int8`
    rows or `bfloat16`)."""
    if dtype not in PACK_DTYPES:
        raise ValueError(f"Unknown pack dtype {dtype!r}: choose one of {', '.join(PACK_DTYPES)}.")
    if delta_bits not in DELTA_BITS:
        raise ValueError(f"delta_bits must be one of {DELTA_BITS}, got {delta_bits}.")
    ref = _Reference(reference_dir(reference)) if reference is not None else None
    layer_map = _reference_name_map(config or {})
    stored, entries = {}, {}
    draft_rows = state_dict.get(DRAFT_ROWS)
    for name, tensor in state_dict.items():
        entry = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        parent = _parent_name(name, layer_map)
        match = ref.match_rows(tensor) if ref is not None else None
        head_base = ref.draft_rows_base(tensor, draft_rows) if ref is not None and match is None else None
        if match is not None:
            ref_name, rows = match
            entry.update(kind="ref", ref=ref_name, sha256=tensor_sha256(tensor))
            if not torch.equal(rows, torch.arange(ref.shape(ref_name)[0])):
                stored[name + ".rows"] = rows
            if (rows < 0).any():  # rows that are no copy (e.g. a converted drafter's special tokens) are stored
                stored[name + ".patch"] = tensor[rows < 0].contiguous()
        elif (ref is not None and tensor.is_floating_point() and tensor.dim() == 2 and parent in ref.files
              and ref.shape(parent) == tuple(tensor.shape)):  # fmt: skip
            stored[name], stored[name + ".scale"] = ROW_CODECS[delta_bits][0](tensor.float() - ref.get(parent).float())
            entry.update(kind="delta", ref=parent, ref_sha256=tensor_sha256(ref.get(parent)), bits=delta_bits)
        elif head_base is not None:
            base = ref.get(head_base)
            change = tensor.float() - base.float()[draft_rows]
            stored[name], stored[name + ".scale"] = ROW_CODECS[delta_bits][0](change)
            entry.update(kind="delta", ref=head_base, ref_sha256=tensor_sha256(base), rows=DRAFT_ROWS, bits=delta_bits)
        elif tensor.is_floating_point() and tensor.dim() == 2 and dtype == "int8":
            stored[name], stored[name + ".scale"] = int8_rows(tensor)
            entry["kind"] = "int8"
        elif tensor.is_floating_point() and dtype == "bfloat16" and tensor.dim() == 2:
            stored[name], entry["kind"] = tensor.to(torch.bfloat16), "bfloat16"
        else:
            stored[name], entry["kind"] = tensor.contiguous(), "raw"
        entries[name] = entry
    manifest = {"format": PACK_FORMAT, "reference": reference, "dtype": dtype, "delta_bits": delta_bits}
    return stored, manifest | {"tensors": entries}


def write_pack(output_dir: Path, stored: dict[str, torch.Tensor], manifest: dict) -> None:
    """Writes `pack_tensors`' result (the manifest completed with its `files`) into `output_dir`."""
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(stored, output_dir / PACK_WEIGHTS, metadata={"format": f"osprey-pack-{PACK_FORMAT}"})
    (output_dir / PACK_MANIFEST).write_text(json.dumps({"files": {}} | manifest, indent=1) + "\n")


def pack(
    model_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    reference: str | None = None,
    dtype: str = "int8",
    delta_bits: int = 8,
) -> Path:
    """Writes `model_dir`'s checkpoint to `output_dir` in the compact form described in the module docstring:
    its tensors as `pack_tensors` stores them, its other files copied (gzipped from 1 MiB on)."""
    model_dir, output_dir = Path(model_dir), require_empty_output_dir(output_dir)
    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
    stored, manifest = pack_tensors(_read_state_dict(model_dir), reference, config, dtype, delta_bits)
    files = {}
    output_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name in WEIGHT_FILES or path.name.startswith("model-"):
            continue
        if path.name == "optimizer.pt":
            _strip_optimizer(path, output_dir / path.name)
        elif path.stat().st_size > MAX_COPIED_FILE_BYTES:
            raise ValueError(f"{path} is {path.stat().st_size / 2**20:.0f} MiB: too large to pack; remove it.")
        elif path.stat().st_size < MIN_GZIPPED_FILE_BYTES:
            shutil.copy2(path, output_dir / path.name)
        else:
            with path.open("rb") as source, gzip.GzipFile(output_dir / f"{path.name}.gz", "wb", mtime=0) as target:
                shutil.copyfileobj(source, target)
            files[path.name] = {"sha256": _file_sha256(path), "from": "gzip"}
    write_pack(output_dir, stored, manifest | {"files": files})
    return output_dir


def reference_dir(reference: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the reference of a pack lives: its directory, or the build of the zoo model it names in the zoo's cache
    (root `cache_dir`, default as `osprey.ground.cache_root`). Building zoo models is the zoo's job, and the zoo
    unpacks its shipped backbones with this module: callers fetch a zoo reference first (`osprey.models.pack` and
    `osprey.models.zoo` do)."""
    path = Path(reference).expanduser()
    if path.is_dir():
        return path
    built = cache_root(cache_dir) / "models" / str(reference)
    if (built / "config.json").is_file():
        return built
    raise ValueError(
        f"The reference {str(reference)!r} is neither a directory nor a zoo model built in {built.parent}: fetch it "
        f"first (`osprey fetch {reference}`)."
    )


def _reference_dir(manifest: dict, cache_dir: str | os.PathLike | None = None) -> Path | None:
    return reference_dir(manifest["reference"], cache_dir) if manifest.get("reference") is not None else None


def _save_reference_tokenizer(directory: Path, output_dir: Path) -> None:
    """The reference's tokenizer as `save_pretrained` writes it: what a trainer's checkpoint holds (a re-save can
    differ from the original files, e.g. Qwen2's tokenizer.json gains its NFC normalizer)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError, TypeError):  # a reference without a (loadable) tokenizer
        return
    tokenizer.save_pretrained(output_dir)


def _file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _strip_optimizer(source: Path, destination: Path) -> None:
    """An optimizer state dict without per-parameter state: `Trainer` then resumes the schedule, moments restart."""
    state = torch.load(source, map_location="cpu", weights_only=True)
    torch.save({"state": {}, "param_groups": state["param_groups"]}, destination)


def read_pack(packed_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """The state dict stored by `pack` / `write_pack` in `packed_dir`, each tensor in its original dtype; tensors
    stored by reference are rebuilt from the reference (`reference_dir`) and checked."""
    manifest = read_manifest(Path(packed_dir))
    stored = load_file(Path(packed_dir) / PACK_WEIGHTS)
    kinds = {entry["kind"] for entry in manifest["tensors"].values()}
    ref = _Reference(_reference_dir(manifest, cache_dir)) if not kinds.isdisjoint(("ref", "delta")) else None
    state_dict = {}
    for name, entry in manifest["tensors"].items():
        original = getattr(torch, entry["dtype"])
        kind = entry["kind"]
        if kind == "ref":
            tensor = ref.get(entry["ref"]).to(original)
            if name + ".rows" in stored:
                rows = stored[name + ".rows"]
                tensor = tensor[rows.clamp(min=0)]
                if name + ".patch" in stored:
                    tensor[rows < 0] = stored[name + ".patch"]
            _check(tensor_sha256(tensor), entry["sha256"], name, manifest["reference"], entry["ref"])
        elif kind == "delta":
            base = ref.get(entry["ref"])
            _check(tensor_sha256(base), entry["ref_sha256"], name, manifest["reference"], entry["ref"])
            if "rows" in entry:  # an LM head over a draft vocabulary: the reference's rows of those ids
                base = base[stored[entry["rows"]]]
            tensor = (base.float() + _dequantized_rows(stored, name, entry)).to(original)
        elif kind == "int8":
            tensor = _dequantized_rows(stored, name, entry).to(original)
        else:
            tensor = stored[name].to(original)
        state_dict[name] = tensor
    return state_dict


def read_manifest(packed_dir: Path) -> dict:
    """The manifest `pack` wrote in `packed_dir` (what each tensor is stored as, and the reference), checked."""
    if not (packed_dir / PACK_MANIFEST).is_file():
        raise ValueError(
            f"{packed_dir} holds no {PACK_MANIFEST}: pass a directory written by `osprey pack --checkpoint`."
        )
    manifest = json.loads((packed_dir / PACK_MANIFEST).read_text())
    if manifest["format"] != PACK_FORMAT:
        raise ValueError(f"{packed_dir} is pack format {manifest['format']}; this osprey reads format {PACK_FORMAT}.")
    return manifest


def unpack(
    packed_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Writes the ordinary checkpoint stored by `pack` in `packed_dir` to `output_dir` (each tensor in its original
    dtype unless `dtype` is given); tensors stored by reference are rebuilt from the reference and checked."""
    packed_dir, output_dir = Path(packed_dir), require_empty_output_dir(output_dir)
    manifest = read_manifest(packed_dir)
    state_dict = read_pack(packed_dir, cache_dir)
    if dtype is not None:
        state_dict = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state_dict.items()}
    output_dir.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, output_dir / "model.safetensors", metadata={"format": "pt"})
    files = manifest.get("files", {})
    gzipped = {f"{name}.gz" for name, file in files.items() if file["from"] == "gzip"}
    for path in sorted(packed_dir.iterdir()):
        if path.is_file() and path.name not in (PACK_MANIFEST, PACK_WEIGHTS, *gzipped):
            shutil.copy2(path, output_dir / path.name)
    with tempfile.TemporaryDirectory() as resaved:
        resaved = Path(resaved)
        if any(file["from"] == "tokenizer" for file in files.values()):  # an older pack's references
            _save_reference_tokenizer(_reference_dir(manifest, cache_dir), resaved)
        for name, file in files.items():
            if file["from"] == "gzip":
                with gzip.open(packed_dir / f"{name}.gz", "rb") as source, (output_dir / name).open("wb") as target:
                    shutil.copyfileobj(source, target)
                if _file_sha256(output_dir / name) != file["sha256"]:
                    raise ValueError(f"{packed_dir / name}.gz does not unpack to the file that was packed.")
                continue
            source = (_reference_dir(manifest, cache_dir) if file["from"] == "file" else resaved) / name
            _check(_file_sha256(source), file["sha256"], name, manifest["reference"], name)
            shutil.copy2(source, output_dir / name)
    return output_dir


def _check(actual: str | None, expected: str, name: str, reference: str, ref_name: str) -> None:
    if actual != expected:
        raise ValueError(
            f"{name!r} rebuilt from {reference!r} ({ref_name}) does not match the SHA-256 recorded when it was "
            f"packed: this {reference!r} is not the model the checkpoint was made from. Rebuild the zoo model with "
            f"`osprey fetch {reference} --force`, or pass the original checkpoint directory as the reference."
        )


def pack_size_mib(directory: str | os.PathLike) -> float:
    return sum(path.stat().st_size for path in Path(directory).iterdir() if path.is_file()) / 2**20
