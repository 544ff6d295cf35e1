"""Stage 2: target-agnostic pretraining of a pruned backbone, next-token LM training on general text.

The backbone is still an ordinary Llama / Qwen / Gemma causal LM (see `osprey prune`), so this is TRL's `SFTTrainer`
on plain text with packing, plus an optional self-distillation term: the KL divergence from the unpruned parent's
next-token distribution, which tells the pruned model what its lost blocks used to contribute at every position,
not only which token came next.
"""

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from trl import SFTConfig, SFTTrainer, TrlParser

from osprey.models.zoo import load_causal_lm, load_tokenizer

from .corpora.loading import DatasetArguments, load_text_dataset
from .devices import (
    compile_with_dynamic_shapes,
    loss_autocast,
    set_cpu_memory_policy,
    set_device_defaults,
    train_and_save,
)
from .losses import soft_cross_entropy, target_distribution_and_entropy, token_cross_entropy


@dataclass
class OspreyPretrainConfig(SFTConfig):
    r"""
    Configuration of [`OspreyPretrainer`]: [`~trl.SFTConfig`] plus the self-distillation settings.

    Defaults that differ from `SFTConfig`, chosen so that a CPU run works out of the box: `bf16` is on only where CUDA
    supports it, activation checkpointing is off (pruned backbones are small), `packing` is on with the `"wrapped"`
    strategy (documents joined by EOS, no token dropped, no padding), `max_length` is 1024 and `learning_rate` 3e-4.

    Parameters:
        parent_model (`str`, *optional*):
            Zoo name, local directory or Hub id of the unpruned model the backbone was pruned from. When set, the loss
            adds `distill_weight * temperature**2 * KL(parent || model)` at every trained position.
        distill_weight (`float`, *optional*, defaults to 1.0):
            Weight of the self-distillation term.
        temperature (`float`, *optional*, defaults to 1.0):
            Softmax temperature of both distributions in the KL term.
        freeze_embeddings (`bool`, *optional*, defaults to `False`):
            Keep the input embedding fixed (as `osprey distill --freeze_embeddings`).
        freeze_lm_head (`bool`, *optional*, defaults to `False`):
            Keep the LM head fixed. With both frozen, a backbone pruned from a zoo model changes only in its blocks:
            `osprey pack --reference` then stores the 2 x 136 M vocabulary parameters of a Qwen2.5 backbone as
            references to the zoo model, and the backward pass skips the LM head's weight gradient.
    """

    output_dir: str | None = field(
        default=None,
        metadata={"help": "Where checkpoints and the trained backbone are saved.", "aliases": ["--output"]},
    )
    parent_model: str | None = field(default=None, metadata={"help": "Unpruned parent to self-distill from."})
    distill_weight: float = field(default=1.0, metadata={"help": "Weight of the KL(parent || model) term."})
    temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of the KL term."})
    freeze_embeddings: bool = field(default=False, metadata={"help": "Keep the input embedding fixed."})
    freeze_lm_head: bool = field(default=False, metadata={"help": "Keep the LM head fixed."})
    learning_rate: float = field(default=3e-4, metadata={"help": "The initial learning rate for AdamW."})
    # TRL turns activation checkpointing on by default (through the deprecated alias); pruned backbones need none.
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "Deprecated alias (transformers 5)."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on iff CUDA has bf16."})
    packing: bool = field(default=True, metadata={"help": "Pack sequences into blocks of max_length tokens."})
    # Classic LM pretraining: documents joined by EOS and cut into full rows. "bfd"/"bfd_split" keep documents apart
    # through padding-free batches, which is fast with FlashAttention but 2x slower on CPU (a dense block mask).
    packing_strategy: str = field(
        default="wrapped",
        metadata={"help": "Packing strategy: bfd, bfd_split or wrapped.", "choices": ["bfd", "bfd_split", "wrapped"]},
    )

    def __post_init__(self):
        set_device_defaults(self)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}.")
        super().__post_init__()


class OspreyPretrainer(SFTTrainer):
    """[`~trl.SFTTrainer`] with optional self-distillation from the unpruned parent (see [`OspreyPretrainConfig`]).

    The loss is the next-token cross-entropy, plus `distill_weight * T**2 * KL(parent || model)` with a parent, both
    summed over the trained tokens and divided by their number (`SFTTrainer`'s normalisation). Without a parent it is
    `trainers.losses.token_cross_entropy` over the model's logits (one fused pass writing the gradient; TRL's fused LM
    head saves memory on large vocabularies but runs about 1.8x slower on CPU, where pruned backbones are often
    trained). `mean_token_accuracy` is logged, and with a parent `lm_loss` and `distill_kl`.
    """

    def __init__(self, model, args: OspreyPretrainConfig | None = None, *, parent_model=None, **kwargs):
        args = args if args is not None else OspreyPretrainConfig(output_dir="osprey-pretrain")
        if isinstance(model, PreTrainedModel):
            if args.freeze_embeddings:
                model.get_input_embeddings().requires_grad_(False)
            if args.freeze_lm_head:
                if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
                    raise ValueError("This model ties its LM head to its embedding: freeze both or neither.")
                model.get_output_embeddings().requires_grad_(False)
        super().__init__(model, args=args, **kwargs)
        set_cpu_memory_policy(self)
        parent_model = parent_model if parent_model is not None else self.args.parent_model
        if isinstance(parent_model, str):
            parent_model = load_causal_lm(parent_model, dtype=torch.bfloat16 if self.args.bf16 else torch.float32)
        if parent_model is not None:
            parent_vocab = parent_model.config.get_text_config().vocab_size
            model_vocab = self.model.config.get_text_config().vocab_size
            if parent_vocab != model_vocab:
                raise ValueError(
                    f"The parent model's vocabulary ({parent_vocab}) differs from the model's ({model_vocab}): "
                    "self-distillation needs the model the backbone was pruned from."
                )
            parent_model = parent_model.to(self.args.device).eval().requires_grad_(False)
        self.parent_model: PreTrainedModel | None = parent_model

    def _build_accelerator_args(self, **kwargs):
        return compile_with_dynamic_shapes(super()._build_accelerator_args(**kwargs))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        # Without a cache, transformers reads packed documents from `position_ids` and keeps them apart.
        model_inputs = {key: value for key, value in inputs.items() if key != "labels"}
        with loss_autocast(self, model):
            outputs = model(**model_inputs, use_cache=False)
        labels = inputs["labels"][:, 1:]
        mask = labels != -100
        num_tokens = mask.sum() if num_items_in_batch is None else num_items_in_batch
        num_tokens = torch.as_tensor(num_tokens, device=labels.device).clamp(min=1)
        counted = mask.sum().clamp(min=1)  # the metrics are means over this micro-batch's tokens
        if self.parent_model is None:  # the fused loss: no float32 copy of the logits, gradient written in the forward
            # Logits of every position (a view, no copy) against the next tokens, the last position ignored.
            next_tokens = F.pad(labels, (0, 1), value=-100).reshape(-1)
            loss_sum, correct = token_cross_entropy(outputs.logits.flatten(0, 1), next_tokens)
            lm_loss = loss_sum / num_tokens
            metrics = {"mean_token_accuracy": correct / counted}
            loss = lm_loss
        else:  # the same fused losses: KL(p || q) = CE(p, q) - H(p), the parent's entropy H(p) a constant
            trained = F.pad(mask, (0, 1), value=False).flatten()  # positions whose next token is trained on
            logits = outputs.logits.flatten(0, 1)[trained]  # (tokens, vocabulary) in the compute dtype
            lm_sum, correct = token_cross_entropy(logits, labels[mask])
            lm_loss = lm_sum / num_tokens
            temperature = self.args.temperature
            tempered = (lambda x: x) if temperature == 1 else (lambda x: x / temperature)
            with torch.no_grad():
                parent_logits = self.parent_model(**model_inputs, use_cache=False).logits
                parent_probs, parent_entropy = target_distribution_and_entropy(tempered(parent_logits), trained)
            cross_sum, _ = soft_cross_entropy(tempered(logits), parent_probs)
            kl_sum = cross_sum - parent_entropy
            loss = lm_loss + self.args.distill_weight * temperature**2 * kl_sum / num_tokens
            # per token of this micro-batch (the loss divides by the whole accumulated batch's tokens)
            metrics = {
                "mean_token_accuracy": correct / counted,
                "lm_loss": lm_sum / counted,
                "distill_kl": kl_sum / counted,
            }
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # like SFTTrainer: DDP averages, the count is global
        values = self.accelerator.gather_for_metrics(torch.stack(list(metrics.values())).detach()[None]).mean(0)
        for name, value in zip(metrics, values.tolist()):
            self._metrics[mode][name].append(value)
        return (loss, outputs) if return_outputs else loss


@dataclass
class PretrainScriptArguments(DatasetArguments):
    """What to train and on what; the training itself is configured by [`OspreyPretrainConfig`]."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Pruned backbone to train: zoo name, local directory or Hub id.", "aliases": ["--backbone"]},
    )
    eval_only: bool = field(
        default=False,
        metadata={"help": "Only report the held-out loss and perplexity (dataset_test_split) of the model."},
    )


def main(argv: list[str] | None = None) -> int:
    """`osprey pretrain`: `--config config.yaml` and/or flags, see `osprey pretrain --help`."""
    parser = TrlParser((PretrainScriptArguments, OspreyPretrainConfig), prog="osprey pretrain", description=__doc__)
    script_args, config = parser.parse_args_and_config(argv)
    if script_args.model_name_or_path is None or script_args.dataset_name is None:
        raise ValueError("Pass --backbone (the pruned backbone) and --dataset-name (see `osprey data`).")
    tokenizer = load_tokenizer(script_args.model_name_or_path)
    model = load_causal_lm(script_args.model_name_or_path)
    dataset = load_text_dataset(script_args)
    eval_dataset = dataset.get(script_args.dataset_test_split)
    if script_args.eval_only:
        if eval_dataset is None:
            raise ValueError(f"--eval-only needs a {script_args.dataset_test_split!r} split to evaluate on.")
        # SFTTrainer requires a train dataset; the held-out split stands in, nothing is trained.
        trainer = OspreyPretrainer(
            model, config, train_dataset=eval_dataset, eval_dataset=eval_dataset, processing_class=tokenizer
        )
        metrics = trainer.evaluate()
        metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        return 0
    trainer = OspreyPretrainer(
        model,
        config,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=eval_dataset if config.eval_strategy != "no" else None,
        processing_class=tokenizer,
    )
    return train_and_save(trainer, resume_argument(config.resume_from_checkpoint))


def resume_argument(value: str | None) -> str | bool | None:
    """`--resume-from-checkpoint true` resumes from the latest checkpoint in `output_dir`; a path from that one."""
    return True if value is not None and value.lower() == "true" else value


if __name__ == "__main__":
    sys.exit(main())
