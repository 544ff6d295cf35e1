"""Realistic decoding bugs, each a small switchable fault in Osprey's decoding loop
(`modeling_osprey.decoding_osprey`): the failing controls of the output check (`osprey.decoding.near_tie`), here and in
the tests. Each is a context manager over the target; inside it, `decode` runs with the bug, and after it, without.

- `positions_off_by_one`: a verification forward gives its draft tokens positions one too far (the root's stays
  right), as a loop that counts positions from the cache's length after appending would.
- `rejected_draft_kept`: after a chain verification the cache is cut one entry too long, so the first rejected draft
  stays in the target's KV cache and every later forward reads it.
- `sibling_visible`: the tree attention mask lets every draft node see the sibling drafted just before it.
- `bonus_from_wrong_row`: when a chain's every draft is accepted, the bonus token is read from the row before the
  last (the last draft's row), not the last.
- `second_best`: after the accepted drafts, a chain emits the target's second-best token.

`SHAPES` names the drafting each one shows in (chains, or trees for the tree mask).
"""

from contextlib import contextmanager

import torch

import modeling_osprey.decoding_osprey as decoding_osprey
from osprey.ground import ForwardHooks


@contextmanager
def _patched(name: str, replacement):
    original = getattr(decoding_osprey, name)
    setattr(decoding_osprey, name, replacement(original))
    try:
        yield
    finally:
        setattr(decoding_osprey, name, original)


def accepts_the_second_best(verify):
    """`decoding_osprey._verify` made wrong: the target's second-best token after the accepted drafts."""

    def wrong(logits, sequence, drafts, *args):
        accepted, _ = verify(logits, sequence, drafts, *args)
        return accepted, logits[0, accepted].float().topk(2).indices[1].view(1, 1)

    return wrong


@contextmanager
def second_best(target=None):
    with _patched("_verify", accepts_the_second_best):
        yield


@contextmanager
def bonus_from_wrong_row(target=None):
    def wrong(verify):
        def bonus_from_the_last_drafts_row(logits, sequence, drafts, *args):
            accepted, next_token = verify(logits, sequence, drafts, *args)
            if accepted == drafts.shape[1] > 0:
                next_token = logits[:, accepted - 1].argmax(dim=-1, keepdim=True)
            return accepted, next_token

        return bonus_from_the_last_drafts_row

    with _patched("_verify", wrong):
        yield


@contextmanager
def rejected_draft_kept(target=None):
    def wrong(crop_cache):
        def keeps_the_first_rejected(cache, length):
            crop_cache(cache, min(length + 1, cache.get_seq_length()))

        return keeps_the_first_rejected

    with _patched("crop_cache", wrong):
        yield


@contextmanager
def sibling_visible(target=None):
    def wrong(tree_attention_mask):
        def sees_the_previous_sibling(target, cache, tree, dtype):
            mask = tree_attention_mask(target, cache, tree, dtype)
            if not isinstance(mask, torch.Tensor):
                raise NotImplementedError("the sibling fault is written for models with one attention mask")
            first = mask.shape[-1] - tree.num_nodes  # the key column of tree node 0
            for node in range(tree.num_nodes):
                earlier = [other for other in tree.children(tree.parents[node]) if other < node]
                if earlier:
                    mask[..., node + 1, first + earlier[-1]] = 0
            return mask

        return sees_the_previous_sibling

    with _patched("tree_attention_mask", wrong):
        yield


@contextmanager
def positions_off_by_one(target):
    def shift(module, args, kwargs):
        input_ids, cached = ForwardHooks.fed(args, kwargs)
        fed = input_ids.shape[1]
        if cached == 0 or fed == 1:  # the prefill and one-token steps verify no draft
            return args, kwargs
        positions = ForwardHooks.positions(kwargs, fed, cached).to(input_ids.device).clone()[None]
        positions[:, 1:] += 1
        return args, {**kwargs, "position_ids": positions}

    handle = target.register_forward_pre_hook(shift, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


FAULTS = {
    "positions_off_by_one": positions_off_by_one,
    "rejected_draft_kept": rejected_draft_kept,
    "sibling_visible": sibling_visible,
    "bonus_from_wrong_row": bonus_from_wrong_row,
    "second_best": second_best,
}
SHAPES = {name: "tree" if name == "sibling_visible" else "chain" for name in FAULTS}
