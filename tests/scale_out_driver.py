"""The worker of `tests/test_scale_out.py`: what `accelerate launch` starts in every process.

`python scale_out_driver.py RUNS.json` runs the `osprey pretrain` / `osprey distill` scripts (`trainers.pretrain.main`,
`trainers.distill.main`, the modules `accelerate launch -m trainers.distill` runs) once per entry of `RUNS.json`, a
list of `{"stage": "pretrain" | "distill", "argv": [...], "report": PATH}`, in order, in the same processes. The main
process writes each run's report to its `report`: the distributed type, whether the trained parameters are sharded
(FSDP), the optimizer steps it ran and the loss logged at every step. `run(stage, argv, report)` does the same in the
calling process (the tests' one-process reference runs).

On a machine without GPUs accelerate does not turn FSDP on: `AcceleratorState` takes the FSDP plugin (built from
`ACCELERATE_USE_FSDP`, which `accelerate launch --config_file fsdp.yaml` sets) only on accelerator devices and runs
CPU processes as plain DDP, silently (accelerate 1.16). So that the shipped `fsdp.yaml` is tested on CPU processes
(gloo) as it runs on GPUs (FSDP2 sharding, the full state dict it saves, its checkpoints), this worker makes
accelerate keep the plugin on CPU too (`keep_fsdp_on_cpu`) when that variable is set. Nothing else is changed.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback


def keep_fsdp_on_cpu() -> None:
    """Makes `AcceleratorState` keep its FSDP plugin for CPU processes (MULTI_CPU), as it does for GPUs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original_init = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def is_sharded(model) -> bool:
    """Whether some parameter of `model` holds only a shard of itself in this process (an FSDP2 DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())


class StepCounter(TrainerCallback):
    """Counts the optimizer steps this process ran (a resumed run: only those after its checkpoint)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


@contextlib.contextmanager
def reporting(module, report: str | None):
    """Wraps `module.train_and_save` so that the main process writes the trained run's report to `report`."""
    train_and_save = module.train_and_save

    def train_and_report(trainer, *args, **kwargs):
        counter = StepCounter()
        trainer.add_callback(counter)
        status = train_and_save(trainer, *args, **kwargs)
        if report is not None and trainer.accelerator.is_main_process:
            logs = [entry for entry in trainer.state.log_history if "loss" in entry]
            summary = {
                "status": status,
                "distributed_type": trainer.accelerator.distributed_type.value,
                "num_processes": trainer.accelerator.num_processes,
                "sharded": is_sharded(trainer.model),
                "global_step": trainer.state.global_step,
                "steps_run": counter.steps,
                "steps": [entry["step"] for entry in logs],
                "losses": [entry["loss"] for entry in logs],
            }
            Path(report).write_text(json.dumps(summary))
        return status

    module.train_and_save = train_and_report
    try:
        yield
    finally:
        module.train_and_save = train_and_save


def run(stage: str, argv: list[str], report: str | None = None) -> int:
    """`osprey STAGE ARGV...` in this process; the main process writes the run's report to `report`."""
    import trainers.distill
    import trainers.pretrain

    module = {"pretrain": trainers.pretrain, "distill": trainers.distill}[stage]
    with reporting(module, report):
        return module.main(argv)


def main() -> int:
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        keep_fsdp_on_cpu()  # acts on CPU processes only
    status = 0
    for entry in json.loads(Path(sys.argv[1]).read_text()):
        status = status or run(entry["stage"], entry["argv"], entry.get("report"))
    # Every process waits for the main one to finish saving, then ends its process group.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    status = main()
    # Every run's products are written and the process group is gone; the process ends here without the interpreter's
    # teardown. After a resumed FSDP run on CPU processes (gloo, the configuration `keep_fsdp_on_cpu` makes and
    # accelerate does not), that teardown sometimes aborts in a C++ destructor with no Python frame left ("terminate
    # called without an active exception"), which would fail a run that finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
