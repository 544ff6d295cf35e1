"""Publish an adapted drafter to the Hugging Face Hub with a generated model card, or a Gradio Space.

`osprey push --drafter DIR --repo-id ID` uploads a drafter directory (written by `osprey convert` or `osprey distill`)
in one commit: the safetensors weights, the config with `auto_map` and the remote-code files it names (so the drafter
loads with `trust_remote_code=True` without this package), a generation config drafting 5 tokens per step, the
target's tokenizer, the alignment report, license notices and a model card rendered from `hub_cards/drafter.md`:
target (`base_model`), backbone, vocabulary alignment, training budget (`trainer_state.json`), usage and, with
`--bench-results`, the `osprey bench` results as eval results. `push_drafter(drafter, repo_id)` publishes the same
way from Python; `drafter.push_to_hub(repo_id)` stays transformers' own (weights, config, remote code, a generic
card). `osprey push --space DIR --repo-id ID` uploads a Gradio Space folder.

Nothing local is written. A commit is atomic on the Hub, so an upload that fails (server, auth or network error)
commits nothing, and running the same command again is the retry.
"""

import argparse
import os
import shutil
import sys
import tempfile
from fnmatch import fnmatch
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, HfApi, SpaceCard
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import validate_repo_id

from modeling_osprey.decoding_osprey import CUSTOM_GENERATE_DIR, write_custom_generate

try:  # the HTTP client of huggingface_hub 2.x; 1.x used httpx
    import httpx2 as httpx
except ImportError:
    import httpx

from .model_card import (
    COMPANION_FILES,
    MODEL_FILES,
    backbone_card,
    drafter_card,
    drafter_generation_config,
    publishable_files,
    read_json,
)

SPACE_IGNORED = ("__pycache__", "*.pyc", ".*")


class HubPushError(RuntimeError):
    """An upload did not complete: nothing was committed and nothing local changed, so pushing again is the retry."""


def push_drafter_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    **card_options,
) -> CommitInfo:
    """Publishes the drafter saved in `folder` as `repo_id` in one commit, with its card (`card_options` go to
    [`drafter_card`]); returns the commit. Raises `HubPushError` when the upload fails, `ValueError` on bad input."""
    folder = Path(folder)
    validate_repo_id(repo_id)
    card = drafter_card(folder, repo_id, **card_options)  # refuses bad input before anything reaches the Hub
    config = read_json(folder / "config.json")

    def operations(created_repo_id: str) -> list[CommitOperationAdd]:
        """The files, and the card naming the repo as created (a bare name gets the token's namespace)."""
        final_card = card if created_repo_id == repo_id else drafter_card(folder, created_repo_id, **card_options)
        files = [
            CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
            for path in publishable_files(folder, MODEL_FILES + COMPANION_FILES)
            if path.name != "generation_config.json"
        ]
        generation_config = drafter_generation_config(folder, config).encode()
        files.append(CommitOperationAdd("generation_config.json", generation_config))
        files += custom_generate_operations(folder)
        return files + [CommitOperationAdd("README.md", str(final_card).encode())]

    return _commit(
        repo_id,
        operations,
        private=private,
        token=token,
        revision=revision,
        create_pr=create_pr,
        commit_message=commit_message or "Upload Osprey drafter",
        commit_description=commit_description,
    )


def custom_generate_operations(folder: Path) -> list[CommitOperationAdd]:
    """`custom_generate/` (Osprey's decoding loop as remote code) as the folder saved it, or, for a drafter saved
    before drafters carried it, as the installed package writes it (nothing local is written)."""
    saved = folder / CUSTOM_GENERATE_DIR
    if not (saved / "generate.py").is_file():
        with tempfile.TemporaryDirectory(prefix="osprey-custom-generate-") as staging:
            saved = write_custom_generate(staging)
            return [
                CommitOperationAdd(f"{CUSTOM_GENERATE_DIR}/{path.name}", path.read_bytes())
                for path in sorted(saved.glob("*.py"))
            ]
    return [CommitOperationAdd(f"{CUSTOM_GENERATE_DIR}/{path.name}", str(path)) for path in sorted(saved.glob("*.py"))]


def push_drafter(
    drafter,
    repo_id: str,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_size: int | str = "50GB",
    **push_options,
) -> CommitInfo:
    """`osprey push` from Python: saves the drafter to a temporary directory, adds the tokenizer, alignment
    report, training record and notices of `source_dir` (default: the directory it was loaded from) and publishes
    that with [`push_drafter_folder`], which `push_options` go to."""
    if source_dir is None and os.path.isdir(drafter.name_or_path or ""):
        source_dir = drafter.name_or_path
    with tempfile.TemporaryDirectory(prefix="osprey-push-") as staging:
        drafter.save_pretrained(staging, max_shard_size=max_shard_size)
        if source_dir is not None:
            for path in publishable_files(Path(source_dir), COMPANION_FILES):
                shutil.copy2(path, staging)
        tags = list(drafter.model_tags or []) + list(push_options.pop("tags", None) or [])
        return push_drafter_folder(staging, repo_id, tags=tags, **push_options)


BACKBONE_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "osprey_backbone.json",
    "corpus-manifest.json",
)


def push_backbone(
    backbone: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
) -> CommitInfo:
    """Publishes a pretrained Osprey backbone (a zoo name such as `osprey-backbone-qwen2.5-0.5b-2l`, fetched first, or
    its directory) as the model `repo_id` in one commit: weights, config, tokenizer, its record and its card."""
    from .zoo import resolve_model_path

    validate_repo_id(repo_id)
    folder = Path(resolve_model_path(backbone))
    card = backbone_card(folder, repo_id)  # refuses a folder that is no pretrained backbone

    def operations(created_repo_id: str) -> list[CommitOperationAdd]:
        final_card = card if created_repo_id == repo_id else backbone_card(folder, created_repo_id)
        files = [
            CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
            for path in publishable_files(folder, BACKBONE_FILES + COMPANION_FILES)
        ]
        return files + [CommitOperationAdd("README.md", str(final_card).encode())]

    return _commit(
        repo_id,
        operations,
        private=private,
        token=token,
        commit_message=commit_message or "Upload Osprey drafter backbone",
    )


def push_space(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    commit_message: str | None = None,
) -> CommitInfo:
    """Publishes a Space folder (README.md with `sdk:` metadata, the app file it names) as the Space `repo_id`."""
    folder = Path(folder)
    validate_repo_id(repo_id)
    readme = folder / "README.md"
    if not readme.is_file():
        raise ValueError(f"{folder} has no README.md: a Space folder needs one, with `sdk: gradio` in its metadata.")
    metadata = SpaceCard.load(readme).data
    if not metadata.get("sdk"):
        raise ValueError(f"{readme} names no SDK: add `sdk: gradio` (and `app_file: app.py`) to its metadata block.")
    app_file = metadata.get("app_file") or "app.py"
    if not (folder / app_file).is_file():
        raise ValueError(f"{folder} has no {app_file}, the app file its README.md names: add it or fix `app_file`.")
    files = [
        CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
        for path in sorted(folder.rglob("*"))
        if path.is_file()
        and not any(fnmatch(part, pattern) for part in path.relative_to(folder).parts for pattern in SPACE_IGNORED)
    ]
    return _commit(
        repo_id,
        lambda created_repo_id: files,
        repo_type="space",
        space_sdk=metadata["sdk"],
        private=private,
        token=token,
        commit_message=commit_message or "Upload Space",
    )


def _commit(repo_id, operations, *, repo_type="model", space_sdk=None, private, token, **commit) -> CommitInfo:
    """Creates the repo if needed and commits `operations(created_repo_id)` in one commit, turning any failure of
    the upload into a `HubPushError`."""
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, repo_type=repo_type, space_sdk=space_sdk, private=private, exist_ok=True)
        return api.create_commit(repo.repo_id, operations(repo.repo_id), repo_type=repo_type, **commit)
    except Exception as error:  # any failure of the upload: the message says what to retry
        raise HubPushError(_failure_message(repo_id, api.endpoint, error)) from error


def _failure_message(repo_id: str, endpoint: str, error: Exception) -> str:
    response = getattr(error, "response", None) if isinstance(error, HfHubHTTPError) else None
    status = getattr(response, "status_code", None)
    if status in (401, 403):
        hint = (
            "log in with `hf auth login` (or set HF_TOKEN) using a token that can write to "
            f"{repo_id.split('/')[0] if '/' in repo_id else 'your namespace'}, then "
        )
    elif status is not None and (status == 429 or status >= 500):
        hint = "the Hub had a server-side problem; wait a moment, then "
    elif isinstance(error, OfflineModeIsEnabled):
        hint = "unset HF_HUB_OFFLINE, then "
    elif isinstance(error, httpx.TransportError):
        hint = f"check your network connection (and HF_ENDPOINT, now {endpoint}), then "
    else:
        hint = ""
    reason = f"HTTP {status}: {getattr(error, 'server_message', None) or error}" if status else error
    return (
        f"Publishing {repo_id} to {endpoint} failed ({type(error).__name__}: {reason}). No files were "
        f"committed and nothing local was changed: {hint}push again."
    )


def add_subcommand(subparsers) -> None:
    """Adds `osprey push` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "push",
        help="publish a drafter (with a generated model card) or a Gradio Space to the Hub",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--drafter", metavar="DIR", help="drafter directory (osprey convert / distill)")
    what.add_argument("--space", metavar="DIR", help="Gradio Space folder (app.py, README.md)")
    # --backbone alone publishes a pretrained backbone; with --drafter it is the backbone named on the drafter's card
    parser.add_argument("--repo-id", required=True, help="Hub repository, e.g. you/osprey-drafter (no namespace: you)")
    parser.add_argument("--private", action="store_true", help="create the repository private (if it is new)")
    card = parser.add_argument_group("model card (drafters only)")
    card.add_argument("--bench-results", metavar="JSON", help="`osprey bench` results, published as eval results")
    card.add_argument(
        "--bench-method", default="osprey", metavar="METHOD", help="method of this drafter's bench records (osprey)"
    )
    card.add_argument("--base-model", metavar="ID", help="Hub id of the target (default: from alignment_report.json)")
    card.add_argument(
        "--backbone",
        metavar="NAME",
        help="alone: publish this pretrained backbone (zoo name or directory); with --drafter: the backbone named on "
        "the drafter's card (default: from alignment_report.json)",
    )
    card.add_argument("--license", help="license id (default: gemma if Gemma terms travel with it, else apache-2.0)")
    parser.set_defaults(run=_run_push)


def _run_push(args) -> int:
    private = True if args.private else None  # None: the namespace's default visibility
    if not (args.drafter or args.space or args.backbone):
        raise ValueError("say what to publish: --drafter DIR, --backbone NAME_OR_DIR or --space DIR.")
    try:
        if args.space:
            commit = push_space(args.space, args.repo_id, private=private)
        elif args.backbone and not args.drafter:
            commit = push_backbone(args.backbone, args.repo_id, private=private)
        else:
            commit = push_drafter_folder(
                args.drafter,
                args.repo_id,
                private=private,
                bench_results=args.bench_results,
                bench_method=args.bench_method,
                base_model=args.base_model,
                backbone=args.backbone,
                license=args.license,
            )
    except HubPushError as error:
        print(f"osprey push: error: {error}", file=sys.stderr)
        return 1
    print(f"published {args.space or args.drafter or args.backbone} to {commit.repo_url} (commit {commit.oid[:10]})")
    return 0


__all__ = ["HubPushError", "push_backbone", "push_drafter", "push_drafter_folder", "push_space"]
