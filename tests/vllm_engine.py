"""Runs vLLM for `tests/test_vllm.py`, inside vLLM's own environment (it imports nothing of osprey).

    python tests/vllm_engine.py JOB.json

The job names a target, optionally an exported drafter (`osprey export --format vllm`) and prompts as token ids. The
script generates greedily in float32 with the target's tokenizer skipped, and writes next to the job:

- `JOB.result.json`: each prompt's new token ids, vLLM's own spec-decode counters (drafts, draft tokens, accepted
  tokens, accepted per position) and the acceptance length they give;
- with `"record": true`, `JOB.first_pass.safetensors`: what the drafter saw and computed on its first forward over
  the first prompt (token ids, positions, the target's tap states before `fc`, and logits at every position), read
  with hooks on the drafter inside vLLM's worker, and how often the proposer read greedy drafts from the drafter's
  `get_top_tokens` (`top_tokens_calls`);
- `"speculative_options"`: more keys of vLLM's speculative config (those of the export's `speculative_config.json`);
- with `"controls": [NAME, ...]`, the prompts generated again once per control, each with the drafter broken on
  purpose inside vLLM's worker (`CONTROLS`; test hooks, never used in serving), in `result["controls"][NAME]`
  (outputs and the spec-decode counters of that pass alone).

The engine core and its worker run in this process, so that `collective_rpc` may ship the hooks above as plain
functions; with `"multiprocessing": true` (no `record`, no `controls`) they run in vLLM's default engine instead, a
separate engine-core process, as `vllm serve` and `LLM` run them.

Errors (e.g. a drafter that does not fit the target) propagate: the script exits non-zero with vLLM's traceback.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def install_recorder(worker) -> bool:
    """Wraps the drafter's `combine_hidden_states` and `forward` to keep its first multi-token forward."""
    import torch

    model = worker.model_runner.drafter.model
    record = {}
    combine, forward = model.combine_hidden_states, model.forward

    def combine_hidden_states(hidden_states):
        if "taps" not in record:
            record["pending_taps"] = hidden_states.detach().clone()
        return combine(hidden_states)

    def recording_forward(input_ids, positions, hidden_states, inputs_embeds=None):
        outputs = forward(input_ids, positions, hidden_states, inputs_embeds)
        if "logits" not in record and input_ids is not None and input_ids.shape[0] > 1 and "pending_taps" in record:
            record["taps"] = record.pop("pending_taps")
            record["input_ids"] = input_ids.detach().clone()
            record["positions"] = positions.detach().clone()
            with torch.no_grad():
                record["logits"] = model.compute_logits(outputs[0]).detach().clone()
        return outputs

    model.combine_hidden_states = combine_hidden_states
    model.forward = recording_forward
    if hasattr(model, "get_top_tokens"):  # counted: which way the proposer read the greedy drafts
        get_top_tokens = model.get_top_tokens
        record["top_tokens_calls"] = 0

        def counted_get_top_tokens(hidden_states):
            record["top_tokens_calls"] += 1
            return get_top_tokens(hidden_states)

        model.get_top_tokens = counted_get_top_tokens
    worker._osprey_record = record
    return True


def read_record(worker) -> dict:
    record = worker._osprey_record
    tensors = {name: record[name].cpu() for name in ("input_ids", "positions", "taps", "logits")}
    return {**tensors, "top_tokens_calls": torch_scalar(record.get("top_tokens_calls", 0))}


def torch_scalar(value: int):
    import torch

    return torch.tensor([value])


# Ways to break the drafter's later draft steps (2 to K), for a test's failing control; a draft's first step, which
# reads the target's taps, is left alone.
CONTROLS = {
    # the pre-norm state fed back from the previous draft step replaced by zeros
    "zero_fed_back_state": lambda positions, hidden_states: (positions, hidden_states.new_zeros(hidden_states.shape)),
    # each later draft step run at the position after its own (its rotary embedding off by one)
    "shift_draft_positions": lambda positions, hidden_states: (positions + 1, hidden_states),
}


def set_control(worker, control: str | None) -> bool:
    """Test hook: from now on the drafter's later draft steps run broken as `CONTROLS[control]` says (None: as
    served). A forward after `combine_hidden_states` is a draft's first step (vLLM's EAGLE-3 proposer projects the
    target's taps just before it); every other forward is a later step, fed the drafter's own previous state."""
    model = worker.model_runner.drafter.model
    if not hasattr(worker, "_osprey_control"):
        combine, forward = model.combine_hidden_states, model.forward
        state = {"first_step": False}

        def combine_hidden_states(hidden_states):
            state["first_step"] = True
            return combine(hidden_states)

        def controlled_forward(input_ids, positions, hidden_states, inputs_embeds=None):
            first_step, state["first_step"] = state["first_step"], False
            if worker._osprey_control is not None and not first_step:
                positions, hidden_states = CONTROLS[worker._osprey_control](positions, hidden_states)
            return forward(input_ids, positions, hidden_states, inputs_embeds)

        model.combine_hidden_states = combine_hidden_states
        model.forward = controlled_forward
    worker._osprey_control = control
    return True


def generate(llm, prompts, params) -> list[list[int]]:
    """Each prompt's new token ids, one prompt at a time: the first-pass record is the first prompt's, and batch
    composition cannot matter."""
    outputs = []
    for prompt in prompts:
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outputs.append(list(output.outputs[0].token_ids))
    return outputs


def main(job_path: str) -> None:
    job_path = Path(job_path)
    job = json.loads(job_path.read_text())
    if job.get("multiprocessing"):
        if job.get("record") or job.get("controls"):
            raise ValueError("`record` and `controls` hook the worker, which needs the one-process engine.")
    else:  # set before vLLM is imported
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from osprey_vllm.metrics import acceptance_length, counters_between, spec_decode_counters
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    speculative_config = None
    if job.get("drafter"):
        speculative_config = {
            "method": "eagle3",
            "model": job["drafter"],
            "num_speculative_tokens": job.get("num_speculative_tokens", 3),
            **job.get("speculative_options", {}),
        }
    llm = LLM(
        model=job["target"],
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 256),
        max_num_seqs=4,
        # On CPU: the share of the machine's memory that must be free at start (the pytest process holds some).
        gpu_memory_utilization=0.5,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    if job.get("record"):
        llm.collective_rpc(install_recorder)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    outputs = generate(llm, job["prompts"], params)
    if job.get("record"):
        (record,) = llm.collective_rpc(read_record)
        save_file({k: v.contiguous() for k, v in record.items()}, str(job_path.with_suffix(".first_pass.safetensors")))
    counters = spec_decode_counters(llm) if speculative_config else None
    result = {
        "outputs": outputs,
        "spec_decode": counters,
        "acceptance_length": acceptance_length(counters) if counters else None,
        "controls": {},
    }
    for control in job.get("controls", []):
        llm.collective_rpc(set_control, args=(control,))
        llm.reset_prefix_cache()  # nothing computed with the drafter as served is reused
        before = spec_decode_counters(llm)
        control_outputs = generate(llm, job["prompts"], params)
        result["controls"][control] = {
            "outputs": control_outputs,
            "spec_decode": counters_between(before, spec_decode_counters(llm)),
        }
    job_path.with_suffix(".result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
