"""Labels the differing outputs of saved `osprey bench` results: each request whose greedy output differs from the
target alone's gets its `divergence` (`osprey.decoding.near_tie.replay`: the method decodes that prompt again and the
verification forward that decided the first differing token is checked, "rounding (shape-dependent)" or
"UNEXPLAINED"), as a run labels its own; the JSON and its `.md` table are rewritten. Each method is loaded again from
the spec the results name (its drafter folder, `--dtype`, the run's settings); a method that cannot be loaded leaves
its differences "not checked".

Results saved before token ids were kept (whose differences `osprey bench` refuses to label) have their ids rebuilt
from each completion, checked against its saved `output_sha256` (`old_results.py`, beside this script); where the
target alone's cannot be rebuilt (a completion that ends inside a multi-byte character), the target decodes that
prompt again and its output must hash the same.

    python benchmarks/numerics/label_differences.py benchmarks/results/replication-qwen2.5-coder-1.5b-instruct.json

`--withdraw-near-ties` loads no model: it takes off every "near tie" label (given by the bound the replay replaced,
which checked no forward), so those differences read "not checked" until labelled again, and rewrites the records and
the table.

    python benchmarks/numerics/label_differences.py --withdraw-near-ties $(grep -rl '"near tie"' benchmarks/results)

Prompts come from the suites the results name (`spec_bench`, `mt_bench`, `humaneval`, `mmath`, the demo's `demo`) or
from `--prompts FILE` (a JSONL file or folder, named as the bench named it). Results saved without their dtype need
`--dtype`. Exit status 1 if any difference is UNEXPLAINED or could not be checked ("not checked", allowed with
`--allow-unchecked`: the rule `osprey bench` exits by, `osprey.measuring.bench_report.fails`), or a target-alone output
needed for the check could not be reproduced.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from old_results import label_divergences_rebuilding_ids, output_token_ids

from osprey.decoding.decode import encode_prompt, target_generate
from osprey.decoding.near_tie import NEAR_TIE
from osprey.measuring.bench import output_sha256, summarize
from osprey.measuring.bench_report import (
    add_allow_unchecked_argument,
    difference_label,
    differing_requests,
    fails,
    markdown_table,
)
from osprey.measuring.bench_suites import SUITES, held_out_prompts, load_suite
from osprey.measuring.demo import DEMO_PROMPTS
from osprey.measuring.methods import load_method
from osprey.models.zoo import load_causal_lm, load_tokenizer


def _key(row: dict) -> tuple[str, str, str]:
    return row["suite"], row["category"], row["prompt_id"]


def prompts_for(results: dict, extra: list[str], data_dir: str | None) -> list:
    """Every prompt the results may name: the demo's, the named suites', `--prompts`, and for `held_out` (tuning
    runs, `osprey.measuring.bench_suites.held_out_prompts`) those held out of the suites' 1- to 3-per-category benches
    (a request is matched by suite, category and prompt id, so prompts it does not name are never used)."""
    prompts = list(DEMO_PROMPTS) if "demo" in results["prompts"] else []
    prompts += [prompt for suite in results["prompts"] if suite in SUITES for prompt in load_suite(suite, data_dir)]
    if "held_out" in results["prompts"]:
        prompts += [
            p for n in (1, 2, 3) for p in held_out_prompts(list(SUITES), n, results["settings"]["seed"], data_dir)
        ]
    return prompts + [prompt for source in extra for prompt in load_suite(source, data_dir)]


def redecode_references(target, tokenizer, results: dict, prompts: list, eos_ids: list[int]) -> int:
    """Saves `output_ids` on target-alone requests that some other output differs from and whose ids the completion
    does not give back, by decoding again; returns how many could not be reproduced."""
    baseline = next(name for name, spec in results["methods"].items() if spec == "target")
    texts = {(prompt.suite, prompt.category, prompt.prompt_id): prompt.text for prompt in prompts}
    hashes = {_key(row): row["output_sha256"] for row in results["requests"] if row["method"] == baseline}
    differed = {_key(row) for row in results["requests"] if row["output_sha256"] != hashes.get(_key(row))}
    failed = 0
    for row in results["requests"]:
        key = _key(row)
        if row["method"] != baseline or key not in texts or key not in differed:
            continue
        if output_token_ids(row, tokenizer, eos_ids) is not None:
            continue
        prompt_ids = encode_prompt(tokenizer, texts[key], results["settings"]["chat_template"])
        eos = target.generation_config.eos_token_id
        output = target_generate(target, prompt_ids, results["settings"]["max_new_tokens"], eos_token_id=eos)
        ids = output[0, prompt_ids.shape[1] :].tolist()
        if output_sha256(ids) == row["output_sha256"]:
            row["output_ids"] = ids
        else:
            failed += 1
    return failed


def load_methods(results: dict, tokenizer, dtype: torch.dtype) -> list:
    """The results' methods other than the target alone, as they ran (their own settings included), to replay their
    differences; one whose drafter or model cannot be loaded here is left out, saying why."""
    methods = []
    own = results.get("method_settings", {})
    quantization = results["settings"].get("drafter_quantization", "none")
    for name, spec in results["methods"].items():
        if spec == "target":
            continue
        try:
            methods.append(load_method(name, spec, tokenizer, dtype, "cpu", quantization, own.get(name, {})))
        except (OSError, ValueError) as error:
            print(f"{name} ({spec}) cannot be loaded, so its differences stay unchecked: {error}", file=sys.stderr)
    return methods


def withdraw_near_ties(path: Path) -> int:
    """Takes the NEAR_TIE labels off the requests of the results at `path`, rewriting its records and its table;
    returns how many."""
    results = json.loads(path.read_text())
    withdrawn = [row for row in results["requests"] if (row.get("divergence") or {}).get("label") == NEAR_TIE]
    for row in withdrawn:
        del row["divergence"]
    if withdrawn:
        _write(results, path)
    return len(withdrawn)


def _write(results: dict, path: Path) -> None:
    """The results and their records, and the table where there is one (the plots are left as they are)."""
    results["records"] = summarize(results)
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    if path.with_suffix(".md").exists():
        path.with_suffix(".md").write_text(markdown_table(results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="`osprey bench` results JSON files")
    parser.add_argument("--prompts", action="append", default=[], metavar="SUITE|PATH")
    parser.add_argument("--data-dir")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="for results saved without it")
    parser.add_argument("--relabel", action="store_true", help="label again requests already labelled")
    parser.add_argument(
        "--withdraw-near-ties",
        action="store_true",
        help=f'only take off "{NEAR_TIE}" labels (no model is loaded): those differences become "not checked"',
    )
    add_allow_unchecked_argument(parser)
    args = parser.parse_args()
    if args.withdraw_near_ties:
        for path in args.results:
            print(f"{path}: {withdraw_near_ties(path)} {NEAR_TIE} label(s) taken off")
        return 0
    status = 0
    loaded = {}
    for path in args.results:
        results = json.loads(path.read_text())
        dtype = results.get("target_dtype") or args.dtype
        if dtype is None:
            raise SystemExit(f"{path} does not record the target's dtype: pass --dtype.")
        results["target_dtype"] = dtype
        if (results["target"], dtype) not in loaded:
            loaded.clear()  # one target in memory at a time
            target = load_causal_lm(results["target"], dtype=getattr(torch, dtype)).eval()
            loaded[results["target"], dtype] = target, load_tokenizer(results["target"])
        target, tokenizer = loaded[results["target"], dtype]
        eos = target.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if args.relabel:
            for row in results["requests"]:
                row.pop("divergence", None)
        prompts = prompts_for(results, args.prompts, args.data_dir)
        unreproduced = redecode_references(target, tokenizer, results, prompts, eos_ids)
        methods = load_methods(results, tokenizer, getattr(torch, dtype))
        label_divergences_rebuilding_ids(target, tokenizer, results, prompts, eos_ids, methods)
        _write(results, path)
        counts = Counter(difference_label(row) for row in differing_requests(results))
        print(f"{path}: {dict(counts)}; target outputs not reproduced: {unreproduced}")
        status |= any(fails(label, args.allow_unchecked) for label in counts) or bool(unreproduced)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
