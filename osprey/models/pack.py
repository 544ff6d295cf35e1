"""Drafter loading, and the packed drafter format: one loader for every drafter directory Osprey accepts.

`load_drafter(name_or_path)` is how every command (`osprey decode`, `bench`, `demo`, `distill`, `export`, `baseline`)
and the Space load a drafter: a checkpoint directory or Hub id written by `save_pretrained`, or a *packed* directory
written by `osprey pack` (`pack_drafter`). It always builds the installed `OspreyForDrafting`, never the
modeling files copied beside the weights, so the package's code is what runs.

A packed drafter stores every weight matrix as int8 with one float32 scale per row (symmetric absmax), everything else
as it is, plus the usual `config.json` and `generation_config.json`: a trained drafter ships in a quarter of the
space. Verification stays lossless with a quantized drafter: only how often drafts are accepted can change.
`osprey unpack --drafter DIR --output OUT` (`unpack_drafter`) turns it back into an ordinary checkpoint that
`AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)` loads without this package.

A drafter made from a zoo backbone packs far smaller against it (`osprey pack --drafter DIR --reference ZOO_NAME
[--delta-bits 4]`): its frozen copies of the backbone's tensors (the embedding) are rebuilt from the zoo model and
checked by SHA-256, its trained blocks and head stored as int8, int4 or 3-bit changes from the tensors they started as
(`osprey.models.compact`). A Qwen2.5-0.5B-based drafter: 36-50 MiB instead of 762 MiB in float32.

What the packed formats store is decided by `write_packed_weights` and read back by `read_packed_weights`; the rest
of this module goes through those two.
"""

import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from modeling_osprey import OspreyConfig, OspreyForDrafting
from modeling_osprey.decoding_osprey import CUSTOM_GENERATE_DIR
from modeling_osprey.modeling_osprey import PACKED_WEIGHTS_NAME as PACKED_WEIGHTS

from ..ground import require_empty_output_dir
from .compact import DELTA_BITS, PACK_MANIFEST, int8_rows, pack_tensors, read_manifest, read_pack, write_pack
from .zoo import fetch_reference, resolve_model_path

PACKED_FORMAT = "osprey-int8-rows"
SCALE_SUFFIX = ".int8_row_scale"
# Records that travel with a drafter: how its vocabulary was aligned and how it was trained (for the model card).
COMPANION_RECORDS = ("alignment_report.json", "trainer_state.json")


def is_packed(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a packed drafter (`pack_drafter`, with or without a reference) rather than a
    `save_pretrained` checkpoint."""
    return (Path(directory) / PACKED_WEIGHTS).is_file() or (Path(directory) / PACK_MANIFEST).is_file()


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a packed drafter stores: int8 rows plus a scale per row for every floating-point matrix, every
    other tensor (norms, the draft-to-target id map) unchanged."""
    tensors = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            tensors[name], tensors[name + SCALE_SUFFIX] = int8_rows(tensor)
        else:
            tensors[name] = tensor.contiguous()
    return tensors


def unpack_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's state dict from the tensors `pack_state_dict` stored, matrices dequantized to float32."""
    state_dict = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        state_dict[name] = tensor.float() * scale[:, None] if scale is not None else tensor
    return state_dict


def write_packed_weights(
    state_dict: dict[str, torch.Tensor], directory: Path, reference: str | None = None, delta_bits: int = 8
) -> None:
    """Writes a drafter's weights packed into `directory`: int8 rows, or against the zoo model `reference`."""
    if reference is None:
        save_file(pack_state_dict(state_dict), directory / PACKED_WEIGHTS, metadata={"format": PACKED_FORMAT})
    else:
        fetch_reference(reference)
        write_pack(directory, *pack_tensors(state_dict, reference, delta_bits=delta_bits))


def read_packed_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The state dict `write_packed_weights` stored in `directory`."""
    if (directory / PACK_MANIFEST).is_file():
        fetch_reference(read_manifest(directory).get("reference"))
        return read_pack(directory)
    return unpack_state_dict(load_file(directory / PACKED_WEIGHTS))


def pack_drafter(
    drafter: str | os.PathLike,
    output_dir: str | os.PathLike,
    target_name_or_path: str | None = None,
    reference: str | None = None,
    delta_bits: int = 8,
) -> Path:
    """Writes the drafter `drafter` (anything `load_drafter` accepts) packed to `output_dir` (new or empty): int8
    weights (or, with `reference`, the zoo model it was made from, its weights as references to it and int8 or
    int4 changes from it), config, generation config, and its alignment report and training record.
    `target_name_or_path` records the target in the config when the drafter does not name it yet (drafters converted
    before it was recorded); the packed drafter must name its target, which demos load."""
    output_dir = require_empty_output_dir(output_dir)
    model = load_drafter(drafter, dtype=torch.float32)
    if target_name_or_path is not None:
        model.config.target_name_or_path = target_name_or_path
    if not model.config.target_name_or_path:
        raise ValueError(
            f"{drafter} does not record the target it was converted for: pass it (--target, a zoo name or Hub id)."
        )
    output_dir.mkdir(parents=True, exist_ok=True)
    write_packed_weights(model.state_dict(), output_dir, reference, delta_bits)
    model.config.to_json_file(output_dir / "config.json")  # JSON only: the loader provides the code
    model.generation_config.save_pretrained(output_dir)
    copy_companions(model.name_or_path, output_dir)
    return output_dir


def unpack_drafter(packed_dir: str | os.PathLike, output_dir: str | os.PathLike) -> Path:
    """Writes the packed drafter in `packed_dir` as an ordinary checkpoint to `output_dir` (new or empty):
    safetensors weights, the config with `auto_map` and the remote-code files, the generation config and its
    records, so that it loads with `AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True)`."""
    if not is_packed(packed_dir):
        raise ValueError(
            f"{packed_dir} holds no {PACKED_WEIGHTS}, so it is not a packed drafter (`osprey pack`); an "
            "ordinary drafter directory needs no unpacking."
        )
    output_dir = require_empty_output_dir(output_dir)
    load_drafter(packed_dir, dtype=torch.float32).save_pretrained(output_dir)
    copy_companions(packed_dir, output_dir)
    return output_dir


DRAFTER_QUANTIZATIONS = ("none", "int8")


def load_drafter(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    quantization: str = "none",
) -> OspreyForDrafting:
    """The drafter in a checkpoint directory, a Hub repo or a packed directory, as the installed `OspreyForDrafting`
    in `dtype` (on `device` if given), in eval mode. The one loader: every command and the Space use it.

    `quantization="int8"` (CPU only) runs the drafter's linear layers as PyTorch's dynamic int8 ones (int8 weights,
    activations quantized per call) and the rest in float32, whatever `dtype`: a drafting step on a CPU reads every
    weight for a handful of tokens, so it costs about the weights' bytes, and int8 drafts about twice as fast as
    bfloat16 (`benchmarks/drafting_cost.py` times both; docs/decoding.md). The drafts change a little; the output
    does not (the target verifies)."""
    if quantization not in DRAFTER_QUANTIZATIONS:
        raise ValueError(
            f"Unknown drafter quantization {quantization!r}: choose from {', '.join(DRAFTER_QUANTIZATIONS)}."
        )
    if quantization == "int8" and torch.device(device or "cpu").type != "cpu":
        raise ValueError(
            f"int8 drafters run on a CPU only (PyTorch's dynamic int8 linear layers), not on {device}: load it with "
            "device='cpu', or without quantization (--drafter-quantization none)."
        )
    directory = Path(name_or_path) if is_packed(name_or_path) else Path(resolve_model_path(name_or_path))
    if is_packed(directory):  # a local packed directory, or a Hub repo holding one
        config = OspreyConfig.from_pretrained(directory)
        drafter = OspreyForDrafting(config)
        drafter.load_state_dict(read_packed_weights(directory), strict=True)
        drafter.generation_config = drafter.generation_config.from_pretrained(directory)
        drafter.name_or_path = drafter.config.name_or_path = str(directory)
    else:
        _check_is_drafter(directory)
        drafter = OspreyForDrafting.from_pretrained(directory, dtype=dtype)
    if quantization == "int8":
        return _dynamic_int8(drafter.to(dtype=torch.float32).eval())
    drafter = drafter.to(dtype=dtype) if device is None else drafter.to(device=device, dtype=dtype)
    return drafter.eval()


def _dynamic_int8(drafter: OspreyForDrafting) -> OspreyForDrafting:
    """`drafter` with every `nn.Linear` replaced, in place, by a dynamic int8 one (fbgemm's packed int8 GEMMs)."""
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao on every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(drafter, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def custom_generate_folder(drafter: OspreyForDrafting, name: str) -> str:
    """The folder `drafter` was loaded from, for `target.generate(custom_generate=...)`; a clear error when it holds no
    `custom_generate/generate.py` (saved before drafters carried it, or packed)."""
    folder = Path(drafter.name_or_path)
    if not (folder / CUSTOM_GENERATE_DIR / "generate.py").is_file():
        raise ValueError(
            f"{name} has no {CUSTOM_GENERATE_DIR}/generate.py for the custom route: it was saved before drafters "
            "carried it, or is packed. Save it again (`osprey unpack --drafter DIR --output NEW_DIR`, or "
            "`load_drafter(DIR).save_pretrained(NEW_DIR)`) and use NEW_DIR."
        )
    return str(folder)


def _check_is_drafter(directory: Path) -> None:
    config = OspreyConfig.get_config_dict(directory)[0]
    if config.get("model_type") != OspreyConfig.model_type:
        raise ValueError(
            f"{directory} holds a {config.get('model_type')!r} model, not an Osprey drafter: make one for your target "
            "with `osprey convert --backbone ... --target ...`."
        )


def copy_companions(source_dir, output_dir: Path) -> None:
    """Copies the `COMPANION_RECORDS` that `source_dir` holds into `output_dir`."""
    if source_dir and Path(source_dir).is_dir():
        for name in COMPANION_RECORDS:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, output_dir / name)


def add_subcommand(subparsers) -> None:
    """Adds `osprey pack` and `osprey unpack` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "pack", help="write a drafter as a packed (int8-row) drafter, or any checkpoint against its zoo model"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--drafter", help="drafter directory or Hub id")
    source.add_argument(
        "--checkpoint", help="any checkpoint folder (a backbone, a trainer checkpoint): see osprey.models.compact"
    )
    parser.add_argument("--output", required=True, help="new (or empty) directory for the packed drafter")
    parser.add_argument("--target", help="record the target (zoo name or Hub id) if the drafter does not name it")
    parser.add_argument(
        "--reference",
        help="zoo name or directory of the model the drafter or checkpoint was made from (tensors it copied or "
        "changed are stored as references or int8 / int4 / 3-bit deltas)",
    )
    parser.add_argument("--dtype", choices=("int8", "bfloat16"), default="int8", help="--checkpoint: other matrices")
    parser.add_argument(
        "--delta-bits",
        type=int,
        choices=DELTA_BITS,
        default=8,
        help="with --reference: bits per stored change against it (4: half the size, error 1/28 of a row's change "
        "instead of 1/254; 3: three eighths, error about a quarter of the change's norm)",
    )
    parser.set_defaults(run=_run_pack)
    parser = subparsers.add_parser("unpack", help="write a packed drafter or checkpoint as an ordinary checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--drafter", help="packed drafter directory, e.g. osprey/demo_drafter_qwen")
    source.add_argument("--checkpoint", help="directory written by `osprey pack --checkpoint`")
    parser.add_argument("--output", required=True, help="new (or empty) directory for the checkpoint")
    parser.set_defaults(run=_run_unpack)


def _run_pack(args) -> int:
    if args.checkpoint:
        from .compact import pack, pack_size_mib

        fetch_reference(args.reference)
        output = pack(args.checkpoint, args.output, args.reference, args.dtype, args.delta_bits)
        print(f"packed {args.checkpoint} to {output} ({pack_size_mib(output):.1f} MiB)")
        return 0
    output = pack_drafter(args.drafter, args.output, args.target, args.reference, args.delta_bits)
    size = sum(path.stat().st_size for path in output.iterdir())
    print(f"packed {args.drafter} to {output} ({size / 2**20:.1f} MiB)")
    return 0


def _run_unpack(args) -> int:
    if args.checkpoint:
        from .compact import pack_size_mib, unpack

        fetch_reference(read_manifest(Path(args.checkpoint)).get("reference"))
        output = unpack(args.checkpoint, args.output)
        print(f"unpacked {args.checkpoint} to {output} ({pack_size_mib(output):.1f} MiB)")
        return 0
    output = unpack_drafter(args.drafter, args.output)
    print(f"unpacked {args.drafter} to {output}: AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)")
    return 0
