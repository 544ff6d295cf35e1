"""The measured processes of `benchmarks/training_throughput.py`: one `Trainer.train()` (or feature-cache build, or
matmul timing) per process, printed as one JSON line.

Run by path (`runpy`) with `PYTHONPATH` pointing at the trainers to measure, the current ones or an older commit's
checkout: it uses only the API both share (`OspreyDistillTrainer`, `OspreyPretrainer`, `FeatureCacheDataset`,
`TargetHead`, `build_feature_cache`), so the same worker times both.

    python benchmarks/throughput_worker.py distill|pretrain|features|matmul|configs ARGS...

`distill NAME STEPS [compile]` and `pretrain STEPS [compile]` train with `torch_compile` (dynamic shapes) given
`compile`, as the shipped configs do; an older commit's trainers run as they were. `self-distill STEPS [compile]
[bf16]` times stage 2 of the Qwen backbone (self-distillation from the unpruned parent, the zoo's weights).

It also profiles a distillation step, the start of any work on its speed (one thread, as the throughput runs):

    OMP_NUM_THREADS=1 python benchmarks/throughput_worker.py profile distill-qwen2.5-coder-1.5b \
        [ROWS] [shapes] [compile]

prints the ops by self CPU time (stderr; with `shapes`, each op per input shapes), then the step's milliseconds per
token in matmuls, the compiled loss kernels, the chain attention and the rest (stdout, JSON). The profiler adds a few
percent to small ops. The TTT loss eager against compiled (bf16 autocast) on a real feature cache and drafter, per step:

    python benchmarks/throughput_worker.py compiled-ttt FEATURE_CACHE DRAFTER [BATCHES]

A real distillation (a feature cache, a drafter and a YAML config, with `FLAG=VALUE` overrides such as
`train_sampling_strategy=group_by_length` or `torch_compile=true`) for STEPS timed steps after WARMUP, counting the
tokens each batch trains on and the positions it computes (padding included), for `benchmarks/distill_batching.py`:

    python benchmarks/throughput_worker.py real-distill FEATURE_CACHE DRAFTER CONFIG STEPS WARMUP [FLAG=VALUE ...]

The loss kernels alone, per chunk of rows (default 256 x 32,000):

    OMP_NUM_THREADS=1 python benchmarks/throughput_worker.py loss-kernels [ROWS] [VOCAB]
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

# Where the trainers and the pipeline had their modules before they were sub-packages: the worker also times an older
# commit's checkout (PYTHONPATH), which has only these.
EARLIER_MODULES = {
    "trainers.features.feature_cache": "trainers.feature_cache",
    "osprey.models.zoo": "osprey.zoo",
    "osprey.stages.prune": "osprey.prune",
    "osprey.models.pack": "osprey.pack",
    "trainers.ttt": "trainers.distill",
}


def moved_names(module: str, *names: str) -> tuple:
    """`names` from `module`, or from its earlier place in a checkout from before the move."""
    import importlib

    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if not module.startswith(f"{error.name}.") and error.name != module:
            raise
        found = importlib.import_module(EARLIER_MODULES[module])
    return tuple(getattr(found, name) for name in names)


QWEN_VOCAB, SMOLLM_VOCAB = 151936, 49152
DISTILL_CONFIGS = {
    # name: drafter shape (OspreyConfig overrides), sequences per micro-batch, tokens per sequence
    "distill-qwen2.5-coder-1.5b": {
        "drafter": {
            "vocab_size": QWEN_VOCAB,
            "draft_vocab_size": 32000,
            "target_hidden_size": 1536,
            "target_layer_ids": [1, 13, 24],
        },
        "batch_size": 2,
        "seq_len": 1024,
        "accumulation": 2,
        "ttt_steps": 5,
    },
    "distill-smollm2-135m": {
        "drafter": {
            "vocab_size": SMOLLM_VOCAB,
            "draft_vocab_size": 8192,
            "target_hidden_size": 576,
            "target_layer_ids": [1, 14, 26],
        },
        "batch_size": 2,
        "seq_len": 1024,
        "accumulation": 2,
        "ttt_steps": 5,
    },
}
PRETRAIN_CONFIG = {"batch_size": 4, "seq_len": 1024, "accumulation": 2}
SMOLLM2_2L = {
    "vocab_size": SMOLLM_VOCAB,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 2,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
}
SMOLLM2_135M = "smollm2-135m-instruct"


# ------------------------------------------------------------------------------------------------------ workers
# Each runs in its own process against whichever `trainers` / `modeling_osprey` PYTHONPATH points at, and prints one
# JSON line. They use only the API both versions share.


def tokens_per_step(spec: dict) -> int:
    """Tokens one optimizer step trains on, for a config of DISTILL_CONFIGS or PRETRAIN_CONFIG."""
    return spec["batch_size"] * spec["seq_len"] * spec["accumulation"]


class _StepTimer:
    def __init__(self):
        import resource

        import transformers

        def now():
            usage = resource.getrusage(resource.RUSAGE_SELF)
            return time.perf_counter(), time.process_time(), usage.ru_stime, usage.ru_minflt

        class Callback(transformers.TrainerCallback):
            def on_step_begin(cb, args, state, control, **kwargs):
                self.begin = now()

            def on_step_end(cb, args, state, control, **kwargs):
                self.steps.append(tuple(end - begin for end, begin in zip(now(), self.begin, strict=True)))

        self.steps: list[tuple[float, float, float, int]] = []  # wall, CPU and system seconds, minor page faults
        self.callback = Callback()

    def result(self, tokens: int) -> dict:
        timed = self.steps[1:]  # the first step warms up (allocations, torch.compile)
        wall, cpu, system, faults = (sum(step[part] for step in timed) for part in range(4))
        return {
            "tokens_per_s": tokens * len(timed) / wall,
            "cpu_s_per_1k_tokens": 1000 * cpu / (tokens * len(timed)),
            "system_s_per_step": round(system / len(timed), 2),
            "page_faults_per_step": round(faults / len(timed)),
            "step_wall_s": [round(step[0], 2) for step in self.steps],
        }


def zoo_dir(name: str) -> Path:
    """Where `osprey fetch` caches a zoo model (`$OSPREY_HOME`, default ~/.cache/osprey), in any version."""
    return Path(os.environ.get("OSPREY_HOME", "~/.cache/osprey")).expanduser() / "models" / name


def distill_worker(name: str, steps: int, callbacks: tuple = (), compile: bool = False) -> dict:
    import torch

    from modeling_osprey import OspreyConfig, OspreyForDrafting
    from trainers.distill import OspreyDistillConfig, OspreyDistillTrainer

    FeatureCacheDataset, TargetHead = moved_names(
        "trainers.features.feature_cache", "FeatureCacheDataset", "TargetHead"
    )

    spec = DISTILL_CONFIGS[name]
    torch.manual_seed(0)
    drafter = OspreyForDrafting(OspreyConfig(**spec["drafter"]))
    taps, width, vocab = (
        len(spec["drafter"]["target_layer_ids"]),
        spec["drafter"]["target_hidden_size"],
        spec["drafter"]["vocab_size"],
    )

    class RandomFeatures(FeatureCacheDataset):
        """Random sequences with the fields of a feature cache, held in memory."""

        def __init__(self, num_sequences: int):
            generator = torch.Generator().manual_seed(1)
            length = spec["seq_len"]
            self.items = [
                {
                    "input_ids": torch.randint(0, vocab, (length,), generator=generator, dtype=torch.int32),
                    "loss_mask": torch.ones(length, dtype=torch.uint8),
                    "target_hidden_states": torch.randn(length, taps * width, generator=generator).bfloat16(),
                    "target_last_hidden_state": torch.randn(length, width, generator=generator).bfloat16(),
                    "target_argmax": torch.randint(0, vocab, (length,), generator=generator, dtype=torch.int32),
                }
                for _ in range(num_sequences)
            ]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, item):
            return self.items[item]

        def check_drafter(self, drafter_config):
            pass

        def target_head(self):
            weight = torch.randn(vocab, width, generator=torch.Generator().manual_seed(2)).bfloat16()
            return TargetHead(weight.mul_(width**-0.5))

    dataset = RandomFeatures(spec["batch_size"] * spec["accumulation"] * (steps + 1))
    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = timed_config(
            OspreyDistillConfig,
            output_dir,
            steps,
            compile,
            per_device_train_batch_size=spec["batch_size"],
            gradient_accumulation_steps=spec["accumulation"],
            ttt_steps=spec["ttt_steps"],
            learning_rate=3e-4,
            lr_scheduler_type="cosine",
            max_grad_norm=0.5,
            bf16=True,
            use_cpu=True,
        )
        trainer = OspreyDistillTrainer(drafter, config, train_dataset=dataset, callbacks=[timer.callback, *callbacks])
        trainer.train()
    return timer.result(tokens_per_step(spec))


def pretrain_precision() -> dict:
    """`bf16` / `use_cpu` as the measured checkout's own stage-2 config sets them (absent: the trainer's default)."""
    import yaml

    import trainers

    config = yaml.safe_load((Path(trainers.__file__).parent / "configs" / "pretrain-smollm2-2l.yaml").read_text())
    return {key: config[key] for key in ("bf16", "use_cpu") if key in config}


def timed_config(config_class, output_dir: str, steps: int, compile: bool, **settings):
    """A trainer config for `steps` timed steps after one warm-up, nothing saved or logged on the way."""
    defaults = {"save_strategy": "no", "report_to": "none", "disable_tqdm": True, "logging_steps": 1000, "seed": 0}
    compiled = {"torch_compile": True} if compile else {}
    return config_class(output_dir=output_dir, max_steps=steps + 1, **defaults, **compiled, **settings)


def timed_pretraining(model, tokenizer, rows: list, steps: int, compile: bool, tokens: int, **settings) -> dict:
    """`OspreyPretrainer` (stage 2) on token `rows` for `steps` timed steps after one warm-up; `tokens` per step."""
    from datasets import Dataset

    from trainers.pretrain import OspreyPretrainConfig, OspreyPretrainer

    timer = _StepTimer()
    parent_model = settings.pop("parent_model", None)
    with tempfile.TemporaryDirectory() as output_dir:
        config = timed_config(OspreyPretrainConfig, output_dir, steps, compile, dataloader_drop_last=True, **settings)
        trainer = OspreyPretrainer(
            model,
            config,
            train_dataset=Dataset.from_dict({"input_ids": rows}),
            processing_class=tokenizer,
            callbacks=[timer.callback],
            **({"parent_model": parent_model} if parent_model is not None else {}),
        )
        trainer.train()
    return {**timer.result(tokens), "precision": "bf16 autocast" if config.bf16 else "float32"}


def pretrain_worker(steps: int, compile: bool = False) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_2L))
    tokenizer = AutoTokenizer.from_pretrained(zoo_dir(SMOLLM2_135M))
    spec = PRETRAIN_CONFIG
    num_rows = spec["batch_size"] * spec["accumulation"] * (steps + 1)
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, SMOLLM_VOCAB, (num_rows, spec["seq_len"]), generator=generator).tolist()
    return timed_pretraining(
        model,
        tokenizer,
        rows,
        steps,
        compile,
        tokens_per_step(spec),
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["accumulation"],
        max_length=spec["seq_len"],
        learning_rate=3e-4,
        **pretrain_precision(),
    )


QWEN_STAGE2_CONFIG = "pretrain-qwen2.5-coder-0.5b-multilingual.yaml"
QWEN_0_5B = "qwen2.5-coder-0.5b-instruct"


def self_distill_worker(steps: int, compile: bool = False, bf16: bool = False) -> dict:
    """Stage 2 of the same-tokenizer backbone as `benchmarks/replication/stage2_qwen.sh` runs it: the zoo's
    Qwen2.5-Coder-0.5B-Instruct pruned to its first 2 blocks (`osprey.stages.prune.prune`), self-distilled from the
    whole model (its config's weights, temperature and frozen embedding and head), on random tokens, 2 x 1,024 per step
    (one micro-batch); the parent in bfloat16 with `bf16` (autocast), else in float32, as the trainer loads it."""
    import torch
    import yaml

    import trainers

    load_causal_lm, load_tokenizer = moved_names("osprey.models.zoo", "load_causal_lm", "load_tokenizer")
    (prune,) = moved_names("osprey.stages.prune", "prune")

    recipe = yaml.safe_load((Path(trainers.__file__).parent / "configs" / QWEN_STAGE2_CONFIG).read_text())
    parent = load_causal_lm(QWEN_0_5B, dtype=torch.bfloat16 if bf16 else torch.float32)
    batch_size, seq_len = 2, 1024
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, QWEN_VOCAB, (batch_size * (steps + 1), seq_len), generator=generator).tolist()
    return timed_pretraining(
        prune(parent, 2).float(),
        load_tokenizer(QWEN_0_5B),
        rows,
        steps,
        compile,
        batch_size * seq_len,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        max_length=seq_len,
        learning_rate=2e-4,
        bf16=bf16,
        use_cpu=bf16,  # older trainers need it for bf16 on a CPU
        parent_model=parent,
        **{key: recipe[key] for key in ("distill_weight", "temperature", "freeze_embeddings", "freeze_lm_head")},
    )


def features_worker(num_sequences: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    (build_feature_cache,) = moved_names("trainers.features.feature_cache", "build_feature_cache")

    directory = zoo_dir(SMOLLM2_135M)
    if (directory / "model.safetensors").is_file():
        target, source = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16), "zoo weights"
    else:
        config = AutoConfig.from_pretrained(directory) if directory.is_dir() else None
        target, source = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), "random weights"
    target.eval()
    seq_len = 1024
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, target.config.vocab_size, (num_sequences, seq_len), generator=generator)
    with torch.inference_mode():
        target(rows[:1], use_cache=False)  # warm-up
        start = time.perf_counter()
        for row in rows:
            target(row[None], use_cache=False)
        forward_rate = num_sequences * seq_len / (time.perf_counter() - start)
    dataset = Dataset.from_dict({"input_ids": rows.tolist(), "loss_mask": [[1] * seq_len] * num_sequences})
    with tempfile.TemporaryDirectory() as output_dir:
        start = time.perf_counter()
        build_feature_cache(target, {"train": dataset}, Path(output_dir) / "cache", [1, 14, 26], batch_size=1)
        rate = num_sequences * seq_len / (time.perf_counter() - start)
        split_bytes = sum(path.stat().st_size for path in (Path(output_dir) / "cache" / "train").iterdir())
    return {
        "tokens_per_s": rate,
        "target_forward_tokens_per_s": forward_rate,
        "target": f"{SMOLLM2_135M} ({source})",
        "bytes_per_token": split_bytes / (num_sequences * seq_len),
    }


def matmul_worker(shapes: list[list[int]]) -> dict:
    """bfloat16 GFLOP/s of `torch.matmul` at each (m, k, n)."""
    import torch

    rates = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
        torch.matmul(a, b)
        repeats, start = 0, time.perf_counter()
        while repeats < 3 or time.perf_counter() - start < 1.0:
            torch.matmul(a, b)
            repeats += 1
        rates[f"{m}x{k}x{n}"] = 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e9
    return rates


def loss_kernels_worker(rows: int = 256, vocab: int = 32000) -> dict:
    """Milliseconds per call of the soft cross-entropy's two compiled passes over one chunk of `rows` x `vocab`
    bf16 logits (`trainers.losses`); the first pass also as it was before the block maxima (its argmax a min over all
    the columns reaching the maximum, its target terms summed over the whole chunk) and without an argmax (the floor).
    Minimum of 15 calls."""
    import torch

    from trainers import losses

    def all_columns_first_pass(logits, target_probs, rows):  # the first pass as it was before the block maxima
        scores = logits.float()
        probs = target_probs if rows is None else target_probs[rows]
        maximum = scores.amax(dim=-1, keepdim=True)
        exps = (scores - maximum).exp()
        sums = exps.sum(dim=-1, keepdim=True)
        loss = ((maximum + sums.log()).squeeze(-1) * probs.sum(dim=-1)).sum() - (probs * scores).sum()
        columns = torch.arange(scores.shape[-1])
        first = torch.where(scores == maximum, columns, scores.shape[-1]).amin(dim=-1)
        return loss, first.clamp(max=scores.shape[-1] - 1), exps, sums

    def without_argmax(logits, target_probs, rows):
        return losses._soft_exps(logits, target_probs, rows)[::2]

    def milliseconds(function, *args) -> float:
        function(*args)
        times = []
        for _ in range(15):
            start = time.perf_counter()
            function(*args)
            times.append(time.perf_counter() - start)
        return round(min(times) * 1000, 2)

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator).bfloat16()
    # the TTT loss reads a micro-batch's target rows (2 x 1,024 in the Qwen-shape step) shifted by its step
    target_probs = torch.randn(8 * rows, vocab, generator=generator).softmax(dim=-1)
    index = torch.arange(rows) + 3 * rows + 1
    compiled = {
        name: torch.compile(function, dynamic=True)
        for name, function in (
            ("first pass", losses._soft_exps),
            ("first pass, argmax over all columns", all_columns_first_pass),
            ("first pass, no argmax", without_argmax),
        )
    }
    results = {name: milliseconds(function, logits, target_probs, index) for name, function in compiled.items()}
    _, argmax, exps, sums = compiled["first pass"](logits, target_probs, index)
    if not torch.equal(argmax, logits.argmax(dim=-1)):
        raise AssertionError("the first pass's argmax differs from torch.argmax")
    out = torch.empty_like(logits)
    second = torch.compile(losses._soft_gradient, dynamic=True)
    results["second pass"] = milliseconds(second, exps, sums, target_probs, index, logits.dtype, out)
    return {"rows": rows, "vocab": vocab, "threads": torch.get_num_threads(), "ms_per_call": results}


def compiled_ttt_worker(feature_cache: str, drafter_path: str, batches: int = 2) -> dict:
    """The TTT loss's per-step losses on the first `batches` batches (2 sequences each) of a real feature cache, eager
    and through `torch.compile(dynamic=True)`, both under bf16 autocast, and their largest difference: the check that
    found the chain attention computing wrong values when compiled under autocast (TTT step 1's loss 4.27 against
    1.27 on the Qwen replication's drafter; random tiny drafters did not show it), now kept out of the graph."""
    import torch

    from modeling_osprey import OspreyForDrafting
    from trainers.distill import DistillDataCollator

    label_positions, ttt_loss = moved_names("trainers.ttt", "label_positions", "ttt_loss")

    (FeatureCacheDataset,) = moved_names("trainers.features.feature_cache", "FeatureCacheDataset")

    dataset = FeatureCacheDataset(feature_cache)
    drafter = OspreyForDrafting.from_pretrained(drafter_path).train()
    target_head = dataset.target_head().restricted(drafter.draft_to_target)
    compiled = torch.compile(drafter, dynamic=True)
    losses = {"eager": [], "compiled": []}
    for index in range(batches):
        batch = DistillDataCollator()([dataset[2 * index], dataset[2 * index + 1]])
        target_logits = target_head(batch["target_last_hidden_state"][label_positions(batch["loss_mask"])])
        for name, model in (("eager", drafter), ("compiled", compiled)):
            with torch.autocast("cpu", dtype=torch.bfloat16):  # with gradients, as in training
                output = ttt_loss(
                    model,
                    batch["input_ids"],
                    batch["target_hidden_states"].to(drafter.dtype),
                    target_logits,
                    batch["target_argmax"],
                    batch["loss_mask"],
                    drafter.draft_to_target,
                )
            losses[name].append([round(loss, 4) for loss in output.step_losses.tolist()])
    difference = max(
        abs(a - b) for eager, other in zip(losses["eager"], losses["compiled"]) for a, b in zip(eager, other)
    )
    return {**losses, "max_abs_difference": round(difference, 4)}


def real_distill_worker(feature_cache: str, drafter_path: str, config_path: str, steps: int, warmup: int, *flags):
    """`osprey distill`'s trainer on a real feature cache and drafter for `warmup` + `steps` steps: tokens per second
    over the timed steps, counting the tokens the batches hold (not their padding), and the share of padding."""
    import yaml

    (load_drafter,) = moved_names("osprey.models.pack", "load_drafter")
    from trainers.distill import DistillDataCollator, OspreyDistillConfig, OspreyDistillTrainer

    (FeatureCacheDataset,) = moved_names("trainers.features.feature_cache", "FeatureCacheDataset")

    class CountingCollator(DistillDataCollator):
        def __call__(self, examples):
            batch = super().__call__(examples)
            batches.append((int(batch["attention_mask"].sum()), batch["attention_mask"].numel()))
            return batch

    batches: list[tuple[int, int]] = []  # (tokens, positions) of every batch, in training order
    settings = yaml.safe_load(Path(config_path).read_text())
    settings.update({key: yaml.safe_load(value) for key, value in (flag.split("=", 1) for flag in flags)})
    settings.update(eval_strategy="no", save_strategy="no", logging_steps=1000, disable_tqdm=True, report_to="none")
    timer = _StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = OspreyDistillConfig(output_dir=output_dir, max_steps=warmup + steps, **settings)
        trainer = OspreyDistillTrainer(
            load_drafter(drafter_path),
            config,
            train_dataset=FeatureCacheDataset(feature_cache),
            data_collator=CountingCollator(),
            callbacks=[timer.callback],
        )
        trainer.train()
    per_step = config.gradient_accumulation_steps
    timed = batches[warmup * per_step : (warmup + steps) * per_step]
    tokens, positions = sum(batch[0] for batch in timed), sum(batch[1] for batch in timed)
    wall = sum(step[0] for step in timer.steps[warmup:])
    return {
        "flags": list(flags),
        "steps": steps,
        "warmup_steps": warmup,
        "tokens": tokens,
        "padding_share": round(1 - tokens / positions, 4),
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
        "step_wall_s": [round(step[0], 2) for step in timer.steps],
    }


PROFILE_PARTS = {  # part of a profiled step: substrings of the op names it sums
    "matmul": ("aten::mm", "aten::bmm", "aten::addmm"),
    "loss kernels (compiled)": ("CompiledFxGraph",),
    "attention": ("scaled_dot_product",),
}


def profile_worker(name: str, rows: int = 30, shapes: bool = False, compile: bool = False) -> dict:
    """One distillation step of a config under `torch.profiler`, after one warm-up step: prints the ops by self CPU
    time (per input shapes with `shapes`) and returns the step's split into PROFILE_PARTS and the rest, in milliseconds
    per trained token."""
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    class ProfileSecondStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.profiler = profile(activities=[ProfilerActivity.CPU], record_shapes=shapes)
                self.profiler.__enter__()
                self.wall = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                self.profiler.__exit__(None, None, None)
                self.wall = time.perf_counter() - self.wall

    callback = ProfileSecondStep()
    distill_worker(name, 1, callbacks=(callback,), compile=compile)
    spec = DISTILL_CONFIGS[name]
    tokens = tokens_per_step(spec)
    events = callback.profiler.key_averages(group_by_input_shape=shapes)
    table = events.table(
        sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60, max_shapes_column_width=80
    )
    print(table, file=sys.stderr)
    split = dict.fromkeys([*PROFILE_PARTS, "rest"], 0.0)
    for event in events:
        part = next((part for part, keys in PROFILE_PARTS.items() if any(key in event.key for key in keys)), "rest")
        split[part] += event.self_cpu_time_total / 1000 / tokens  # microseconds to ms per token
    return {
        "config": name,
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "step_wall_s_profiled": round(callback.wall, 2),
        "ms_per_token": {part: round(ms, 3) for part, ms in split.items()},
    }


def main(argv: list[str]) -> int:
    kind, *rest = argv
    workers = {
        "distill": lambda: distill_worker(rest[0], int(rest[1]), compile="compile" in rest[2:]),
        "pretrain": lambda: pretrain_worker(int(rest[0]), compile="compile" in rest[1:]),
        "self-distill": lambda: self_distill_worker(
            int(rest[0]), compile="compile" in rest[1:], bf16="bf16" in rest[1:]
        ),
        "features": lambda: features_worker(int(rest[0])),
        "matmul": lambda: matmul_worker(json.loads(rest[0])),
        "loss-kernels": lambda: loss_kernels_worker(*map(int, rest[:2])),
        "profile": lambda: profile_worker(
            rest[0], *map(int, rest[1:2]), shapes="shapes" in rest[2:], compile="compile" in rest[2:]
        ),
        "compiled-ttt": lambda: compiled_ttt_worker(rest[0], rest[1], *map(int, rest[2:3])),
        "real-distill": lambda: real_distill_worker(*rest[:3], int(rest[3]), int(rest[4]), *rest[5:]),
        "configs": lambda: {"distill": DISTILL_CONFIGS, "pretrain": PRETRAIN_CONFIG, "pretrain_model": SMOLLM2_2L},
    }
    print(json.dumps(workers[kind]()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
