"""Chain drafting: the core shared by `target.generate(ids, assistant_model=drafter)` and `osprey.decode`.

Position convention (EAGLE's): drafter position `t` pairs the target's features at position `t` (the hidden states
that predicted token `t + 1`) with the embedding of token `t + 1`, and predicts token `t + 2`. So for a sequence of
`N` tokens whose first `N - 1` positions the target has verified, the drafter reads positions `0 .. N - 2`, and its
last one proposes token `N`; every further draft step feeds back the drafter's own pre-norm hidden state in place of
the target's features. Cache entries computed from such predicted features are recomputed from the target's real
features once it has verified the tokens.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList

from .target_features import TargetFeatureCapture

# The drafting settings and their defaults, read by every way of decoding (`decoding_osprey.decode` and its
# `custom_generate` entry, `osprey decode`, `bench` and `demo`, the Space): how a drafter drafts unless told otherwise.
# Chains of 5 tokens per verification step (the Osprey paper's), no early stop (a threshold above 0 ends a chain at
# the first draft the drafter gave less than that probability); `draft_topk` > 1 drafts trees of `tree_size` nodes
# (None: `decoding_osprey.default_tree_size`); `prompt_lookup_num_tokens` > 0 adds a prompt-lookup branch to every
# draft. `configuration_osprey.DRAFTING_DEFAULTS` says the chain's in a generation config's names.
DRAFTING_SETTINGS = {
    "num_draft_tokens": 5,
    "confidence_threshold": 0.0,
    "draft_topk": 1,
    "tree_size": None,
    "prompt_lookup_num_tokens": 0,
}


@dataclass
class DraftState:
    """The drafter's memory of one sequence being generated.

    Attributes:
        cache: the drafter's KV cache.
        num_verified_positions: how many leading drafter positions were computed from the target's real features;
            entries past them came from the drafter's own predictions and are dropped before the next draft.
    """

    cache: DynamicCache = field(default_factory=DynamicCache)
    num_verified_positions: int = 0


def draft_scores_over_target_vocab(drafter, draft_logits: torch.Tensor) -> torch.Tensor:
    """Scores over the whole target vocabulary: a reduced draft vocabulary leaves the other tokens at -inf, so a
    draft sampled from these scores has exactly the probabilities the verifier will be told."""
    draft_logits = draft_logits.float()
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        return draft_logits
    scores = draft_logits.new_full((draft_logits.shape[0], drafter.config.vocab_size), float("-inf"))
    scores[:, drafter.draft_to_target] = draft_logits
    return scores


def choose_draft_token(
    drafter,
    draft_logits: torch.Tensor,
    sequence: torch.LongTensor,
    logits_processor: LogitsProcessorList | None,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Picks the next draft token (target id) from the drafter's last-position logits, after the same logits
    processors the target applies; returns it with the processed scores it was drawn from."""
    scores = draft_scores_over_target_vocab(drafter, draft_logits)
    if logits_processor:
        scores = logits_processor(sequence, scores)
    if do_sample:
        token = torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator)
    else:
        token = scores.argmax(dim=-1, keepdim=True)
    return token, scores


@torch.no_grad()
def draft_chain(
    drafter,
    state: DraftState,
    input_ids: torch.LongTensor,
    new_target_features: torch.Tensor,
    num_draft_tokens: int,
    logits_processor: LogitsProcessorList | None = None,
    do_sample: bool = False,
    eos_token_ids: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    confidence_threshold: float = 0.0,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Drafts up to `num_draft_tokens` tokens following `input_ids` (batch 1), one drafter step each.

    Args:
        input_ids: the sequence so far; the target has verified every position but the last token's.
        new_target_features: the target's tap features for positions `state.num_verified_positions .. N - 2`
            (`N = input_ids.shape[1]`); trailing extra positions (from rejected drafts) are ignored.
        eos_token_ids: drafting stops after proposing one of these.
        confidence_threshold: drafting also stops after a token the drafter gave a probability below this (the
            semantics of transformers' `assistant_confidence_threshold`): later drafts would rarely be accepted, and
            each costs a drafter step. 0 drafts the full chain. Lossless either way: the stop depends on the drafter
            alone.

    Returns:
        The draft token ids `(1, k)` in the target vocabulary (`1 <= k <= num_draft_tokens`) and the processed
        scores `(1, k, vocab_size)` each was chosen from.
    """
    outputs = _read_verified_positions(drafter, state, input_ids, new_target_features)
    return _continue_chain(
        drafter,
        outputs,
        state.cache,
        input_ids,
        num_draft_tokens,
        logits_processor,
        do_sample,
        eos_token_ids,
        generator,
        confidence_threshold,
    )


def _read_verified_positions(drafter, state: DraftState, input_ids, new_target_features):
    """Runs the drafter over the positions the target verified since the last draft (dropping the cache entries its
    own predictions left); its last position's output proposes the first draft token."""
    start, sequence_length = state.num_verified_positions, input_ids.shape[1]
    num_new_positions = sequence_length - 1 - start
    if num_new_positions < 1 or new_target_features.shape[1] < num_new_positions:
        raise RuntimeError(
            f"The drafter expected target features for positions {start}..{sequence_length - 2} but got "
            f"{new_target_features.shape[1]} position(s): the target and the drafter's state went out of sync. "
            "Start a new generation (a fresh DraftState)."
        )
    crop_cache(state.cache, start)
    outputs = drafter(
        input_ids[:, start + 1 :],
        target_hidden_states=new_target_features[:, :num_new_positions].to(drafter.dtype),
        cache=state.cache,
        use_cache=True,
        logits_to_keep=1,
    )
    state.num_verified_positions = sequence_length - 1
    return outputs


@dataclass
class DraftTree:
    """Draft tokens as a tree rooted at the sequence's last token; nodes are listed parents first.

    Attributes:
        tokens: `(num_nodes,)` target-vocabulary ids.
        parents: each node's parent index, -1 for the root's children.
        depths: each node's depth (1 for the root's children).
        draft_scores: per node, the processed drafter scores `(vocab_size,)` at its parent, over the target
            vocabulary: what the node was picked from (siblings share one tensor).
        cumulative_log_probs: per node, the log of the product of draft probabilities along its path: the score
            nodes were ranked by.
    """

    tokens: torch.LongTensor
    parents: list[int]
    depths: list[int]
    draft_scores: list[torch.Tensor]
    cumulative_log_probs: list[float]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def children(self, node: int) -> list[int]:
        """Indices of `node`'s children (`node = -1`: the root's), most probable first."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """Node indices from a child of the root down to `node` (empty for the root, -1)."""
        return _path(self.parents, node)

    def proposal(self, node: int, earlier_siblings: list[int]) -> torch.Tensor:
        """The distribution `node` was drawn from, given its earlier siblings. A draft tree takes the drafter's top-k,
        a deterministic choice: a point mass on the node's token. Verification's recursive rejection over siblings
        divides by it."""
        return F.one_hot(self.tokens[node], self.draft_scores[node].shape[-1]).to(self.draft_scores[node].dtype)


@torch.no_grad()
def draft_tree(
    drafter,
    state: DraftState,
    input_ids: torch.LongTensor,
    new_target_features: torch.Tensor,
    depth: int,
    topk: int,
    tree_size: int,
    logits_processor: LogitsProcessorList | None = None,
    eos_token_ids: torch.Tensor | None = None,
) -> DraftTree:
    """Drafts a tree following `input_ids` (batch 1), EAGLE-2 style: level 1 holds the drafter's `topk` most probable
    first tokens; each further level (up to `depth`) expands the `topk` most probable nodes of the previous level (by
    cumulative draft probability) into their `topk` most probable children, all in one drafter step under a tree
    attention mask; then the `tree_size` most probable nodes of all levels are kept. Children are the drafter's top-k
    after `logits_processor`, for greedy and sampling alike (verification treats them as deterministic picks).

    `input_ids` and `new_target_features` are as for `draft_chain`. Nodes holding an eos token are not expanded.
    """
    outputs = _read_verified_positions(drafter, state, input_ids, new_target_features)
    eos = set() if eos_token_ids is None else set(eos_token_ids.tolist())
    verified_length, device = state.cache.get_seq_length(), input_ids.device
    tokens, parents, depths, draft_scores, cumulative = [], [], [], [], []
    frontier, cache_index = [-1], {}  # expanded nodes of the last level; node -> its drafter cache position
    for level in range(1, depth + 1):
        new_nodes = []
        for slot, parent in enumerate(frontier):
            scores = draft_scores_over_target_vocab(drafter, outputs.logits[:, slot if parent >= 0 else -1])
            if logits_processor:
                path_tokens = input_ids.new_tensor([tokens[node] for node in _path(parents, parent)])
                scores = logits_processor(torch.cat([input_ids, path_tokens[None]], dim=-1), scores)
            log_probs = scores[0].log_softmax(dim=-1)
            best = log_probs.topk(min(topk, log_probs.shape[0]))
            base = cumulative[parent] if parent >= 0 else 0.0
            for log_prob, token in zip(best.values.tolist(), best.indices.tolist()):
                if log_prob == float("-inf"):  # outside a reduced draft vocabulary, or filtered out
                    continue
                new_nodes.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                depths.append(level)
                draft_scores.append(scores[0])
                cumulative.append(base + log_prob)
        # The draft hidden state a node is fed with is the drafter output its token was picked from.
        hidden_slot = {node: frontier.index(parents[node]) for node in new_nodes}
        expandable = [node for node in new_nodes if tokens[node] not in eos]
        expandable = sorted(expandable, key=lambda node: -cumulative[node])[:topk]
        if level == depth or not expandable or not _can_enter(cumulative[expandable[0]], cumulative, tree_size):
            break
        past_length = state.cache.get_seq_length()
        mask = torch.zeros(1, 1, len(expandable), past_length + len(expandable), dtype=torch.bool, device=device)
        mask[..., :verified_length] = True
        for row, node in enumerate(expandable):
            cache_index[node] = past_length + row
            for ancestor in _path(parents, node):
                mask[0, 0, row, cache_index[ancestor]] = True
        feed = input_ids.new_tensor([tokens[node] for node in expandable])[None]
        previous_hidden = outputs.prenorm_hidden_states[:, -1:] if frontier == [-1] else outputs.prenorm_hidden_states
        outputs = drafter(
            feed,
            draft_hidden_states=previous_hidden[:, [hidden_slot[node] for node in expandable]],
            attention_mask=mask,
            position_ids=torch.full_like(feed, input_ids.shape[1] - 2 + level),  # a depth-`level` token's position
            cache=state.cache,
            use_cache=True,
        )
        frontier = expandable
    keep = _most_probable_closed_subtree(cumulative, tree_size)
    renumber = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        tokens=input_ids.new_tensor([tokens[node] for node in keep]),
        parents=[renumber[parents[node]] if parents[node] >= 0 else -1 for node in keep],
        depths=[depths[node] for node in keep],
        draft_scores=[draft_scores[node] for node in keep],
        cumulative_log_probs=[cumulative[node] for node in keep],
    )


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _can_enter(best_frontier_score: float, cumulative_log_probs: list[float], size: int) -> bool:
    """Whether a child of the best frontier node could still be among the `size` most probable nodes: children score
    at most their parent and lose ties to the nodes created before them, so once the frontier's best is no better than
    the `size`-th best node so far, deeper levels cannot change the tree (and their drafter steps are saved)."""
    if len(cumulative_log_probs) < size:
        return True
    return best_frontier_score > sorted(cumulative_log_probs, reverse=True)[size - 1]


def _most_probable_closed_subtree(cumulative_log_probs: list[float], size: int) -> list[int]:
    """The `size` nodes of highest cumulative probability, in creation order (parents first). A child's cumulative
    probability never exceeds its parent's and parents are created first, so with a stable sort every kept node's
    ancestors are kept too."""
    ranked = sorted(range(len(cumulative_log_probs)), key=lambda node: -cumulative_log_probs[node])
    return sorted(ranked[:size])


def prompt_lookup(sequence: torch.LongTensor, num_tokens: int, max_ngram_size: int = 2) -> list[int]:
    """Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): the up to `num_tokens` tokens that
    followed the latest earlier occurrence of the sequence's (batch 1) last n-gram, trying the longest n-gram first
    (`max_ngram_size` down to 1); empty when none recurs. It costs no model call."""
    tokens = sequence[0]
    length = tokens.shape[0]
    for size in range(min(max_ngram_size, length - 1), 0, -1):
        windows = tokens.unfold(0, size, 1)[: length - size]  # every n-gram that has at least one token after it
        starts = (windows == tokens[length - size :]).all(dim=-1).nonzero()
        if len(starts):
            start = int(starts[-1]) + size
            return tokens[start : start + num_tokens].tolist()
    return []


def add_branch(tree: DraftTree, tokens: list[int], vocab_size: int) -> DraftTree:
    """`tree` with the path `tokens` from its root merged in: the path follows existing nodes while their tokens match
    and goes on as new nodes (appended, so parents still come first). New nodes were not drafted by the drafter: their
    `cumulative_log_probs` are -inf and their `draft_scores` (over the `vocab_size` target tokens) all -inf: a
    point-mass pick, like every tree node."""
    if not tokens:
        return tree
    parents, depths = list(tree.parents), list(tree.depths)
    token_list, draft_scores, cumulative = (
        tree.tokens.tolist(),
        list(tree.draft_scores),
        list(tree.cumulative_log_probs),
    )
    node, no_scores = -1, torch.full((vocab_size,), float("-inf"), device=tree.tokens.device)
    for token in tokens:
        child = next((c for c, parent in enumerate(parents) if parent == node and token_list[c] == token), None)
        if child is None:
            child = len(parents)
            parents.append(node)
            depths.append(depths[node] + 1 if node >= 0 else 1)
            token_list.append(token)
            draft_scores.append(no_scores)
            cumulative.append(float("-inf"))
        node = child
    return DraftTree(tree.tokens.new_tensor(token_list), parents, depths, draft_scores, cumulative)


@torch.no_grad()
def draft_without_target_features(
    drafter,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """One draft token before the target has run at all: with zero features the drafter falls back on its
    pretrained backbone, reading the prompt as a plain LM (so the pairing shift does not apply). Nothing is cached."""
    features = torch.zeros(
        (*input_ids.shape, drafter.config.fused_feature_size), dtype=drafter.dtype, device=input_ids.device
    )
    outputs = drafter(input_ids, target_hidden_states=features, use_cache=False, logits_to_keep=1)
    token, scores = choose_draft_token(
        drafter, outputs.logits[:, -1], input_ids, logits_processor, do_sample, generator
    )
    return token, scores[:, None]


def _continue_chain(
    drafter,
    outputs,
    cache,
    input_ids,
    num_draft_tokens,
    logits_processor,
    do_sample,
    eos_token_ids,
    generator,
    confidence_threshold,
):
    sequence, draft_ids, draft_scores = input_ids, [], []
    for step in range(num_draft_tokens):
        token, scores = choose_draft_token(
            drafter, outputs.logits[:, -1], sequence, logits_processor, do_sample, generator
        )
        sequence = torch.cat([sequence, token], dim=-1)
        draft_ids.append(token)
        draft_scores.append(scores)
        is_eos = eos_token_ids is not None and bool(torch.isin(token, eos_token_ids).any())
        is_unsure = confidence_threshold > 0 and scores.softmax(dim=-1).gather(-1, token).item() < confidence_threshold
        if is_eos or is_unsure or step == num_draft_tokens - 1:
            break
        outputs = drafter(
            token,
            draft_hidden_states=outputs.prenorm_hidden_states[:, -1:],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return torch.cat(draft_ids, dim=-1), torch.stack(draft_scores, dim=1)


def check_rollback(target, cache: DynamicCache | None = None) -> None:
    """Raises unless every layer of the target's cache (`cache`, default a new one for its config) is an attention
    KV cache (full or sliding window), the only kind that rejected draft tokens and tree branches can be cut from.
    Recurrent (linear-attention) and quantized states are refused, whatever transformers' `is_croppable` says: its
    5.25 rollback of recurrent states does not reproduce plain greedy decoding."""
    cache = cache if cache is not None else DynamicCache(config=target.config)
    for layer_idx, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise ValueError(
                f"{type(target).__name__}'s cache layer {layer_idx} is a {type(layer).__name__}: it keeps recurrent "
                "(or quantized) state that cannot be rolled back after rejected drafts, so it cannot be verified "
                "speculatively. Use a target whose layers all cache attention keys and values."
            )


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keeps the first `length` positions (in transformers 5.24 `crop(-n)` removes the last n)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


class OspreyAssistantMixin:
    """Makes an Osprey drafter an `assistant_model` for transformers' assisted generation: the target calls the
    drafter's `generate` before each verification step, and the drafter reads the target's features through hooks
    installed by `attach_target`. Expects `self._target_capture` and `self._draft_state` set to None at init."""

    def attach_target(self, target: nn.Module) -> None:
        """Hooks `target`'s tap layers so that `target.generate(..., assistant_model=self)` feeds this drafter.

        Replaces any previously attached target. Raises unless the drafter fits it (`OspreyConfig.check_target`).
        """
        self.config.check_target(target)
        check_rollback(target)  # transformers 5.25 verifies stateful targets, but not exactly: refused, as in 5.24
        capture = TargetFeatureCapture(target, self.config.target_layer_ids)  # validates the taps first
        self.detach_target()
        self._target_capture = capture
        self._draft_state = None

    @contextmanager
    def attached(self, target: nn.Module):
        """`with drafter.attached(target):` hooks `target` for `target.generate(..., assistant_model=drafter)` inside
        the block and removes the hooks when it ends, even on error (`attach_target` / `detach_target` in one)."""
        self.attach_target(target)
        try:
            yield self
        finally:
            self.detach_target()

    def detach_target(self) -> None:
        """Removes the hooks `attach_target` installed; the target runs unobserved again."""
        if self._target_capture is not None:
            self._target_capture.remove()
        self._target_capture = None
        self._draft_state = None

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        max_new_tokens: int | None = None,
        cache: DynamicCache | None = None,
        **kwargs,
    ) -> GenerateDecoderOnlyOutput:
        """Drafts candidates for transformers' assisted generation (the target calls this; it is not a standalone LM
        `generate`). Returns the sequence extended by a chain of draft tokens, the processed scores they were drawn
        from (the verifier's `q` when sampling), and the drafter's KV cache as `cache`, which transformers hands back
        on the next call: a call without this drafter's current cache starts a new sequence.

        Remaining keyword arguments (attention mask, `min_new_tokens`, ...) are accepted and unused.
        """
        if self._target_capture is None:
            raise ValueError(
                "The Osprey drafter reads the target's hidden states: run `target.generate(..., "
                "assistant_model=drafter)` inside `with drafter.attached(target):` (or call "
                "`drafter.attach_target(target)` first), or pass `custom_generate=DRAFTER_DIR, "
                "trust_remote_code=True`, which attaches by itself."
            )
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"Assisted generation drafts for one sequence at a time (got batch size {input_ids.shape[0]}); use "
                "`osprey.decode.speculative_generate` per prompt."
            )
        generation_config = generation_config or self.generation_config
        configs = (generation_config, self.generation_config)
        draft_topk = max(getattr(config, "draft_topk", None) or 1 for config in configs)
        if draft_topk > 1:
            raise ValueError(
                f"draft_topk={draft_topk} asks for draft trees, but transformers' assisted generation "
                "(`assistant_model=`) verifies chains. Set `drafter.generation_config.draft_topk = 1`, or decode trees "
                "with `target.generate(..., custom_generate=DRAFTER_DIR, trust_remote_code=True)` or "
                "`osprey.decode.speculative_generate`."
            )
        confidence_threshold = generation_config.assistant_confidence_threshold or 0.0
        logits_processor = LogitsProcessorList(logits_processor or [])  # transformers passes a plain list
        num_draft_tokens = max_new_tokens or generation_config.num_assistant_tokens
        eos_token_ids = generation_config.eos_token_id
        eos_token_ids = None if eos_token_ids is None else torch.tensor(eos_token_ids, device=input_ids.device).view(-1)
        if self._draft_state is None or cache is not self._draft_state.cache:
            # A new generation: forget the previous sequence and any target forward captured for it.
            self._draft_state = DraftState()
            self._target_capture.clear()
            draft_ids, scores = draft_without_target_features(
                self, input_ids, logits_processor, generation_config.do_sample
            )
        else:
            draft_ids, scores = draft_chain(
                self,
                self._draft_state,
                input_ids,
                self._target_capture.features,
                num_draft_tokens,
                logits_processor,
                generation_config.do_sample,
                eos_token_ids,
                confidence_threshold=confidence_threshold,
            )
        self._target_capture.clear()
        return GenerateDecoderOnlyOutput(
            sequences=torch.cat([input_ids, draft_ids], dim=-1),
            scores=tuple(scores.unbind(dim=1)),
            cache=self._draft_state.cache,
        )
