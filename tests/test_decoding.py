"""Lossless speculative decoding: `target.generate(ids, assistant_model=drafter)` and `osprey.decoding.decode`."""

import pytest
import torch
from conftest import TINY_TARGET_ARCHS, make_tiny_target
from scipy.stats import chisquare

import modeling_osprey.decoding_osprey as decoding_osprey
import modeling_osprey.generation_osprey as generation_osprey
from osprey import OspreyConfig, OspreyForDrafting
from osprey.decoding.decode import sampling_processors, speculative_generate


def random_drafter(target, seed: int = 0, **overrides) -> OspreyForDrafting:
    values = dict(
        vocab_size=target.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        target_hidden_size=target.config.hidden_size,
        target_layer_ids=[1, 3, 4],
    )
    values.update(overrides)
    torch.manual_seed(seed)
    return OspreyForDrafting(OspreyConfig(**values)).eval()


# How much of each block's output the near-copy target keeps: enough for context to matter, little enough that a
# bigram drafter agrees with it on most greedy tokens (50-80%).
NEAR_COPY_BLOCK_SCALE = {"llama": 0.003, "qwen2": 0.003, "qwen3": 0.003, "minimax_m2": 0.003, "gemma3": 0.3}


def near_copy_pair(arch: str):
    """A target whose blocks barely move its residual stream (close to a bigram model of its embeddings), and a
    drafter computing exactly that bigram model: most drafts are accepted, some are not, so both the acceptance and
    the rollback paths run. Works for every architecture without copying its blocks."""
    target = make_tiny_target(arch)
    block_scale = NEAR_COPY_BLOCK_SCALE[arch]
    with torch.no_grad():
        for layer in target.model.layers:
            if arch == "gemma3":  # sandwich norms renormalise block outputs; Gemma norms scale by (1 + weight)
                layer.post_attention_layernorm.weight.fill_(block_scale - 1)
                layer.post_feedforward_layernorm.weight.fill_(block_scale - 1)
            else:
                layer.self_attn.o_proj.weight.mul_(block_scale)
                down = layer.mlp.experts.down_proj if arch == "minimax_m2" else layer.mlp.down_proj.weight
                down.mul_(block_scale)
    drafter = random_drafter(target, hidden_size=target.config.hidden_size)
    with torch.no_grad():
        # The drafter's blocks add nothing; its normed embeddings are the target's normed embeddings.
        for layer in drafter.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        vocab = torch.arange(target.config.vocab_size)
        drafter.model.embed_tokens.weight.copy_(target.model.norm(target.model.embed_tokens(vocab)))
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return target, drafter


def prompt(length: int, seed: int) -> torch.LongTensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def plain_greedy(target, input_ids, max_new_tokens, eos_token_id=None):
    return target.generate(
        input_ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=0
    )


def assisted_greedy(target, drafter, input_ids, max_new_tokens, eos_token_id=None):
    return target.generate(
        input_ids,
        assistant_model=drafter,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


CASES = [(1, 0, 3), (9, 1, 23), (5, 2, 40)]  # (prompt length, prompt seed, max_new_tokens)


@pytest.mark.parametrize("arch", TINY_TARGET_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["random", "near_copy"])
def test_greedy_assisted_generate_equals_plain_generate(arch, drafter_kind):
    if drafter_kind == "random":
        target = make_tiny_target(arch)
        drafter = random_drafter(target)
    else:
        target, drafter = near_copy_pair(arch)
    drafter.attach_target(target)
    for length, seed, max_new_tokens in CASES:
        input_ids = prompt(length, seed)
        expected = plain_greedy(target, input_ids, max_new_tokens)
        assert torch.equal(assisted_greedy(target, drafter, input_ids, max_new_tokens), expected)
        standalone, _ = speculative_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens)
        assert torch.equal(standalone, expected)


@pytest.mark.parametrize("arch", TINY_TARGET_ARCHS)
def test_near_copy_drafter_exercises_acceptance_and_rollback(arch):
    target, drafter = near_copy_pair(arch)
    _, stats = speculative_generate(target, drafter, prompt(9, 1), max_new_tokens=60)
    assert stats.tau > 1.5, "the near-copy drafter should get many drafts accepted"
    assert min(stats.accepted_per_step) < 5, "some drafts must be rejected so rollback runs"
    assert stats.new_tokens == 60
    assert stats.new_tokens == 1 + sum(a + 1 for a in stats.accepted_per_step)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eos_inside_a_draft_stops_exactly_like_plain_generate(arch):
    target, drafter = near_copy_pair(arch)
    drafter.attach_target(target)
    input_ids = prompt(6, 3)
    reference = plain_greedy(target, input_ids, 40)[0, 6:].tolist()
    for stop_index in (3, 11):  # tokens that first occur there become eos
        eos = reference[stop_index]
        if eos in reference[:stop_index]:
            continue
        expected = plain_greedy(target, input_ids, 40, eos_token_id=eos)
        assert expected[0, -1] == eos and expected.shape[1] == 6 + stop_index + 1
        assert torch.equal(assisted_greedy(target, drafter, input_ids, 40, eos_token_id=eos), expected)
        standalone, _ = speculative_generate(target, drafter, input_ids, max_new_tokens=40, eos_token_id=eos)
        assert torch.equal(standalone, expected)


def test_drafter_is_reusable_across_prompts_and_calls():
    target, drafter = near_copy_pair("qwen3")
    drafter.attach_target(target)
    prompts = [prompt(7, 10), prompt(3, 11), prompt(7, 10)]
    outputs = [assisted_greedy(target, drafter, ids, 25) for ids in prompts]
    for ids, output in zip(prompts, outputs):
        assert torch.equal(output, plain_greedy(target, ids, 25))
    assert torch.equal(outputs[0], outputs[2])
    speculative_generate(target, drafter, prompt(4, 12), max_new_tokens=10)  # interleave the standalone loop
    assert torch.equal(assisted_greedy(target, drafter, prompts[1], 25), outputs[1])


def test_reduced_draft_vocabulary_is_mapped_back_to_target_ids():
    target, drafter = near_copy_pair("llama")
    reduced = random_drafter(target, hidden_size=64, draft_vocab_size=128)
    keep = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:128]
    with torch.no_grad():
        reduced.load_state_dict(
            {**drafter.state_dict(), "lm_head.weight": drafter.lm_head.weight[keep], "draft_to_target": keep}
        )
    reduced.attach_target(target)
    input_ids = prompt(5, 4)
    assert torch.equal(assisted_greedy(target, reduced, input_ids, 30), plain_greedy(target, input_ids, 30))
    _, stats = speculative_generate(target, reduced, input_ids, max_new_tokens=30)
    assert stats.tau > 1.0  # drafts inside the kept half of the vocabulary do get accepted


# --- sampling is distribution-exact ----------------------------------------------------------------------------


def exact_second_token_distribution(target, input_ids, temperature):
    """P(second generated token) = sum_x1 P(x1) P(x2 | x1), enumerated exactly over the (small) vocabulary."""
    processors = sampling_processors(temperature=temperature)
    with torch.no_grad():
        first = processors(input_ids, target(input_ids).logits[:, -1].float()).softmax(-1)[0]
        vocab = target.config.vocab_size
        continuations = torch.cat([input_ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = processors(continuations, target(continuations).logits[:, -1].float()).softmax(-1)
    return first @ second


def second_token_counts(generate_once, num_samples, vocab_size):
    counts = torch.zeros(vocab_size)
    for _ in range(num_samples):
        counts[generate_once()] += 1
    return counts


def chi_square_pvalue(counts, probabilities):
    """Goodness of fit, rare outcomes pooled so every expected count is at least 5."""
    expected = probabilities.double() * counts.sum()
    common = expected >= 5
    observed, expected = counts[common].double(), expected[common]
    if not common.all():
        observed = torch.cat([observed, counts[~common].sum()[None]])
        expected = torch.cat([expected, (counts.sum() - expected.sum())[None]])
    expected = expected * observed.sum() / expected.sum()  # exact equality of totals, as scipy demands
    return chisquare(observed.numpy(), expected.numpy()).pvalue


def misreport_q(monkeypatch):
    """The failing control: the drafter samples from q but reports a flattened q, so verification accepts
    with the wrong ratio and the output distribution is biased."""
    honest = generation_osprey.choose_draft_token

    def dishonest(*args, **kwargs):
        token, scores = honest(*args, **kwargs)
        return token, scores * 0.2

    monkeypatch.setattr(generation_osprey, "choose_draft_token", dishonest)


@pytest.fixture(scope="module")
def sampling_pair():
    target = make_tiny_target("llama", vocab_size=24, initializer_range=0.1)
    drafter = random_drafter(target)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(40)  # a confident, mostly wrong drafter: q far from p
    drafter.attach_target(target)
    return target, drafter


SAMPLES = 1000


@pytest.mark.parametrize("route", ["assisted_generate", "standalone"])
@pytest.mark.parametrize("honest", [True, False], ids=["honest", "misreported_q_control"])
def test_speculative_sampling_matches_the_target_distribution(sampling_pair, route, honest, monkeypatch):
    target, drafter = sampling_pair
    if not honest:
        misreport_q(monkeypatch)
    input_ids, temperature = torch.tensor([[3, 7, 5]]), 1.5
    # With 3 new tokens the second is drafted and verified on both routes (the standalone loop's first comes from
    # the prefill; transformers' third may be the target's alone).
    second_position = input_ids.shape[1] + 1
    torch.manual_seed(1234)

    if route == "assisted_generate":

        def generate_once():
            output = target.generate(
                input_ids,
                assistant_model=drafter,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                max_new_tokens=3,
                eos_token_id=None,
                pad_token_id=0,
            )
            return output[0, second_position]
    else:

        def generate_once():
            output, _ = speculative_generate(
                target, drafter, input_ids, max_new_tokens=3, do_sample=True, temperature=temperature
            )
            return output[0, second_position]

    counts = second_token_counts(generate_once, SAMPLES, target.config.vocab_size)
    pvalue = chi_square_pvalue(counts, exact_second_token_distribution(target, input_ids, temperature))
    if honest:
        assert pvalue > 1e-3, f"speculative sampling is biased (p={pvalue:.2e})"
    else:
        assert pvalue < 1e-6, f"the control was not caught (p={pvalue:.2e}): the test has no power"


# --- errors ------------------------------------------------------------------------------------------------------


def test_drafter_for_another_target_is_refused_at_attach():
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match=r"hidden_size 64 \(the drafter's: 48\)"):
        random_drafter(target, target_hidden_size=48).attach_target(target)
    with pytest.raises(ValueError, match=r"vocab_size 256 \(the drafter's: 300\)"):
        random_drafter(target, vocab_size=300).attach_target(target)
    with pytest.raises(ValueError, match=r"8 layers \(the drafter taps \[1, 3, 9\]\)"):
        random_drafter(target, target_layer_ids=[1, 3, 9]).attach_target(target)
    assert random_drafter(target)._target_capture is None  # nothing was hooked by the refusals


def test_drafter_names_its_target_and_refuses_another_of_the_same_shape():
    target = make_tiny_target("llama")
    drafter = random_drafter(target, target_name_or_path="qwen2.5-coder-1.5b-instruct")
    for same in ("/cache/osprey/models/qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", ""):
        target.config.name_or_path = same  # the zoo's cache directory, the Hub id, or unknown (built in memory)
        drafter.attach_target(target)
        drafter.detach_target()
    target.config.name_or_path = "/cache/osprey/models/qwen2.5-coder-0.5b-instruct"
    with pytest.raises(
        ValueError, match="converted for 'qwen2.5-coder-1.5b-instruct', not .*0.5b.*target_name_or_path"
    ):
        drafter.attach_target(target)
    with pytest.raises(ValueError, match="converted for 'qwen2.5-coder-1.5b-instruct'"):
        speculative_generate(target, drafter, prompt(4, 0), max_new_tokens=4)


def test_generate_without_attached_target_says_how_to_fix():
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="attach_target"):
        assisted_greedy(target, random_drafter(target), prompt(4, 0), 5)


def test_batches_are_refused():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    drafter.attach_target(target)
    batch = torch.cat([prompt(4, 0), prompt(4, 1)])
    with pytest.raises(ValueError, match="batch_size = 1"):
        assisted_greedy(target, drafter, batch, 5)
    with pytest.raises(ValueError, match="one prompt at a time"):
        speculative_generate(target, drafter, batch)


def test_detach_removes_the_hooks():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    drafter.attach_target(target)
    drafter.attach_target(target)  # re-attaching replaces, never stacks
    assert sum(len(layer._forward_hooks) for layer in target.model.layers) == 3
    drafter.detach_target()
    assert all(not layer._forward_hooks for layer in target.model.layers)


def test_saved_drafter_drafts_full_chains_of_five_tokens_by_default(tmp_path):
    target = make_tiny_target("llama")
    random_drafter(target).save_pretrained(tmp_path)
    reloaded = OspreyForDrafting.from_pretrained(tmp_path)
    assert reloaded.generation_config.num_assistant_tokens == 5
    assert reloaded.generation_config.num_assistant_tokens_schedule == "constant"
    assert reloaded.generation_config.assistant_confidence_threshold == 0.0  # full chains, not transformers' 0.4


def test_target_with_unrollbackable_state_is_refused():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    target = Qwen3NextForCausalLM(config).eval()  # linear-attention layers keep a recurrent state
    drafter = random_drafter(target)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        speculative_generate(target, drafter, prompt(5, 0), max_new_tokens=5)
    with pytest.raises(ValueError, match="cannot be rolled back"):  # before `assistant_model=drafter` can be used
        drafter.attach_target(target)


def test_streamed_tokens_rebuild_the_output_and_mark_accepted_drafts():
    target, drafter = near_copy_pair("llama")
    input_ids = prompt(9, 1)
    streamed = []
    output, stats = speculative_generate(
        target,
        drafter,
        input_ids,
        max_new_tokens=30,
        on_tokens=lambda tokens, accepted: streamed.append((tokens, accepted)),
    )
    assert streamed[0][1] is None and streamed[0][0].shape == (1, 1)  # the prefill's token
    assert [accepted for _, accepted in streamed[1:]] == stats.accepted_per_step
    assert torch.equal(torch.cat([input_ids] + [tokens for tokens, _ in streamed], dim=-1), output)
    assert all(tokens.shape[1] <= accepted + 1 for tokens, accepted in streamed[1:])


# --- early stopping ------------------------------------------------------------------------------------------------


def record_chains(monkeypatch) -> list[tuple[list[float], int]]:
    """Records, for every chain drafted, each draft's probability under the drafter and the chain's length budget."""
    chains, draft = [], generation_osprey._continue_chain

    def recording(drafter, outputs, cache, input_ids, num_draft_tokens, *args):
        draft_ids, scores = draft(drafter, outputs, cache, input_ids, num_draft_tokens, *args)
        probabilities = scores.softmax(dim=-1)[0].gather(-1, draft_ids[0][:, None])[:, 0]
        chains.append((probabilities.tolist(), num_draft_tokens))
        return draft_ids, scores

    monkeypatch.setattr(generation_osprey, "_continue_chain", recording)
    return chains


@pytest.mark.parametrize("route", ["assisted_generate", "standalone"])
def test_confidence_threshold_ends_chains_at_the_first_unsure_draft_and_stays_exact(route, monkeypatch):
    target, drafter = near_copy_pair("llama")
    threshold, input_ids = 0.08, prompt(9, 1)  # the near-copy drafter's draft probabilities span 0.004-0.4
    chains = record_chains(monkeypatch)
    if route == "assisted_generate":
        drafter.generation_config.assistant_confidence_threshold = threshold
        drafter.attach_target(target)
        output = assisted_greedy(target, drafter, input_ids, 60)
    else:
        output, _ = speculative_generate(target, drafter, input_ids, max_new_tokens=60, confidence_threshold=threshold)
    assert torch.equal(output, plain_greedy(target, input_ids, 60))
    for probabilities, budget in chains:
        assert all(p >= threshold for p in probabilities[:-1]), "a chain went on past an unsure draft"
        assert probabilities[-1] < threshold or len(probabilities) == budget, "a chain stopped while sure"
    stopped_early = [len(probabilities) < budget for probabilities, budget in chains]
    assert any(stopped_early) and not all(stopped_early), "the threshold should end some chains early, not all"


def test_zero_confidence_threshold_drafts_full_chains(monkeypatch):
    target, drafter = near_copy_pair("llama")
    chains = record_chains(monkeypatch)
    speculative_generate(target, drafter, prompt(9, 1), max_new_tokens=60)
    assert all(len(probabilities) == budget for probabilities, budget in chains)
    assert min(min(probabilities) for probabilities, _ in chains) < 0.08  # unsure drafts were there to stop at


# --- draft trees -----------------------------------------------------------------------------------------------------

TREES = [(2, 4), (3, 10), (4, 24)]  # (draft_topk, tree_size)


@pytest.mark.parametrize("arch", TINY_TARGET_ARCHS)
@pytest.mark.parametrize("drafter_kind", ["random", "near_copy"])
def test_greedy_tree_decoding_equals_plain_generate(arch, drafter_kind):
    if drafter_kind == "random":
        target = make_tiny_target(arch)
        drafter = random_drafter(target)
    else:
        target, drafter = near_copy_pair(arch)
    for (length, seed, max_new_tokens), (topk, size) in zip(CASES, TREES):
        input_ids = prompt(length, seed)
        output, stats = speculative_generate(
            target, drafter, input_ids, max_new_tokens=max_new_tokens, draft_topk=topk, tree_size=size
        )
        assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens))
        assert all(verified <= size for verified in stats.verified_per_step)
    if drafter_kind == "near_copy":
        assert stats.tau > 1.5 and min(stats.accepted_per_step) < 5, "both acceptance and rollback should run"


def test_tree_decoding_on_a_target_mixing_sliding_and_full_layers():
    """Qwen2 with sliding windows on its first layers: the tree masks go per layer type, the window cuts ancestors."""
    target = make_tiny_target("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=4)
    assert set(target.config.layer_types) == {"sliding_attention", "full_attention"}
    drafter = random_drafter(target)
    input_ids = prompt(9, 1)
    output, _ = speculative_generate(target, drafter, input_ids, max_new_tokens=30, draft_topk=3, tree_size=12)
    assert torch.equal(output, plain_greedy(target, input_ids, 30))


@pytest.mark.parametrize("max_new_tokens", range(1, 14))
def test_max_new_tokens_inside_a_tree_cuts_exactly(max_new_tokens):
    target, drafter = near_copy_pair("llama")
    input_ids = prompt(9, 1)
    output, stats = speculative_generate(
        target, drafter, input_ids, max_new_tokens=max_new_tokens, draft_topk=3, tree_size=12
    )
    assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens))
    assert stats.new_tokens == max_new_tokens


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eos_inside_a_tree_stops_exactly_like_plain_generate(arch):
    target, drafter = near_copy_pair(arch)
    input_ids = prompt(6, 3)
    reference = plain_greedy(target, input_ids, 40)[0, 6:].tolist()
    for stop_index in (3, 11):
        eos = reference[stop_index]
        if eos in reference[:stop_index]:
            continue
        expected = plain_greedy(target, input_ids, 40, eos_token_id=eos)
        output, _ = speculative_generate(
            target, drafter, input_ids, max_new_tokens=40, eos_token_id=eos, draft_topk=3, tree_size=12
        )
        assert torch.equal(output, expected)


def test_tree_with_a_reduced_draft_vocabulary():
    target, drafter = near_copy_pair("llama")
    reduced = random_drafter(target, hidden_size=64, draft_vocab_size=128)
    keep = torch.randperm(256, generator=torch.Generator().manual_seed(0))[:128]
    with torch.no_grad():
        reduced.load_state_dict(
            {**drafter.state_dict(), "lm_head.weight": drafter.lm_head.weight[keep], "draft_to_target": keep}
        )
    input_ids = prompt(5, 4)
    output, stats = speculative_generate(target, reduced, input_ids, max_new_tokens=30, draft_topk=3, tree_size=10)
    assert torch.equal(output, plain_greedy(target, input_ids, 30))
    assert stats.tau > 1.0  # drafts inside the kept half of the vocabulary do get accepted


def test_verified_tree_is_the_most_probable_and_the_accepted_path_is_in_it():
    target, drafter = near_copy_pair("qwen3")
    steps = []
    speculative_generate(
        target, drafter, prompt(9, 1), max_new_tokens=30, draft_topk=3, tree_size=7, on_step=steps.append
    )
    assert all(step.tree is not None for step in steps[:-1])  # the last may have room for the target's token only
    for step in filter(lambda step: step.tree is not None, steps):
        tree = step.tree
        assert tree.num_nodes <= 7 and tree.depth <= 5
        for node, parent in enumerate(tree.parents):  # parents first, and no child more probable than its parent
            assert parent < node
            if parent >= 0:
                assert tree.cumulative_log_probs[node] <= tree.cumulative_log_probs[parent]
        assert step.accepted_nodes == tree.path(step.accepted_nodes[-1]) if step.accepted_nodes else True
        assert torch.equal(step.emitted[0, : step.accepted], tree.tokens[step.accepted_nodes])


def misreport_tree_proposals(monkeypatch):
    """The failing control for trees: verification is told the top-k children were sampled (without replacement)
    from the drafter's q, as if they were random draws, so it accepts them with the wrong ratio."""

    def as_if_sampled(tree, node, earlier_siblings):
        q = tree.draft_scores[node].softmax(dim=-1).clone()
        q[tree.tokens[earlier_siblings]] = 0
        return q / q.sum()

    monkeypatch.setattr(generation_osprey.DraftTree, "proposal", as_if_sampled)


SAMPLING_PROMPT, SAMPLING_TEMPERATURE = torch.tensor([[3, 7, 5]]), 1.5


def check_second_token_distribution(target, drafter, honest: bool, what: str, **decoding) -> None:
    """Samples 3 tokens `SAMPLES` times with `speculative_generate(..., **decoding)` and checks the second one's
    distribution against the exact target distribution: it must fit when `honest`, and be caught otherwise."""
    input_ids, temperature = SAMPLING_PROMPT, SAMPLING_TEMPERATURE
    torch.manual_seed(4321)

    def generate_once():
        output, _ = speculative_generate(
            target, drafter, input_ids, max_new_tokens=3, do_sample=True, temperature=temperature, **decoding
        )
        return output[0, input_ids.shape[1] + 1]

    counts = second_token_counts(generate_once, SAMPLES, target.config.vocab_size)
    pvalue = chi_square_pvalue(counts, exact_second_token_distribution(target, input_ids, temperature))
    if honest:
        assert pvalue > 1e-3, f"{what} is biased (p={pvalue:.2e})"
    else:
        assert pvalue < 1e-6, f"the control was not caught (p={pvalue:.2e}): the test has no power"


@pytest.mark.parametrize("honest", [True, False], ids=["honest", "misreported_proposal_control"])
def test_tree_speculative_sampling_matches_the_target_distribution(sampling_pair, honest, monkeypatch):
    target, drafter = sampling_pair
    if not honest:
        misreport_tree_proposals(monkeypatch)
    check_second_token_distribution(target, drafter, honest, "tree speculative sampling", draft_topk=3, tree_size=6)


def test_bad_tree_settings_are_refused():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    with pytest.raises(ValueError, match="draft_topk must be >= 1"):
        speculative_generate(target, drafter, prompt(4, 0), max_new_tokens=5, draft_topk=0)
    with pytest.raises(ValueError, match="tree_size must be >= 1"):
        speculative_generate(target, drafter, prompt(4, 0), max_new_tokens=5, draft_topk=2, tree_size=0)
    with pytest.raises(ValueError, match="Pass one of the two"):
        speculative_generate(target, drafter, prompt(4, 0), draft_topk=2, confidence_threshold=0.3)


def test_assisted_generate_refuses_a_tree_setting():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    drafter.generation_config.draft_topk = 3
    drafter.attach_target(target)
    with pytest.raises(ValueError, match="verifies chains"):
        assisted_greedy(target, drafter, prompt(4, 0), 5)


def test_levels_that_cannot_enter_the_tree_are_not_drafted(monkeypatch):
    """Once no child of the level's best node could rank among the tree_size most probable, drafting stops: the same
    trees, fewer drafter steps."""
    target, drafter = near_copy_pair("llama")

    def run():
        steps, calls = [], []
        handle = drafter.register_forward_pre_hook(lambda module, args: calls.append(1))
        speculative_generate(
            target, drafter, prompt(9, 1), max_new_tokens=40, draft_topk=3, tree_size=4, on_step=steps.append
        )
        handle.remove()
        return [(step.tree.tokens.tolist(), step.tree.parents) for step in steps if step.tree is not None], len(calls)

    pruned_trees, pruned_calls = run()
    monkeypatch.setattr(generation_osprey, "_can_enter", lambda *args: True)
    full_trees, full_calls = run()
    assert pruned_trees == full_trees and pruned_calls < full_calls


def test_attached_hooks_the_target_inside_the_block_only_even_on_error():
    target, drafter = near_copy_pair("llama")
    input_ids = prompt(9, 1)
    with drafter.attached(target) as attached:
        assert attached is drafter and sum(len(layer._forward_hooks) for layer in target.model.layers) == 3
        assert torch.equal(assisted_greedy(target, drafter, input_ids, 20), plain_greedy(target, input_ids, 20))
    assert all(not layer._forward_hooks for layer in target.model.layers)
    with pytest.raises(RuntimeError, match="inside"), drafter.attached(target):
        raise RuntimeError("inside")
    assert all(not layer._forward_hooks for layer in target.model.layers)
    with pytest.raises(ValueError, match="attach_target"):  # detached again: the route says how to attach
        assisted_greedy(target, drafter, input_ids, 5)


# --- a prompt-lookup branch beside the drafter's -----------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_occurrence_of_the_longest_matching_ngram():
    sequence = torch.tensor([[5, 6, 7, 8, 1, 6, 9, 2, 5, 6]])
    assert generation_osprey.prompt_lookup(sequence, 3) == [7, 8, 1]  # 2-gram (5, 6) wins over the later 1-gram 6
    assert generation_osprey.prompt_lookup(sequence, 3, max_ngram_size=1) == [9, 2, 5]  # latest 6
    assert generation_osprey.prompt_lookup(torch.tensor([[1, 2, 3]]), 4) == []
    assert generation_osprey.prompt_lookup(torch.tensor([[4, 4]]), 4) == [4]  # the continuation ends at the end
    assert generation_osprey.prompt_lookup(torch.tensor([[4]]), 4) == []


def test_a_lookup_branch_merges_into_the_tree_parents_first():
    scores = torch.zeros(10)
    tree = generation_osprey.DraftTree(
        torch.tensor([3, 4, 5]), [-1, -1, 0], [1, 1, 2], [scores] * 3, [-0.1, -1.0, -0.5]
    )
    merged = generation_osprey.add_branch(tree, [3, 5, 8, 9], vocab_size=10)
    assert merged.tokens.tolist() == [3, 4, 5, 8, 9] and merged.parents == [-1, -1, 0, 2, 3]
    assert merged.depths == [1, 1, 2, 3, 4] and merged.cumulative_log_probs[3:] == [float("-inf")] * 2
    fresh = generation_osprey.add_branch(tree, [7], vocab_size=10)
    assert fresh.parents == [-1, -1, 0, -1] and fresh.children(-1) == [0, 1, 3]
    assert torch.equal(fresh.proposal(3, [0, 1]), torch.nn.functional.one_hot(torch.tensor(7), 10).float())
    assert generation_osprey.add_branch(tree, [], vocab_size=10) is tree


def repeating_prompt(target, seed: int) -> torch.LongTensor:
    """A prompt that quotes the target's own continuation of its start, then the start's last token again, as code
    and chat prompts quote themselves: prompt lookup has something right to find."""
    while True:  # `generate` would read a pad id (0) or other special in the prompt as padding: skip such seeds
        start = prompt(6, seed)
        quoted = torch.cat([start, plain_greedy(target, start, 12)[:, 6:], start[:, -1:]], dim=-1)
        if quoted.min() >= 3:
            return quoted
        seed += 100


@pytest.mark.parametrize("arch", TINY_TARGET_ARCHS)
@pytest.mark.parametrize("draft_topk", [1, 3])
def test_greedy_with_a_prompt_lookup_branch_equals_plain_generate(arch, draft_topk):
    target, _ = near_copy_pair(arch)  # its next token hangs mostly on the last one, so the quoted continuation recurs
    drafter = random_drafter(target)  # wrong nearly always: what gets accepted is mostly the lookup branch's
    steps = []
    for seed, max_new_tokens in ((0, 40), (1, 7), (2, 1)):
        input_ids = repeating_prompt(target, seed)
        output, stats = speculative_generate(
            target,
            drafter,
            input_ids,
            max_new_tokens=max_new_tokens,
            draft_topk=draft_topk,
            tree_size=4,
            prompt_lookup_num_tokens=6,
            on_step=steps.append,
        )
        assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens))
        assert stats.new_tokens == max_new_tokens
    lookup_nodes = [
        node
        for step in steps
        if step.tree is not None
        for node in step.accepted_nodes
        if step.tree.cumulative_log_probs[node] == float("-inf")
    ]
    assert lookup_nodes, "the lookup branch was never accepted: the test did not exercise it"


def test_eos_inside_a_lookup_branch_stops_exactly_like_plain_generate():
    target, _ = near_copy_pair("llama")
    drafter = random_drafter(target)
    input_ids = repeating_prompt(target, 0)
    reference = plain_greedy(target, input_ids, 30)[0, input_ids.shape[1] :].tolist()
    eos = next(token for index, token in enumerate(reference) if index > 2 and token not in reference[:index])
    output, _ = speculative_generate(
        target, drafter, input_ids, max_new_tokens=30, eos_token_id=eos, prompt_lookup_num_tokens=8
    )
    assert torch.equal(output, plain_greedy(target, input_ids, 30, eos_token_id=eos))


def test_prompt_lookup_settings_are_checked():
    target = make_tiny_target("llama")
    drafter = random_drafter(target)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be >= 0"):
        speculative_generate(target, drafter, prompt(4, 0), max_new_tokens=5, prompt_lookup_num_tokens=-1)
    with pytest.raises(ValueError, match="Pass one of the two"):
        speculative_generate(target, drafter, prompt(4, 0), prompt_lookup_num_tokens=4, confidence_threshold=0.3)


def misreport_lookup_proposals(monkeypatch):
    """The failing control for the lookup branch: verification is told its tokens were drawn from a flat q, so it
    accepts them far too often."""
    honest = generation_osprey.DraftTree.proposal

    def flat_for_lookup(tree, node, earlier_siblings):
        if tree.cumulative_log_probs[node] == float("-inf"):
            return torch.full_like(tree.draft_scores[node], 1 / tree.draft_scores[node].shape[-1])
        return honest(tree, node, earlier_siblings)

    monkeypatch.setattr(generation_osprey.DraftTree, "proposal", flat_for_lookup)


@pytest.mark.parametrize(
    "draft_topk, honest", [(1, True), (3, True), (3, False)], ids=["chain", "tree", "misreported_lookup_control"]
)
def test_sampling_with_a_prompt_lookup_branch_matches_the_target_distribution(
    sampling_pair, draft_topk, honest, monkeypatch
):
    target, drafter = sampling_pair
    exact = exact_second_token_distribution(target, SAMPLING_PROMPT, SAMPLING_TEMPERATURE)
    # The branch every step gets: the second token's likeliest value, then another (lookup's own matches are rare
    # in a 3-token prompt; what is under test is how verification treats the branch).
    branch = [int(exact.argmax()), int(exact.argsort()[-2])]
    monkeypatch.setattr(decoding_osprey, "prompt_lookup", lambda sequence, num_tokens: branch[:num_tokens])
    if not honest:
        misreport_lookup_proposals(monkeypatch)
    check_second_token_distribution(
        target,
        drafter,
        honest,
        "sampling with a lookup branch",
        draft_topk=draft_topk,
        tree_size=4,
        prompt_lookup_num_tokens=2,
    )
