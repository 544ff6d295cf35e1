"""Where and in which precision the trainers run, one rule for all of them: bf16 mixed precision exactly where CUDA
supports it (CPU runs in float32), host memory pinned only when there is a device to copy to, and the frozen target
loaded in bfloat16 or float32 to match."""

import torch
from transformers import PreTrainedModel, TrainingArguments

from osprey.zoo import load_causal_lm


def cuda_bf16_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def set_device_defaults(args: TrainingArguments) -> None:
    """Fills a trainer config's `bf16` when left unset (None) and turns off pinned memory without an accelerator;
    called by the configs' `__post_init__` before `TrainingArguments` checks them."""
    if args.bf16 is None:
        args.bf16 = cuda_bf16_available() and not args.fp16 and not args.use_cpu
    if not torch.accelerator.is_available():  # pinning host memory only helps copies to a device
        args.dataloader_pin_memory = False


def load_target(name_or_path: str, dtype: str, device_map: str | None = None) -> PreTrainedModel:
    """The frozen target of distillation or a feature cache; `dtype="auto"` is bfloat16 where CUDA has it."""
    if dtype == "auto":
        dtype = "bfloat16" if cuda_bf16_available() else "float32"
    return load_causal_lm(name_or_path, dtype=getattr(torch, dtype), device_map=device_map)
