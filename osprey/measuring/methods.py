"""The methods an `osprey bench` run decodes with, and their settings: `BenchSettings` (shared by every method),
`BenchMethod` (how one method decodes a request), and reading them from the command line (`--drafter`, `--baselines`,
`--method-settings`) into loaded methods.
"""

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from modeling_osprey.generation_osprey import DRAFTING_SETTINGS

from ..decoding.decode import speculative_generate, target_generate
from ..models.pack import custom_generate_folder, load_drafter


@dataclass(frozen=True)
class BenchSettings:
    """How every method decodes; a resumed run must use the same."""

    max_new_tokens: int = 128
    num_draft_tokens: int = DRAFTING_SETTINGS["num_draft_tokens"]
    confidence_threshold: float = DRAFTING_SETTINGS["confidence_threshold"]
    # tree methods' shape (chain methods draft chains whatever these say)
    draft_topk: int = DRAFTING_SETTINGS["draft_topk"]
    tree_size: int | None = DRAFTING_SETTINGS["tree_size"]
    # the `-lookup` methods' prompt-lookup branch (chain methods have none)
    prompt_lookup_num_tokens: int = DRAFTING_SETTINGS["prompt_lookup_num_tokens"]
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    chat_template: bool = True
    drafter_quantization: str = "none"  # how the drafter methods' drafters run (`load_drafter`'s `quantization`)


ROUTES = ("standalone", "hf", "custom")
# The settings a method may have its own values of (`BenchMethod.overrides`, `osprey bench --method-settings`): the
# drafting settings; for a PLD baseline `prompt_lookup_num_tokens` is its lookup length (`pld:N`).
METHOD_SETTINGS = tuple(DRAFTING_SETTINGS)


@dataclass
class BenchMethod:
    """A decoding method. With `drafter` (an Osprey-format drafter) it decodes by `route`: `standalone` runs
    `speculative_generate`, `hf` transformers' `target.generate(assistant_model=drafter)` (chains), `custom` the
    drafter folder's `custom_generate` inside `target.generate` (`drafter_dir`); `tree` drafts trees of the settings'
    `draft_topk` / `tree_size` instead of chains; `lookup` adds the settings' prompt-lookup branch to every draft.
    Without a drafter: `target.generate`, assisted by `assistant` (SpS) or `prompt_lookup_num_tokens` (PLD), or
    alone. `overrides` are this method's own values of some `METHOD_SETTINGS` (e.g. its best draft length), used
    instead of the run's."""

    name: str
    spec: str
    drafter: torch.nn.Module | None = None
    assistant: torch.nn.Module | None = None
    prompt_lookup_num_tokens: int | None = None
    route: str = "standalone"
    tree: bool = False
    lookup: bool = False
    drafter_dir: str | None = None
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.overrides) - set(METHOD_SETTINGS))
        if unknown:
            raise ValueError(
                f"Method {self.name!r}: {unknown} cannot be set per method; use {', '.join(METHOD_SETTINGS)}."
            )
        if self.overrides and self.draft_model is None and self.prompt_lookup_num_tokens is None:
            raise ValueError(f"Method {self.name!r} is the target alone: it has no draft settings to set.")
        if self.route not in ROUTES:
            raise ValueError(f"Unknown route {self.route!r}: use one of {', '.join(ROUTES)}.")
        if self.route == "hf" and (self.tree or self.lookup):
            raise ValueError(
                "The `hf` route (assistant_model=) verifies chains only: drop the tree and prompt-lookup branch for it."
            )
        if self.route == "custom" and self.drafter_dir is None:
            raise ValueError("The `custom` route runs the drafter folder's custom_generate: pass drafter_dir.")

    def generate(self, target, input_ids, settings: BenchSettings, eos_token_id, request_seed: int):
        """The full output sequence and, for `speculative_generate`, its `SpeculativeStats` (else None)."""
        settings = replace(settings, **self.overrides)
        shape = dict(draft_topk=settings.draft_topk, tree_size=settings.tree_size) if self.tree else {}
        if self.lookup:
            shape["prompt_lookup_num_tokens"] = settings.prompt_lookup_num_tokens
        if self.drafter is not None and self.route == "standalone":
            generator = torch.Generator(device=input_ids.device).manual_seed(request_seed)
            return speculative_generate(
                target,
                self.drafter,
                input_ids,
                max_new_tokens=settings.max_new_tokens,
                num_draft_tokens=settings.num_draft_tokens,
                confidence_threshold=settings.confidence_threshold,
                do_sample=settings.do_sample,
                temperature=settings.temperature,
                top_k=settings.top_k,
                top_p=settings.top_p,
                eos_token_id=eos_token_id,
                generator=generator,
                **shape,
            )
        torch.manual_seed(request_seed)
        extra = {}
        if self.drafter is not None:  # the drafter's routes through `target.generate`
            self.drafter.generation_config.num_assistant_tokens = settings.num_draft_tokens
            self.drafter.generation_config.assistant_confidence_threshold = settings.confidence_threshold
            extra["assistant_model"] = self.drafter
            if self.route == "custom":
                extra |= dict(custom_generate=self.drafter_dir, trust_remote_code=True, **shape)
            else:
                with self.drafter.attached(target):
                    return self._target_generate(target, input_ids, settings, eos_token_id, extra), None
        if self.assistant is not None:  # SpS: chains of `num_draft_tokens`, stopping early exactly as the drafters do
            self.assistant.generation_config.num_assistant_tokens = settings.num_draft_tokens
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            self.assistant.generation_config.assistant_confidence_threshold = settings.confidence_threshold
            extra["assistant_model"] = self.assistant
        if self.prompt_lookup_num_tokens is not None:  # PLD: its own lookup length, else its spec's
            extra["prompt_lookup_num_tokens"] = self.overrides.get(
                "prompt_lookup_num_tokens", self.prompt_lookup_num_tokens
            )
        return self._target_generate(target, input_ids, settings, eos_token_id, extra), None

    @staticmethod
    def _target_generate(target, input_ids, settings, eos_token_id, extra):
        return target_generate(
            target,
            input_ids,
            settings.max_new_tokens,
            settings.do_sample,
            settings.temperature,
            settings.top_k,
            settings.top_p,
            eos_token_id,
            **extra,
        )

    @property
    def draft_model(self):
        return self.drafter if self.drafter is not None else self.assistant


def parse_method_specs(drafters: list[str], baselines: str) -> list[tuple[str, str]]:
    """(name, spec) pairs from `--drafter [NAME=]DIR` (named `osprey` by default) and `--baselines` (comma-separated
    `[NAME=]target|pld[:N]|sps:MODEL|eagle3:DIR`, named after their kind)."""
    pairs = []
    for spec in drafters:
        name, _, location = spec.partition("=") if "=" in spec else ("osprey", "", spec)
        pairs.append((name, f"drafter:{location}"))
    for spec in filter(None, (part.strip() for part in baselines.split(","))):
        name, _, body = spec.partition("=") if "=" in spec else (spec.partition(":")[0], "", spec)
        kind = body.partition(":")[0]
        if kind not in ("target", "pld", "sps", "eagle3"):
            raise ValueError(f"Unknown baseline {spec!r}: use target, pld[:N], sps:MODEL or eagle3:DIR.")
        if kind in ("sps", "eagle3") and not body.partition(":")[2]:
            raise ValueError(f"Baseline {spec!r} needs a model: sps:MODEL (zoo name, directory or Hub id), eagle3:DIR.")
        pairs.append((name, f"drafter:{body.partition(':')[2]}" if kind == "eagle3" else body))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names must be unique, got {names}: name them, e.g. --drafter scratch=DIR.")
    return pairs


# A drafter's method per (route, tree, lookup): (spec kind, name suffix, route, tree, lookup).
DRAFTER_METHODS = {
    ("standalone", False, False): ("drafter", "", "standalone", False, False),
    ("standalone", True, False): ("drafter-tree", "-tree", "standalone", True, False),
    ("standalone", False, True): ("drafter-lookup", "-lookup", "standalone", False, True),
    ("standalone", True, True): ("drafter-tree-lookup", "-tree-lookup", "standalone", True, True),
    ("hf", False, False): ("hf", "-hf", "hf", False, False),
    ("custom", False, False): ("custom", "-custom", "custom", False, False),
    ("custom", True, False): ("custom-tree", "-custom-tree", "custom", True, False),
    ("custom", False, True): ("custom-lookup", "-custom-lookup", "custom", False, True),
    ("custom", True, True): ("custom-tree-lookup", "-custom-tree-lookup", "custom", True, True),
}

# A drafter method's (route, tree, lookup) by its spec kind.
DRAFTER_KINDS = {spec_kind: (route, tree, lookup) for spec_kind, _, route, tree, lookup in DRAFTER_METHODS.values()}


def expand_drafter_methods(
    pairs: list[tuple[str, str]], routes: list[str], trees: bool, lookup: bool = False
) -> list[tuple[str, str]]:
    """Each `drafter:DIR` method once per route (`standalone` keeps the plain name, others get `-hf` / `-custom`),
    with `trees` again drafting trees (`-tree`), and with `lookup` again with a prompt-lookup branch (`-lookup`, on
    the trees if any), on the routes that verify them; other methods unchanged."""
    unknown = sorted(set(routes) - set(ROUTES))
    if unknown:
        raise ValueError(f"Unknown route(s) {unknown}: choose from {', '.join(ROUTES)}.")
    expanded = []
    for name, spec in pairs:
        kind, _, location = spec.partition(":")
        if kind != "drafter":
            expanded.append((name, spec))
            continue
        shapes = [(False, False)] + ([(True, False)] if trees else []) + ([(trees, True)] if lookup else [])
        for key in [(route, *shape) for route in routes for shape in shapes]:
            if key in DRAFTER_METHODS:
                spec_kind, suffix, *_ = DRAFTER_METHODS[key]
                expanded.append((name + suffix, f"{spec_kind}:{location}"))
    return expanded


def read_method_settings(path: str | None, names: list[str]) -> dict[str, dict]:
    """`--method-settings`: {method name: its own settings} for methods among `names`, from a JSON file: a mapping
    written for this run, where every entry must name one of its methods, or a tuning result (its `chosen` entry, as
    `benchmarks/replication/tune_methods.py` writes), which may tune more methods than a run benches: only this
    run's are taken."""
    if path is None:
        return {}
    table = json.loads(Path(path).read_text())
    if "chosen" in table:
        return {name: own for name, own in table["chosen"].items() if name in names}
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ValueError(
            f"{path} sets methods this run does not have: {unknown} (it has {names}); name the methods alike "
            "(NAME=DIR, NAME=SPEC) or drop those entries."
        )
    return table


def load_method(
    name: str,
    spec: str,
    tokenizer,
    dtype: torch.dtype,
    device: str,
    drafter_quantization: str = "none",
    overrides: dict | None = None,
) -> BenchMethod:
    from ..models.zoo import load_causal_lm, load_tokenizer

    kind, _, argument = spec.partition(":")
    own = dict(overrides=dict(overrides or {}))
    if kind in DRAFTER_KINDS:
        route, tree, lookup = DRAFTER_KINDS[kind]
        drafter = load_drafter(argument, dtype, device, quantization=drafter_quantization)
        folder = custom_generate_folder(drafter, argument) if route == "custom" else drafter.name_or_path
        return BenchMethod(
            name, spec, drafter=drafter, route=route, tree=tree, lookup=lookup, drafter_dir=str(folder), **own
        )
    if kind == "pld":
        return BenchMethod(name, spec, prompt_lookup_num_tokens=int(argument or 10), **own)
    if kind == "sps":
        if load_tokenizer(argument).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"sps:{argument} does not share the target's tokenizer; SpS needs a same-tokenizer model.")
        return BenchMethod(name, spec, assistant=load_causal_lm(argument, dtype=dtype).to(device).eval(), **own)
    return BenchMethod(name, spec, **own)
