#!/usr/bin/env bash
# Does the faster distillation learn the same thing? 50 steps of `osprey distill` from one random-init drafter (the
# SmolLM2 pilot's shape: 2 blocks at 576, 8k draft vocabulary) on one feature cache (SmolLM2-135M-Instruct over 40
# ShareGPT conversations of up to 256 tokens, 40 held out), with the trainers of BASELINE (a git worktree) and of this checkout,
# then the held-out TTT losses side by side. Seeds 0 and 1 of the current code give the seed-to-seed noise.
#
#   benchmarks/distill_equivalence.sh        (RUNS=/work/runs/distill-equivalence BASELINE=175b08b)
#
# CURRENT_FLAGS are added to the current code's two runs (e.g. "--torch_compile true", as the shipped configs set).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs/distill-equivalence}
BASELINE=${BASELINE:-175b08b}
read -r -a CURRENT_FLAGS <<< "${CURRENT_FLAGS:-}"
PY=${PY:-$(git rev-parse --git-common-dir)/../.venv/bin/python}
mkdir -p "$RUNS"
[ -d "$RUNS/baseline-src" ] || git worktree add --detach "$RUNS/baseline-src" "$BASELINE"
[ -f "$RUNS/features/feature_cache.json" ] || PYTHONPATH=$PWD $PY -m trainers.features.feature_cache \
  --target_model smollm2-135m-instruct --dataset_name sharegpt --output_dir "$RUNS/features" --max_length 256 \
  --max_examples 40 --batch_size 4 --target_dtype float32 --target_layer_ids 1 14 26
[ -f "$RUNS/init/model.safetensors" ] || PYTHONPATH=$PWD $PY -c "
import sys, torch
from modeling_osprey import OspreyConfig, OspreyForDrafting
from osprey.models.zoo import load_tokenizer
torch.manual_seed(0)
config = OspreyConfig(vocab_size=49152, draft_vocab_size=8192, target_hidden_size=576, target_layer_ids=[1, 14, 26])
OspreyForDrafting(config).save_pretrained(sys.argv[1])
load_tokenizer('smollm2-135m-instruct').save_pretrained(sys.argv[1])
" "$RUNS/init"
run() {  # run NAME SOURCE SEED [FLAGS...]
  [ -f "$RUNS/$1/trainer_state.json" ] && return
  PYTHONPATH=$2 $PY -m trainers.distill --drafter "$RUNS/init" --feature_cache "$RUNS/features" \
    --output_dir "$RUNS/$1" --max_steps 50 --per_device_train_batch_size 2 --gradient_accumulation_steps 1 \
    --learning_rate 3e-4 --lr_scheduler_type cosine --warmup_steps 5 --max_grad_norm 0.5 --eval_strategy steps \
    --eval_steps 50 --per_device_eval_batch_size 4 --save_strategy no --report_to none --seed "$3" --bf16 true \
    --use_cpu true --logging_steps 10 --disable_tqdm true "${@:4}" > "$RUNS/$1.log" 2>&1
}
run baseline "$RUNS/baseline-src" 0
run current "$PWD" 0 "${CURRENT_FLAGS[@]}"
run current-seed1 "$PWD" 1 "${CURRENT_FLAGS[@]}"
git worktree remove --force "$RUNS/baseline-src"
$PY - "$RUNS" <<'PY'
import json, sys
from pathlib import Path
for name in ("baseline", "current", "current-seed1"):
    state = json.loads((Path(sys.argv[1]) / name / "trainer_state.json").read_text())
    evaluation = [entry for entry in state["log_history"] if "eval_loss" in entry][-1]
    steps = [round(evaluation[f"eval_ttt_loss_{k}"], 4) for k in range(5)]
    print(f"{name:14s} eval_loss {evaluation['eval_loss']:.4f} per-step {steps} "
          f"acc_0 {evaluation['eval_ttt_acc_0']:.4f} train_runtime {state['log_history'][-1]['train_runtime']:.0f} s")
PY
