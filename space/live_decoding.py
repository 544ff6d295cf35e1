"""The Space's event functions: Osprey decoding streamed step by step, then the target alone, and saved benchmarks.

Kept apart from the Gradio layout (`app.py`) so tests drive them directly with tiny models.
"""

import html
import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd
import torch
from allowlist import PAGE_SETTINGS, ModelCatalog
from transformers.generation.streamers import BaseStreamer

from modeling_osprey.generation_osprey import DRAFTING_SETTINGS
from osprey.decoding.decode import SpeculativeStats, encode_prompt, speculative_generate, target_generate
from osprey.decoding.near_tie import check_difference, first_divergence
from osprey.measuring.bench_report import fails
from osprey.models.pack import custom_generate_folder

APP_DIR = Path(__file__).resolve().parent
ACCEPTED, TARGET = "accepted draft", "target token"
# How Osprey's run decodes: the osprey package's loop, or the same loop from the drafter folder's custom_generate
# inside `target.generate` (the route a user without the package takes).
ROUTES = {"standalone": "speculative_generate (osprey package)", "custom": "target.generate(custom_generate=drafter)"}
RESULT_KEYS = ("method", "suite", "category", "num_prompts", "tau", "tokens_per_s", "speedup")
OUTPUT_NAMES = (
    "osprey",
    "target_only",
    "tau",
    "osprey_tokens_per_s",
    "target_tokens_per_s",
    "speedup",
    "new_tokens",
    "verify_steps",
    "tree",
)


@dataclass(frozen=True)
class Limits:
    """What one visitor may ask for: the bounds keep a public Space responsive for the next one."""

    max_prompt_chars: int = 2000
    max_prompt_tokens: int = 512
    max_new_tokens: int = 256
    max_draft_tokens: int = 10
    max_draft_topk: int = 8
    max_tree_size: int = 64
    max_prompt_lookup_tokens: int = 16
    max_temperature: float = 2.0
    max_queue: int = 20


class SegmentedText:
    """The decoded text of a growing token sequence, split into labelled segments (accepted drafts, target tokens).

    Each addition decodes the whole sequence, so multi-byte characters split across tokens and tokenizers that
    rewrite earlier text stay exact: the segments always join to the sequence's decoded text. A trailing incomplete
    character waits for its remaining bytes, and is counted with the segment that completes it.
    """

    def __init__(self, tokenizer):
        self.tokenizer, self.token_ids, self.segments = tokenizer, [], []

    def add(self, token_ids: list[int], label: str, final: bool = False) -> None:
        self.token_ids += token_ids
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        text = text if final else text.rstrip("\ufffd")
        shown = "".join(piece for piece, _ in self.segments)
        keep = len(os.path.commonprefix([shown, text]))
        while len(shown) > keep:  # earlier text was revised: drop it back to the common prefix
            piece, piece_label = self.segments.pop()
            shown = shown[: -len(piece)]
            if len(shown) < keep:
                self.segments.append((piece[: keep - len(shown)], piece_label))
                shown = text[:keep]
        if len(text) > keep:
            self.segments.append((text[keep:], label))

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.segments)


class BackgroundJob:
    """Runs `work(emit)` in a thread, holding `lock`, while the caller iterates over what it emits: how a Gradio
    generator streams from a callback. When the caller stops early (the visitor left), the next `emit` aborts the
    work, so an abandoned generation frees its model within one step."""

    _DONE = object()

    def __init__(self, work, lock: threading.Lock):
        self._work, self._lock = work, lock
        self._events, self._stopped = queue.Queue(), threading.Event()
        self.result, self._error = None, None

    def _run(self) -> None:
        try:
            with self._lock:
                self.result = self._work(self._emit)
        except Exception as error:  # noqa: BLE001 (re-raised in the caller's thread)
            self._error = error
        finally:
            self._events.put(self._DONE)

    def _emit(self, event) -> None:
        if self._stopped.is_set():
            raise RuntimeError("Generation abandoned by its caller.")
        self._events.put(event)

    def __iter__(self):
        threading.Thread(target=self._run, daemon=True).start()
        try:
            while (event := self._events.get()) is not self._DONE:
                yield event
        finally:
            self._stopped.set()
        if self._error is not None:
            raise self._error


class _TokenStreamer(BaseStreamer):
    """Hands each token `generate` decides to a callback; `generate` puts the prompt first, which is skipped."""

    def __init__(self, emit):
        self.emit, self.prompt_seen = emit, False

    def put(self, value):
        if self.prompt_seen:
            self.emit(value.view(-1).tolist())
        self.prompt_seen = True

    def end(self):
        pass


class OspreySpace:
    """The Space's event functions, over an allow-listed `ModelCatalog` (tests pass one holding tiny models)."""

    def __init__(self, catalog: ModelCatalog, limits: Limits = Limits(), results_dir: str | Path | None = None):
        self.catalog, self.limits = catalog, limits
        self.results_dir = Path(results_dir) if results_dir else default_results_dir()
        self._warm_pairs: set[tuple[str, str, str]] = set()

    def drafter_choices(self, target_name: str):
        names = self._checked(self.catalog.drafter_names, target_name)
        return gr.Dropdown(choices=names, value=names[0])

    def drafter_settings(self, target_name: str, drafter_name: str) -> tuple:
        """The drafting controls' values (`PAGE_SETTINGS` order) for a drafter: its measured settings when it has
        them (`ModelCatalog.settings`), so picking a drafter sets the shape it decodes best with."""
        settings = self._checked(self.catalog.settings, target_name, drafter_name)
        return tuple(settings[name] for name in PAGE_SETTINGS)

    def generate(
        self,
        prompt,
        target_name,
        drafter_name,
        num_draft_tokens,
        temperature,
        max_new_tokens,
        confidence_threshold=DRAFTING_SETTINGS["confidence_threshold"],
        draft_topk=DRAFTING_SETTINGS["draft_topk"],
        tree_size=DRAFTING_SETTINGS["tree_size"],
        route="standalone",
        prompt_lookup_num_tokens=DRAFTING_SETTINGS["prompt_lookup_num_tokens"],
    ):
        """Streams the outputs in `OUTPUT_NAMES` order: Osprey's run step by step (with the last verified draft tree
        when drafting trees: `draft_topk` > 1 or a prompt-lookup branch of up to `prompt_lookup_num_tokens`), then the
        target alone. The statistics are strings, blank until known, as a Number box would show a misleading 0 (the
        speedup as "1.85x"). `route` (a key of `ROUTES`) picks how Osprey's run decodes."""
        if route not in ROUTES:
            raise gr.Error(f"Unknown route {route!r}: choose one of {', '.join(ROUTES)}.")
        num_draft_tokens, max_new_tokens, temperature = int(num_draft_tokens), int(max_new_tokens), float(temperature)
        confidence_threshold, draft_topk = float(confidence_threshold), int(draft_topk)
        tree_size = int(tree_size) if tree_size else num_draft_tokens * draft_topk
        lookup = int(prompt_lookup_num_tokens or 0)
        self._check_settings(
            num_draft_tokens, temperature, max_new_tokens, confidence_threshold, draft_topk, tree_size, lookup
        )
        target, tokenizer, drafter = self._checked(self.catalog.load, target_name, drafter_name)
        request = _Request(
            target,
            tokenizer,
            drafter,
            self._encode(prompt, tokenizer).to(target.device),
            num_draft_tokens,
            confidence_threshold,
            temperature,
            max_new_tokens,
            self.catalog.lock(target_name),
            draft_topk,
            tree_size,
            route,
            lookup,
        )
        if route == "custom":
            self._checked(custom_generate_folder, drafter, drafter_name)
        if (target_name, drafter_name, route) not in self._warm_pairs:  # one-off first-call costs skew the speedup
            try:
                _warm_up(request)
            except Exception as error:
                raise _generation_error(error) from error
            self._warm_pairs.add((target_name, drafter_name, route))
        osprey, stats, tree, osprey_ids = yield from _stream_osprey(request)
        target_only, target_rate, target_ids = None, None, []
        for target_only, target_rate, target_ids in _stream_target_only(request, stats.new_tokens):  # noqa: B007
            yield _row(
                osprey,
                target_only,
                stats.tau,
                stats.tokens_per_s,
                target_rate,
                None,
                stats.new_tokens,
                stats.verify_steps,
                tree=tree,
            )
        speedup = f"{stats.tokens_per_s / target_rate:.2f}x"
        tree = difference_note(request, osprey_ids, target_ids) + tree
        yield _row(
            osprey,
            target_only,
            stats.tau,
            stats.tokens_per_s,
            target_rate,
            speedup,
            stats.new_tokens,
            stats.verify_steps,
            tree=tree,
        )

    def benchmark_view(self):
        """The τ-per-category plot's data and a note: what to run when there are no results, which files were bad."""
        frame, problems = load_benchmark_results(self.results_dir)
        frame = frame.assign(tau=pd.to_numeric(frame["tau"], errors="coerce")).dropna(subset=["tau"])
        notes = [f"Skipped `{problem}`" for problem in problems]
        if frame.empty:
            notes.insert(0, f"No benchmark results yet: `osprey bench` writes them to `{self.results_dir}/*.json`.")
        frame = frame.assign(
            category=frame["suite"].astype(str) + " / " + frame["category"].astype(str),
            series=frame["run"] + ": " + frame["method"].astype(str),  # results of several targets side by side
        )
        return frame, "\n\n".join(notes)

    def _check_settings(
        self,
        num_draft_tokens: int,
        temperature: float,
        max_new_tokens: int,
        confidence_threshold: float,
        draft_topk: int = 1,
        tree_size: int = 1,
        prompt_lookup_num_tokens: int = 0,
    ) -> None:
        limits = self.limits
        if draft_topk > 1 and confidence_threshold > 0:
            raise gr.Error("Early stop ends chains; a tree (branching > 1) is pruned by its size instead. Set one.")
        if prompt_lookup_num_tokens > 0 and confidence_threshold > 0:
            raise gr.Error(
                "Early stop ends chains; a prompt-lookup branch makes the draft a tree, pruned by its size instead. "
                "Set one of the two to 0."
            )
        for name, value, low, high in [
            ("Draft length", num_draft_tokens, 1, limits.max_draft_tokens),
            ("Branching", draft_topk, 1, limits.max_draft_topk),
            ("Tree size", tree_size, 1, limits.max_tree_size),
            ("Prompt-lookup branch", prompt_lookup_num_tokens, 0, limits.max_prompt_lookup_tokens),
            ("Early stop", confidence_threshold, 0, 1),
            ("Temperature", temperature, 0, limits.max_temperature),
            ("Max new tokens", max_new_tokens, 1, limits.max_new_tokens),
        ]:
            if not low <= value <= high:
                raise gr.Error(f"{name} must be between {low} and {high}, got {value}.")

    def _encode(self, prompt: str, tokenizer) -> torch.LongTensor:
        if not prompt or not prompt.strip():
            raise gr.Error("Type a prompt, or pick one of the examples.")
        if len(prompt) > self.limits.max_prompt_chars:
            raise gr.Error(
                f"The prompt has {len(prompt)} characters; this Space takes at most {self.limits.max_prompt_chars}. "
                "Shorten it."
            )
        input_ids = encode_prompt(tokenizer, prompt, chat_template=bool(tokenizer.chat_template))
        if input_ids.shape[1] > self.limits.max_prompt_tokens:
            raise gr.Error(
                f"The prompt is {input_ids.shape[1]} tokens long; this Space takes at most "
                f"{self.limits.max_prompt_tokens}. Shorten it."
            )
        return input_ids

    @staticmethod
    def _checked(function, *args):
        """Catalog refusals (unknown or mismatched models) reach the visitor as a message, not a traceback."""
        try:
            return function(*args)
        except ValueError as error:
            raise gr.Error(str(error)) from error


@dataclass
class _Request:
    target: object
    tokenizer: object
    drafter: object
    input_ids: torch.LongTensor
    num_draft_tokens: int
    confidence_threshold: float
    temperature: float
    max_new_tokens: int
    lock: threading.Lock
    draft_topk: int = DRAFTING_SETTINGS["draft_topk"]
    tree_size: int | None = DRAFTING_SETTINGS["tree_size"]
    route: str = "standalone"
    prompt_lookup_num_tokens: int = DRAFTING_SETTINGS["prompt_lookup_num_tokens"]

    @property
    def sampling(self) -> dict:
        return {"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else {"do_sample": False}

    @property
    def drafting(self) -> dict:
        """The drafting shape, as `speculative_generate` takes it."""
        return {name: getattr(self, name) for name in DRAFTING_SETTINGS}


def _warm_up(request: _Request) -> None:
    """A few tokens through both decoding paths (Osprey's with the request's drafting shape), so that neither timed
    run pays for lazy initialisation."""
    short = {"max_new_tokens": 3, "eos_token_id": None}
    with request.lock:
        speculative_generate(request.target, request.drafter, request.input_ids[:, :8], **short, **request.drafting)
        if request.route == "custom":  # loading the folder's custom_generate module is a first-call cost too
            short_request = _Request(**{**vars(request), "input_ids": request.input_ids[:, :8], "max_new_tokens": 3})
            _custom_generate(short_request, lambda item: None)
        request.target.generate(request.input_ids[:, :8], do_sample=False, min_new_tokens=3, pad_token_id=0, **short)


def _custom_generate(request: _Request, emit) -> tuple[torch.LongTensor, SpeculativeStats]:
    """The `custom` route: the drafter folder's `custom_generate` inside `target.generate`, its steps streamed."""
    stats, start = SpeculativeStats(), time.perf_counter()
    streamer = _StepStreamer(emit, stats)
    torch.manual_seed(0)
    output = request.target.generate(
        request.input_ids,
        assistant_model=request.drafter,
        custom_generate=str(request.drafter.name_or_path),
        trust_remote_code=True,
        streamer=streamer,
        max_new_tokens=request.max_new_tokens,
        num_draft_tokens=request.num_draft_tokens,
        draft_topk=request.draft_topk,
        tree_size=request.tree_size if request.draft_topk > 1 or request.prompt_lookup_num_tokens > 0 else None,
        prompt_lookup_num_tokens=request.prompt_lookup_num_tokens,
        eos_token_id=request.target.generation_config.eos_token_id,
        pad_token_id=request.tokenizer.pad_token_id or 0,
        **request.sampling,
    )
    stats.wall_time_s = time.perf_counter() - start
    return output, stats


class _StepStreamer(BaseStreamer):
    """`custom_generate`'s streamer: skips the prompt, emits the first token, then each verification step whole
    (Osprey's loop hands a streamer that has `on_step` every step), counting the run's statistics on the way."""

    def __init__(self, emit, stats: SpeculativeStats):
        self.emit, self.stats, self.puts = emit, stats, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:  # the first is the prompt
            self.stats.new_tokens = 1
            self.emit((value.view(1, -1), None, None))

    def on_step(self, step):
        self.stats.add_step(step)
        self.emit((step.emitted, step.accepted, step))

    def end(self):
        pass


def _osprey_decode(request: _Request, emit) -> tuple[torch.LongTensor, SpeculativeStats]:
    """Osprey's decoding of the request by its route, each step sent to `emit`: the full sequence and its stats. The
    same call decodes again, exactly, when a difference is replayed (`difference_note`)."""
    if request.route == "custom":
        return _custom_generate(request, emit)
    target = request.target
    return speculative_generate(
        target,
        request.drafter,
        request.input_ids,
        max_new_tokens=request.max_new_tokens,
        eos_token_id=target.generation_config.eos_token_id,
        generator=torch.Generator(target.device).manual_seed(0),
        on_tokens=lambda tokens, accepted: emit((tokens, None, None)) if accepted is None else None,
        on_step=lambda step: emit((step.emitted, step.accepted, step)),
        **request.drafting,
        **request.sampling,
    )


def _stream_osprey(request: _Request):
    """Yields the full output row after each verification step; returns the final segments and the run's stats."""
    start = time.perf_counter()
    job = BackgroundJob(lambda emit: _osprey_decode(request, emit), request.lock)
    text, decided, steps, tree = SegmentedText(request.tokenizer), 0, 0, ""
    for tokens, accepted, step in _reporting_errors(job):
        tokens = tokens[0].tolist()
        if step is not None and step.tree is not None:
            tree = tree_html(request.tokenizer, step)
        if accepted is None:  # the prefill's token
            text.add(tokens, TARGET)
        else:
            text.add(tokens[:accepted], ACCEPTED)
            text.add(tokens[accepted:], TARGET)
            decided, steps = decided + accepted + 1, steps + 1
        new_tokens = len(text.token_ids)
        rate = new_tokens / (time.perf_counter() - start)
        tau = decided / steps if steps else None
        yield _row(list(text.segments), "", tau, rate, None, None, new_tokens, steps, tree=tree)
    text.add([], TARGET, final=True)
    return text.segments, job.result[1], tree, text.token_ids


def difference_note(request: _Request, osprey_ids: list[int], target_ids: list[int]) -> str:
    """For a greedy run whose output differs from the target alone's: where, and whether rounding explains it
    (`osprey.decoding.near_tie.check_difference`: every token must lie within rounding of a clean forward's best, and
    Osprey decodes again so that the verification forward that decided the first differing token must have chosen it
    and agree with a clean forward within rounding). Empty when the outputs are equal or when sampling (where they
    differ by design)."""
    if request.temperature > 0 or first_divergence(target_ids, osprey_ids) is None:
        return ""
    with request.lock:
        divergence = check_difference(
            request.target,
            lambda: _osprey_decode(request, lambda item: None)[0],
            request.input_ids,
            target_ids,
            osprey_ids,
        )
    if not fails(divergence.label):
        reading = (
            "a near tie, which rounding in this dtype can flip (a verification forward over several tokens rounds "
            "differently from a one-token step), not a drafting error"
        )
    else:
        reading = "a decoding bug (please report it)"
    return (
        f"<p><b>The outputs differ from new token {divergence.position}</b>: {reading}. "
        f"{html.escape(divergence.describe())}.</p>"
    )


def tree_html(tokenizer, step) -> str:
    """The draft tree a verification step verified, as nested lists, each node's token with its draft probability
    (along the path; `lookup` for a prompt-lookup node); the accepted path is marked (green, bold) and the target's
    own next token follows it."""
    tree, accepted = step.tree, set(step.accepted_nodes)

    def node_html(node: int) -> str:
        token = html.escape(repr(tokenizer.decode([int(tree.tokens[node])]))[1:-1]) or "&nbsp;"
        style = "color:#047857;font-weight:bold" if node in accepted else "color:#6b7280"
        log_probability = tree.cumulative_log_probs[node]  # -inf: a prompt-lookup node, not drafted by the drafter
        source = "lookup" if log_probability == float("-inf") else f"{math.exp(log_probability):.2f}"
        children = "".join(node_html(child) for child in tree.children(node))
        label = f'<span style="{style}"><code>{token}</code> {source}</span>'
        return f"<li>{label}{f'<ul>{children}</ul>' if children else ''}</li>"

    own = step.emitted[0, step.accepted :].tolist()
    own_text = html.escape(repr(tokenizer.decode(own))[1:-1]) if own else "(cut at eos / length)"
    return (
        f"<p>Last step: {len(step.accepted_nodes)} of {tree.num_nodes} draft nodes accepted (depth {tree.depth}); "
        f"then the target's own token <code>{own_text}</code>.</p>"
        f"<ul>{''.join(node_html(child) for child in tree.children(-1))}</ul>"
    )


def _stream_target_only(request: _Request, num_tokens: int):
    """Yields (text so far, tokens/s so far) while `target.generate` decodes `num_tokens` tokens (exactly that many
    when sampling, so both runs do the same work); the last pair is final, timed like Osprey's run."""
    tokenizer, target = request.tokenizer, request.target
    length = {"min_new_tokens": num_tokens} if request.temperature > 0 else {}
    job = BackgroundJob(
        lambda emit: _timed(
            target_generate,
            target,
            request.input_ids,
            num_tokens,
            eos_token_id=target.generation_config.eos_token_id,
            streamer=_TokenStreamer(emit),
            **length,
            **request.sampling,
        ),
        request.lock,
    )
    text, start = SegmentedText(tokenizer), time.perf_counter()
    for tokens in _reporting_errors(job):
        text.add(tokens, TARGET)
        yield text.text, len(text.token_ids) / (time.perf_counter() - start), text.token_ids
    text.add([], TARGET, final=True)
    yield text.text, len(text.token_ids) / job.result[1], text.token_ids


def _reporting_errors(job: BackgroundJob):
    try:
        yield from job
    except Exception as error:
        raise _generation_error(error) from error


def _generation_error(error: Exception) -> gr.Error:
    """What the visitor sees when the models fail: the error itself, not a generic "Error" box."""
    return gr.Error(f"Generation failed: {type(error).__name__}: {error}")


def _timed(function, *args, **kwargs):
    start = time.perf_counter()
    return function(*args, **kwargs), time.perf_counter() - start


def _row(osprey, target_only, *numbers, tree: str = "") -> tuple:
    """One update of the outputs in `OUTPUT_NAMES` order; numbers as shown, blank while not known yet."""
    shown = ["" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value) for value in numbers]
    return osprey, target_only, *shown, tree


def default_results_dir() -> Path:
    """`space/results/` when the Space ships its own results, else the repository's `benchmarks/results/`."""
    bundled = APP_DIR / "results"
    return bundled if bundled.is_dir() else APP_DIR.parent / "benchmarks" / "results"


def load_benchmark_results(directory: str | Path) -> tuple[pd.DataFrame, list[str]]:
    """The records of every `*.json` in `directory` (an `osprey bench` results file, whose `records` are one per
    method x suite x category, or a bare list of such records), with the file's name as `run`; and a line per file
    that held no such records."""
    rows, problems = [], []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            content = json.loads(path.read_text())
            records = content.get("records") if isinstance(content, dict) else content
            if not isinstance(records, list) or not all(
                isinstance(record, dict) and set(RESULT_KEYS) <= record.keys() for record in records
            ):
                raise ValueError(f"expected records with keys {', '.join(RESULT_KEYS)}")
        except (OSError, ValueError) as error:
            problems.append(f"{path.name}: {error}")
            continue
        rows += [{"run": path.stem} | {key: record[key] for key in RESULT_KEYS} for record in records]
    return pd.DataFrame(rows, columns=["run", *RESULT_KEYS]), problems
