"""Token ids for `osprey bench` results saved before the bench kept them (`output_ids`).

Such results keep each request's completion and the SHA-256 of its new token ids (`output_sha256`), which is enough to
rebuild the ids: the completion tokenized again, checked against the hash. `osprey bench` itself refuses them
(`osprey.measuring.bench.check_output_ids`); label_differences.py labels their differences through `label_divergences`,
which gives `osprey.measuring.bench.label_divergences` copies of the requests with their ids rebuilt.
"""

from osprey.measuring.bench import label_divergences, output_sha256


def output_token_ids(row: dict, tokenizer, eos_ids: list[int], guide: list[int] | None = None) -> list[int] | None:
    """A request's new token ids: saved (`output_ids`), or, for results saved before they were, its completion
    tokenized again when that matches its saved `output_sha256`. Tried: the whole completion, and the tokens of
    `guide` (another output of the same prompt) as far as their text begins the completion followed by the rest
    tokenized, each also with an eos appended (decoding may have ended on one), and for a completion cut inside a
    character, each token of the vocabulary as its last. None if nothing matches."""
    if "output_ids" in row:
        return row["output_ids"]
    text = row["completion"]
    heads = [[]]
    if guide:
        decoded = [tokenizer.decode(guide[:k], skip_special_tokens=True) for k in range(len(guide) + 1)]
        heads.append(guide[: max(k for k, prefix in enumerate(decoded) if text.startswith(prefix))])
    for head in heads:
        rest = text[len(tokenizer.decode(head, skip_special_tokens=True)) :]
        ids = head + tokenizer(rest, add_special_tokens=False)["input_ids"]
        for candidate in [ids] + [ids + [eos] for eos in eos_ids]:
            if output_sha256(candidate) == row["output_sha256"]:
                return candidate
    if text.endswith("\ufffd"):  # cut inside a character: its last token's bytes do not decode, so try every token
        for head in heads:
            rest = text[len(tokenizer.decode(head, skip_special_tokens=True)) :].rstrip("\ufffd")
            ids = head + tokenizer(rest, add_special_tokens=False)["input_ids"]
            for last in range(len(tokenizer)):
                if output_sha256(ids + [last]) == row["output_sha256"]:
                    return ids + [last]
    return None


def _key(row: dict) -> tuple[str, str, str]:
    return row["suite"], row["category"], row["prompt_id"]


def label_divergences_rebuilding_ids(
    target, tokenizer, results: dict, prompts: list, eos_ids: list[int], methods: list
) -> None:
    """`osprey.measuring.bench.label_divergences` for results that may hold requests saved without `output_ids`: it
    labels copies of the requests with their ids rebuilt (`output_token_ids`, the target alone's guided by the differing
    output where they cannot be rebuilt alone) and gives each request its copy's label; the saved requests keep their
    fields otherwise. `methods` (`osprey.measuring.methods.BenchMethod`s) replay the differences; a differing request
    whose ids, or whose target-alone reference's, cannot be rebuilt, or whose method is not among them, is left
    unlabelled ("not checked")."""
    baseline = next((name for name, spec in results["methods"].items() if spec == "target"), None)
    references = {_key(row): row for row in results["requests"] if row["method"] == baseline}
    texts = {(prompt.suite, prompt.category, prompt.prompt_id) for prompt in prompts}
    copies = {id(row): dict(row) for row in results["requests"]}
    for row in results["requests"]:
        reference = references.get(_key(row))
        if row["method"] == baseline or "divergence" in row or reference is None or _key(row) not in texts:
            continue
        if row["output_sha256"] == reference["output_sha256"]:
            continue
        reference_ids = output_token_ids(reference, tokenizer, eos_ids)
        ids = output_token_ids(row, tokenizer, eos_ids, guide=reference_ids)
        if reference_ids is None and ids is not None:  # the shared part is tokenized as the output has it
            reference_ids = output_token_ids(reference, tokenizer, eos_ids, guide=ids)
        if None in (ids, reference_ids):
            del copies[id(row)]  # left out: unlabelled
            continue
        copies[id(row)]["output_ids"], copies[id(reference)]["output_ids"] = ids, reference_ids
    label_divergences(target, tokenizer, results | {"requests": list(copies.values())}, prompts, methods)
    for row in results["requests"]:
        if id(row) in copies and "divergence" in copies[id(row)]:
            row["divergence"] = copies[id(row)]["divergence"]
