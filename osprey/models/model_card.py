"""The model card of an Osprey drafter, rendered from `hub_cards/drafter.md` with what the drafter directory records.

The card lives apart from the upload (`osprey.models.hub`) so that it can be rendered and checked without a Hub:
`drafter_card(dir, repo_id)` reads the config, `alignment_report.json` (target, backbone, pruning, vocabulary
alignment), `trainer_state.json` (training budget), the weights (size) and, optionally, `osprey bench` results (eval
results and table). Which files get published is decided here too (`publishable_files`), because the card describes
exactly those files: the tokenizer it says travels with the drafter, the license notices it lists.
"""

import json
import math
import os
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import logging

from modeling_osprey.configuration_osprey import DRAFTING_DEFAULTS
from modeling_osprey.modeling_osprey import check_safetensors_checkpoint

from ..ground import is_notice
from .pack import is_packed

logger = logging.get_logger(__name__)

TAGS = ["osprey", "speculative-decoding", "eagle3", "drafter"]
# The zoo rebuilds these Hub checkpoints from GGUF quantisations of them; a drafter for a zoo model drafts for them.
ZOO_HUB_IDS = {
    "smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma-3-270m": "google/gemma-3-270m",
    "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
}
# What `save_pretrained` writes for a drafter, and what travels with it; anything else in the directory (optimizer
# states, pickled training arguments, checkpoint folders, a README that the generated card replaces) stays local.
MODEL_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json", "*.py")
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "alignment_report.json",
    "trainer_state.json",
    "osprey_adaptation.json",
)
# Written beside a drafter by `osprey adapt`: its target, backbone, prompt sets, whether the target answered chats or
# continued plain text (a base model), and the budget; the card says how the drafter was adapted from it.
ADAPTATION_RECORD = "osprey_adaptation.json"
TOKENIZER_VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BENCH_FIELDS = ("method", "suite", "category", "num_prompts", "tau", "tokens_per_s", "speedup")
BENCH_METRICS = (  # record field, model-index metric type and name
    ("tau", "mean_acceptance_length", "τ (mean acceptance length)"),
    ("speedup", "speedup", "speedup over plain decoding"),
    ("tokens_per_s", "tokens_per_second", "tokens/s"),
)


def hub_model_id(name_or_path: str | None) -> str | None:
    """The Hub id a model reference stands for: a zoo name or zoo cache directory maps to the checkpoint the zoo
    rebuilds, a Hub id is itself, and any other local path has none."""
    if not name_or_path:
        return None
    path = Path(name_or_path)
    if name_or_path in ZOO_HUB_IDS or (path.name in ZOO_HUB_IDS and path.parent.name == "models"):
        return ZOO_HUB_IDS[path.name]
    if path.is_absolute() or path.exists() or name_or_path.count("/") != 1:
        return None
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        return None
    return name_or_path


def load_bench_results(path: str | os.PathLike) -> list[dict]:
    """The records of an `osprey bench --output` file (or of a JSON list of such records), checked for the fields
    the model card reads."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Could not read benchmark results {path}: {error}") from error
    records = results.get("records") if isinstance(results, dict) else results
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise ValueError(f"{path} is not `osprey bench` output: expected its results, with a list of `records`.")
    for index, record in enumerate(records):
        missing = [name for name in BENCH_FIELDS if name not in record]
        if missing:
            raise ValueError(
                f"Record {index} of {path} lacks {missing}: `osprey bench` records have the fields "
                f"{', '.join(BENCH_FIELDS)}."
            )
    return records


def bench_eval_results(records: list[dict], method: str) -> list[EvalResult]:
    """Model-index eval results from the bench records of `method`: τ, speedup and tokens/s per suite and category."""
    own = [record for record in records if record["method"] == method]
    if not own:
        found = sorted({str(record["method"]) for record in records})
        raise ValueError(f"No benchmark record has method {method!r} (found: {', '.join(found)}); pass --bench-method.")
    results = []
    for record in own:
        suite, category = str(record["suite"]), None if record["category"] is None else str(record["category"])
        task = {"task_type": "text-generation", "task_name": "Speculative decoding"}
        where = {"dataset_type": suite, "dataset_name": suite, "dataset_config": category, **task}
        for field, metric_type, name in BENCH_METRICS:
            if record[field] is not None:
                results.append(
                    EvalResult(metric_type=metric_type, metric_name=name, metric_value=record[field], **where)
                )
    return results


def drafter_card(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    base_model: str | None = None,
    backbone: str | None = None,
    license: str | None = None,
    bench_results: str | os.PathLike | list[dict] | None = None,
    bench_method: str = "osprey",
    tags: list[str] | None = None,
) -> ModelCard:
    """The model card of the drafter saved in `folder`, to be published as `repo_id`.

    `base_model` (the target's Hub id) and `backbone` default to what `alignment_report.json` records; `license` to
    `gemma` when Gemma terms travel with the drafter, else `apache-2.0`. `bench_results` is an `osprey bench` JSON
    file (or its records); the records of `bench_method` become the card's eval results, all of them its table.
    """
    folder = Path(folder)
    config = _check_drafter_folder(folder)
    report = read_json(folder / "alignment_report.json") or {}
    recorded_target = config.get("target_name_or_path") or report.get("target")
    base_model = base_model or hub_model_id(recorded_target)
    if base_model is None:
        logger.warning(
            f"The drafter's target is not known as a Hub id (it records {recorded_target!r}), so the card "
            "names no base_model; pass it (--base-model) to link the drafter to its target."
        )
    published = {path.name for path in publishable_files(folder, MODEL_FILES + COMPANION_FILES)}
    notices = sorted(name for name in published if is_notice(name))
    license = license or ("gemma" if any("gemma" in name.lower() for name in notices) else "apache-2.0")
    records = load_bench_results(bench_results) if isinstance(bench_results, (str, os.PathLike)) else bench_results
    model_name = repo_id.split("/")[-1]
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=TAGS + [tag for tag in tags or [] if tag not in TAGS],
        model_name=model_name if records else None,
        eval_results=bench_eval_results(records, bench_method) if records else None,
    )
    target_name = base_model or Path(recorded_target or "").name or f"a {config.get('target_model_type')} model"
    backbone = backbone or hub_model_id(report.get("backbone")) or Path(report.get("backbone") or "").name
    tokenizer_config = read_json(folder / "tokenizer_config.json") or {}
    template = resources.files("hub_cards").joinpath("drafter.md").read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        repo_id=repo_id,
        model_name=model_name,
        target_name=target_name,
        target_id=base_model or target_name,
        target_name_or_path=config.get("target_name_or_path"),
        backbone_name=backbone or "a pruned pretrained model",
        pruning=report.get("pruning"),
        alignment=report.get("alignment"),
        draft_vocab=report.get("draft_vocab"),
        draft_vocab_size=config.get("draft_vocab_size") or config["vocab_size"],
        num_parameters=_parameter_count(folder),
        num_assistant_tokens=json.loads(drafter_generation_config(folder, config))["num_assistant_tokens"],
        training=_training_record(folder),
        adaptation=read_json(folder / ADAPTATION_RECORD),
        bench_records=records,
        notices=notices,
        has_tokenizer=any(name in published for name in TOKENIZER_VOCABULARIES),
        has_chat_template="chat_template.jinja" in published or "chat_template" in tokenizer_config,
        **{key: config.get(key) for key in ("target_model_type", "target_hidden_size", "target_layer_ids")},
        **{key: config.get(key) for key in ("backbone_model_type", "num_hidden_layers", "hidden_size", "vocab_size")},
        residual_stream=config.get("residual_stream", "tokens"),
    )


def backbone_card(folder: str | os.PathLike, repo_id: str) -> ModelCard:
    """The model card of a pretrained backbone saved in `folder` (a shipped zoo backbone, unpacked: its
    `osprey_backbone.json` records the parent, pruning, stage-2 corpus and budget and held-out perplexity)."""
    folder = Path(folder)
    facts = read_json(folder / "osprey_backbone.json")
    config = read_json(folder / "config.json")
    if facts is None or config is None:
        raise ValueError(
            f"{folder} has no osprey_backbone.json or config.json, so it is not a pretrained Osprey backbone: fetch "
            "one with `osprey fetch NAME` (`osprey fetch --list`)."
        )
    parent_id = ZOO_HUB_IDS.get(facts["parent"], facts["parent"])
    card_data = ModelCardData(
        base_model=parent_id,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=facts["license"],
        tags=["osprey", "speculative-decoding", "drafter-backbone"],
    )
    template = resources.files("hub_cards").joinpath("backbone.md").read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        repo_id=repo_id,
        model_name=repo_id.split("/")[-1],
        parent_id=parent_id,
        architecture=(config.get("architectures") or [config.get("model_type")])[0],
        num_hidden_layers=config["num_hidden_layers"],
        pruning=facts["pruning"],
        stage2=facts["stage2"],
        perplexity=facts["held_out_perplexity"],
        license=facts["license"],
        zoo_name=facts["name"],
    )


def _check_drafter_folder(folder: Path) -> dict:
    """The drafter's config, after refusing folders that would not load from the Hub with `trust_remote_code`."""
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory: pass the drafter directory of `osprey convert` or `distill`.")
    config = read_json(folder / "config.json")
    if config is None:
        space_hint = " For a Gradio Space folder, pass it as --space." if (folder / "app.py").is_file() else ""
        raise ValueError(
            f"{folder} has no config.json, so it is not a saved drafter: pass the directory written by "
            f"`osprey convert` or `osprey distill`.{space_hint}"
        )
    if config.get("model_type") != "osprey":
        raise ValueError(
            f"{folder} holds a {config.get('model_type')!r} model, not an Osprey drafter: turn it into one for your "
            "target with `osprey convert` and publish that."
        )
    if is_packed(folder):
        raise ValueError(
            f"{folder} is a packed drafter, which only Osprey reads: write it as an ordinary checkpoint with "
            f"`osprey unpack --drafter {folder} --output NEW_DIR` and publish that."
        )
    check_safetensors_checkpoint(folder)
    modules = sorted({reference.split(".")[0] for reference in (config.get("auto_map") or {}).values()})
    missing = [f"{module}.py" for module in modules if not (folder / f"{module}.py").is_file()]
    if modules and not missing:
        try:
            for module in modules:
                get_relative_import_files(folder / f"{module}.py")
        except FileNotFoundError as error:
            missing = [Path(error.filename).name]
    if not modules or missing:
        what = f"lacks the remote-code files {missing}" if modules else "has no auto_map in its config.json"
        raise ValueError(
            f"{folder} {what}, so it would not load with `trust_remote_code=True`: re-save it with "
            "`OspreyForDrafting.from_pretrained(DIR).save_pretrained(NEW_DIR)` (which writes both) and push that."
        )
    return config


def publishable_files(folder: Path, patterns) -> list[Path]:
    """The files of `folder` that match `patterns`, and its license notices, which always travel with the weights."""
    return sorted(
        path
        for path in folder.iterdir()
        if path.is_file() and (is_notice(path.name) or any(fnmatch(path.name, pattern) for pattern in patterns))
    )


def drafter_generation_config(folder: Path, config: dict) -> str:
    """The folder's generation config, with Osprey's drafting defaults (`DRAFTING_DEFAULTS`: full chains of 5) unless
    it sets its own number of draft tokens (transformers' default of 20 growing drafts wastes drafter steps)."""
    settings = read_json(folder / "generation_config.json") or {
        key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    if "num_assistant_tokens" not in settings:
        settings.update(DRAFTING_DEFAULTS)
    return json.dumps(settings, indent=2, sort_keys=True) + "\n"


def _parameter_count(folder: Path) -> str | None:
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            names = [name for name in weights.keys() if name != "draft_to_target"]  # noqa: SIM118 (not iterable)
            shapes = [weights.get_slice(name).get_shape() for name in names]
        total += sum(math.prod(shape) for shape in shapes)
    return f"{total / 1e6:.1f}M" if total else None


def _training_record(folder: Path) -> dict | None:
    """The training budget from the folder's `trainer_state.json`, else from its latest Trainer checkpoint's."""
    checkpoints = sorted(folder.glob("checkpoint-*/trainer_state.json"), key=_checkpoint_step, reverse=True)
    for path in [folder / "trainer_state.json", *checkpoints]:
        state = read_json(path)
        if state is not None:
            break
    else:
        return None
    logs = state.get("log_history") or []
    record = {key: state.get(key) for key in ("global_step", "max_steps", "epoch", "train_batch_size")}
    record.update(num_input_tokens_seen=state.get("num_input_tokens_seen"), total_flos=state.get("total_flos"))
    record["loss"] = next((log["loss"] for log in reversed(logs) if "loss" in log), None)
    record["eval_loss"] = next((log["eval_loss"] for log in reversed(logs) if "eval_loss" in log), None)
    return {"source": path.relative_to(folder).as_posix(), **record}


def _checkpoint_step(trainer_state: Path) -> int:
    step = trainer_state.parent.name.removeprefix("checkpoint-")
    return int(step) if step.isdigit() else -1


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when the file is absent (every record the card reads is optional)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): restore or delete it before publishing.") from error


__all__ = [
    "COMPANION_FILES",
    "MODEL_FILES",
    "TAGS",
    "ZOO_HUB_IDS",
    "bench_eval_results",
    "drafter_card",
    "drafter_generation_config",
    "hub_model_id",
    "load_bench_results",
    "publishable_files",
    "read_json",
]
