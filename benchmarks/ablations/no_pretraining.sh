#!/usr/bin/env bash
# What does stage 2 (target-agnostic pretraining) buy? (issue 6) The pilot's Osprey drafter again, without stage 2:
# SmolLM2-135M-Instruct pruned to its first 2 blocks, converted and distilled exactly like the pilot (8k draft
# vocabulary, benchmarks/replication/distill-common.yaml on the SmolLM2 feature cache, 150 steps), then benched on the
# pilot's 50 prompts (float32, greedy), converted-and-undistilled too. Its τ compares per prompt with the pilot's
# drafters in benchmarks/results/replication-smollm2-135m-instruct.json: greedy float32 decoding is deterministic, and
# the target-alone outputs of the two runs must match. Resumable; writes benchmarks/results/ablation-no-pretraining.*
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=smollm2-135m-instruct
FEATURES=$RUNS/features-smollm2-135m-sharegpt  # shared with benchmarks/replication/run.sh
OUT=$RUNS/no-pretraining
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
source benchmarks/replication/stages.sh
target_features $TARGET "$FEATURES"
sharegpt_text "$RUNS/sharegpt-train.txt"

[ -f "$OUT/pruned/model.safetensors" ] || $OSPREY prune --model $TARGET --num-layers 2 --output "$OUT/pruned"
[ -f "$OUT/osprey-init/model.safetensors" ] || $OSPREY convert --backbone "$OUT/pruned" --target $TARGET \
  --draft-vocab-size 8192 --draft-vocab-corpus "$RUNS/sharegpt-train.txt" --output "$OUT/osprey-init"
[ -f "$OUT/osprey/model.safetensors" ] || distill "$OUT/osprey-init" "$OUT/osprey" "$FEATURES"
log "benchmark -> benchmarks/results/ablation-no-pretraining.json"
$OSPREY bench --target $TARGET --drafter no-stage-2="$OUT/osprey" --drafter no-stage-2-undistilled="$OUT/osprey-init" \
  --baselines target --prompts spec_bench --prompts mt_bench --prompts humaneval --prompts mmath --per-category 2 \
  --max-new-tokens 64 --seed 0 --dtype float32 --output benchmarks/results/ablation-no-pretraining.json
log "done"
