#!/usr/bin/env bash
# Does stage 2 learn the same in bf16 autocast as in float32? (issue 16: bf16 is the trainers' lever on the CPU's AMX)
# Two runs from the same pruned init on one CPU thread, same data order and optimiser, 60 steps of 2 rows of 512
# tokens (as benchmarks/ablations/self_distillation.sh), evaluated at steps 30 and 60 on general/test; only the
# precision differs: float32 (OspreyPretrainConfig's CPU default) or `--bf16 true --use_cpu true`. A third run,
# bf16 with seed 1 (another data order; the init is the same pruned model), gives the run-to-run noise.
# Held-out losses and wall times: each run's log and wall.txt. Results: docs/training.md ("Training throughput").
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}/ablation-stage2-precision
INIT=${INIT:-/work/runs/pretrain-smollm2-2l/init}  # osprey prune --backbone smollm2-135m-instruct --num-layers 2
export OMP_NUM_THREADS=1
mkdir -p "$RUNS"
common=(--model_name_or_path "$INIT" --dataset_name general --max_length 512 --per_device_train_batch_size 2
        --per_device_eval_batch_size 8 --learning_rate 3e-4 --lr_scheduler_type cosine --warmup_steps 5
        --weight_decay 0.01 --logging_steps 5 --eval_strategy steps --eval_steps 30 --save_strategy no
        --report_to none --seed 0 --disable_tqdm true --max_steps 60)
for run in float32 bf16 bf16-seed1; do
  [ -f "$RUNS/$run/model.safetensors" ] && continue
  extra=()
  [ $run != float32 ] && extra=(--bf16 true --use_cpu true)
  [ $run = bf16-seed1 ] && extra+=(--seed 1)
  start=$(date +%s)
  .venv/bin/osprey pretrain "${common[@]}" "${extra[@]}" --output_dir "$RUNS/$run" > "$RUNS/$run.log" 2>&1
  echo "$run wall_s=$(( $(date +%s) - start ))" >> "$RUNS/wall.txt"
done
grep -H "eval_loss" "$RUNS"/*.log
cat "$RUNS/wall.txt"
