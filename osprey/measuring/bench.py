"""`osprey bench`: every decoding method on the same prompts, in one process, with τ, per-position acceptance,
tokens/s and the speedup over the target alone measured in the same run.

Methods: Osprey-format drafters (Osprey, scratch, EAGLE-3 baselines: `speculative_generate`), and transformers'
`generate` for the target alone, SpS (assisted generation with a same-tokenizer small model) and PLD (prompt lookup).
Every method decodes the same way: greedy, or plain temperature / top-k / top-p sampling (the target's own
`generation_config` sampling defaults are overridden), and stops at the target's eos.

τ is the mean over a request's verification steps of the tokens each step decided (accepted drafts + the target's own
token); the prefill is not a step. For `generate` methods the steps are read off the target's forward calls: before
each call its KV cache holds every decided token but the last, so consecutive calls show what each one decided.
Forward hooks also time the target's prefill and verification calls and the drafter's calls; the rest is overhead.

Greedy outputs that differ from the target alone's are labelled after the run (`label_divergences`) by the output
check (`osprey.decoding.near_tie.check_difference`): an audit of every emitted token against one clean teacher-forced
forward, and an exact replay of the verification forward that decided the first differing token. "rounding
(shape-dependent)" when every token lies within rounding of that clean forward's best and the first differing one is
its verification forward's argmax with logits a clean forward's up to rounding, "UNEXPLAINED" otherwise, which makes
`osprey bench` exit with status 1; so does a difference left "not checked" unless `--allow-unchecked` is passed. A
difference to label in results saved before the bench kept token ids is refused:
`benchmarks/numerics/label_differences.py` labels those.

Results are saved after every request; re-running with the same `--output` skips the requests already there.
"""

import hashlib
import json
import os
import sys
import time
import zlib
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_osprey.decoding_osprey import default_tree_size

from ..decoding.decode import add_decoding_arguments, encode_prompt
from ..decoding.near_tie import check_difference, float32_margin, upcast
from ..ground import ForwardHooks
from .bench_report import (
    add_allow_unchecked_argument,
    exit_status,
    save_report,
    summarize,
)
from .bench_suites import CORPUS_SUITES, SUITES, BenchPrompt, available_suites, select_subset
from .methods import (
    METHOD_SETTINGS,
    BenchMethod,
    BenchSettings,
    expand_drafter_methods,
    load_method,
    parse_method_specs,
    read_method_settings,
)

RESULTS_FORMAT = 1
# Labels the differences of saved results, those saved before the bench kept token ids included (a repository script).
LABEL_SCRIPT = "benchmarks/numerics/label_differences.py"


class ForwardRecorder(ForwardHooks):
    """Forward hooks on `model` noting, for each call, the KV-cache length before it, the tokens fed and the seconds."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = []

    def _before(self, module, args, kwargs):
        input_ids, cached = self.fed(args, kwargs)
        _synchronize(input_ids.device)
        self._pending = (cached, input_ids.shape[1], time.perf_counter())

    def _after(self, module, args, output):
        cache_length, fed, start = self._pending
        _synchronize(next(module.parameters()).device)
        self.calls.append((cache_length, fed, time.perf_counter() - start))

    @property
    def seconds(self) -> float:
        return sum(seconds for _, _, seconds in self.calls)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steps_from_target_calls(calls, prompt_length: int, final_length: int) -> tuple[list[int], list[int]]:
    """(accepted drafts, drafted tokens) per verification step of a decoding loop, from its target's forward calls
    (`ForwardRecorder.calls`). Call 0 is the prefill. Before call k >= 1 the cache holds every decided token but the
    last, so `decided_k = cache_k + 1`; call k was fed `decided_k - cache_k` decided tokens and its drafts."""
    decided = [prompt_length] + [cache + 1 for cache, _, _ in calls[1:]] + [final_length]
    accepted = [decided[k + 1] - decided[k] - 1 for k in range(1, len(calls))]
    drafted = [cache + fed - decided[k] for k, (cache, fed, _) in enumerate(calls) if k > 0]
    return accepted, drafted


def request_seed(settings: BenchSettings, prompt: BenchPrompt) -> int:
    """The seed a request decodes with (sampling, and any randomness of a method), the same in every run."""
    return settings.seed + zlib.crc32(f"{prompt.suite}/{prompt.category}/{prompt.prompt_id}".encode())


def run_request(target, tokenizer, method: BenchMethod, prompt: BenchPrompt, settings: BenchSettings) -> dict:
    """Decodes one prompt with one method; the request's row of the results."""
    input_ids = encode_prompt(tokenizer, prompt.text, settings.chat_template).to(target.device)
    eos_token_id = target.generation_config.eos_token_id
    with ForwardRecorder(target) as target_calls, ForwardRecorder(method.draft_model) as draft_calls:
        _synchronize(input_ids.device)
        start = time.perf_counter()
        output, stats = method.generate(target, input_ids, settings, eos_token_id, request_seed(settings, prompt))
        _synchronize(input_ids.device)
        wall_time_s = time.perf_counter() - start
    if stats is not None:
        accepted, drafted, verified = stats.accepted_per_step, stats.drafted_per_step, stats.verified_per_step
    else:
        accepted, drafted = steps_from_target_calls(target_calls.calls, input_ids.shape[1], output.shape[1])
        verified = drafted
    new_ids = output[0, input_ids.shape[1] :].tolist()
    prefill_s = target_calls.calls[0][2] if target_calls.calls else 0.0
    verify_s, draft_s = target_calls.seconds - prefill_s, draft_calls.seconds
    return {
        "method": method.name,
        "suite": prompt.suite,
        "category": prompt.category,
        "prompt_id": prompt.prompt_id,
        "prompt_tokens": input_ids.shape[1],
        "new_tokens": len(new_ids),
        "wall_time_s": wall_time_s,
        "tokens_per_s": len(new_ids) / wall_time_s,
        "tau": sum(a + 1 for a in accepted) / len(accepted) if accepted else None,
        "accepted_per_step": accepted,
        "drafted_per_step": drafted,
        "verified_per_step": verified,
        "time_split_s": {
            "prefill": prefill_s,
            "verify": verify_s,
            "draft": draft_s,
            "other": wall_time_s - prefill_s - verify_s - draft_s,
        },
        "output_sha256": output_sha256(new_ids),
        "output_ids": new_ids,
        "completion": tokenizer.decode(new_ids, skip_special_tokens=True),
    }


def _request_key(row: dict) -> tuple[str, str, str, str]:
    return row["method"], row["suite"], row["category"], row["prompt_id"]


def saved_settings(results: dict) -> dict:
    """The settings a results JSON was made with; a setting added since it was saved keeps its default."""
    return asdict(BenchSettings()) | results.get("settings", {})


def _start_results(
    target_name: str, target_dtype: str, settings: BenchSettings, methods, output_path: Path | None
) -> dict:
    """A fresh results dict, or the one saved at `output_path` if it was made with the same target, dtype and
    settings."""
    fresh = {
        "format": RESULTS_FORMAT,
        "target": target_name,
        "target_dtype": target_dtype,
        "settings": asdict(settings),
        "methods": {},
        "prompts": {},
        "requests": [],
        "records": [],
    }
    if output_path is None or not output_path.exists():
        return fresh
    saved = json.loads(output_path.read_text())
    saved["settings"] = saved_settings(saved)
    saved.setdefault("target_dtype", target_dtype)  # saved before the dtype was recorded
    for key in ("format", "target", "target_dtype", "settings"):
        if saved.get(key) != fresh[key]:
            raise ValueError(
                f"{output_path} holds results for another {key} ({saved.get(key)} instead of {fresh[key]}); "
                "it is kept as it is. Pass another --output, or the same settings to resume it."
            )
    for method in methods:
        if saved["methods"].get(method.name, method.spec) != method.spec:
            raise ValueError(
                f"{output_path} has results of a method named {method.name!r} that was "
                f"{saved['methods'][method.name]!r}, not {method.spec!r}: give this one another name (NAME=SPEC) or "
                "pass another --output."
            )
        own = saved.get("method_settings", {}).get(method.name, {})
        if method.name in saved["methods"] and own != method.overrides:
            raise ValueError(
                f"{output_path} has results of method {method.name!r} with its own settings {own}, not "
                f"{method.overrides}: pass the same --method-settings to resume it, or another --output."
            )
    return saved


def _save(results: dict, output_path: Path | None) -> None:
    """Writes the results whole (to a temporary file, then renamed), so a killed run never leaves half a file."""
    results["records"] = summarize(results)
    if output_path is None:
        return
    output_path.parent.mkdir(parents=True, exist_ok=True)
    staging = output_path.with_name(f".{output_path.name}.tmp")
    staging.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    os.replace(staging, output_path)


def run_benchmark(
    target,
    tokenizer,
    methods: list[BenchMethod],
    prompts: list[BenchPrompt],
    settings: BenchSettings = BenchSettings(),
    output_path: str | os.PathLike | None = None,
    warmup: bool = True,
    progress: bool = True,
    target_name: str | None = None,
) -> dict:
    """Decodes every prompt with every method (methods interleaved per prompt, so load changes hit all alike).

    Returns the results: `settings`, `methods`, the `prompts` ids per suite and category, one row per request in
    `requests`, and one record per method x suite x category (and `overall`) in `records`. With `output_path`,
    results are saved after each request and requests already saved there are skipped. `target_name` (default: the
    target's `name_or_path`) identifies the target in the results; a resumed run must name the same.
    """
    if len({method.name for method in methods}) != len(methods):
        raise ValueError(f"Method names must be unique, got {[method.name for method in methods]}.")
    output_path = None if output_path is None else Path(output_path)
    target_dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    results = _start_results(target_name or target.config.name_or_path, target_dtype, settings, methods, output_path)
    results["methods"].update({method.name: method.spec for method in methods})
    own = {method.name: method.overrides for method in methods if method.overrides}
    if own:
        results.setdefault("method_settings", {}).update(own)
    for prompt in prompts:
        ids = results["prompts"].setdefault(prompt.suite, {}).setdefault(prompt.category, [])
        ids += [] if prompt.prompt_id in ids else [prompt.prompt_id]
    done = {_request_key(row) for row in results["requests"]}
    pending = [
        (prompt, method)
        for prompt in prompts
        for method in methods
        if (method.name, prompt.suite, prompt.category, prompt.prompt_id) not in done
    ]
    warm_settings = BenchSettings(**(asdict(settings) | {"max_new_tokens": min(8, settings.max_new_tokens)}))
    warmed = set()
    for prompt, method in tqdm(pending, desc="osprey bench", unit="request", disable=not progress):
        if warmup and method.name not in warmed:  # first calls pay one-off costs (allocations, kernel selection)
            run_request(target, tokenizer, method, prompt, warm_settings)
            warmed.add(method.name)
        results["requests"].append(run_request(target, tokenizer, method, prompt, settings))
        _save(results, output_path)
    label_divergences(target, tokenizer, results, prompts, methods)
    _save(results, output_path)
    return results


def label_divergences(target, tokenizer, results: dict, prompts: list[BenchPrompt], methods: list[BenchMethod]) -> None:
    """Gives every greedy request whose output differs from the target alone's on the same prompt its `divergence`
    (`osprey.decoding.near_tie.check_difference`: every token audited against a clean forward, and the method decodes
    that prompt again so that the verification forward that decided the first differing token is checked; "rounding
    (shape-dependent)" or "UNEXPLAINED"), and equal ones `divergence: None`.
    Then, as information, the target's float32 margin there (one float32 pass for all; skipped where the target does not
    fit in float32). Requests already labelled are skipped, and so are those whose prompt is not in `prompts` or whose
    method is not in `methods` (left "not checked"). A differing request, or its target-alone reference, saved without
    token ids (`output_ids`: results saved before the bench kept them) is refused (`check_output_ids`)."""
    baseline = next((name for name, spec in results["methods"].items() if spec == "target"), None)
    if baseline is None or results["settings"]["do_sample"]:
        return
    references = {_request_key(row)[1:]: row for row in results["requests"] if row["method"] == baseline}
    by_key = {(prompt.suite, prompt.category, prompt.prompt_id): prompt for prompt in prompts}
    by_name = {method.name: method for method in methods}
    differing = []
    for row in results["requests"]:
        key = _request_key(row)[1:]
        if row["method"] == baseline or "divergence" in row or key not in references or key not in by_key:
            continue
        if row["output_sha256"] == references[key]["output_sha256"]:
            row["divergence"] = None
        elif row["method"] in by_name:
            differing.append((row, key))
    if not differing:
        return
    check_output_ids([row for pair in differing for row in (pair[0], references[pair[1]])], "These results")
    settings = BenchSettings(**saved_settings(results))
    eos_token_id = target.generation_config.eos_token_id
    found = []
    for row, key in differing:
        method, prompt = by_name[row["method"]], by_key[key]
        prompt_ids = encode_prompt(tokenizer, prompt.text, settings.chat_template).to(target.device)
        seed = request_seed(settings, prompt)
        divergence = check_difference(
            target,
            partial(_sequence, method, target, prompt_ids, settings, eos_token_id, seed),
            prompt_ids,
            references[key]["output_ids"],
            row["output_ids"],
        )
        found.append((row, prompt_ids, references[key]["output_ids"], divergence))
    margins = {}  # information only: a target too large for float32 on this device goes without
    try:
        with upcast(target):
            for row, prompt_ids, reference, _ in found:
                margins[id(row)] = float32_margin(target, prompt_ids, reference, row["output_ids"])
    except RuntimeError as error:  # out of memory: torch.OutOfMemoryError on accelerators, a RuntimeError on CPUs
        if not isinstance(error, torch.OutOfMemoryError) and "memory" not in str(error).lower():
            raise
    for row, _, _, divergence in found:
        row["divergence"] = replace(divergence, margin=margins.get(id(row))).to_dict()


def _sequence(method: BenchMethod, *args) -> torch.LongTensor:
    return method.generate(*args)[0]


def check_output_ids(rows: list[dict], source: str) -> None:
    """Refuses requests saved without their token ids (`output_ids`, which results saved before the bench kept them
    lack): their differences cannot be checked here; the script that labels saved results rebuilds them."""
    old = len({id(row) for row in rows if "output_ids" not in row})
    if old:
        raise ValueError(
            f"{source} hold {old} differing request(s) or their target-alone reference(s) saved without token ids "
            f"(`output_ids`), as results were saved before the bench kept them. Label their differences with "
            f"`python {LABEL_SCRIPT} RESULTS.json`, which rebuilds the ids from each completion and its saved hash."
        )


def output_sha256(ids: list[int]) -> str:
    """What a request saves to identify its output: the SHA-256 of its new token ids as JSON."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def add_subcommand(subparsers) -> None:
    """Adds `osprey bench` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "bench", help="benchmark drafters and baselines on prompt suites: τ, acceptance, tokens/s, speedup"
    )
    parser.add_argument("--target", required=True, help="zoo name, local directory or Hub id of the target")
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="an Osprey-format drafter (repeatable; name several, e.g. osprey=DIR scratch=DIR2)",
    )
    parser.add_argument(
        "--baselines",
        default="target",
        metavar="LIST",
        help="comma-separated [NAME=]target|pld[:N]|sps:MODEL|eagle3:DIR (default: target)",
    )
    parser.add_argument(
        "--prompts",
        action="append",
        metavar="SUITE|PATH",
        help=f"suite ({', '.join(SUITES + CORPUS_SUITES)}) or JSONL file / directory; repeatable (default: spec_bench)",
    )
    parser.add_argument(
        "--data-dir",
        help="folder with spec_bench/ and mt_bench/ (default: $OSPREY_DATA_DIR or ../shared/data beside the "
        "repository, where a missing suite is skipped with a line saying how to add it)",
    )
    parser.add_argument("--per-category", type=int, help="seeded sample of N prompts per category (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the subset and sampling")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    add_decoding_arguments(parser)
    parser.add_argument(
        "--routes",
        default="standalone",
        metavar="LIST",
        help="comma-separated routes each drafter decodes by: standalone (speculative_generate), hf "
        "(target.generate(assistant_model=drafter), chains), custom (target.generate(custom_generate=DRAFTER_DIR)); "
        "with --draft-topk > 1 each drafter also drafts trees on the routes that verify them, and with "
        "--prompt-lookup-num-tokens again with that prompt-lookup branch (default: standalone)",
    )
    parser.add_argument(
        "--method-settings",
        metavar="JSON",
        help="methods' own settings: a JSON file mapping method names to some of "
        f"{', '.join(METHOD_SETTINGS)} (e.g. each method's best draft length), or a tuning result (its `chosen` is "
        "read for this run's methods), used instead of the run's for those methods and recorded in the results",
    )
    parser.add_argument("--no-chat-template", action="store_true", help="feed prompts without the chat template")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", required=True, help="results JSON (resumed if it exists); .md and .png beside it")
    add_allow_unchecked_argument(parser)
    parser.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    from ..models.zoo import load_causal_lm, load_tokenizer

    routes = [route.strip() for route in args.routes.split(",") if route.strip()]
    specs = expand_drafter_methods(
        parse_method_specs(args.drafter, args.baselines), routes, args.draft_topk > 1, args.prompt_lookup_num_tokens > 0
    )
    suites, skipped = available_suites(args.prompts or ["spec_bench"], args.data_dir)
    if not suites:
        raise ValueError(f"no prompts to run: {' '.join(skipped)} Or pass --prompts FILE, a JSONL file of your own.")
    for line in skipped:
        print(f"osprey bench: {line}", file=sys.stderr)
    prompts = [prompt for suite in suites.values() for prompt in select_subset(suite, args.per_category, args.seed)]
    settings = BenchSettings(
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        confidence_threshold=args.confidence_threshold,
        do_sample=args.do_sample,
        draft_topk=args.draft_topk,
        tree_size=args.tree_size,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=not args.no_chat_template,
        drafter_quantization=args.drafter_quantization,
    )
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_causal_lm(args.target, dtype=dtype).to(args.device).eval(), load_tokenizer(args.target)
    if args.draft_topk > 1 and args.tree_size is None:  # the default this target's device gets, recorded
        settings = replace(settings, tree_size=default_tree_size(target, args.num_draft_tokens, args.draft_topk))
    own = read_method_settings(args.method_settings, [name for name, _ in specs])
    methods = [
        load_method(name, spec, tokenizer, dtype, args.device, settings.drafter_quantization, own.get(name, {}))
        for name, spec in specs
    ]
    results = run_benchmark(
        target, tokenizer, methods, prompts, settings, output_path=args.output, target_name=args.target
    )
    markdown = save_report(results, Path(args.output))
    print(markdown)
    return exit_status(results, args.allow_unchecked)
