"""Stopping and resuming: pretraining and distillation resume exactly, a SIGTERM saves the running step, kept
models outlive checkpoint rotation, a resumed run keeps its own schedule, length-grouped batches resume."""

import json
import os

import torch
from conftest import make_tiny_target
from test_trainers import (
    TAPS,
    char_tokenizer,
    distill_config,
    mixed_length_dataset,
    pretrain_config,
    text_dataset,
    tiny_drafter,
    token_dataset,
)

from osprey import OspreyForDrafting
from trainers import (
    FeatureCacheDataset,
    OspreyDistillTrainer,
    OspreyPretrainer,
    build_feature_cache,
)
from trainers.devices import (
    unwrap,
)


def interrupted_and_resumed(tmp_path, make_trainer, total_steps: int, interrupt_at: int):
    """Trains `total_steps` in one go, and in a run stopped after `interrupt_at` steps then resumed from its
    checkpoint by a fresh trainer; returns both final state dicts."""
    uninterrupted = make_trainer(tmp_path / "a", total_steps)
    uninterrupted.train()

    class Interrupt(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= interrupt_at

    interrupted = make_trainer(tmp_path / "b", total_steps, save_steps=interrupt_at)
    interrupted.add_callback(Interrupt())
    interrupted.train()
    assert interrupted.state.global_step == interrupt_at
    resumed = make_trainer(tmp_path / "b", total_steps)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / f"checkpoint-{interrupt_at}"))
    assert resumed.state.global_step == uninterrupted.state.global_step == total_steps
    assert not torch.equal(next(interrupted.model.parameters()), next(resumed.model.parameters()))
    return uninterrupted.model.state_dict(), resumed.model.state_dict()


def test_pretraining_resumes_exactly(tmp_path):
    def make_trainer(output_dir, max_steps, save_steps=None):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(
            tmp_path,
            output_dir=str(output_dir),
            max_steps=max_steps,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
        )
        return OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer())

    expected, resumed = interrupted_and_resumed(tmp_path, make_trainer, total_steps=8, interrupt_at=3)
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def test_sigterm_saves_the_running_step_and_stops_without_a_final_model(tmp_path):
    """`timeout` ends a chunk of a long run with SIGTERM: the step in flight is finished and checkpointed, and no
    final model is written that would pass for a finished run; a run that is not signalled ends as before."""
    import signal

    from trainers.devices import train_and_save

    class Terminate(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    def make_trainer(output_dir):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(tmp_path, output_dir=str(output_dir), max_steps=5, save_strategy="no")
        return OspreyPretrainer(model, config, train_dataset=text_dataset(), processing_class=char_tokenizer())

    handler = signal.getsignal(signal.SIGTERM)
    signalled = make_trainer(tmp_path / "signalled")
    signalled.add_callback(Terminate())
    assert train_and_save(signalled, None) == 128 + signal.SIGTERM
    assert signalled.state.global_step == 2
    assert sorted(path.name for path in (tmp_path / "signalled").iterdir() if path.name.startswith("checkpoint-")) == [
        "checkpoint-2"
    ]
    assert not (tmp_path / "signalled" / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # a second SIGTERM ends the process as usual

    plain = make_trainer(tmp_path / "plain")
    assert train_and_save(plain, None) == 0
    assert plain.state.global_step == 5
    assert (tmp_path / "plain" / "model.safetensors").is_file()
    assert signal.getsignal(signal.SIGTERM) == handler


def test_models_at_the_keep_steps_outlive_checkpoint_rotation(tmp_path):
    """A long run's learning-curve points: the model at each of `keep_steps` is evaluated and kept, whole and without
    the optimizer, in `kept/step-N` while `save_total_limit` rotates the resume checkpoints away; steps not listed are
    not kept, nor evaluated before the last."""
    from safetensors.torch import load_file

    from trainers.devices import train_and_save

    target, seen = make_tiny_target("llama"), {}

    class Snapshot(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen[state.global_step] = {name: t.detach().clone() for name, t in unwrap(model).state_dict().items()}

    config = distill_config(
        tmp_path,
        max_steps=5,
        save_strategy="steps",
        save_steps=100,
        save_total_limit=1,
        eval_strategy="steps",
        eval_steps=100,
        keep_steps=[2, 4],
    )
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        config,
        train_dataset=token_dataset(32, 12),
        eval_dataset=token_dataset(4, 12, seed=1),
        target_model=target,
    )
    trainer.add_callback(Snapshot())
    assert train_and_save(trainer, None, config.keep_steps) == 0
    output = tmp_path / "distill"
    assert sorted(path.name for path in (output / "kept").iterdir()) == ["step-2", "step-4"]
    evaluated = {entry["step"] for entry in trainer.state.log_history if "eval_loss" in entry}
    assert {2, 4} <= evaluated and not {1, 3} & evaluated  # (and the last step, as `Trainer` does)
    assert len(list(output.glob("checkpoint-*"))) == 1 and not (output / "checkpoint-2").exists()  # rotated away
    for step in (2, 4):
        kept = output / "kept" / f"step-{step}"
        assert not (kept / "optimizer.pt").exists()
        assert json.loads((kept / "trainer_state.json").read_text())["global_step"] == step
        weights = load_file(kept / "model.safetensors")
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, seen[step][name], rtol=0, atol=0, msg=name)
        assert not torch.equal(weights["model.fc.weight"], seen[5]["model.fc.weight"])  # not the final model
        OspreyForDrafting.from_pretrained(kept)  # loads as a drafter


def test_a_resumed_run_evaluates_and_saves_on_its_own_schedule(tmp_path):
    """A run resumed with other `eval_steps` and `save_steps` than its checkpoint's follows the new ones (the
    `Trainer` alone keeps the checkpoint's: stage 2 evaluated for 27 minutes at a step its config had dropped)."""
    from trainers.devices import train_and_save

    def run(max_steps, every, resume):
        model = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2).train()
        config = pretrain_config(
            tmp_path,
            output_dir=str(tmp_path / "run"),
            max_steps=max_steps,
            eval_strategy="steps",
            eval_steps=every,
            save_strategy="steps",
            save_steps=every,
            save_total_limit=None,
        )
        trainer = OspreyPretrainer(
            model, config, train_dataset=text_dataset(), eval_dataset=text_dataset(4), processing_class=char_tokenizer()
        )
        assert train_and_save(trainer, resume) == 0
        return trainer

    run(max_steps=2, every=2, resume=None)
    resumed = run(max_steps=6, every=3, resume=str(tmp_path / "run" / "checkpoint-2"))
    assert [entry["step"] for entry in resumed.state.log_history if "eval_loss" in entry] == [2, 3, 6]
    assert sorted(int(path.name.split("-")[1]) for path in (tmp_path / "run").glob("checkpoint-*")) == [2, 3, 6]


def assert_distillation_resumes_exactly(
    tmp_path, target, dataset, total_steps, interrupt_at, drafter_overrides=None, **settings
):
    """A distillation interrupted after `interrupt_at` steps and resumed from its checkpoint ends bit-identical to
    the same run uninterrupted."""

    def make_trainer(output_dir, max_steps, save_steps=None):
        config = distill_config(
            tmp_path,
            output_dir=str(output_dir),
            max_steps=max_steps,
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
            **settings,
        )
        drafter = tiny_drafter(target, **(drafter_overrides or {}))
        return OspreyDistillTrainer(drafter, config, train_dataset=dataset, target_model=target)

    expected, resumed = interrupted_and_resumed(tmp_path, make_trainer, total_steps, interrupt_at)
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)


def test_distillation_resumes_exactly(tmp_path):
    target = make_tiny_target("llama")
    assert_distillation_resumes_exactly(
        tmp_path, target, token_dataset(32, 12), total_steps=6, interrupt_at=2, lr_scheduler_type="cosine"
    )


def test_length_grouped_batches_pad_less_and_resume_exactly(tmp_path):
    target = make_tiny_target("llama")
    lengths = [int(n) for n in torch.randint(5, 40, (160,), generator=torch.Generator().manual_seed(4))]
    dataset = mixed_length_dataset(lengths, seed=4)
    cache = FeatureCacheDataset(build_feature_cache(target, {"train": dataset}, tmp_path / "cache", TAPS))
    assert cache.lengths == lengths

    def padded_positions(strategy, epoch):
        trainer = OspreyDistillTrainer(
            tiny_drafter(target), distill_config(tmp_path, train_sampling_strategy=strategy), train_dataset=cache
        )
        loader = trainer.get_train_dataloader()
        loader.set_epoch(epoch)
        batches = [batch["input_ids"] for batch in loader]
        seen = sorted(tuple(row[: (row != 0).nonzero().max() + 1].tolist()) for batch in batches for row in batch)
        assert seen == sorted(tuple(ids) for ids in dataset["input_ids"])  # every sequence once an epoch
        return [batch.numel() for batch in batches]

    grouped = padded_positions("group_by_length", 0)
    assert sum(grouped) < 0.8 * sum(padded_positions("random", 0))
    assert padded_positions("group_by_length", 1) != grouped  # a new order each epoch
    assert padded_positions("group_by_length", 0) == grouped  # and the same order for the same epoch

    # 10 batches an epoch: interrupted in the second epoch, at a step the random strategy would order differently.
    assert_distillation_resumes_exactly(
        tmp_path,
        target,
        dataset.select(range(40)),
        total_steps=14,
        interrupt_at=12,
        train_sampling_strategy="group_by_length",
    )
