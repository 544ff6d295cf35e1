"""vLLM's speculative-decoding counters of an offline `LLM`, as plain numbers."""

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def spec_decode_counters(llm) -> dict:
    """`{"num_drafts", "num_draft_tokens", "num_accepted_tokens": int, "num_accepted_tokens_per_pos": [int]}` so far,
    read from `llm.get_metrics()` (the engine needs `disable_log_stats=False`); zeros before any speculation."""
    values = {name: 0 for name in COUNTERS[:3]} | {"num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in COUNTERS:
            values[name] = [int(v) for v in metric.values] if hasattr(metric, "values") else int(metric.value)
    return values


def counters_between(before: dict, after: dict) -> dict:
    """The counters of what ran between two `spec_decode_counters` readings."""
    earlier, later = before["num_accepted_tokens_per_pos"], after["num_accepted_tokens_per_pos"]
    per_position = [a - (earlier[i] if i < len(earlier) else 0) for i, a in enumerate(later)]  # earlier: [] at first
    return {name: after[name] - before[name] for name in COUNTERS[:3]} | {"num_accepted_tokens_per_pos": per_position}


def acceptance_length(counters: dict) -> float | None:
    """vLLM's mean acceptance length τ: 1 + accepted draft tokens per draft (None without drafts)."""
    return 1 + counters["num_accepted_tokens"] / counters["num_drafts"] if counters["num_drafts"] else None
