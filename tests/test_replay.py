"""Keeping the backbone's languages: the plain language-modelling replay term and the pretrained learning-rate
scale, their resumption, errors and flags."""

import json
import os
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from datasets import Dataset
from test_resume import assert_distillation_resumes_exactly
from test_trainers import (
    TAPS,
    char_tokenizer,
    distill_config,
    logged,
    predictable_target,
    text_dataset,
    tiny_drafter,
    token_dataset,
)

import trainers.distill
from osprey import OspreyForDrafting
from trainers import (
    DistillDataCollator,
    FeatureCacheDataset,
    OspreyDistillConfig,
    OspreyDistillTrainer,
    build_feature_cache,
)


def converted_drafter(tmp_path, draft_vocab_size: int | None = 40):
    """A tiny Llama backbone, a drafter `osprey convert` made from it for a tiny Llama target (both speaking
    `char_tokenizer`, so every text token maps directly), that target, and the tokenizer."""
    from osprey.stages.convert import convert

    tokenizer = char_tokenizer()
    backbone = make_tiny_target("llama", vocab_size=128, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    target = make_tiny_target("llama", vocab_size=128)
    corpus = tmp_path / "draft-vocab.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20 + "0123456789\n")
    drafter, _ = convert(
        backbone,
        target.config,
        target_layer_ids=TAPS,
        draft_vocab_size=draft_vocab_size,
        corpus=[corpus] if draft_vocab_size else None,
        backbone_tokenizer=tokenizer,
        target_tokenizer=tokenizer,
    )
    return backbone, drafter, target, tokenizer


def padded_text_batch(lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded random text tokens (ids 6..101 of `char_tokenizer`), every token a training target."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(6, 102, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": attention_mask.clone()}


@torch.no_grad()
def test_lm_replay_of_a_converted_drafter_is_its_backbones_cross_entropy(tmp_path):
    """The replay term reads no target features: on a freshly converted drafter it is the backbone's own next-token
    cross-entropy over the draft vocabulary (next tokens outside it ignored), and it stays so whatever the feature
    weights become in training; the control reads features and no longer computes the backbone."""
    from trainers.ttt import lm_replay_loss, target_to_draft_ids

    backbone, drafter, _, _ = converted_drafter(tmp_path)
    batch = padded_text_batch([14, 9], seed=2)
    draft_to_target = drafter.draft_to_target
    target_to_draft = target_to_draft_ids(draft_to_target, drafter.config.vocab_size)
    total, count = 0.0, 0
    for row in range(2):
        ids = batch["input_ids"][row, : int(batch["attention_mask"][row].sum())]
        logits = backbone(ids[None]).logits[0, :-1][:, draft_to_target]  # the backbone's, over the draft vocabulary
        labels = target_to_draft[ids[1:]]
        kept = labels >= 0
        total += torch.nn.functional.cross_entropy(logits[kept], labels[kept], reduction="sum")
        count += int(kept.sum())
    assert 5 < count < 21  # some next tokens are outside the 40-token draft vocabulary, and ignored
    replay, replay_count = lm_replay_loss(drafter, **batch, target_to_draft=target_to_draft)
    assert int(replay_count) == count
    torch.testing.assert_close(replay, total / count, rtol=1e-5, atol=1e-5)

    hidden = drafter.config.hidden_size
    for projection in ("q_proj", "k_proj", "v_proj"):  # distillation opens the feature half of q/k/v, and fc
        getattr(drafter.model.layers[0].self_attn, projection).weight[:, :hidden].normal_()
    drafter.model.fc.weight.normal_()
    drafter.model.layers[0].hidden_norm.weight.normal_()
    torch.testing.assert_close(lm_replay_loss(drafter, **batch, target_to_draft=target_to_draft)[0], replay)
    features = torch.randn(*batch["input_ids"].shape, drafter.config.fused_feature_size)
    with_features = drafter(batch["input_ids"], target_hidden_states=features, attention_mask=batch["attention_mask"])
    without = drafter(batch["input_ids"], draft_hidden_states=torch.zeros(*batch["input_ids"].shape, hidden),
                      attention_mask=batch["attention_mask"])  # fmt: skip
    assert not torch.allclose(with_features.logits, without.logits, atol=1e-3)


def test_linear_token_cross_entropy_equals_the_head_then_the_loss():
    from trainers.losses import linear_token_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=generator)
    labels[::5] = -100
    loss, correct = linear_token_cross_entropy(hidden, weight, labels, chunk_size=8, gemm_chunk_size=16)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert int(correct) == int(((logits.argmax(-1) == labels) & (labels >= 0)).sum())
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_replay_batches_are_a_pure_function_of_the_draw():
    from trainers.distill import replay_indices

    drawn = [replay_indices(draw, 3, 10, seed=5) for draw in range(10)]  # three epochs of 10 examples
    flat = [index for batch in drawn for index in batch]
    for epoch in range(3):
        assert sorted(flat[10 * epoch : 10 * epoch + 10]) == list(range(10))  # each epoch a permutation
    assert flat[:10] != flat[10:20]  # drawn anew per epoch
    assert drawn == [replay_indices(draw, 3, 10, seed=5) for draw in range(10)]
    assert drawn != [replay_indices(draw, 3, 10, seed=6) for draw in range(10)]


def test_replay_adds_its_weighted_cross_entropy_and_lowers_it(tmp_path):
    """The training loss is `ttt + lm_replay_weight * replay` (logged as `lm_replay_loss`, evaluation leaves it
    out), and with the term on a few steps lower the drafter's cross-entropy on the replay text well below the same
    run's without it."""
    from trainers.distill import replay_indices
    from trainers.ttt import lm_replay_loss, target_to_draft_ids, ttt_loss

    target, tokenizer = predictable_target(), char_tokenizer()
    replay_text, weight = text_dataset(16), 0.5
    settings = dict(max_steps=12, learning_rate=1e-2, logging_steps=4, lm_replay_batch_size=3)
    trainer = OspreyDistillTrainer(
        tiny_drafter(target),
        distill_config(tmp_path, lm_replay_weight=weight, **settings),
        train_dataset=token_dataset(32, 12),
        target_model=target,
        processing_class=tokenizer,
        lm_replay_dataset=replay_text,
    )
    drafter = trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    loss = trainer.compute_loss(drafter, batch)
    features, target_logits, target_argmax = trainer._target_signals(batch, drafter)
    ttt = ttt_loss(drafter, batch["input_ids"], features, target_logits, target_argmax, batch["loss_mask"],
                   drafter.draft_to_target, num_steps=3).loss  # fmt: skip
    replayed = trainer.lm_replay_dataset[replay_indices(0, 3, len(replay_text), seed=0)]
    assert len(replayed["input_ids"]) == 3 and replayed["input_ids"][0][:3] == tokenizer("the")["input_ids"]
    replay_batch = DistillDataCollator()([{"input_ids": ids, "loss_mask": m} for ids, m in
                                          zip(replayed["input_ids"], replayed["loss_mask"])])  # fmt: skip
    target_to_draft = target_to_draft_ids(drafter.draft_to_target, drafter.config.vocab_size)
    replay, _ = lm_replay_loss(drafter, replay_batch["input_ids"], replay_batch["attention_mask"],
                               replay_batch["loss_mask"], target_to_draft)  # fmt: skip
    assert replay > 1.0
    torch.testing.assert_close(loss, ttt + weight * replay)
    drafter.eval()
    torch.testing.assert_close(trainer.compute_loss(drafter, batch), ttt)  # evaluation: the TTT loss alone

    trainer._replay_step = None  # the step-0 batch was drawn above: draw it again in training
    trainer.train()
    replay_losses = logged(trainer, "lm_replay_loss")
    assert len(replay_losses) == 3 and replay_losses[2] < replay_losses[1] < replay_losses[0] - 0.5, replay_losses
    plain = OspreyDistillTrainer(
        tiny_drafter(target), distill_config(tmp_path, **settings), train_dataset=token_dataset(32, 12),
        target_model=target,
    )  # fmt: skip
    plain.train()
    assert not logged(plain, "lm_replay_loss")
    with torch.no_grad():
        held = {name: lm_replay_loss(model.eval(), replay_batch["input_ids"], replay_batch["attention_mask"],
                                     replay_batch["loss_mask"], target_to_draft)[0]
                for name, model in (("replay", trainer.model), ("plain", plain.model))}  # fmt: skip
    assert held["replay"] < held["plain"] - 1.0, held  # replay keeps the LM loss well below plain distillation's


def test_distillation_with_lm_replay_resumes_exactly(tmp_path):
    """The replay corpus named by path (read by `load_text_dataset`), several replay batches per optimizer step
    (gradient accumulation) and replay epochs that end inside a batch: resumed, the run draws what it drew."""
    target = make_tiny_target("llama")
    token_dataset(10, 9, seed=3).to_json(tmp_path / "replay.jsonl")
    assert_distillation_resumes_exactly(
        tmp_path,
        target,
        token_dataset(32, 12),
        total_steps=5,
        interrupt_at=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        lm_replay_dataset=str(tmp_path / "replay.jsonl"),
        lm_replay_weight=0.5,
        lm_replay_batch_size=3,
    )


def one_step_updates(tmp_path, drafter, target, scale: float) -> dict[str, torch.Tensor]:
    """Every parameter's change in one AdamW step (weight decay on) of a distillation at `scale`."""
    import copy

    model = copy.deepcopy(drafter).train()
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    config = distill_config(
        tmp_path, max_steps=1, learning_rate=1e-3, weight_decay=0.1, pretrained_learning_rate_scale=scale
    )
    trainer = OspreyDistillTrainer(
        model, config, train_dataset=token_dataset(8, 12, vocab_size=102), target_model=target
    )
    trainer.train()
    initial_rates = [group["initial_lr"] for group in trainer.optimizer.param_groups]  # (decay, no decay) x (new, old)
    assert initial_rates == ([1e-3] * 2 if scale == 1 else [1e-3, 1e-3 * scale] * 2)
    return {name: param.detach() - before[name] for name, param in model.named_parameters()}


def test_backbone_weights_train_at_the_scaled_learning_rate(tmp_path):
    """After one step, every element the backbone supplied moved `scale` times as far as with scale 1 (weight decay
    included), and the elements convert added (fc, hidden_norm, the feature columns of block 0's q/k/v) as far; both
    halves of q/k/v are checked apart, so a mask on the wrong columns (or none) fails. The feature columns start
    open (as after some distillation): at exactly zero they would pass fc and hidden_norm no gradient."""
    _, drafter, target, _ = converted_drafter(tmp_path)
    scale, hidden = 0.25, drafter.config.hidden_size
    with torch.no_grad():
        for name in "qkv":
            getattr(drafter.model.layers[0].self_attn, f"{name}_proj").weight[:, :hidden].normal_(std=0.05)
    full, scaled = one_step_updates(tmp_path, drafter, target, 1.0), one_step_updates(tmp_path, drafter, target, scale)
    close = partial(torch.testing.assert_close, rtol=1e-3, atol=3e-7)  # a few float32 ulps of the weights (~1)
    fusion_qkv = [f"model.layers.0.self_attn.{name}_proj.weight" for name in "qkv"]
    added = ["model.fc.weight", "model.layers.0.hidden_norm.weight"]
    for name, update in full.items():
        assert update.abs().sum() > 0, name
        if name in added:
            close(scaled[name], update, msg=name)
        elif name in fusion_qkv:
            features, tokens = update[:, :hidden], update[:, hidden:]
            assert features.abs().sum() > 0 and tokens.abs().sum() > 0, name
            close(scaled[name][:, :hidden], features, msg=name)
            close(scaled[name][:, hidden:], scale * tokens, msg=name)
            assert not torch.allclose(scaled[name][:, :hidden], scale * features, rtol=1e-2)
            assert not torch.allclose(scaled[name][:, hidden:], tokens, rtol=1e-2)
        else:
            close(scaled[name], scale * update, msg=name)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.up_proj.weight"} <= set(full)


def test_distillation_with_a_pretrained_learning_rate_scale_resumes_exactly(tmp_path):
    """The split param groups are saved and loaded in order (the optimizer state loads without error and the run
    trains on bit-identically); a resume that changes the scale is refused by name."""
    target = make_tiny_target("llama")
    settings = dict(pretrained_learning_rate_scale=0.5, lr_scheduler_type="cosine", weight_decay=0.1)
    assert_distillation_resumes_exactly(
        tmp_path, target, token_dataset(32, 12), total_steps=5, interrupt_at=2,
        drafter_overrides={"backbone_model_type": "llama"}, **settings,
    )  # fmt: skip
    config = distill_config(tmp_path, output_dir=str(tmp_path / "b"), max_steps=5)
    other = OspreyDistillTrainer(
        tiny_drafter(target, backbone_model_type="llama"), config, train_dataset=token_dataset(32, 12),
        target_model=target,
    )  # fmt: skip
    with pytest.raises(ValueError, match="trained with pretrained_learning_rate_scale 0.5, this run asks for 1.0"):
        other.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


def test_replay_and_learning_rate_scale_errors_name_the_fix(tmp_path):
    target = make_tiny_target("llama")
    data = token_dataset(8, 12)
    with pytest.raises(ValueError, match="lm_replay_weight must be 0 \\(off\\) or positive"):
        distill_config(tmp_path, lm_replay_weight=-0.1, lm_replay_dataset="multilingual")
    with pytest.raises(ValueError, match="corpus \\(multilingual\\).*lm_replay_weight is 0.*probably a mistake"):
        distill_config(tmp_path, lm_replay_dataset="multilingual")
    for scale in (0.0, 1.5):
        with pytest.raises(ValueError, match="pretrained_learning_rate_scale must be in \\(0, 1\\]"):
            distill_config(tmp_path, pretrained_learning_rate_scale=scale)
    assert distill_config(tmp_path, lm_replay_weight=0.1).lm_replay_batch_size == 4  # per_device_train_batch_size

    def trainer(drafter=None, **settings):
        replay = settings.pop("replay", None)
        return OspreyDistillTrainer(
            drafter or tiny_drafter(target), distill_config(tmp_path, **settings), train_dataset=data,
            target_model=target, processing_class=char_tokenizer(), lm_replay_dataset=replay,
        )  # fmt: skip

    with pytest.raises(ValueError, match="needs a corpus to replay: pass --lm-replay-dataset"):
        trainer(lm_replay_weight=0.1)
    with pytest.raises(ValueError, match="lm_replay_weight is 0.*probably a mistake"):
        trainer(replay=text_dataset(4))
    with pytest.raises(ValueError, match="is empty: no example has 3 tokens or more"):
        trainer(replay=Dataset.from_dict({"text": ["ab", "", "c"]}), lm_replay_weight=0.1)
    with pytest.raises(ValueError, match="not streamed"):
        trainer(replay=text_dataset(4).to_iterable_dataset(), lm_replay_weight=0.1)

    with pytest.raises(ValueError, match="records no backbone.*not made by `osprey convert`"):
        trainer(pretrained_learning_rate_scale=0.5)  # a drafter with no backbone_model_type
    eagle3 = tiny_drafter(target, num_hidden_layers=1, residual_stream="features")
    with pytest.raises(ValueError, match="this EAGLE-3 drafter has none"):
        trainer(eagle3, pretrained_learning_rate_scale=0.5)
    trainer(tiny_drafter(target, backbone_model_type="llama"), pretrained_learning_rate_scale=0.5)  # accepted


def test_the_controls_are_distilled_without_a_pretrained_learning_rate_scale_by_their_driver(tmp_path):
    """`osprey baseline scratch` keeps the converted config (its backbone_model_type too) but its blocks are random.
    The library reads only the config, so it takes the option for the scratch control as for any converted drafter;
    the experiment's driver (benchmarks/replication/languages_qwen.sh) refuses a control with the option (`-slow`)."""
    from osprey.stages.baselines import build_baseline

    _, drafter, target, tokenizer = converted_drafter(tmp_path, draft_vocab_size=None)
    drafter.save_pretrained(tmp_path / "osprey")
    tokenizer.save_pretrained(tmp_path / "osprey")
    build_baseline("scratch", tmp_path / "osprey", tmp_path / "scratch")
    scratch = OspreyForDrafting.from_pretrained(tmp_path / "scratch")
    assert scratch.config.backbone_model_type == "llama"
    config = distill_config(tmp_path, pretrained_learning_rate_scale=0.5)
    OspreyDistillTrainer(scratch, config, train_dataset=token_dataset(8, 12, vocab_size=102), target_model=target)
    script = Path(__file__).parents[1] / "benchmarks" / "replication" / "languages_qwen.sh"
    for variant in ("scratch-mixed-slow", "eagle3-en-vocab-replay-slow"):
        run = subprocess.run(
            ["bash", str(script), "train", variant],
            env={**os.environ, "RUNS": str(tmp_path / "runs")},
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 2
        assert f"{variant}: the controls are distilled without --pretrained-learning-rate-scale" in run.stderr
        assert f"run {variant.removesuffix('-slow')}," in run.stderr


def test_cli_takes_the_replay_and_scale_flags_hyphenated():
    from transformers import HfArgumentParser

    argv = ["--output-dir", "out", "--lm-replay-dataset", "multilingual", "--lm-replay-weight", "0.2",
            "--lm-replay-batch-size", "2", "--lm-replay-max-length", "256",
            "--pretrained-learning-rate-scale", "0.1"]  # fmt: skip
    (config,) = HfArgumentParser(OspreyDistillConfig).parse_args_into_dataclasses(argv)
    assert (config.lm_replay_dataset, config.lm_replay_weight, config.lm_replay_batch_size) == ("multilingual", 0.2, 2)
    assert (config.lm_replay_max_length, config.pretrained_learning_rate_scale) == (256, 0.1)


def test_osprey_distill_replays_and_scales_from_a_feature_cache(tmp_path):
    """The usual way: `osprey distill --feature-cache` with a text replay corpus (tokenized by the drafter's
    tokenizer) and the scale; the cached run's loss, replay term included, is the live run's."""
    target, tokenizer = make_tiny_target("llama"), char_tokenizer()
    dataset = token_dataset(8, 12, seed=1)
    cache = build_feature_cache(target, {"train": dataset}, tmp_path / "cache", TAPS, dtype=torch.float32)
    text_dataset(16).to_json(tmp_path / "replay.jsonl")
    replay = dict(lm_replay_dataset=str(tmp_path / "replay.jsonl"), lm_replay_weight=0.5)
    drafter = tiny_drafter(target, backbone_model_type="llama").train()
    live = OspreyDistillTrainer(drafter, distill_config(tmp_path, **replay), train_dataset=dataset,
                                target_model=target, processing_class=tokenizer)  # fmt: skip
    cached_dataset = FeatureCacheDataset(cache, "train")
    cached = OspreyDistillTrainer(drafter, distill_config(tmp_path, **replay), train_dataset=cached_dataset,
                                  processing_class=tokenizer)  # fmt: skip
    live_batch = live._prepare_inputs(next(iter(live.get_eval_dataloader(dataset))))
    cached_batch = cached._prepare_inputs(next(iter(cached.get_eval_dataloader(cached_dataset))))
    live_loss, cached_loss = live.compute_loss(drafter, live_batch), cached.compute_loss(drafter, cached_batch)
    torch.testing.assert_close(cached_loss, live_loss)
    assert cached._replay_metrics["batches"] == 1

    drafter.save_pretrained(tmp_path / "drafter")
    tokenizer.save_pretrained(tmp_path / "drafter")
    argv = ["--drafter", str(tmp_path / "drafter"), "--feature-cache", str(cache), "--output-dir",
            str(tmp_path / "out"), "--max-steps", "2", "--logging-steps", "1", "--report-to", "none",
            "--lm-replay-dataset", str(tmp_path / "replay.jsonl"), "--lm-replay-weight", "0.5",
            "--lm-replay-batch-size", "2", "--pretrained-learning-rate-scale", "0.5"]  # fmt: skip
    assert trainers.distill.main(argv) == 0
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "lm_replay_loss" in entry] == [1, 2]
