"""Where and in which precision the trainers run, one rule for all of them: bf16 mixed precision exactly where CUDA
supports it (CPU runs in float32), host memory pinned only when there is a device to copy to, the frozen target
loaded in bfloat16 or float32 to match, one autocast per loss (`loss_autocast`), and on a CPU with glibc freed memory
kept in the C heap for reuse and given back after growth (`set_cpu_memory_policy`)."""

import contextlib
import ctypes
import ctypes.util
import functools
import os
import shutil
import signal
import threading
from pathlib import Path

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, IntervalStrategy

from osprey.models.zoo import load_causal_lm


def cuda_bf16_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def set_device_defaults(args: TrainingArguments) -> None:
    """Fills a trainer config's `bf16` when left unset (None) and turns off pinned memory without an accelerator;
    called by the configs' `__post_init__` before `TrainingArguments` checks them. Without an accelerator `bf16: true`
    means bf16 autocast on the CPU, which `TrainingArguments` accepts only with `use_cpu`: it is set, so that one
    config runs on a GPU machine and on a CPU-only one."""
    if args.bf16 is None:
        args.bf16 = cuda_bf16_available() and not args.fp16 and not args.use_cpu
    if not torch.accelerator.is_available():  # pinning host memory only helps copies to a device
        args.dataloader_pin_memory = False
        args.use_cpu = args.use_cpu or bool(args.bf16)


def load_target(name_or_path: str, dtype: str, device_map: str | None = None) -> PreTrainedModel:
    """The frozen target of distillation or a feature cache; `dtype="auto"` is bfloat16 where CUDA has it."""
    if dtype == "auto":
        dtype = "bfloat16" if cuda_bf16_available() else "float32"
    return load_causal_lm(name_or_path, dtype=getattr(torch, dtype), device_map=device_map)


def unwrap(model):
    """The model inside its DistributedDataParallel (or similar) and `torch.compile` wrappers."""
    return extract_model_from_parallel(model, keep_torch_compile=False)


def loss_autocast(trainer: Trainer, model) -> contextlib.AbstractContextManager:
    """One bf16 autocast around a whole loss computation, instead of accelerate's around each forward of `model`.

    Under mixed precision accelerate wraps the model's forward in autocast and converts its outputs to float32. For a
    language-model head that is a float32 copy of its `(tokens, vocabulary)` logits (and a cast of their gradient
    back in the backward), and, when the loss calls the model several times (TTT steps), every weight cast to bf16
    again, as autocast caches casts for one forward only. The fused cross-entropies read bf16 logits themselves; so
    with bf16 this drops the wrapper and returns one autocast for the caller's loss: logits stay bf16, weights are
    cast once. Losses are the same numbers; the logits' gradient is rounded to bf16 before its scale is applied
    instead of after. fp16 keeps accelerate's wrapper (its loss scaling needs the float32 gradient)."""
    if not trainer.args.bf16:
        return contextlib.nullcontext()
    module = unwrap(model)
    # accelerate's own `unwrap_model(keep_fp32_wrapper=False)` would follow `__wrapped__` past this bound forward into
    # the undecorated class function, dropping transformers' forward decorators: restore exactly what it wrapped.
    original_forward = module.__dict__.pop("_original_forward", None)  # set by accelerate with its wrapper
    if original_forward is not None:
        module.forward = original_forward
    return trainer.accelerator.autocast()


def compile_with_dynamic_shapes(accelerator_args: dict) -> dict:
    """The accelerator arguments of a trainer with `torch_compile` (`--torch_compile true`) traced with dynamic
    shapes, unless the backend needs static ones (transformers leaves it to accelerate's default otherwise).

    Batches of a distillation or stage 2 vary in length: compiled for static shapes, the model is compiled for the
    first batch's length and compiled again, with dynamic shapes, on the second. Traced dynamic from the start it is
    compiled once per variant of the call (each TTT step's, training and evaluation), and it runs a distillation step
    faster than the static trace does (docs/training.md, "Training throughput")."""
    plugin = accelerator_args.get("dynamo_plugin")
    if plugin is not None and plugin.dynamic is None:
        plugin.dynamic = True
    return accelerator_args


def states_in_parameter_layout(optimizer: torch.optim.Optimizer) -> None:
    """Gives every optimizer state shaped like its parameter the parameter's strides; registered to run after each
    `load_state_dict`. A fused AdamW steps over the parameter, its gradient and its states as flat memory: a state
    saved row-major (an older checkpoint) stepped beside a column-major parameter (`store_column_major`) would update
    the wrong elements, silently."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


@functools.cache
def _glibc():
    """The C library when it is glibc on Linux (with `mallopt` and `malloc_trim`), else None."""
    if not os.path.exists("/proc/self/statm"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
MALLOC_ENVIRONMENT = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_heap() -> bool:
    """Makes glibc serve every allocation from its heap and keep what is freed there for reuse (no `mmap` for large
    blocks, no automatic trim); False where that is not available, or where the environment already sets glibc's
    malloc tunables (then they rule).

    By default glibc maps each block above 32 MiB afresh and unmaps it on free, so every large tensor of a training
    step (logits' gradients, target distributions) arrives as new pages the kernel must fault in and zero, seconds of
    system time per step on a CPU; kept in the heap, they are reused instead (docs/training.md, "Training
    throughput"). The heap then only grows; `HeapTrimCallback` gives its free pages back."""
    libc = _glibc()
    if libc is None or any(name in os.environ for name in MALLOC_ENVIRONMENT):
        return False
    libc.mallopt(M_MMAP_MAX, 0)
    # -1 turns automatic trimming off: the largest positive value, 2 GiB - 1, still gives back the heap's free top
    # whenever a step frees more than that, and the next micro-batch faults it in again (docs/training.md)
    libc.mallopt(M_TRIM_THRESHOLD, -1)
    return True


def resident_bytes() -> int:
    """This process's resident memory not shared with others (Linux `/proc/self/statm`: resident minus shared)."""
    with open("/proc/self/statm") as statm:
        _, resident, shared, *_ = map(int, statm.read().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> bool:
    """Gives the C heap's free pages back to the system (`malloc_trim(0)`); False where that is not available."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


class HeapTrimCallback(TrainerCallback):
    """After an optimizer step that ends with this process's resident memory `growth` times what it was at the end of
    the first step after the last trim (or of training's first step), gives the C heap's free pages back to the system.

    On a CPU, PyTorch takes tensor memory from the C allocator. With batches of varying lengths glibc's heap fills
    with free holes between live blocks, which it keeps, so a distillation's resident memory grows to several times
    what `malloc_trim(0)` leaves (docs/training.md, "Memory on a CPU"), enough for runs side by side to meet the
    kernel's OOM killer. A trim costs the pages' faults on their next use, so it runs only after that much growth,
    counted from a step's end, when the heap holds a whole step's working memory: counted from right after a trim,
    the next step alone would grow past the limit, and a distillation would trim (and fault its memory in again)
    every step or two.
    """

    def __init__(self, growth: float = 1.5):
        if growth <= 1:
            raise ValueError(f"growth must be above 1, got {growth}.")
        self.growth = growth
        self.limit = None
        self.trims = 0

    def on_step_end(self, args, state, control, **kwargs):
        resident = resident_bytes()
        if self.limit is None:
            self.limit = self.growth * resident
        elif resident > self.limit and release_free_heap():
            self.trims += 1
            self.limit = None  # set again after the next step, with that step's working memory back in the heap


class StopOnTerminate(TrainerCallback):
    """On SIGTERM (what `timeout` sends when a chunk's time is up), lets the running optimizer step finish, saves a
    checkpoint of it and stops training, so a chunked run loses no update it paid for (killed mid-way, a chunk would
    lose every update since the last `save_steps` checkpoint). A second SIGTERM ends the process at once, as without
    this callback."""

    def __init__(self):
        self.received = False
        self._previous = None

    def _handle(self, signum, frame):
        self.received = True
        signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)  # None: a handler not set from Python

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():  # Python handles signals in the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.received:
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._previous is not None and not self.received:
            signal.signal(signal.SIGTERM, self._previous)


class ScheduleFromArguments(TrainerCallback):
    """Logs, evaluates and saves on this run's `logging_steps`, `eval_steps` and `save_steps`, also when it resumes.

    A resumed `Trainer` takes these three from the checkpoint's `trainer_state.json` and only warns that they differ
    from the arguments: a run resumed with a larger `eval_steps` (to make room for a long evaluation) would still
    evaluate at the old steps, and an evaluation that runs past a chunk's end keeps its SIGTERM stop from saving, so
    the chunk's updates are lost."""

    def on_train_begin(self, args, state, control, **kwargs):
        state.compute_steps(args, state.max_steps)


class KeepModelAt(TrainerCallback):
    """The points of a learning curve in a long run whose rolling checkpoints only serve to resume it: at each of
    `steps` the model is evaluated (unless `eval_strategy` is "no"), checkpointed, and that checkpoint's model
    (weights, configs, trainer state; not the optimizer) kept in `output_dir/kept/step-N`, beyond the reach of
    `save_total_limit`'s rotation, to be benchmarked later."""

    KEPT_DIR = "kept"
    LEFT_OUT = ("optimizer.pt", "scheduler.pt", "training_args.bin")

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            control.should_save = True
            control.should_evaluate = args.eval_strategy != IntervalStrategy.NO

    def on_save(self, args, state, control, **kwargs):
        if state.global_step not in self.steps or not state.is_world_process_zero:
            return
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        kept = Path(args.output_dir) / self.KEPT_DIR / f"step-{state.global_step}"
        if kept.exists():  # kept by an earlier run that was resumed from before this step
            return
        partial = kept.with_name(kept.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(
            checkpoint, partial, ignore=lambda _, names: [n for n in names if n in self.LEFT_OUT or n.startswith("rng")]
        )
        partial.rename(kept)


def train_and_save(trainer: Trainer, resume_from_checkpoint: str | bool | None, keep_steps=()) -> int:
    """Trains, then saves the model to `output_dir` and returns 0; both stages' scripts end with it. A resumed run
    keeps this run's logging, evaluation and save steps (`ScheduleFromArguments`); the models at `keep_steps` are
    kept in `output_dir/kept/step-N` (`KeepModelAt`). Stopped by SIGTERM (`StopOnTerminate`), it saves only the step's
    checkpoint, not a final model that would pass for a finished run, and returns 143 (128 + SIGTERM): resume with
    `--resume-from-checkpoint true`."""
    stop = StopOnTerminate()
    trainer.add_callback(ScheduleFromArguments())
    if keep_steps:
        trainer.add_callback(KeepModelAt(keep_steps))
    trainer.add_callback(stop)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    if stop.received:
        print(
            f"stopped by SIGTERM after step {trainer.state.global_step}, its checkpoint saved in "
            f"{trainer.args.output_dir}: resume with --resume-from-checkpoint true",
            flush=True,
        )
        return 128 + signal.SIGTERM
    trainer.save_model(trainer.args.output_dir)
    return 0


def set_cpu_memory_policy(trainer: Trainer) -> None:
    """On a CPU with glibc: freed memory kept in the heap for reuse (`keep_freed_heap`) and given back after each
    1.5x growth of resident memory (`HeapTrimCallback`). Both trainers call it."""
    if trainer.args.device.type == "cpu" and _glibc() is not None:
        keep_freed_heap()
        trainer.add_callback(HeapTrimCallback())
