"""Stage 4: distill a converted drafter against its frozen target, with training-time test (TTT).

The loss is EAGLE-3's: the drafter is unrolled for `ttt_steps` chain steps exactly as it drafts (step 0 reads the
target's features, every later step its own previous pre-norm hidden state), and each step is trained on the target's
next-token distribution by soft cross-entropy. Positions, tokens and attention match
`modeling_osprey.generation_osprey` one to one, so what is trained is what decoding runs (see `ttt_loss`).
"""

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices
from transformers.trainer_utils import has_length
from trl import TrlParser

from modeling_osprey.target_features import extract_target_features
from osprey.models.pack import load_drafter
from osprey.models.zoo import load_tokenizer

from .corpora.loading import DatasetArguments, load_text_dataset
from .corpora.tokenization import tokenize_dataset
from .devices import (
    compile_with_dynamic_shapes,
    load_target,
    loss_autocast,
    set_cpu_memory_policy,
    set_device_defaults,
    states_in_parameter_layout,
    train_and_save,
    unwrap,
)
from .features.feature_cache import SEQUENCE_FIELDS, FeatureCacheDataset, greedy_tokens
from .losses import (
    store_column_major,
)
from .pretrain import resume_argument
from .ttt import label_positions, lm_replay_loss, target_to_draft_ids, ttt_loss


def check_replay_weight(weight: float, corpus: str | None) -> None:
    """Refuses a replay corpus (`corpus`, its name or how it was given) with `lm_replay_weight` 0, which turns the
    replay term off: probably a mistake."""
    if corpus is not None and weight == 0:
        raise ValueError(
            f"An LM replay corpus ({corpus}) was given but lm_replay_weight is 0, which turns the replay term off: "
            "probably a mistake. Set --lm-replay-weight (e.g. 0.1), or pass no replay corpus (--lm-replay-dataset)."
        )


@dataclass
class OspreyDistillConfig(TrainingArguments):
    r"""
    Configuration of [`OspreyDistillTrainer`]: [`~transformers.TrainingArguments`] plus the distillation settings.

    Defaults that differ from `TrainingArguments`: `bf16` is on only where CUDA supports it (CPU runs in float32),
    `learning_rate` is 1e-4, `logging_steps` 10 and `ddp_find_unused_parameters` False.

    Parameters:
        target_model (`str`, *optional*):
            Zoo name, local directory or Hub id of the frozen target, run live on every batch. Not needed with
            `feature_cache`.
        target_dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype the live target is loaded in: `"auto"` is bfloat16 where CUDA supports it, else float32.
        feature_cache (`str`, *optional*):
            Directory written by `osprey features`: `osprey distill` trains on its precomputed target features instead
            of a live target (in Python, pass `FeatureCacheDataset(directory)` as the trainer's `train_dataset`).
        ttt_steps (`int`, *optional*, defaults to 5):
            Chain steps unrolled per position (training-time test); 1 trains step 0 only.
        ttt_decay (`float`, *optional*, defaults to 0.8):
            Step `k`'s loss is weighted by `ttt_decay ** k`.
        max_length (`int`, *optional*, defaults to 2048):
            Sequences are truncated to this many tokens when tokenized.
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            Column holding plain text; examples with a `messages` column are rendered with the chat template instead.
        assistant_only_loss (`bool`, *optional*, defaults to `True`):
            Train on assistant tokens only when examples are conversations.
        freeze_embeddings (`bool`, *optional*, defaults to `False`):
            Keep the drafter's input embedding fixed, as EAGLE-3 does with the target's embedding it reuses.
        keep_steps (`list[int]`, *optional*, defaults to `[]`):
            Steps at which a checkpoint is saved and its model kept in `output_dir/kept/step-N`, out of reach of
            `save_total_limit`: the points of a learning curve in a long run (see `trainers.devices.KeepModelAt`).
        lm_replay_dataset (`str`, *optional*):
            A text (or chat) corpus `trainers.corpora.loading.load_text_dataset` reads, typically `multilingual`: its
            `train` split, tokenized by the drafter's tokenizer (`processing_class`), is replayed as plain language
            modelling (see `lm_replay_loss`) so that distillation on English answers does not erase the backbone's other
            languages. Needs `lm_replay_weight > 0`.
        lm_replay_weight (`float`, *optional*, defaults to 0.0):
            Each training micro-batch's loss adds `lm_replay_weight * CE`, `CE` the drafter's mean next-token
            cross-entropy on a replay batch read without target features (0: off).
        lm_replay_batch_size (`int`, *optional*):
            Replay sequences per micro-batch; defaults to `per_device_train_batch_size`.
        lm_replay_max_length (`int`, *optional*, defaults to 512):
            Replay sequences are truncated to this many tokens.
        pretrained_learning_rate_scale (`float`, *optional*, defaults to 1.0):
            In (0, 1]: the weights the pretrained backbone supplied train at `scale * learning_rate`, the weights
            `osprey convert` added (`model.fc`, `model.layers.0.hidden_norm` and the feature half, the first
            `hidden_size` input columns, of block 0's q/k/v) at `learning_rate`. Refused for drafters whose config
            records no pretrained body: EAGLE-3 drafters, and those no `osprey convert` made (`check_pretrained_body`).
    """

    target_model: str | None = field(
        default=None, metadata={"help": "Zoo name, directory or Hub id of the target.", "aliases": ["--target"]}
    )
    output_dir: str | None = field(
        default=None,
        metadata={"help": "Where checkpoints and the distilled drafter are saved.", "aliases": ["--output"]},
    )
    target_dtype: str = field(default="auto", metadata={"help": "Live target dtype: auto, bfloat16 or float32."})
    feature_cache: str | None = field(default=None, metadata={"help": "Directory written by `osprey features`."})
    ttt_steps: int = field(default=5, metadata={"help": "Chain steps unrolled per position (training-time test)."})
    ttt_decay: float = field(default=0.8, metadata={"help": "Weight of step k's loss is ttt_decay ** k."})
    max_length: int | None = field(default=2048, metadata={"help": "Truncate sequences to this many tokens."})
    dataset_text_field: str = field(default="text", metadata={"help": "Column holding plain text."})
    assistant_only_loss: bool = field(default=True, metadata={"help": "Train on assistant tokens only (chats)."})
    freeze_embeddings: bool = field(default=False, metadata={"help": "Keep the input embedding fixed (EAGLE-3)."})
    keep_steps: list[int] = field(
        default_factory=list,
        metadata={"help": "Steps whose model is kept in output_dir/kept/step-N (learning-curve points).", "nargs": "+"},
    )
    lm_replay_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Corpus replayed as language modelling without target features (its train split, e.g. "
            "`multilingual` from `osprey data multilingual`): keeps a pretrained backbone's other languages. "
            "Needs --lm-replay-weight."
        },
    )
    lm_replay_weight: float = field(
        default=0.0,
        metadata={"help": "Weight of the replay next-token cross-entropy added to each training loss (0: off)."},
    )
    lm_replay_batch_size: int | None = field(
        default=None, metadata={"help": "Replay sequences per micro-batch (default: per_device_train_batch_size)."}
    )
    lm_replay_max_length: int = field(default=512, metadata={"help": "Truncate replay sequences to this many tokens."})
    pretrained_learning_rate_scale: float = field(
        default=1.0,
        metadata={
            "help": "In (0, 1]: the weights the pretrained backbone supplied train at this times learning_rate; the "
            "weights `osprey convert` added (fc, the fusion block's hidden_norm and the feature half of its q/k/v) "
            "at learning_rate. Refused for a drafter whose config records no pretrained body (EAGLE-3, or not made by "
            "`osprey convert`); only the config is read, so a body randomised since (`osprey baseline scratch`) is not."
        },
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "The initial learning rate for AdamW."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps."})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on iff CUDA has bf16."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Every drafter parameter takes part in every step: DDP need not search."}
    )

    def __post_init__(self):
        set_device_defaults(self)
        super().__post_init__()
        if self.activation_checkpointing:
            raise ValueError(
                "Activation (gradient) checkpointing is not supported by the TTT unroll: later steps read earlier "
                "steps' keys from the drafter's KV cache, which a checkpointed layer would append to again when "
                "replayed. Drafters are shallow; lower per_device_train_batch_size or max_length instead."
            )
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be at least 1, got {self.ttt_steps}.")
        if self.lm_replay_weight < 0:
            raise ValueError(
                f"lm_replay_weight must be 0 (off) or positive, got {self.lm_replay_weight}: set --lm-replay-weight "
                "to e.g. 0.1."
            )
        check_replay_weight(self.lm_replay_weight, self.lm_replay_dataset)
        if self.lm_replay_batch_size is None:
            self.lm_replay_batch_size = self.per_device_train_batch_size
        if self.lm_replay_batch_size < 1 or self.lm_replay_max_length < 2:
            raise ValueError(
                "lm_replay_batch_size must be at least 1 and lm_replay_max_length at least 2 (a next token), got "
                f"{self.lm_replay_batch_size} and {self.lm_replay_max_length}."
            )
        if not 0 < self.pretrained_learning_rate_scale <= 1:
            raise ValueError(
                f"pretrained_learning_rate_scale must be in (0, 1], got {self.pretrained_learning_rate_scale}: 1 "
                "trains every weight at learning_rate, 0.1 the backbone's weights at a tenth of it (0 would freeze "
                "them: use a small positive value)."
            )


def replay_indices(draw: int, batch_size: int, num_examples: int, seed: int) -> list[int]:
    """The examples of replay batch number `draw` (0-based): positions `draw * batch_size ...` of an endless stream
    of epochs, epoch `e` a permutation of the `num_examples` examples drawn from `seed + e`. A pure function, so a
    resumed run draws exactly the batches the uninterrupted run drew."""
    indices, permutation, epoch = [], None, None
    for position in range(draw * batch_size, (draw + 1) * batch_size):
        position_epoch, offset = divmod(position, num_examples)
        if position_epoch != epoch:
            epoch = position_epoch
            permutation = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch))
        indices.append(int(permutation[offset]))
    return indices


class DistillDataCollator:
    """Right-pads every sequence field of the examples to the longest one (`input_ids` with `pad_token_id`, the
    others with 0) and adds the `attention_mask`."""

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        for key in examples[0]:
            values = [torch.as_tensor(example[key]) for example in examples]
            if key in ("input_ids", "target_argmax"):  # stored as int32 in a feature cache
                values = [value.long() for value in values]
            padding_value = self.pad_token_id if key == "input_ids" else 0
            batch[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=padding_value)
        lengths = torch.tensor([len(example["input_ids"]) for example in examples])
        batch["attention_mask"] = (torch.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]).long()
        return batch


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' `LengthGroupedSampler` (a random permutation cut into mega-batches of 50 batches, each sorted by
    length, so a batch pads little) whose permutation is drawn from `seed + epoch`: a run resumed from a checkpoint
    replays its epoch's order exactly, as accelerate's seedable random sampler does for the random strategy."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


PRETRAINED_SCALE_KEY = "pretrained_learning_rate_scale"  # recorded in every param group, checked on resume


def check_pretrained_body(drafter) -> None:
    """Refuses `pretrained_learning_rate_scale` for a drafter whose config says it has no pretrained body: an
    EAGLE-3 drafter (`residual_stream="features"`: one block over the target's features, no backbone) or one whose
    config records no backbone (`backbone_model_type`, set by `osprey convert`). Only the config is read: whether a
    converted drafter's pretrained weights are worth a lower rate is the caller's call."""
    config = drafter.config
    if config.residual_stream == "features":
        raise ValueError(
            "pretrained_learning_rate_scale lowers the learning rate of the weights a pretrained backbone supplied, "
            "and this EAGLE-3 drafter has none (random body and head, the target's embedding): distill it without "
            "--pretrained-learning-rate-scale."
        )
    if config.backbone_model_type is None:
        raise ValueError(
            "pretrained_learning_rate_scale lowers the learning rate of the weights a pretrained backbone supplied, "
            "but this drafter's config records no backbone (backbone_model_type is None): it was not made by "
            "`osprey convert`. Distill it without --pretrained-learning-rate-scale."
        )


def scale_pretrained_learning_rate(optimizer: torch.optim.Optimizer, drafter, scale: float) -> None:
    """Makes the backbone's weights in `optimizer` train at `scale` times each group's learning rate, the weights
    `osprey convert` added at the group's own.

    Each param group is split in two, in order: the tensors convert added or that hold added columns (`model.fc`,
    block 0's `hidden_norm` and q/k/v weights) keep the group's `lr`, every other tensor gets `lr * scale`; a
    scheduler made afterwards scales each group's own initial rate. The token half of q/k/v (input columns
    `hidden_size:`, the backbone's) shares a tensor with the added feature half, so a step pre-hook saves it and a
    post-hook blends it back to `before + scale * (after - before)`: with AdamW (the default) or SGD the step, weight
    decay included, is linear in the learning rate and the moments do not depend on it, so that is exactly the step
    at `lr * scale`, each step."""
    fusion = unwrap(drafter).model.layers[0]
    hidden_size = unwrap(drafter).config.hidden_size
    split = [fusion.self_attn.q_proj.weight, fusion.self_attn.k_proj.weight, fusion.self_attn.v_proj.weight]
    added = {id(unwrap(drafter).model.fc.weight), id(fusion.hidden_norm.weight)} | {id(p) for p in split}
    groups = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        new = [param for param in group["params"] if id(param) in added]
        pretrained = [param for param in group["params"] if id(param) not in added]
        for params, lr in ((new, settings["lr"]), (pretrained, settings["lr"] * scale)):
            if params:
                groups.append({**settings, "params": params, "lr": lr})
    optimizer.param_groups = groups
    before = []

    def save_token_halves(optimizer, args, kwargs):
        before[:] = [param.detach()[:, hidden_size:].clone() for param in split]

    @torch.no_grad()
    def blend_token_halves(optimizer, args, kwargs):
        for param, old in zip(split, before, strict=True):
            half = param.detach()[:, hidden_size:]
            half.copy_(torch.lerp(old, half, scale))
        before.clear()

    optimizer.register_step_pre_hook(save_token_halves)
    optimizer.register_step_post_hook(blend_token_halves)


class OspreyDistillTrainer(Trainer):
    """A [`~transformers.Trainer`] distilling an [`OspreyForDrafting`] drafter against a frozen target by TTT.

    The target's features and distribution come from `target_model` run live on each batch, or from a feature cache:
    pass a [`FeatureCacheDataset`] as `train_dataset` (and `eval_dataset`), then no target is needed. Datasets of text
    or chats are tokenized here (see `trainers.corpora.tokenization`); per-step losses and top-1 accuracies are logged
    as `ttt_loss_k` / `ttt_acc_k`.

    With `lm_replay_weight > 0` every training micro-batch also reads a replay batch of `lm_replay_dataset` (or of the
    `lm_replay_dataset` passed here: a `datasets.Dataset` of text, chats or `input_ids`) without target features and
    adds `lm_replay_weight` times its next-token cross-entropy (`lm_replay_loss`), logged as `lm_replay_loss`. Replay
    batch number `n = (global_step * gradient_accumulation_steps + micro_step) * num_processes + process_index` holds
    the examples `replay_indices(n, ...)` gives, so a resumed run draws what the uninterrupted one drew.

    With `pretrained_learning_rate_scale < 1` the optimizer's groups are split (`scale_pretrained_learning_rate`);
    drafters without a pretrained body are refused (`check_pretrained_body`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        args: OspreyDistillConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        target_model: PreTrainedModel | str | None = None,
        processing_class=None,
        data_collator=None,
        callbacks=None,
        optimizers=(None, None),
        lm_replay_dataset=None,
    ):
        args = args if args is not None else OspreyDistillConfig(output_dir="osprey-distill")
        if args.pretrained_learning_rate_scale != 1:
            check_pretrained_body(model)
            if optimizers[0] is not None:
                raise ValueError(
                    "pretrained_learning_rate_scale splits the param groups of the optimizer the trainer creates: "
                    "do not pass an optimizer, or give yours the scaled groups and leave the scale at 1."
                )
        replay = self._load_replay_dataset(args, lm_replay_dataset, processing_class)
        self.feature_cache = train_dataset if isinstance(train_dataset, FeatureCacheDataset) else None
        target_model = target_model if target_model is not None else args.target_model
        if self.feature_cache is None:
            if target_model is None:
                raise ValueError("Pass a `target_model` (`--target`), or train from a feature cache.")
            if isinstance(target_model, str):
                target_model = load_target(target_model, args.target_dtype)
            tokenize = {
                "tokenizer": processing_class,
                "max_length": args.max_length,
                "text_field": args.dataset_text_field,
                "assistant_only_loss": args.assistant_only_loss,
            }
            train_dataset = tokenize_dataset(train_dataset, **tokenize)
            eval_dataset = None if eval_dataset is None else tokenize_dataset(eval_dataset, **tokenize)
        elif target_model is not None:
            raise ValueError("Pass either a `target_model` or a feature cache dataset, not both.")
        else:
            self.feature_cache.check_drafter(model.config)
        if args.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
        pad_token_id = getattr(processing_class, "pad_token_id", None) or 0
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or DistillDataCollator(pad_token_id),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        # The layout the TTT loss's head GEMMs read fastest; FSDP shards contiguous parameters only
        if model.lm_head.weight is not model.get_input_embeddings().weight and not self.is_fsdp_enabled:
            store_column_major(model.lm_head.weight)
        set_cpu_memory_policy(self)
        self.target_model = None
        if target_model is not None:
            model.config.check_target(target_model)
            self.target_model = target_model.to(self.args.device).eval().requires_grad_(False)
        self.target_head = None
        if self.feature_cache is not None:  # restricted once to the draft vocabulary, the only logits distillation uses
            head = self.feature_cache.target_head().restricted(model.draft_to_target)
            self.target_head = head.to(self.args.device)
        self._metrics = {mode: {"sums": torch.zeros(3, args.ttt_steps), "batches": 0} for mode in ("train", "eval")}
        self.lm_replay_dataset = replay
        self._replay_metrics = {"sum": 0.0, "batches": 0}
        self._replay_step, self._replay_micro_step = None, 0
        if replay is not None:
            self._target_to_draft = target_to_draft_ids(model.draft_to_target, model.config.vocab_size).to(
                self.args.device
            )
            self._replay_collator = DistillDataCollator(pad_token_id)

    @staticmethod
    def _load_replay_dataset(args: OspreyDistillConfig, dataset, tokenizer):
        """The tokenized replay corpus (`input_ids`, `loss_mask`), or None when replay is off."""
        if dataset is None and args.lm_replay_dataset is not None:
            name = args.lm_replay_dataset
            splits = load_text_dataset(DatasetArguments(dataset_name=name))
            if "train" not in splits:
                raise ValueError(f"The LM replay corpus {name!r} has no 'train' split (it has {sorted(splits)}).")
            dataset = splits["train"]
        else:
            name = "passed as lm_replay_dataset"
        if dataset is None:
            if args.lm_replay_weight > 0:
                raise ValueError(
                    f"lm_replay_weight={args.lm_replay_weight} needs a corpus to replay: pass --lm-replay-dataset "
                    "(e.g. multilingual, built by `osprey data multilingual`), or set --lm-replay-weight 0."
                )
            return None
        check_replay_weight(args.lm_replay_weight, name)
        if not isinstance(dataset, Dataset):
            raise ValueError(
                f"The LM replay corpus must be a `datasets.Dataset` (not streamed, replay draws by index), got "
                f"{type(dataset).__name__}."
            )
        dataset = tokenize_dataset(
            dataset,
            tokenizer=tokenizer,
            max_length=args.lm_replay_max_length,
            text_field=args.dataset_text_field,
            assistant_only_loss=False,  # language modelling: every token of a chat, as of a text
        )
        if len(dataset) == 0:
            raise ValueError(
                f"The LM replay corpus ({name}) is empty: no example has 3 tokens or more after tokenization. Build "
                "it (`osprey data multilingual`) or point --lm-replay-dataset at a corpus with text."
            )
        return dataset

    def _replay_batch(self) -> dict[str, torch.Tensor]:
        """The replay batch of this micro-step: a pure function of the seed, `global_step` and the micro-step."""
        if self.state.global_step != self._replay_step:
            self._replay_step, self._replay_micro_step = self.state.global_step, 0
        draws_per_step = self.args.gradient_accumulation_steps
        draw = self._replay_step * draws_per_step + self._replay_micro_step
        draw = draw * self.accelerator.num_processes + self.accelerator.process_index
        self._replay_micro_step += 1
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        indices = replay_indices(draw, self.args.lm_replay_batch_size, len(self.lm_replay_dataset), seed)
        rows = self.lm_replay_dataset[indices]
        masks = rows.get("loss_mask") or [[1] * len(input_ids) for input_ids in rows["input_ids"]]
        length = self.args.lm_replay_max_length  # also cuts a corpus given already tokenized
        batch = self._replay_collator(
            [
                {"input_ids": input_ids[:length], "loss_mask": mask[:length]}
                for input_ids, mask in zip(rows["input_ids"], masks, strict=True)
            ]
        )
        return {key: value.to(self.args.device) for key, value in batch.items()}

    def create_optimizer(self, model=None):
        created = self.optimizer is None
        optimizer = super().create_optimizer(model)
        scale = self.args.pretrained_learning_rate_scale
        if created and scale != 1:
            scale_pretrained_learning_rate(optimizer, self.model if model is None else model, scale)
            for group in optimizer.param_groups:
                group[PRETRAINED_SCALE_KEY] = scale
        if created:
            optimizer.register_load_state_dict_pre_hook(self._check_resumed_scale)
        optimizer.register_load_state_dict_post_hook(states_in_parameter_layout)
        return optimizer

    def _check_resumed_scale(self, optimizer, state_dict):
        """A checkpoint's optimizer holds the param groups of its run's `pretrained_learning_rate_scale`."""
        saved = {group.get(PRETRAINED_SCALE_KEY, 1.0) for group in state_dict["param_groups"]}
        scale = self.args.pretrained_learning_rate_scale
        if saved != {scale}:
            raise ValueError(
                f"The checkpoint was trained with pretrained_learning_rate_scale {', '.join(map(str, sorted(saved)))}, "
                f"this run asks for {scale}: its optimizer state has that run's param groups. Resume with "
                "the checkpoint's --pretrained-learning-rate-scale."
            )

    def _build_accelerator_args(self, **kwargs):
        return compile_with_dynamic_shapes(super()._build_accelerator_args(**kwargs))

    def _get_train_sampler(self, train_dataset=None):
        """`train_sampling_strategy: group_by_length` batches sequences of similar length, read from a feature
        cache's index (not by loading every sequence) and in an order a resumed run replays exactly."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        if isinstance(dataset, FeatureCacheDataset):
            lengths = dataset.lengths
        else:
            lengths = [len(input_ids) for input_ids in dataset["input_ids"]]
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        batch_size = self.args.train_batch_size * self.args.gradient_accumulation_steps
        return EpochSeededLengthGroupedSampler(batch_size, lengths, seed)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(SEQUENCE_FIELDS)  # a feature cache's; text datasets have the first two

    @torch.no_grad()
    def _target_signals(self, inputs: dict, drafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tap features, logits over the draft vocabulary and full-vocabulary greedy tokens of the target."""
        draft_to_target = drafter.draft_to_target
        if self.target_head is not None:  # the logits at the label positions only: the rest would go unread
            hidden_states = inputs["target_last_hidden_state"][label_positions(inputs["loss_mask"])]
            return inputs["target_hidden_states"], self.target_head(hidden_states), inputs["target_argmax"]
        features, logits = extract_target_features(
            self.target_model, inputs["input_ids"], drafter.config.target_layer_ids, inputs["attention_mask"]
        )
        return features, logits[..., draft_to_target], greedy_tokens(logits)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        drafter = self.accelerator.unwrap_model(model)
        features, target_logits, target_argmax = self._target_signals(inputs, drafter)
        replay = self._replay_batch() if model.training and self.lm_replay_dataset is not None else None
        with loss_autocast(self, model):
            output = ttt_loss(
                model,
                inputs["input_ids"],
                features.to(drafter.dtype),
                target_logits,
                target_argmax,
                inputs["loss_mask"],
                drafter.draft_to_target,
                num_steps=self.args.ttt_steps,
                decay=self.args.ttt_decay,
            )
            loss = output.loss
            if replay is not None:
                replay_loss, _ = lm_replay_loss(
                    model, replay["input_ids"], replay["attention_mask"], replay["loss_mask"], self._target_to_draft
                )
                loss = loss + self.args.lm_replay_weight * replay_loss
                reduced = self.accelerator.reduce(replay_loss.detach().float(), reduction="sum")
                self._replay_metrics["sum"] += reduced.item()
                self._replay_metrics["batches"] += self.accelerator.num_processes
        stats = torch.stack([output.step_losses, output.step_correct.float(), output.step_counts.float()])
        metrics = self._metrics["train" if model.training else "eval"]
        metrics["sums"] += self.accelerator.reduce(stats, reduction="sum").cpu()
        metrics["batches"] += self.accelerator.num_processes
        return (loss, output) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        if metrics["batches"]:
            losses, correct, counts = metrics["sums"]
            prefix = "eval_" if mode == "eval" else ""
            for step in range(len(losses)):
                logs[f"{prefix}ttt_loss_{step}"] = round(losses[step].item() / metrics["batches"], 4)
                logs[f"{prefix}ttt_acc_{step}"] = round(correct[step].item() / max(counts[step].item(), 1), 4)
            metrics["sums"].zero_()
            metrics["batches"] = 0
        if mode == "train" and self._replay_metrics["batches"]:
            logs["lm_replay_loss"] = round(self._replay_metrics["sum"] / self._replay_metrics["batches"], 4)
            self._replay_metrics.update(sum=0.0, batches=0)
        super().log(logs, start_time)


@dataclass
class DistillScriptArguments(DatasetArguments):
    """What to distill on what; the training itself is configured by [`OspreyDistillConfig`]."""

    drafter: str | None = field(default=None, metadata={"help": "Drafter directory written by `osprey convert`."})


def main(argv: list[str] | None = None) -> int:
    """`osprey distill`: `--config config.yaml` and/or flags, see `osprey distill --help`."""
    parser = TrlParser((DistillScriptArguments, OspreyDistillConfig), prog="osprey distill", description=__doc__)
    script_args, config = parser.parse_args_and_config(argv)
    if script_args.drafter is None:
        raise ValueError("Pass --drafter, the drafter directory written by `osprey convert`.")
    drafter = load_drafter(script_args.drafter)
    train_split, test_split = script_args.dataset_train_split, script_args.dataset_test_split
    evaluate = config.eval_strategy != "no"
    if config.feature_cache is not None:
        tokenizer = load_tokenizer(script_args.drafter)
        train_dataset = FeatureCacheDataset(config.feature_cache, train_split)
        has_test = test_split in train_dataset.index["splits"]
        eval_dataset = FeatureCacheDataset(config.feature_cache, test_split) if evaluate and has_test else None
    else:
        if config.target_model is None or script_args.dataset_name is None:
            raise ValueError("Pass --target and --dataset-name, or --feature-cache (see `osprey features`).")
        tokenizer = load_tokenizer(config.target_model)
        dataset = load_text_dataset(script_args)
        train_dataset = dataset[train_split]
        eval_dataset = dataset[test_split] if evaluate and test_split in dataset else None
    trainer = OspreyDistillTrainer(
        drafter, config, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer
    )
    status = train_and_save(trainer, resume_argument(config.resume_from_checkpoint), config.keep_steps)
    if status:
        return status
    trainer.save_state()  # trainer_state.json: the training budget, for the model card
    report = Path(script_args.drafter) / "alignment_report.json"
    if report.is_file():
        shutil.copy2(report, Path(config.output_dir) / report.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
