"""Stage 5, decode: speculative decoding with per-request statistics, and `osprey decode`.

The loop itself is `modeling_osprey.decoding_osprey.decode` (remote code, also run by a saved drafter's
`custom_generate`); this module wraps it with what benchmarks, the demo and the Space read: how many drafts were
accepted at every verification step, the mean acceptance length τ, tokens/s. `target.generate(ids,
assistant_model=drafter)` is transformers' route, chains only (transformers verifies chains).
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from modeling_osprey.decoding_osprey import CPU_DRAFT_TOPK, CPU_TREE_SIZE, DecodingStep, decode
from modeling_osprey.generation_osprey import DRAFTING_SETTINGS

from ..models.pack import DRAFTER_QUANTIZATIONS


@dataclass
class SpeculativeStats:
    """What one request's decoding did.

    Attributes:
        new_tokens: tokens generated, the prefill's included.
        accepted_per_step: draft tokens the target accepted at each verification step.
        drafted_per_step: the longest draft path offered at each verification step (chain length, tree depth).
        verified_per_step: draft tokens the target verified at each step (the chain's, or the tree's nodes).
        wall_time_s: seconds spent in the loop, prefill included.
    """

    new_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0

    def add_step(self, step: DecodingStep) -> None:
        """Counts one verification step of the loop."""
        self.new_tokens += step.emitted.shape[1]
        self.accepted_per_step.append(step.accepted)
        self.drafted_per_step.append(step.drafted)
        self.verified_per_step.append(step.drafted if step.tree is None else step.tree.num_nodes)

    @property
    def verify_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per verification step, the target's own (bonus) token counted."""
        return sum(accepted + 1 for accepted in self.accepted_per_step) / max(self.verify_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    def position_acceptance_rates(self) -> list[float]:
        """For draft position k (0-based): the fraction of steps that drafted a k-th token where it was accepted."""
        longest = max(self.drafted_per_step, default=0)
        rates = []
        for position in range(longest):
            reached = sum(1 for drafted in self.drafted_per_step if drafted > position)
            accepted = sum(1 for accepted in self.accepted_per_step if accepted > position)
            rates.append(accepted / reached)
        return rates

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "verify_steps": self.verify_steps,
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "wall_time_s": self.wall_time_s,
            "position_acceptance_rates": self.position_acceptance_rates(),
            "accepted_per_step": self.accepted_per_step,
        }


def sampling_processors(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """transformers' warpers for sampling, applied identically to target and drafter scores."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    return processors


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 128,
    num_draft_tokens: int = DRAFTING_SETTINGS["num_draft_tokens"],
    draft_topk: int = DRAFTING_SETTINGS["draft_topk"],
    tree_size: int | None = DRAFTING_SETTINGS["tree_size"],
    confidence_threshold: float = DRAFTING_SETTINGS["confidence_threshold"],
    prompt_lookup_num_tokens: int = DRAFTING_SETTINGS["prompt_lookup_num_tokens"],
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[torch.LongTensor, int | None], None] | None = None,
    on_step: Callable[[DecodingStep], None] | None = None,
) -> tuple[torch.LongTensor, SpeculativeStats]:
    """Generates up to `max_new_tokens` after `input_ids` (batch 1) with `drafter` proposing chains of
    `num_draft_tokens` (or, with `draft_topk > 1`, trees of that depth and `tree_size` nodes) and `target` verifying
    them; returns the full sequence and the request's statistics. A chain stops early after a draft the drafter gave a
    probability below `confidence_threshold` (0: full chains). With `prompt_lookup_num_tokens = K > 0` every draft also
    holds a prompt-lookup branch of up to K tokens, verified in the same forward. The loop is
    `modeling_osprey.decoding_osprey.decode`.

    `on_tokens(tokens, accepted)` streams the output as it is decided, for demos: it is called with the prefill's
    token (`accepted=None`), then once per verification step with the tokens that step emitted, `tokens[:, :accepted]`
    being accepted drafts and any token after them the target's own (correction or bonus; absent when the step's
    output was cut at eos or `max_new_tokens`). `on_step(step)` sees each verification step whole, the verified tree
    included.
    """
    stats, start_time = SpeculativeStats(), time.perf_counter()

    def record(step: DecodingStep | None, sequence: torch.LongTensor) -> None:
        if step is None:
            stats.new_tokens = 1
            if on_tokens is not None:
                on_tokens(sequence[:, -1:], None)
            return
        stats.add_step(step)
        if on_tokens is not None:
            on_tokens(step.emitted, step.accepted)
        if on_step is not None:
            on_step(step)

    processors = sampling_processors(temperature, top_k, top_p) if do_sample else LogitsProcessorList()
    sequence = decode(
        target,
        drafter,
        input_ids,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        draft_topk=draft_topk,
        tree_size=tree_size,
        confidence_threshold=confidence_threshold,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        logits_processor=processors,
        do_sample=do_sample,
        eos_token_id=eos_token_id,
        generator=generator,
        on_step=record,
    )
    stats.wall_time_s = time.perf_counter() - start_time
    return sequence, stats


# Every logits filter a target's `generation_config` may switch on, off: `speculative_generate` applies none of them,
# so `target_generate` must not either (a repetition penalty or top-k from the target's config would change its output).
FILTERS_OFF = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "num_beams": 1,
    "guidance_scale": None,
}


def target_generate(
    target,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    **generate_kwargs,
) -> torch.LongTensor:
    """`target.generate` decoding exactly what `speculative_generate` decodes with the same arguments: greedy, or
    sampling with only `temperature`, `top_k` and `top_p` (every other filter of the target's generation config is
    off), up to `max_new_tokens` and stopping at `eos_token_id`. The one target-alone baseline of `osprey decode
    --compare`, `osprey bench` and the Space; `generate_kwargs` add an assistant (SpS), prompt lookup (PLD), a
    streamer or `min_new_tokens`. Sampling draws from torch's global generator: seed it first."""
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}
    # Batch 1 has no padding; a pad id the model can generate would only get masked by transformers' heuristics.
    pad_token_id = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    return target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **FILTERS_OFF | sampling | generate_kwargs,
    )


def encode_prompt(tokenizer, text: str, chat_template: bool = True) -> torch.LongTensor:
    """`text` as the user turn of the tokenizer's chat template, ready for generation (raw: `chat_template=False`)."""
    if not chat_template:
        return tokenizer(text, return_tensors="pt")["input_ids"]
    if tokenizer.chat_template is None:
        raise ValueError("The target's tokenizer has no chat template: pass --no-chat-template to feed prompts raw.")
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def add_decoding_arguments(parser) -> None:
    """The chain / tree shape and sampling flags `osprey decode` and `osprey bench` share."""
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DRAFTING_SETTINGS["num_draft_tokens"],
        help="chain length (or tree depth) per verification step",
    )
    parser.add_argument(
        "--draft-topk",
        type=int,
        default=DRAFTING_SETTINGS["draft_topk"],
        help="draft trees: expand the K most probable nodes of each level into their K most probable children "
        "(1: chains)",
    )
    parser.add_argument(
        "--tree-size",
        type=int,
        default=DRAFTING_SETTINGS["tree_size"],
        help=f"draft tree nodes verified per step (default: {CPU_TREE_SIZE} on a CPU, measured with --draft-topk "
        f"{CPU_DRAFT_TOPK}; num-draft-tokens x draft-topk on accelerators)",
    )
    parser.add_argument(
        "--confidence-threshold",
        type=float,
        default=DRAFTING_SETTINGS["confidence_threshold"],
        help="stop a chain after a draft the drafter gives a probability below this (0: full chains, the paper's)",
    )
    parser.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=DRAFTING_SETTINGS["prompt_lookup_num_tokens"],
        help="add a prompt-lookup branch of up to this many tokens to every draft (the continuation of the last "
        "2-gram's latest earlier occurrence; no drafter cost), verified with the draft as one tree (0: none)",
    )
    parser.add_argument(
        "--drafter-quantization",
        choices=DRAFTER_QUANTIZATIONS,
        default="none",
        help="int8: the drafter's linear layers as dynamic int8 (CPU only; drafting 2-2.4x cheaper here, the drafts "
        "change a little, the output does not). none: the drafter in --dtype",
    )
    parser.add_argument("--do-sample", action="store_true", help="sample (lossless) instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)


def add_subcommand(subparsers) -> None:
    """Adds `osprey decode` to the CLI (see `osprey.cli`)."""
    parser = subparsers.add_parser(
        "decode", help="generate with a drafter and the target verifying; print the text and τ, tokens/s, speedup"
    )
    parser.add_argument("--target", required=True, help="zoo name, local directory or Hub id of the target")
    parser.add_argument("--drafter", required=True, help="directory or Hub id of an Osprey drafter")
    parser.add_argument("--prompt", required=True, help="user message (the target's chat template is applied)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_decoding_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compare", action="store_true", help="also time plain target decoding, for the speedup")
    parser.set_defaults(run=_run_decode)


def _run_decode(args) -> int:
    from ..models.pack import load_drafter
    from ..models.zoo import load_causal_lm, load_tokenizer

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_causal_lm(args.target, dtype=dtype).eval(), load_tokenizer(args.target)
    drafter = load_drafter(args.drafter, dtype, quantization=args.drafter_quantization)
    input_ids = encode_prompt(tokenizer, args.prompt)
    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    output, stats = speculative_generate(
        target,
        drafter,
        input_ids,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        draft_topk=args.draft_topk,
        tree_size=args.tree_size,
        confidence_threshold=args.confidence_threshold,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        eos_token_id=target.generation_config.eos_token_id,
        generator=torch.Generator().manual_seed(args.seed),
        **sampling,
    )
    completion = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(completion)
    report = stats.to_dict()
    del report["accepted_per_step"]
    if args.compare:  # the target alone on the same prompt and settings, timed in the same process
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        alone = target_generate(
            target, input_ids, args.max_new_tokens, eos_token_id=target.generation_config.eos_token_id, **sampling
        )
        seconds = time.perf_counter() - start
        report["target_only_tokens_per_s"] = (alone.shape[1] - input_ids.shape[1]) / seconds
        report["speedup"] = report["tokens_per_s"] / report["target_only_tokens_per_s"]
        report["target_only_completion"] = tokenizer.decode(alone[0, input_ids.shape[1] :], skip_special_tokens=True)
        if not args.do_sample:  # greedy decoding is lossless token for token
            report["identical_to_target_only"] = torch.equal(alone, output)
    print(json.dumps(report, indent=2))
    return 0
