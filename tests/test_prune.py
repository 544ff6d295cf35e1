"""Stage 1 pruning on tiny random models of every supported family: exact truncation, block-influence ranking, and a
pruned checkpoint that reloads and generates with a KV cache like any transformers model."""

import argparse
import copy

import pytest
import torch
from test_vocab_alignment import byte_level_tokenizer
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from osprey.stages import prune as prune_module
from osprey.stages.prune import block_influence, perplexity, prune

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
TEXT = "hello world, the wonder of the world is hello again.\n" * 4


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def tiny(tiny_target_factory, family, **overrides):
    return tiny_target_factory(family, vocab_size=len(byte_level_tokenizer()), num_hidden_layers=6, **overrides)


def input_ids(batch_size=2, seq_len=10, vocab_size=256, seed=0):
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_first_keeps_the_first_blocks_exactly(tiny_target_factory, family):
    model = tiny(tiny_target_factory, family)
    pruned = prune(model, 2)
    truncated = copy.deepcopy(model)
    truncated.model.layers = truncated.model.layers[:2]
    truncated.config.num_hidden_layers = 2
    if getattr(truncated.config, "layer_types", None):
        truncated.config.layer_types = truncated.config.layer_types[:2]
    ids = input_ids()
    torch.testing.assert_close(pruned(ids).logits, truncated(ids).logits, rtol=0, atol=0)
    assert model.config.num_hidden_layers == 6 and len(model.model.layers) == 6, "the input model is left untouched"
    assert pruned.config.osprey_pruning == {"strategy": "first", "source_num_hidden_layers": 6, "kept_layers": [0, 1]}


@torch.no_grad()
def test_block_influence_is_one_minus_the_input_output_cosine(tiny_target_factory):
    model = tiny(tiny_target_factory, "llama")
    tokenizer = byte_level_tokenizer()
    scores = block_influence(model, tokenizer, [TEXT])
    hidden = model(tokenizer(TEXT, return_tensors="pt")["input_ids"], output_hidden_states=True).hidden_states
    # hidden_states[i] feeds block i; the last entry is normed, so the last block is checked by its ranking below.
    for index in range(5):
        expected = 1 - torch.nn.functional.cosine_similarity(hidden[index], hidden[index + 1], dim=-1).mean()
        assert scores[index] == pytest.approx(expected.item(), abs=1e-5)


@torch.no_grad()
def test_block_influence_drops_an_identity_block_first(tiny_target_factory, family):
    model = tiny(tiny_target_factory, family)
    identity = model.model.layers[3]
    for projection in (identity.self_attn.o_proj, identity.mlp.down_proj):
        projection.weight.zero_()  # the block adds nothing to its residual stream (Gemma3's sandwich norms keep 0)
    tokenizer = byte_level_tokenizer()
    pruned = prune(model, 5, "block-influence", calibration_texts=[TEXT], tokenizer=tokenizer)
    assert pruned.config.osprey_pruning["block_influence"][3] == pytest.approx(0, abs=1e-6)
    assert pruned.config.osprey_pruning["kept_layers"] == [0, 1, 2, 4, 5]
    if family != "llama":
        assert pruned.config.layer_types == [model.config.layer_types[i] for i in (0, 1, 2, 4, 5)]
    ids = input_ids(vocab_size=len(tokenizer))
    torch.testing.assert_close(pruned(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_pruned_checkpoint_reloads_and_generates_with_a_kv_cache(tiny_target_factory, family, tmp_path):
    # Keep non-adjacent blocks so that renumbering matters: Gemma3's 6th block (index 5) is its full-attention one.
    model = tiny(tiny_target_factory, family)
    model.model.layers[2].self_attn.o_proj.weight.data.zero_()
    model.model.layers[2].mlp.down_proj.weight.data.zero_()
    pruned = prune(model, 5, "block-influence", calibration_texts=[TEXT], tokenizer=byte_level_tokenizer())
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model) and reloaded.config.num_hidden_layers == 5
    assert [layer.self_attn.layer_idx for layer in reloaded.model.layers] == list(range(5))
    assert reloaded.config.osprey_pruning["kept_layers"] == [0, 1, 3, 4, 5]
    prompt = input_ids(batch_size=1, seq_len=7)
    settings = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with_cache = reloaded.generate(prompt, use_cache=True, **settings)
    without_cache = reloaded.generate(prompt, use_cache=False, **settings)
    assert torch.equal(with_cache, without_cache) and with_cache.shape[1] == 19


def test_tied_embeddings_stay_tied(tiny_target_factory):
    pruned = prune(tiny(tiny_target_factory, "llama", tie_word_embeddings=True), 2)
    assert pruned.lm_head.weight is pruned.model.embed_tokens.weight


@torch.no_grad()
def test_perplexity_is_the_exponentiated_mean_token_loss(tiny_target_factory):
    tokenizer = byte_level_tokenizer()
    model = tiny(tiny_target_factory, "llama")
    ids = tokenizer(TEXT, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected = torch.exp(model(ids, labels=ids).loss).item()
    assert perplexity(model, tokenizer, TEXT, max_length=ids.shape[1]) == pytest.approx(expected, rel=1e-5)
    # Windows restart the context, so a short window loses information and the perplexity changes.
    assert perplexity(model, tokenizer, TEXT, max_length=4) != pytest.approx(expected, rel=1e-3)
    with pytest.raises(ValueError, match="fewer than two tokens"):
        perplexity(model, tokenizer, "h")


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"num_layers": 0}, r"num_layers must be in \[1, 6\]"),
        ({"num_layers": 7}, r"num_layers must be in \[1, 6\]"),
        ({"num_layers": 2, "strategy": "random"}, "first, block-influence"),
        ({"num_layers": 2, "strategy": "block-influence"}, "calibration"),
    ],
)
def test_bad_arguments_are_refused(tiny_target_factory, arguments, message):
    with pytest.raises(ValueError, match=message):
        prune(tiny(tiny_target_factory, "llama"), **arguments)


def test_unsupported_architecture_names_the_supported_ones():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="'gpt2'.*llama, qwen2, qwen3, gemma3_text"):
        prune(gpt2, 1)


def _cli(arguments):
    parser = argparse.ArgumentParser()
    prune_module.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(["prune", *arguments])
    return args.run(args)


def test_cli_saves_model_tokenizer_and_prints_perplexities(tiny_target_factory, tmp_path, capsys):
    source = tmp_path / "source"
    tiny(tiny_target_factory, "qwen3").save_pretrained(source)
    byte_level_tokenizer().save_pretrained(source)
    (source / "LICENSE").write_text("terms that travel with derived checkpoints")
    (tmp_path / "calibration.txt").write_text(TEXT)
    output = tmp_path / "pruned"
    arguments = [
        "--backbone",
        str(source),
        "--num-layers",
        "2",
        "--output",
        str(output),
        "--strategy",
        "block-influence",
    ]
    text_file = str(tmp_path / "calibration.txt")
    calibration = ["--calibration-file", text_file, "--eval-file", text_file]
    assert _cli(arguments + calibration) == 0
    printed = capsys.readouterr().out
    assert "kept blocks [0, " in printed and "block influence: 0: " in printed and "perplexity on" in printed
    assert {"config.json", "model.safetensors", "tokenizer.json", "LICENSE"} <= {p.name for p in output.iterdir()}
    assert AutoModelForCausalLM.from_pretrained(output).config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="not an empty directory"):
        _cli(arguments + calibration)
    with pytest.raises(ValueError, match="--calibration-file"):
        _cli(arguments[:4] + ["--output", str(tmp_path / "new"), "--strategy", "block-influence"])
