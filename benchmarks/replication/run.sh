#!/usr/bin/env bash
# The small-scale replication of the paper's table (issue 6 §2): Osprey vs. the body-random (scratch) control vs. an
# EAGLE-3 drafter for one target, distilled on the same feature cache with the same budget, then benchmarked in one
# process. Every stage is skipped when its output is complete and resumes when it was killed, so rerun this script
# until it prints "done". Long stages run for hours on a CPU: start it with nohup.
#
#   benchmarks/replication/run.sh [qwen2.5-coder-1.5b-instruct|smollm2-135m-instruct]
#
# Qwen2.5-Coder-1.5B-Instruct (issue 17): the Qwen-backbone drafters with the full budget, resumable across machines
# from what is committed: full_budget_qwen.sh all (it needs the 4,800 target-written answers of regenerate_qwen.sh).
# SmolLM2-135M-Instruct, the pilot: the SmolLM2 backbone; the three distillations run side by side, one thread each
# (PARALLEL=0: one after the other, OMP_NUM_THREADS each).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-qwen2.5-coder-1.5b-instruct}" = qwen2.5-coder-1.5b-instruct ]; then
  exec benchmarks/replication/full_budget_qwen.sh all
fi
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=$1
BACKBONE=$RUNS/pretrain-smollm2-2l  # stage 2: osprey pretrain --config trainers/configs/pretrain-smollm2-2l.yaml
PARALLEL=${PARALLEL:-1}
case $TARGET in
  smollm2-135m-instruct)  # the second target from the same backbone; a 135M target makes it the cheap pilot
    FEATURES=$RUNS/features-smollm2-135m-sharegpt; DRAFT_VOCAB=8192
    DTYPE=float32; BASELINES=target,pld ;;  # float32: outputs must equal the target's
  *) echo "unknown target $TARGET" >&2; exit 2 ;;
esac
OUT=$RUNS/replication/$TARGET
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

source benchmarks/replication/stages.sh
target_features $TARGET "$FEATURES"
if [ ! -f "$BACKBONE/model.safetensors" ]; then
  log "the pretrained backbone is not finished: resume stage 2 first (docs/training.md)"; exit 1
fi
VOCAB_CORPUS=$RUNS/sharegpt-train.txt
sharegpt_text "$VOCAB_CORPUS"

OSPREY_DRAFTER=$OUT/osprey-init
[ -f "$OSPREY_DRAFTER/model.safetensors" ] || $OSPREY convert --backbone "$BACKBONE" --target $TARGET \
  --draft-vocab-size $DRAFT_VOCAB --draft-vocab-corpus "$VOCAB_CORPUS" --output "$OSPREY_DRAFTER"
[ -f "$OUT/scratch-init/model.safetensors" ] || $OSPREY baseline scratch --like "$OSPREY_DRAFTER" \
  --output "$OUT/scratch-init"
[ -f "$OUT/eagle3-init/model.safetensors" ] || $OSPREY baseline eagle3 --like "$OSPREY_DRAFTER" \
  --target $TARGET --output "$OUT/eagle3-init"

pids=()
for drafter in osprey scratch eagle3; do
  [ -f "$OUT/$drafter/model.safetensors" ] && continue
  extra=()
  [ $drafter = eagle3 ] && extra=(--freeze_embeddings true)  # EAGLE-3 keeps the target's embedding
  if [ "$PARALLEL" = 1 ]; then
    OMP_NUM_THREADS=1 distill "$OUT/$drafter-init" "$OUT/$drafter" "$FEATURES" "${extra[@]}" & pids+=($!)
  else
    distill "$OUT/$drafter-init" "$OUT/$drafter" "$FEATURES" "${extra[@]}"
  fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
for drafter in osprey scratch eagle3; do
  [ -f "$OUT/$drafter/model.safetensors" ] || { log "distill $drafter did not finish: see $OUT/$drafter.log"; exit 1; }
done
PROMPTS=(--prompts spec_bench --prompts mt_bench --prompts humaneval --prompts mmath --per-category ${PER_CATEGORY:-2}
  --max-new-tokens ${MAX_NEW_TOKENS:-64} --seed 0 --dtype $DTYPE)
RESULTS=benchmarks/results/replication-$TARGET.json  # each bench resumes its results file if it exists
log "benchmark -> $RESULTS"
OMP_NUM_THREADS=2 $OSPREY bench --target $TARGET --drafter osprey="$OUT/osprey" --drafter scratch="$OUT/scratch" \
  --drafter eagle3="$OUT/eagle3" --baselines $BASELINES "${PROMPTS[@]}" --output "$RESULTS" 2>&1 | tee -a "$OUT/bench.log"
# The same prompts with chains ending after an unsure draft, for Osprey and for the assistant baselines alike (PLD
# has no draft probabilities to stop on).
EARLY_STOP_BASELINES=${BASELINES//,pld/}
RESULTS=benchmarks/results/replication-$TARGET-early-stop.json
log "benchmark with --confidence-threshold 0.3 -> $RESULTS"
OMP_NUM_THREADS=2 $OSPREY bench --target $TARGET --drafter osprey="$OUT/osprey" --baselines $EARLY_STOP_BASELINES \
  --confidence-threshold 0.3 "${PROMPTS[@]}" --output "$RESULTS" 2>&1 | tee -a "$OUT/bench.log"
log "done"
