#!/usr/bin/env bash
# Does self-distillation from the unpruned parent help stage 2 at equal compute? (issue 5, docs/training.md)
# Two short runs from the same pruned init on one CPU thread, same data order and optimiser:
#   lm:   next-token loss only, 60 steps (evaluated at steps 30 and 60);
#   kl:   next-token loss + KL(parent || model), 30 steps (the parent's extra forward made a step 2.8x dearer).
# Each step is 2 rows of 512 tokens. Held-out loss on general/test is in each run's log (eval_loss; for kl, its
# next-token part is eval_lm_loss). Results: benchmarks/results/ablation-self-distillation.json, docs/training.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}/ablation-self-distillation
INIT=${INIT:-/work/runs/pretrain-smollm2-2l/init}  # osprey prune --model smollm2-135m-instruct --num-layers 2
export OMP_NUM_THREADS=1
mkdir -p "$RUNS"
common=(--model_name_or_path "$INIT" --dataset_name general --max_length 512 --per_device_train_batch_size 2
        --per_device_eval_batch_size 8 --learning_rate 3e-4 --lr_scheduler_type cosine --warmup_steps 5
        --weight_decay 0.01 --logging_steps 5 --eval_strategy steps --eval_steps 30 --save_strategy no
        --report_to none --seed 0 --disable_tqdm true)
for run in kl lm; do
  [ -f "$RUNS/$run/model.safetensors" ] && continue
  extra=(--max_steps 60)
  [ $run = kl ] && extra=(--max_steps 30 --parent_model smollm2-135m-instruct)
  start=$(date +%s)
  .venv/bin/osprey pretrain "${common[@]}" "${extra[@]}" --output_dir "$RUNS/$run" > "$RUNS/$run.log" 2>&1
  echo "$run wall_s=$(( $(date +%s) - start ))" >> "$RUNS/wall.txt"
done
grep -h "eval_loss" "$RUNS"/*.log
cat "$RUNS/wall.txt"
