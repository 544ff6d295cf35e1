"""Drives the plugin's drafter as vLLM's V2 model runner does, for `tests/test_vllm.py`, inside vLLM's own environment
(it imports nothing of osprey).

    python tests/vllm_v2_calls.py JOB.safetensors TARGET DRAFTER OUT.safetensors

V2 (`vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`, the runner of vLLM on GPUs) needs Triton for
its input kernels, which vLLM's CPU build does not ship, so on CPUs vLLM runs the V1 proposer instead. This script
makes the model calls of V2's EAGLE-3 speculator without its kernels: it builds the drafter as V2's
`load_eagle_model` does (`get_model` with the draft model config, weights from the export), then

- first step (`propose`, `_prefill`): `combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))`, then
  `model(input_ids=, positions=, hidden_states=, inputs_embeds=None)` (keywords, as `_run_model` passes them), which
  returns `(last_hidden_states, hidden_states)`, and `compute_logits` of the first;
- later steps (`_decode`): the greedy draft token at the next position, fed the second output (the pre-norm state) of
  the previous step's last position, then `compute_logits` again.

vLLM's paged attention reads block tables and slot mappings that only an engine's KV-cache manager builds, so each
attention layer (vLLM's `Attention`, called as `attn(q, k, v)`) is replaced by a dense causal attention over
the keys and values the layer has seen: the test checks the calls and everything around attention, and the engine
tests check vLLM's attention kernels. JOB holds `input_ids`, `positions` and the taps `aux_0`, `aux_1`, ... of the
first step; OUT gets each step's logits (`logits_1`, ...: every position on the first step) and draft token.
"""

import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

NUM_STEPS = 3


def dense_causal_attention(attention):
    """A stand-in for `attention.forward(q, k, v)`: appends k and v to the layer's own cache, attends causally."""
    import torch

    cache = {"key": None, "value": None}
    heads, kv_heads, head_size = attention.num_heads, attention.num_kv_heads, attention.head_size

    def forward(query, key, value, *args, **kwargs):
        n = query.shape[0]
        query = query.view(n, heads, head_size).transpose(0, 1)
        key = key.view(n, kv_heads, head_size).transpose(0, 1)
        value = value.view(n, kv_heads, head_size).transpose(0, 1)
        if cache["key"] is not None:
            key, value = torch.cat([cache["key"], key], dim=1), torch.cat([cache["value"], value], dim=1)
        cache["key"], cache["value"] = key, value
        past = key.shape[1] - n
        mask = torch.ones(n, key.shape[1], dtype=torch.bool).tril(diagonal=past)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=attention.impl.scale, enable_gqa=heads != kv_heads
        )
        return output.transpose(0, 1).reshape(n, heads * head_size)

    return forward


def main(job_path: str, target: str, drafter: str, out_path: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does: the loader empties an accelerator's cache
    load_general_plugins()  # the plugin registers Eagle3OspreyForCausalLM, as in every engine process
    vllm_config = EngineArgs(
        model=target,
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": NUM_STEPS},
    ).create_engine_config()
    job = load_file(job_path)
    aux_hidden_states = [job[f"aux_{i}"] for i in range(sum(name.startswith("aux_") for name in job))]
    with set_current_vllm_config(vllm_config), torch.inference_mode():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{out_path}.dist", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=vllm_config, model_config=vllm_config.speculative_config.draft_model_config)
        model.eval()
        attentions = [module for module in model.modules() if isinstance(module, Attention)]
        assert attentions, "no vLLM attention layer in the drafter"
        for attention in attentions:
            attention.forward = dense_causal_attention(attention)

        def run_model(input_ids, positions, hidden_states):
            with set_forward_context(None, vllm_config, num_tokens=input_ids.shape[0]):
                return model(input_ids=input_ids, positions=positions, hidden_states=hidden_states, inputs_embeds=None)

        out = {}
        # The first step: the target's taps through fc, the shifted token ids at the target's positions.
        hidden_states = model.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        input_ids, positions = job["input_ids"].long(), job["positions"].long()
        for step in range(1, NUM_STEPS + 1):
            last_hidden_states, hidden_states = run_model(input_ids, positions, hidden_states)
            logits = model.compute_logits(last_hidden_states)
            out[f"logits_{step}"] = logits.clone()
            # The next step: the greedy draft at the next position, fed the last position's pre-norm state.
            token = logits[-1:].argmax(dim=-1)
            out[f"token_{step}"] = token.clone()
            input_ids, positions, hidden_states = token, positions[-1:] + 1, hidden_states[-1:]
    save_file({name: tensor.contiguous() for name, tensor in out.items()}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:5])
