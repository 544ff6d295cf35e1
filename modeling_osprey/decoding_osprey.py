"""Osprey's speculative decoding loop: the drafter proposes a chain or a tree, the target verifies it in one forward.

One loop for every route: `osprey.decode.speculative_generate` (statistics, CLI, bench, Space) wraps `decode`, and a
saved drafter's `custom_generate/generate.py` runs it inside `target.generate(..., custom_generate=drafter_dir)`.
Remote code: torch and transformers only, relative imports.

Verification is lossless. Greedy: a draft is accepted while it equals the target's argmax. Chains, sampling
(speculative sampling, Leviathan et al. 2023): draft `d ~ q` is accepted with probability `min(1, p(d) / q(d))`; the
first rejected position is resampled from `norm(max(0, p - q))`; when every draft is accepted a bonus token is drawn
from `p`. Trees, sampling (multi-draft recursive rejection, as in SpecInfer): at a node, its children are tried in
turn, child `c` (drawn from `s_c`) accepted with probability `min(1, r(c) / s_c(c))` where `r` starts as `p` and
becomes `norm(max(0, r - s_c))` after each rejection; when all are rejected the token is drawn from `r`. Tree children
are the drafter's top-k (`s_c` a point mass), so this is: accept the first child with probability `p(c)`, else remove
it from `p` and go on. `p` and `q` are the target's and drafter's distributions after the same logits processors.
"""

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    GenerationMixin,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from .generation_osprey import (
    DRAFTING_SETTINGS,
    DraftState,
    DraftTree,
    add_branch,
    check_rollback,
    crop_cache,
    draft_chain,
    draft_tree,
    prompt_lookup,
)
from .target_features import TargetFeatureCapture

# Trees on a CPU: its verification forward is compute-bound (its cost grows with every token verified;
# docs/decoding.md), so small trees pay: branching 3 and 4 nodes, chosen for tokens/s on held-out prompts
# (`benchmarks/trees/tune_defaults.py`; a better drafter may pay for more nodes, and `osprey demo` uses each target's
# own).
# On accelerators verification is memory-bound and wide trees are nearly free: there the default is
# `num_draft_tokens * draft_topk` nodes.
CPU_DRAFT_TOPK, CPU_TREE_SIZE = 3, 4


def default_tree_size(target, num_draft_tokens: int, draft_topk: int) -> int:
    """Tree nodes verified per step when `tree_size` is not given: the whole chain for `draft_topk = 1` (a chain
    verified as a tree, beside a prompt-lookup branch), `CPU_TREE_SIZE` for a target on the CPU."""
    if draft_topk == 1:
        return num_draft_tokens
    return CPU_TREE_SIZE if target.device.type == "cpu" else num_draft_tokens * draft_topk


@dataclass
class DecodingStep:
    """What one verification step did.

    Attributes:
        emitted: `(1, n)` the tokens the step added to the sequence: `accepted` drafts, then the target's own token
            (a correction or the bonus; absent when the output was cut at eos or the length limit).
        accepted: how many drafts the target accepted.
        drafted: the longest draft path offered (the chain's length, the tree's depth).
        tree: the verified tree (trees only).
        accepted_nodes: the tree nodes of the accepted path, root's child first (trees only).
    """

    emitted: torch.LongTensor
    accepted: int
    drafted: int
    tree: DraftTree | None = None
    accepted_nodes: list[int] | None = None


def check_tree_settings(
    draft_topk: int, tree_size: int | None, confidence_threshold: float = 0.0, prompt_lookup_num_tokens: int = 0
) -> None:
    """Clear errors for tree settings that cannot work."""
    if prompt_lookup_num_tokens < 0:
        raise ValueError(
            f"prompt_lookup_num_tokens must be >= 0 (0: no prompt-lookup branch), got {prompt_lookup_num_tokens}."
        )
    if prompt_lookup_num_tokens > 0 and confidence_threshold > 0:
        raise ValueError(
            "confidence_threshold ends chains early, but a prompt-lookup branch makes the draft a tree, pruned by "
            "tree_size instead. Pass one of the two."
        )
    if draft_topk < 1:
        raise ValueError(f"draft_topk must be >= 1 (1 drafts chains), got {draft_topk}.")
    if tree_size is not None and tree_size < 1:
        raise ValueError(f"tree_size must be >= 1 (draft nodes verified per step), got {tree_size}.")
    if draft_topk > 1 and confidence_threshold > 0:
        raise ValueError(
            "confidence_threshold ends chains early; a tree (draft_topk > 1) is pruned by tree_size instead. Pass "
            "one of the two."
        )


@torch.no_grad()
def decode(
    target,
    drafter,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 128,
    num_draft_tokens: int = DRAFTING_SETTINGS["num_draft_tokens"],
    draft_topk: int = DRAFTING_SETTINGS["draft_topk"],
    tree_size: int | None = DRAFTING_SETTINGS["tree_size"],
    confidence_threshold: float = DRAFTING_SETTINGS["confidence_threshold"],
    prompt_lookup_num_tokens: int = DRAFTING_SETTINGS["prompt_lookup_num_tokens"],
    logits_processor: LogitsProcessorList | None = None,
    do_sample: bool = False,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    on_step: Callable[[DecodingStep | None, torch.LongTensor], None] | None = None,
) -> torch.LongTensor:
    """Generates up to `max_new_tokens` after `input_ids` (batch 1), `drafter` proposing and `target` verifying;
    returns the full sequence.

    Args:
        num_draft_tokens: the chain's length, or the tree's depth.
        draft_topk: 1 drafts chains; K > 1 drafts trees expanding the K most probable nodes of each level into their K
            most probable children.
        tree_size: draft nodes verified per step (trees; default `default_tree_size`: 4 on a CPU, else
            `num_draft_tokens * draft_topk`).
        confidence_threshold: a chain stops early after a draft the drafter gave a probability below this (0: full
            chains).
        prompt_lookup_num_tokens: K > 0 adds one more branch to every draft, at no drafter cost: the up to K tokens
            that followed the latest earlier occurrence of the sequence's last 2-gram (or 1-gram), as transformers'
            prompt lookup proposes them. The draft is then verified as a tree (a chain with `draft_topk = 1`).
        logits_processor: applied alike to the target's and the drafter's scores (sampling warpers, penalties).
        stopping_criteria: transformers' criteria, checked after every new token: the output ends at the first
            token where one says stop, as in `generate` (eos and `max_new_tokens` are handled without them).
        on_step: called after the prefill with `(None, sequence)`, then after each verification step with the step
            and the sequence so far.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"Osprey decodes one prompt at a time, got batch size {input_ids.shape[0]}.")
    check_tree_settings(draft_topk, tree_size, confidence_threshold, prompt_lookup_num_tokens)
    drafter.config.check_target(target)
    tree_size = tree_size or default_tree_size(target, num_draft_tokens, draft_topk)
    processors = logits_processor if logits_processor is not None else LogitsProcessorList()
    eos_ids = None if eos_token_id is None else torch.tensor(eos_token_id, device=input_ids.device).view(-1)
    with TargetFeatureCapture(target, drafter.config.target_layer_ids) as capture:
        cache = DynamicCache(config=target.config)
        check_rollback(target, cache)  # a config's cache holds every layer up front (lazily made ones are KV layers)
        cache.activate_past_recording()  # sliding-window layers must keep what they slide out, to roll back
        logits = target(input_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:]
        first = _target_tokens(logits.float(), input_ids, processors, do_sample, generator)
        first, stop = _apply_stopping_criteria(stopping_criteria, input_ids, first)
        sequence, features, new_tokens = torch.cat([input_ids, first], dim=-1), capture.features, 1
        if on_step is not None:
            on_step(None, sequence)
        state = DraftState()
        while not stop and new_tokens < max_new_tokens and not _ends_with(sequence, eos_ids):
            room = max_new_tokens - new_tokens - 1  # tokens a step may draft: its own token takes the last place
            budget = min(num_draft_tokens, room)
            if (draft_topk > 1 or prompt_lookup_num_tokens > 0) and budget > 0:
                tree = draft_tree(
                    drafter, state, sequence, features, budget, draft_topk, tree_size, processors, eos_ids
                )
                if prompt_lookup_num_tokens > 0:
                    lookup = prompt_lookup(sequence, min(prompt_lookup_num_tokens, room))
                    tree = add_branch(tree, lookup, drafter.config.vocab_size)
                step, features = _verify_tree(target, cache, capture, sequence, tree, processors, do_sample, generator)
            else:
                step, features = _verify_chain(
                    target,
                    drafter,
                    state,
                    cache,
                    capture,
                    sequence,
                    features,
                    budget,
                    processors,
                    do_sample,
                    eos_ids,
                    generator,
                    confidence_threshold,
                )
            step.emitted = _truncate_after_eos(step.emitted, eos_ids)[:, : max_new_tokens - new_tokens]
            step.emitted, stop = _apply_stopping_criteria(stopping_criteria, sequence, step.emitted)
            sequence = torch.cat([sequence, step.emitted], dim=-1)
            new_tokens += step.emitted.shape[1]
            if on_step is not None:
                on_step(step, sequence)
    return sequence


def _apply_stopping_criteria(stopping_criteria, sequence, emitted) -> tuple[torch.LongTensor, bool]:
    """`emitted` up to the first token after which a criterion says stop, and whether one did."""
    if not stopping_criteria:
        return emitted, False
    for length in range(1, emitted.shape[1] + 1):
        if bool(stopping_criteria(torch.cat([sequence, emitted[:, :length]], dim=-1), None).any()):
            return emitted[:, :length], True
    return emitted, False


def _verify_chain(
    target,
    drafter,
    state,
    cache,
    capture,
    sequence,
    features,
    budget,
    processors,
    do_sample,
    eos_ids,
    generator,
    confidence_threshold,
):
    if budget > 0:
        drafts, draft_scores = draft_chain(
            drafter,
            state,
            sequence,
            features,
            budget,
            processors,
            do_sample,
            eos_ids,
            generator,
            confidence_threshold,
        )
    else:  # room for one token only: the target's own
        drafts, draft_scores = sequence.new_empty(1, 0), None
    verify_input = torch.cat([sequence[:, -1:], drafts], dim=-1)
    logits = target(verify_input, cache=cache, use_cache=True, logits_to_keep=verify_input.shape[1]).logits
    accepted, next_token = _verify(logits.float(), sequence, drafts, draft_scores, processors, do_sample, generator)
    crop_cache(cache, sequence.shape[1] + accepted)  # the verified positions; the next token is not yet in
    step = DecodingStep(torch.cat([drafts[:, :accepted], next_token], dim=-1), accepted, drafts.shape[1])
    return step, capture.features


def _verify_tree(target, cache, capture, sequence, tree: DraftTree, processors, do_sample, generator):
    """One target forward over the sequence's last token and every tree node, each node seeing the cached prefix and
    its own ancestors at the position of its depth; then the walk down the tree, and the caches cut to the path."""
    cached = cache.get_seq_length()
    verify_input = torch.cat([sequence[:, -1:], tree.tokens[None]], dim=-1)
    depths = torch.tensor([0] + tree.depths, device=sequence.device)
    logits = target(
        verify_input,
        attention_mask=tree_attention_mask(target, cache, tree, logits_dtype(target)),
        position_ids=(cached + depths)[None],
        cache=cache,
        use_cache=True,
        logits_to_keep=verify_input.shape[1],
    ).logits.float()
    node, path = -1, []
    while True:  # node -1 is the root (the sequence's last token), its logits row 0; node i's is row i + 1
        children = tree.children(node)
        prefix = torch.cat([sequence, tree.tokens[path][None]], dim=-1)
        scores = processors(prefix, logits[:, node + 1]) if processors else logits[:, node + 1]
        if do_sample:
            chosen, next_token = _recursive_rejection(scores[0].softmax(dim=-1), tree, children, generator)
        else:
            next_token = scores.argmax(dim=-1)
            chosen = next((child for child in children if tree.tokens[child] == next_token), None)
        if chosen is None:
            break
        node = chosen
        path.append(node)
    keep_tree_path(cache, tree.num_nodes, path)
    features = capture.features[:, [0] + [node + 1 for node in path]]
    emitted = torch.cat([tree.tokens[path], next_token.view(1)])[None]
    return DecodingStep(emitted, len(path), tree.depth, tree, path), features


def _recursive_rejection(target_probs, tree: DraftTree, children, generator):
    """(accepted child or None, and the target's own token when none is)."""
    residual = target_probs
    for index, child in enumerate(children):
        proposal = tree.proposal(child, children[:index])
        token = tree.tokens[child]
        acceptance = (residual[token] / proposal[token]).clamp(max=1.0)
        if torch.rand((), generator=generator, device=acceptance.device) < acceptance:
            return child, None
        residual = (residual - proposal).clamp(min=0)
        residual = residual / residual.sum()
    return None, torch.multinomial(residual, 1, generator=generator)


def logits_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def tree_attention_mask(target, cache: DynamicCache, tree: DraftTree, dtype: torch.dtype):
    """The additive 4-D attention mask(s) of a tree verification forward: query `0` is the sequence's last token,
    query `i + 1` tree node `i`; each sees the cached prefix and its own ancestors (and itself), and on a sliding-window
    layer only what lies within the window of its position (the prefix position plus its depth). Keys are laid out as
    the cache returns them: `kv_offset ..` of the cached positions, then the new tokens.

    A model whose layers all attend alike gets one tensor; a model mixing full and sliding layers gets the dict of
    masks per `config.layer_types` that transformers' hybrid models accept."""
    query_length = tree.num_nodes + 1
    depths = torch.tensor([0] + tree.depths)
    is_ancestor = torch.eye(query_length, dtype=torch.bool)
    is_ancestor[:, 0] = True
    for node in range(tree.num_nodes):
        is_ancestor[node + 1, [ancestor + 1 for ancestor in tree.path(node)]] = True
    masks = {}
    for layer in cache.layers:  # attention KV layers only (`check_rollback`)
        window = layer.sliding_window if layer.is_sliding else None
        if window in masks:
            continue
        cached = layer.get_seq_length()
        kv_length, kv_offset = layer.get_mask_sizes(query_length)
        past_positions = torch.arange(kv_offset, cached)
        query_positions = cached + depths
        allowed = torch.cat(
            [past_positions[None, :].le(query_positions[:, None]).expand(query_length, -1), is_ancestor], dim=1
        )
        if window is not None:
            key_positions = torch.cat([past_positions, query_positions])
            allowed &= (query_positions[:, None] - key_positions[None, :]) < window
        assert allowed.shape[1] == kv_length
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[window] = mask[None, None].to(cache.layers[0].keys.device)
    if len(masks) == 1:
        return next(iter(masks.values()))
    layer_types = getattr(target.config.get_text_config(decoder=True), "layer_types", None)
    if layer_types is None:
        raise ValueError(
            f"{type(target).__name__} mixes sliding and full attention layers without `config.layer_types`: its tree "
            "masks cannot be told apart. Use draft_topk=1."
        )
    sliding = [window for window in masks if window is not None]
    return {"full_attention": masks.get(None), "sliding_attention": masks[sliding[0]]}


def keep_tree_path(cache: DynamicCache, num_nodes: int, path: list[int]) -> None:
    """Drops the cache entries of the tree nodes that are not on the accepted `path` (the last `num_nodes` entries
    of every layer are the tree's, in node order)."""
    for layer in cache.layers:
        if not layer.is_initialized or num_nodes == 0:
            continue
        keep = torch.tensor(path, dtype=torch.long, device=layer.keys.device)
        prefix = layer.keys.shape[-2] - num_nodes
        layer.keys = torch.cat([layer.keys[..., :prefix, :], layer.keys[..., prefix:, :][..., keep, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix, :], layer.values[..., prefix:, :][..., keep, :]], dim=-2)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length -= num_nodes - len(path)


def _target_tokens(logits, prefix, processors, do_sample, generator) -> torch.LongTensor:
    scores = processors(prefix, logits[:, -1]) if processors else logits[:, -1]
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator)
    return scores.argmax(dim=-1, keepdim=True)


def _verify(logits, sequence, drafts, draft_scores, processors, do_sample, generator) -> tuple[int, torch.LongTensor]:
    """Number of drafts accepted, and the target's next token after them (a correction or the bonus token)."""
    num_drafts = drafts.shape[1]
    scores = torch.stack(
        [
            processors(torch.cat([sequence, drafts[:, :position]], dim=-1), logits[:, position])
            if processors
            else logits[:, position]
            for position in range(num_drafts + 1)
        ],
        dim=1,
    )
    if not do_sample:
        target_choice = scores.argmax(dim=-1)
        matches = (target_choice[:, :num_drafts] == drafts)[0].tolist() + [False]
        accepted = matches.index(False)
        return accepted, target_choice[:, accepted : accepted + 1]
    target_probs = scores.softmax(dim=-1)[0]
    for position in range(num_drafts):
        token = drafts[0, position]
        draft_probs = draft_scores[0, position].softmax(dim=-1)
        acceptance = (target_probs[position, token] / draft_probs[token]).clamp(max=1.0)
        if torch.rand((), generator=generator, device=acceptance.device) >= acceptance:
            residual = (target_probs[position] - draft_probs).clamp(min=0)
            return position, torch.multinomial(residual / residual.sum(), 1, generator=generator)[None]
    return num_drafts, torch.multinomial(target_probs[num_drafts], 1, generator=generator)[None]


def _ends_with(sequence: torch.LongTensor, eos_ids: torch.Tensor | None) -> bool:
    return eos_ids is not None and bool(torch.isin(sequence[0, -1], eos_ids))


def _truncate_after_eos(tokens: torch.LongTensor, eos_ids: torch.Tensor | None) -> torch.LongTensor:
    if eos_ids is None:
        return tokens
    is_eos = torch.isin(tokens[0], eos_ids).nonzero()
    return tokens if len(is_eos) == 0 else tokens[:, : int(is_eos[0]) + 1]


# --- `target.generate(..., custom_generate=DRAFTER_DIR, trust_remote_code=True)` ----------------------------------

# `generate`'s own arguments: the drafter, a streamer, a generator, and the drafting settings but the early stop, which
# the drafter's generation config holds (`assistant_confidence_threshold`, as in transformers' assisted generation).
OWN_ARGUMENTS = (
    "assistant_model",
    "streamer",
    "generator",
    *(name for name in DRAFTING_SETTINGS if name != "confidence_threshold"),
)
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def generate(model, *args, **kwargs):
    """The `custom_generate/generate.py` entry of a saved drafter: `target.generate(input_ids, assistant_model=drafter,
    custom_generate=DRAFTER_DIR_OR_REPO, trust_remote_code=True, draft_topk=..., tree_size=...,
    prompt_lookup_num_tokens=..., ...)` runs `decode`
    with the target's generation config (max/min new tokens, eos, stopping criteria, logits processors, streamer,
    `return_dict_in_generate`). No attach is needed: the loop hooks the target's taps and removes the hooks after.
    A `streamer` gets the prompt, the first token, then each verification step's tokens at once; one that also has
    an `on_step(step)` method is handed each step's `DecodingStep` after its tokens (the verified tree included).

    transformers also installs this function as the `generate` of a drafter loaded from the same folder with
    `trust_remote_code=True`; called on the drafter (as assisted generation does), it is the drafter's own `generate`.
    """
    if getattr(model.config, "model_type", None) == "osprey":
        return type(model).generate(model, *args, **kwargs)
    own = {name: kwargs.pop(name, None) for name in OWN_ARGUMENTS}
    drafter = own["assistant_model"]
    if drafter is None or getattr(drafter.config, "model_type", None) != "osprey":
        raise ValueError(
            "custom_generate=<Osprey drafter> decodes with an Osprey drafter: pass it as `assistant_model=drafter` "
            "(loaded with AutoModelForCausalLM.from_pretrained(DRAFTER_DIR, trust_remote_code=True))."
        )
    streamer = own["streamer"]

    def osprey_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"Osprey's custom_generate decodes one sequence at a time, got batch size {input_ids.shape[0]}: call "
                "generate once per prompt."
            )
        if generation_config.num_beams != 1 or (generation_config.num_return_sequences or 1) != 1:
            raise ValueError("Osprey's custom_generate does no beam search and returns one sequence: set num_beams=1.")
        wanted = [name for name in UNSUPPORTED_OUTPUTS if getattr(generation_config, name, False)]
        if wanted:
            raise ValueError(f"Osprey's custom_generate returns sequences only; drop {', '.join(wanted)}.")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("Osprey's custom_generate decodes unpadded prompts: pass no padding in attention_mask.")
        drafting = drafter.generation_config
        num_draft_tokens = own["num_draft_tokens"] or drafting.num_assistant_tokens
        draft_topk = own["draft_topk"] or getattr(drafting, "draft_topk", None) or DRAFTING_SETTINGS["draft_topk"]
        tree_size = own["tree_size"] or getattr(drafting, "tree_size", None) or DRAFTING_SETTINGS["tree_size"]
        lookup = own["prompt_lookup_num_tokens"] or DRAFTING_SETTINGS["prompt_lookup_num_tokens"]
        threshold = drafting.assistant_confidence_threshold or DRAFTING_SETTINGS["confidence_threshold"]
        threshold = threshold if draft_topk == 1 and not lookup else 0.0  # trees are pruned by size, not stopped

        def stream(step, sequence):
            if streamer is None:
                return
            streamer.put((sequence[:, -1:] if step is None else step.emitted).cpu())
            if step is not None and hasattr(streamer, "on_step"):  # a streamer that also wants each step whole
                streamer.on_step(step)

        sequences = decode(
            model,
            drafter,
            input_ids,
            max_new_tokens=generation_config.max_length - input_ids.shape[1],
            num_draft_tokens=num_draft_tokens,
            draft_topk=draft_topk,
            tree_size=tree_size,
            confidence_threshold=threshold,
            prompt_lookup_num_tokens=lookup,
            logits_processor=logits_processor,
            do_sample=bool(generation_config.do_sample),
            eos_token_id=_eos_ids(generation_config),
            generator=own["generator"],
            stopping_criteria=stopping_criteria,
            on_step=stream,
        )
        if streamer is not None:
            streamer.end()
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    return GenerationMixin.generate(model, *args, streamer=streamer, custom_generate=osprey_decoding, **kwargs)


def _eos_ids(generation_config) -> list[int] | None:
    eos = generation_config._eos_token_tensor
    return None if eos is None else eos.view(-1).tolist()


CUSTOM_GENERATE_DIR = "custom_generate"
CUSTOM_GENERATE_ENTRY = '''"""Osprey's speculative decoding loop, chains and draft trees, for transformers' `generate`:

    drafter = AutoModelForCausalLM.from_pretrained(THIS_REPO, trust_remote_code=True)
    target.generate(input_ids, assistant_model=drafter, custom_generate=THIS_REPO, trust_remote_code=True,
                    draft_topk=4, tree_size=16, max_new_tokens=128)

The loop is `decoding_osprey.decode`, the same code as the osprey package's `speculative_generate`.
"""

from .decoding_osprey import generate

__all__ = ["generate"]
'''


def write_custom_generate(save_directory: str | os.PathLike) -> Path:
    """Writes `custom_generate/` into a saved drafter's folder: `generate.py` (transformers' entry) beside copies of
    this module and the drafting modules it imports, so the folder runs Osprey's loop without the osprey package."""
    folder = Path(save_directory) / CUSTOM_GENERATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for module in ("decoding_osprey.py", "generation_osprey.py", "target_features.py"):
        shutil.copyfile(Path(__file__).parent / module, folder / module)
    (folder / "generate.py").write_text(CUSTOM_GENERATE_ENTRY)
    return folder
