"""The Python half of `vllm_v2_smoke.sh` (see benchmarks/gpu/README.md), run with osprey's Python:

    python benchmarks/gpu/vllm_v2_smoke.py prepare OUT   # tiny target, exported drafter, engine jobs
    python benchmarks/gpu/vllm_v2_smoke.py check OUT     # after tests/vllm_engine.py ran both jobs

`prepare` saves a tiny Qwen2 target whose blocks add nothing (its next token is a function of the current token) and
exports a drafter that copies it (tests/test_vllm.py's `copying_drafter`: Osprey's token residual, the target's
embedding, final norm and head), then writes two jobs for tests/vllm_engine.py: the target alone, and with the
drafter, both in vLLM's default multi-process engine. `check` asserts that vLLM with the drafter generates, greedily,
what vLLM alone and transformers generate, and that its drafts are accepted (mean acceptance length above 1.5, of
at most 1 + K): the plugin's drafter runs in the engine, drafts what Osprey drafts, and the output stays lossless.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_vllm import MAX_TOKENS, NUM_SPECULATIVE_TOKENS, PROMPTS, copying_drafter, export, save_target  # noqa: E402

MIN_ACCEPTANCE_LENGTH = 1.5


def prepare(out: Path) -> None:
    target = save_target("qwen2", out / "target", zero_block_outputs=True)
    exported = export(copying_drafter(target), out, out / "target")
    job = {
        "target": str(out / "target"),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "multiprocessing": True,
    }
    (out / "alone.json").write_text(json.dumps(job))
    (out / "osprey.json").write_text(json.dumps(job | {"drafter": str(exported)}))


@torch.no_grad()
def check(out: Path) -> None:
    from transformers import AutoModelForCausalLM

    alone = json.loads((out / "alone.result.json").read_text())
    served = json.loads((out / "osprey.result.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        generated = target.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(generated[0, len(prompt) :].tolist())
    report = {
        "outputs_equal_vllm_alone": served["outputs"] == alone["outputs"],
        "outputs_equal_transformers": served["outputs"] == expected,
        "spec_decode": served["spec_decode"],
        "acceptance_length": served["acceptance_length"],
    }
    print(json.dumps(report, indent=1))
    (out / "smoke.json").write_text(json.dumps(report, indent=1))
    assert report["outputs_equal_vllm_alone"], "vLLM with the drafter generated other tokens than vLLM alone"
    assert report["outputs_equal_transformers"], "vLLM generated other tokens than transformers' greedy generate"
    assert served["spec_decode"]["num_drafts"] > 0, "vLLM ran no speculative step"
    assert (served["acceptance_length"] or 0) > MIN_ACCEPTANCE_LENGTH, "the drafter's drafts were rarely accepted"
    print("vLLM V2 smoke: OK")


if __name__ == "__main__":
    command, out = sys.argv[1], Path(sys.argv[2])
    {"prepare": prepare, "check": check}[command](out)
