"""`osprey export`: EAGLE-3 checkpoints for vLLM (`speculators` format) and SGLang.

The expectations are derived from the engines' loader code, read at (not copied from):
- vLLM: vllm-project/vllm `vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (`Eagle3LlamaForCausalLM`, its `LlamaModel` and `LlamaDecoderLayer`), and
  `vllm/transformers_utils/configs/speculators/{base,algos}.py` (speculators config -> vLLM config);
- speculators: vllm-project/speculators `src/speculators/models/eagle3/{config,core,model_definitions}.py` @ c05b95b3;
- SGLang: sgl-project/sglang `python/sglang/srt/models/llama_eagle3.py` @ 03d5a7771f6082e7737a5f19cae7d1e863087013 and
  d737979cbd17c6162f39c1953cfa72d3d23cc0d0 (`LlamaForCausalLMEagle3`), `python/sglang/srt/models/llama.py`.

The strongest check re-implements the engines' EAGLE-3 draft forward from that reading and feeds it the exported
tensors and config: it must give the drafter's logits, at step 0 and on chain steps fed back their pre-norm state.
"""

import argparse
import json
import math

import pytest
import torch
from conftest import make_tiny_target
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from osprey import OspreyConfig, OspreyForDrafting
from osprey.serving import export as export_module
from osprey.serving.export import SGLANG, SPECULATORS, VLLM, export_drafter
from osprey.serving.vllm_schedule import DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_SCHEDULE, OSPREY_SPECULATIVE_OPTIONS

TAPS = [1, 3, 6]
FUSED_SHARDS = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj"}
FUSED_SHARDS |= {".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def eagle3_drafter(num_layers=1, draft_vocab_size=40, attention_bias=False, hidden_size=32, seed=0, **overrides):
    """A random EAGLE-3-style drafter (feature residual) with perturbed norms and an unsorted reduced vocabulary."""
    values = {
        "vocab_size": 64,
        "draft_vocab_size": draft_vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 48,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5e5,
        "initializer_range": 0.2,
        "target_hidden_size": 24,
        "target_layer_ids": TAPS,
        "residual_stream": "features",
        "attention_bias": attention_bias,
    }
    values.update(overrides)
    torch.manual_seed(seed)
    drafter = OspreyForDrafting(OspreyConfig(**values))
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.copy_(
                    1 + torch.randn_like(parameter) * 0.3 if "norm" in name else torch.randn_like(parameter)
                )
        drafter.draft_to_target.copy_(torch.randperm(values["vocab_size"])[:draft_vocab_size])
    return drafter.eval()


def exported(drafter, export_format, tmp_path, **kwargs):
    output = export_drafter(drafter, export_format, tmp_path / export_format, **kwargs)
    return load_file(output / "model.safetensors"), json.loads((output / "config.json").read_text())


def layer_config(config: dict, export_format: str) -> dict:
    return config["transformer_layer_config"] if export_format == SPECULATORS else config


# --- what the engines' loaders build and how they rename checkpoint keys ------------------------------------------


def _fused(name: str) -> str:
    for shard, fused in FUSED_SHARDS.items():
        if shard in name:
            return name.replace(shard, fused)
    return name


def vllm_parameter(name: str) -> str | None:
    """Eagle3LlamaForCausalLM.load_weights: `t2d` skipped, `d2t` -> `draft_id_to_target_id`, `model.` prefixed unless
    lm_head; then LlamaModel.load_weights: `midlayer.` -> `layers.0.`, q/k/v and gate/up stacked."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    name = name if "lm_head" in name else "model." + name
    return _fused(name.replace("midlayer.", "layers.0."))


def sglang_parameter(name: str) -> str | None:
    """LlamaForCausalLMEagle3.load_weights: `d2t` becomes `hot_token_id` (d2t + arange, not a parameter), `t2d`
    skipped, q/k/v and gate/up stacked, `model.` prefixed when the bare name is not a parameter (lm_head is);
    any other name is silently ignored, so every expected parameter must be hit."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "hot_token_id"
    name = _fused(name)
    return name if name == "lm_head.weight" else "model." + name


def engine_parameter_shapes(config: dict, export_format: str) -> dict[str, tuple]:
    """The parameters the engine's EAGLE-3 model creates and loads, with their shapes."""
    layer = layer_config(config, export_format)
    hidden, inter, head_dim = layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]
    qkv_rows = (layer["num_attention_heads"] + 2 * layer["num_key_value_heads"]) * head_dim
    vocab, draft_vocab = layer["vocab_size"], config["draft_vocab_size"]
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.fc.weight": (hidden, 3 * config["target_hidden_size"]),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    if draft_vocab < vocab:
        shapes["draft_id_to_target_id" if export_format == SPECULATORS else "hot_token_id"] = (draft_vocab,)
    for index in range(layer["num_hidden_layers"]):
        prefix = "model.midlayer." if export_format == SGLANG else f"model.layers.{index}."
        shapes |= {
            prefix + "self_attn.qkv_proj.weight": (qkv_rows, 2 * hidden if index == 0 else hidden),
            prefix + "self_attn.o_proj.weight": (hidden, layer["num_attention_heads"] * head_dim),
            prefix + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
        if index == 0:  # vLLM builds a hidden_norm in every layer but reads only layer 0's
            shapes[prefix + "hidden_norm.weight"] = (hidden,)
        if layer["attention_bias"]:  # vLLM: q/k/v bias and, with it, an o_proj bias
            shapes |= {prefix + "self_attn.qkv_proj.bias": (qkv_rows,), prefix + "self_attn.o_proj.bias": (hidden,)}
    return shapes


@pytest.mark.parametrize(
    "export_format, num_layers, draft_vocab_size, attention_bias",
    [(SPECULATORS, 1, 64, False), (SPECULATORS, 2, 40, True), (SGLANG, 1, 40, False), (SGLANG, 1, 64, False)],
)
def test_exported_tensors_fill_exactly_the_engine_parameters(
    tmp_path, export_format, num_layers, draft_vocab_size, attention_bias
):
    drafter = eagle3_drafter(num_layers, draft_vocab_size, attention_bias)
    tensors, config = exported(drafter, export_format, tmp_path)
    rename = vllm_parameter if export_format == SPECULATORS else sglang_parameter
    loaded: dict[str, list[torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if (parameter := rename(name)) is not None:
            loaded.setdefault(parameter, []).append(tensor)
    shapes = {name: tuple(torch.cat(shards).shape) for name, shards in loaded.items()}  # stacked shards
    assert shapes == engine_parameter_shapes(config, export_format)
    if draft_vocab_size < 64:
        assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].sum() == draft_vocab_size
        assert tensors["d2t"].dtype == torch.int64


@pytest.mark.parametrize("export_format", [SPECULATORS, SGLANG])
def test_exported_config_is_what_the_engine_reads(tmp_path, export_format):
    drafter = eagle3_drafter()
    _, config = exported(drafter, export_format, tmp_path, verifier="Qwen/Qwen3-8B")
    layer = LlamaConfig(**layer_config(config, export_format))  # the engines build the blocks from a LlamaConfig
    assert (layer.hidden_size, layer.num_hidden_layers, layer.head_dim) == (32, 1, 8)
    assert layer.rope_parameters == {"rope_type": "default", "rope_theta": 5e5} and not layer.tie_word_embeddings
    assert (config["draft_vocab_size"], config["target_hidden_size"]) == (40, 24)
    if export_format == SPECULATORS:
        # base.py validates these keys; algos.update_eagle3 reads the rest (norm_before_residual defaults to True).
        assert config["speculators_model_type"] == "eagle3"
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
        assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
        assert config["norm_before_residual"] is False
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]  # vLLM captures the *input* of block i
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TAPS  # SGLang adds 1 itself


# --- the engines' EAGLE-3 forward, re-implemented from the loader code --------------------------------------------


def engine_eagle3_forward(tensors, config, export_format, input_ids, hidden_inputs):
    """Logits over the target vocabulary and pre-norm states of an EAGLE-3 draft model, as vLLM / SGLang compute it
    over positions 0..n-1, from the exported tensors and config alone.

    `hidden_inputs` are per position in drafter space: fc(target taps), or a previous step's pre-norm state. Layer 0:
    residual = hidden input; attention over cat(input_layernorm(embed(ids)), hidden_norm(hidden)); later layers are
    plain pre-norm Llama layers; logits = lm_head(norm(output)), scattered to target ids `arange + d2t`.
    """
    layer = layer_config(config, export_format)
    weights = {name.replace("midlayer.", "layers.0."): tensor for name, tensor in tensors.items()}
    eps, theta, head_dim = layer["rms_norm_eps"], layer["rope_parameters"]["rope_theta"], layer["head_dim"]
    num_heads, num_kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    seq_len = input_ids.shape[1]

    def rms_norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, name):
        bias = weights.get(name + ".bias")
        return x @ weights[name + ".weight"].T + (0 if bias is None else bias)

    def rope(x):  # neox style: rotate the two halves of each head
        frequencies = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.arange(seq_len).float()[:, None] * frequencies[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], -1) * sin

    def heads(y, count):
        return y.view(1, seq_len, count, head_dim).transpose(1, 2)

    def attention(x, prefix):
        query = rope(heads(linear(x, prefix + "q_proj"), num_heads))
        key = rope(heads(linear(x, prefix + "k_proj"), num_kv_heads)).repeat_interleave(num_heads // num_kv_heads, 1)
        value = heads(linear(x, prefix + "v_proj"), num_kv_heads).repeat_interleave(num_heads // num_kv_heads, 1)
        scores = query @ key.transpose(-1, -2) / math.sqrt(head_dim)
        scores = scores.masked_fill(~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), float("-inf"))
        mixed = (scores.softmax(-1) @ value).transpose(1, 2).reshape(1, seq_len, -1)
        return linear(mixed, prefix + "o_proj")

    embeds = weights["embed_tokens.weight"][input_ids]
    hidden, residual = hidden_inputs, None
    for index in range(layer["num_hidden_layers"]):
        prefix = f"layers.{index}."
        if index == 0:
            residual = hidden  # norm_before_residual = false
            x = torch.cat(
                [
                    rms_norm(embeds, weights[prefix + "input_layernorm.weight"]),
                    rms_norm(hidden, weights[prefix + "hidden_norm.weight"]),
                ],
                -1,
            )
        else:
            residual = hidden + residual
            x = rms_norm(residual, weights[prefix + "input_layernorm.weight"])
        residual = attention(x, prefix + "self_attn.") + residual
        x = rms_norm(residual, weights[prefix + "post_attention_layernorm.weight"])
        gate, up = linear(x, prefix + "mlp.gate_proj"), linear(x, prefix + "mlp.up_proj")
        hidden = linear(torch.nn.functional.silu(gate) * up, prefix + "mlp.down_proj")
    prenorm = hidden + residual
    draft_logits = rms_norm(prenorm, weights["norm.weight"]) @ weights["lm_head.weight"].T
    offsets = weights.get("d2t", torch.zeros(draft_logits.shape[-1], dtype=torch.long))
    logits = draft_logits.new_full((*draft_logits.shape[:-1], layer["vocab_size"]), float("-inf"))
    logits[..., torch.arange(len(offsets)) + offsets] = draft_logits
    return logits, prenorm


def in_target_vocabulary(drafter, draft_logits):
    logits = draft_logits.new_full((*draft_logits.shape[:-1], drafter.config.vocab_size), float("-inf"))
    logits[..., drafter.draft_to_target] = draft_logits
    return logits


@torch.no_grad()
@pytest.mark.parametrize(
    "export_format, num_layers, draft_vocab_size, attention_bias",
    [(SPECULATORS, 1, 64, False), (SPECULATORS, 2, 40, True), (SGLANG, 1, 40, False)],
)
def test_engine_forward_on_the_export_reproduces_the_drafter(
    tmp_path, export_format, num_layers, draft_vocab_size, attention_bias
):
    drafter = eagle3_drafter(num_layers, draft_vocab_size, attention_bias)
    tensors, config = exported(drafter, export_format, tmp_path)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (1, 9), generator=generator)
    taps = torch.randn(1, 7, 3 * 24, generator=generator)
    # The drafter: prefill over the target's taps, then two chain steps fed back their own pre-norm state.
    prefill = drafter(tokens[:, :7], target_hidden_states=taps, use_cache=True)
    step1 = drafter(tokens[:, 7:8], draft_hidden_states=prefill.prenorm_hidden_states[:, -1:], cache=prefill.cache)
    step2 = drafter(tokens[:, 8:9], draft_hidden_states=step1.prenorm_hidden_states, cache=step1.cache)
    # The engine: the same positions, each with its hidden input (fc of the taps, then the fed-back states).
    fused = taps @ tensors["fc.weight"].T
    logits, prenorm = engine_eagle3_forward(tensors, config, export_format, tokens[:, :7], fused)
    torch.testing.assert_close(logits, in_target_vocabulary(drafter, prefill.logits))
    hidden_inputs = torch.cat([fused, prenorm[:, -1:]], dim=1)
    logits, prenorm = engine_eagle3_forward(tensors, config, export_format, tokens[:, :8], hidden_inputs)
    torch.testing.assert_close(logits[:, -1:], in_target_vocabulary(drafter, step1.logits))
    hidden_inputs = torch.cat([hidden_inputs, prenorm[:, -1:]], dim=1)
    logits, _ = engine_eagle3_forward(tensors, config, export_format, tokens, hidden_inputs)
    torch.testing.assert_close(logits[:, -1:], in_target_vocabulary(drafter, step2.logits))


# --- what cannot be exported --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "export_format, overrides, message",
    [
        (
            SPECULATORS,
            {"residual_stream": "tokens", "num_layers": 2},
            r"residual_stream='tokens'.*--format vllm.*docs/serving.md",
        ),
        (SGLANG, {"residual_stream": "tokens"}, r"residual_stream='tokens'"),
        (SPECULATORS, {"use_qk_norm": True}, "q/k norm"),
        (VLLM, {"residual_stream": "tokens", "use_qk_norm": True}, "q/k norm"),
        (VLLM, {"residual_stream": "tokens", "hidden_act": "gelu"}, "only silu"),
        (SPECULATORS, {"target_layer_ids": [1, 2, 4, 6]}, "4 target taps"),
        (SPECULATORS, {"hidden_act": "gelu"}, "only silu"),
        (SGLANG, {"num_layers": 2}, "2 decoder blocks.*--format speculators"),
        (SGLANG, {"attention_bias": True}, "without bias"),
        (SGLANG, {"hidden_size": 24}, "pass --target"),  # as wide as the target: the engine may swap in its embedding
        (SPECULATORS, {"hidden_size": 24}, "pass --target"),
    ],
)
def test_drafters_an_engine_would_compute_differently_are_refused(tmp_path, export_format, overrides, message):
    drafter = eagle3_drafter(**overrides)
    with pytest.raises(ValueError, match=message):
        export_drafter(drafter, export_format, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("export_format", [SPECULATORS, SGLANG])
def test_export_of_a_target_wide_drafter_checks_the_shared_embedding(tmp_path, export_format):
    drafter = eagle3_drafter(hidden_size=24)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    save_file(
        {"model.embed_tokens.weight": drafter.model.embed_tokens.weight.detach().clone()},
        target_dir / "model.safetensors",
    )
    LlamaConfig(
        vocab_size=64, hidden_size=24, num_attention_heads=4, architectures=["LlamaForCausalLM"]
    ).save_pretrained(target_dir)
    tensors, config = exported(drafter, export_format, tmp_path, target=target_dir)
    assert torch.equal(tensors["embed_tokens.weight"], drafter.model.embed_tokens.weight)
    if export_format == SPECULATORS:
        assert config["speculators_config"]["verifier"] == {
            "name_or_path": str(target_dir),
            "architectures": ["LlamaForCausalLM"],
        }
    with torch.no_grad():
        drafter.model.embed_tokens.weight.add_(1.0)
    with pytest.raises(ValueError, match="they differ"):
        export_drafter(drafter, export_format, tmp_path / "different", target=target_dir)


def test_vllm_exports_a_drafter_as_wide_as_the_target_with_its_own_embedding(tmp_path):
    """A drafter as wide as its target whose embedding is not the target's (kept from its own backbone, or trained
    while distilling) exports as `vllm` with its own embedding, which the plugin keeps (vLLM itself, in
    test_vllm.py); `speculators` and `sglang-eagle3`, whose engines may swap in the target's, refuse the same drafter
    and say why. An EAGLE-3-style drafter, which every format otherwise takes, isolates the embedding as the reason."""
    target = make_tiny_target("qwen2")  # 64 wide, 256 tokens, 8 blocks
    target.save_pretrained(tmp_path / "target")
    wide = {"hidden_size": 64, "target_hidden_size": 64, "vocab_size": 256}
    drafter = eagle3_drafter(**wide)
    assert not torch.equal(drafter.model.embed_tokens.weight, target.model.embed_tokens.weight)
    for export_format in (SPECULATORS, SGLANG):
        with pytest.raises(ValueError, match=r"equally wide\), and they differ; keep the target's embedding frozen"):
            export_drafter(drafter, export_format, tmp_path / export_format, target=tmp_path / "target")
        assert not (tmp_path / export_format).exists()
    tensors, config = exported(drafter, VLLM, tmp_path, target=tmp_path / "target")
    assert torch.equal(tensors["embed_tokens.weight"], drafter.model.embed_tokens.weight)
    assert config["hidden_size"] == config["target_hidden_size"] == target.config.hidden_size
    # Osprey's own drafters (token residual, several blocks), with or without --target.
    osprey_drafter = eagle3_drafter(num_layers=2, residual_stream="tokens", seed=1, **wide)
    for name, target_dir in (("with-target", tmp_path / "target"), ("without-target", None)):
        output = export_drafter(osprey_drafter, VLLM, tmp_path / name, target=target_dir)
        embedding = load_file(output / "model.safetensors")["embed_tokens.weight"]
        assert torch.equal(embedding, osprey_drafter.model.embed_tokens.weight)


def test_cli_exports_a_saved_drafter_with_its_license(tmp_path, capsys):
    drafter_dir = tmp_path / "drafter"
    eagle3_drafter().save_pretrained(drafter_dir)
    (drafter_dir / "alignment_report.json").write_text(json.dumps({"target": "Qwen/Qwen3-8B"}))
    (drafter_dir / "LICENSE").write_text("terms")
    parser = argparse.ArgumentParser()
    export_module.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(
        ["export", "--drafter", str(drafter_dir), "--format", "speculators", "--output", str(tmp_path / "out")]
    )
    assert args.run(args) == 0 and "exported" in capsys.readouterr().out
    assert {path.name for path in (tmp_path / "out").iterdir()} == {"config.json", "model.safetensors", "LICENSE"}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    with pytest.raises(ValueError, match="not an empty directory"):
        args.run(args)


@pytest.mark.parametrize("residual_stream", ["tokens", "features"])
def test_vllm_format_takes_osprey_drafters_with_the_plugins_architecture(tmp_path, residual_stream):
    """`--format vllm` (the osprey-vllm plugin, tested against vLLM itself in test_vllm.py) takes both residuals; the
    tensors are the speculators format's, the config names the plugin's architecture and the residual."""
    drafter = eagle3_drafter(num_layers=2, attention_bias=True, residual_stream=residual_stream)
    tensors, config = exported(drafter, VLLM, tmp_path)
    speculators_tensors, _ = exported(drafter, SPECULATORS, tmp_path) if residual_stream == "features" else (None, None)
    assert config["architectures"] == ["Eagle3OspreyForCausalLM"] and config["model_type"] == "llama"
    assert config["residual_stream"] == residual_stream and config["osprey_format_version"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [layer_id + 1 for layer_id in TAPS]
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 40
    if speculators_tensors is not None:
        assert tensors.keys() == speculators_tensors.keys()
        assert all(torch.equal(tensors[name], speculators_tensors[name]) for name in tensors)


def test_vllm_export_writes_its_speculative_config_and_the_serve_line(tmp_path, capsys):
    """`--format vllm` writes vLLM's speculative config beside the weights (the shipped draft length per batch size,
    or an `osprey tune` output's), and prints the line that serves it."""
    drafter_dir = tmp_path / "drafter"
    eagle3_drafter(residual_stream="tokens").save_pretrained(drafter_dir)
    (drafter_dir / "alignment_report.json").write_text(json.dumps({"target": "Qwen/Qwen3-8B"}))
    parser = argparse.ArgumentParser()
    export_module.add_subcommand(parser.add_subparsers())
    args = parser.parse_args(
        ["export", "--drafter", str(drafter_dir), "--format", "vllm", "--output", str(tmp_path / "a")]
    )
    assert args.run(args) == 0
    out = capsys.readouterr().out
    served = json.loads((tmp_path / "a" / "speculative_config.json").read_text())
    assert served == {
        "method": "eagle3",
        "model": str((tmp_path / "a").resolve()),
        "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
        "num_speculative_tokens_per_batch_size": DEFAULT_SCHEDULE,
        **OSPREY_SPECULATIVE_OPTIONS,  # greedy drafts read off the drafter's own vocabulary (`get_top_tokens`)
    }
    assert f'--model Qwen/Qwen3-8B --speculative-config "$(cat {tmp_path / "a" / "speculative_config.json"})"' in out
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "speculative_config.json").write_text(
        json.dumps({**served, "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 9, 4]]})
    )
    export_drafter(drafter_dir, VLLM, tmp_path / "b", schedule=tuned)
    served = json.loads((tmp_path / "b" / "speculative_config.json").read_text())
    assert served["num_speculative_tokens"] == 4 and served["num_speculative_tokens_per_batch_size"] == [[1, 9, 4]]
    assert served["model"] == str((tmp_path / "b").resolve())
    with pytest.raises(ValueError, match="--format vllm"):
        export_drafter(drafter_dir, SPECULATORS, tmp_path / "c", schedule=tuned)
    with pytest.raises(ValueError, match="osprey tune"):
        export_drafter(drafter_dir, VLLM, tmp_path / "d", schedule=tmp_path / "missing")


def save_target_config(directory, num_layers):
    """A target directory for `--target`: its config, and a stand-in weights file (the export reads the config)."""
    LlamaConfig(
        vocab_size=64,
        hidden_size=24,
        num_attention_heads=4,
        num_hidden_layers=num_layers,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(directory)
    save_file({"model.embed_tokens.weight": torch.zeros(64, 24)}, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize("export_format", [VLLM, SPECULATORS, SGLANG])
def test_a_tap_on_the_targets_last_block_is_exported_only_where_the_engine_collects_it(tmp_path, export_format):
    """vLLM collects the last block's output (aux id L, after block L - 1 has run), SGLang collects each tap at the
    next block's input, so for a 7-block target tap 6 goes to vLLM and is refused for SGLang, naming the fix; a tap
    beyond the target is refused for every format."""
    drafter = eagle3_drafter()  # TAPS: 1, 3, 6
    last_block_is_tapped = save_target_config(tmp_path / "target-7", 7)
    if export_format == SGLANG:
        with pytest.raises(ValueError, match=r"taps block 6, the last of the target's 7 blocks.*--format speculators"):
            export_drafter(drafter, export_format, tmp_path / "out", target=last_block_is_tapped)
        assert not (tmp_path / "out").exists()
        _, config = exported(drafter, export_format, tmp_path, target=save_target_config(tmp_path / "target-8", 8))
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TAPS
    else:
        _, config = exported(drafter, export_format, tmp_path, target=last_block_is_tapped)
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]  # 7: the output of block 6, the last
    with pytest.raises(ValueError, match=r"6 layers \(the drafter taps \[1, 3, 6\]\)"):
        export_drafter(drafter, export_format, tmp_path / "short", target=save_target_config(tmp_path / "target-6", 6))
