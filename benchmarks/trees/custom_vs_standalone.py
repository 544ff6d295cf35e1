"""A/B timing of the `custom` route (`target.generate(custom_generate=DRAFTER_DIR)`) against the standalone loop
(`speculative_generate`) on one prompt, alternating the two so that load changes on a shared machine hit both alike;
also times `load_custom_generate`, the per-call cost the custom route adds.

    python benchmarks/trees/custom_vs_standalone.py --drafter DIR  # DIR: a saved drafter (with custom_generate/)
"""

import argparse
import statistics
import time

import torch

from osprey.decoding.decode import encode_prompt, speculative_generate
from osprey.models.pack import load_drafter
from osprey.models.zoo import load_causal_lm, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    target, tokenizer = load_causal_lm(args.target, dtype=torch.float32).eval(), load_tokenizer(args.target)
    drafter = load_drafter(args.drafter)
    input_ids = encode_prompt(tokenizer, args.prompt)
    start = time.perf_counter()
    target.load_custom_generate(args.drafter, trust_remote_code=True)
    print(f"load_custom_generate: {time.perf_counter() - start:.3f} s")
    seconds = {"standalone": [], "custom": []}
    for _ in range(args.repeats):
        for route in seconds:
            start = time.perf_counter()
            if route == "standalone":
                eos = target.generation_config.eos_token_id
                speculative_generate(target, drafter, input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            else:
                target.generate(
                    input_ids,
                    assistant_model=drafter,
                    custom_generate=args.drafter,
                    trust_remote_code=True,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                )
            seconds[route].append(time.perf_counter() - start)
    for route, times in seconds.items():
        print(route, [round(t, 3) for t in times], f"mean {statistics.mean(times):.3f} s")
    print(
        f"custom / standalone time: {statistics.mean(seconds['custom']) / statistics.mean(seconds['standalone']):.3f}"
    )


if __name__ == "__main__":
    main()
