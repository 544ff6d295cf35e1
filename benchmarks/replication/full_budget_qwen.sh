#!/usr/bin/env bash
# The full distillation budget of issue 17 §3 for Qwen2.5-Coder-1.5B-Instruct, resumable across machines: Osprey from
# the finished stage-2 backbone (benchmarks/checkpoints/stage2-qwen2.5-coder-0.5b-2l-first/final, converted with the
# shipped drafter's draft vocabulary) and the two controls built like it (`osprey baseline scratch|eagle3 --like`),
# each distilled for TOKEN_PASSES (5 M) token-passes on the same features of the first EXAMPLES (4,800) regenerated
# answers, in the same order with the same seed and settings (distill-qwen-full-budget.yaml).
#
#   full_budget_qwen.sh features                   # the feature cache (~1.5 h of 2 cores, ~20 GB; recomputable)
#   full_budget_qwen.sh train osprey|scratch|eagle3  # chunks of distillation (~6 h each): rerun until it says done
#   full_budget_qwen.sh curve osprey|scratch|eagle3  # tau of every learning-curve point not yet benched
#
# `train` cuts the run into chunks (stages.sh: train_in_chunks, CHUNK_MINUTES, MAX_CHUNKS); after each one its latest
# checkpoint is packed against the drafter's own init (int4 changes; the init is rebuilt here from committed
# products by deterministic commands, and every rebuilt tensor is checked by SHA-256 at unpack) into
# benchmarks/checkpoints/full-budget-qwen2.5-coder-1.5b-instruct/DRAFTER, which COMMIT=1 commits. A fresh machine
# unpacks it and resumes (Adam's moments restart); the pack records the init by its path, so keep RUNS (default
# /work/runs) the same there. The learning curve's points (1/16, 1/8, 1/4 and 1/2 of the steps,
# and the end) are evaluated on the held-out conversations and kept (`--keep_steps`); `train` benches the tau of each
# kept point as soon as its chunk ends (`curve`, a fixed 25-prompt subset, one per category; ~10 min each), so a
# point is measured on the machine that made it.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=qwen2.5-coder-1.5b-instruct
SHIPPED=osprey/demo_drafter_qwen
BACKBONE_PACK=benchmarks/checkpoints/stage2-qwen2.5-coder-0.5b-2l-first/final
ANSWERS=benchmarks/checkpoints/regenerated-sharegpt-$TARGET
CONFIG=benchmarks/replication/distill-qwen-full-budget.yaml
EXAMPLES=${EXAMPLES:-4800}
TOKEN_PASSES=${TOKEN_PASSES:-5000000}
OUT=$RUNS/full-budget
PACKED=${PACKED:-benchmarks/checkpoints/full-budget-$TARGET}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
source benchmarks/replication/stages.sh  # log, restore_answers, train_in_chunks, tau_subset
mkdir -p "$OUT"

usage() { echo "usage: $0 features | train DRAFTER | curve DRAFTER   (DRAFTER: osprey, scratch or eagle3)" >&2; exit 2; }
MODE=${1:-}
case $MODE in
  features) [ $# -eq 1 ] || usage ;;
  train|curve) [ $# -eq 2 ] || usage; case $2 in osprey|scratch|eagle3) ;; *) usage ;; esac ;;
  *) usage ;;
esac

FEATURES=$OUT/features-$EXAMPLES
features() {
  [ -f "$FEATURES/feature_cache.json" ] && return
  restore_answers "$ANSWERS" "$OUT/answers"
  local have; have=$(wc -l < "$OUT/answers/train.jsonl")
  if [ "$have" -lt "$EXAMPLES" ]; then
    log "only $have regenerated answers are committed, $EXAMPLES are needed: run regenerate_qwen.sh first"; exit 1
  fi
  log "features of the first $EXAMPLES regenerated answers -> $FEATURES (resumes after its last complete shard)"
  $OSPREY features --target $TARGET --dataset-name "$OUT/answers" --max-length 640 --batch-size 4 \
    --target-dtype bfloat16 --max-examples "$EXAMPLES" --shard-size-mb 512 --output "$FEATURES"
}
if [ "$MODE" = features ]; then features; log "done: $FEATURES"; exit 0; fi

DRAFTER=$2
# The inits, rebuilt the same way on every machine.
BACKBONE=$OUT/backbone
[ -f "$BACKBONE/model.safetensors" ] || $OSPREY unpack --checkpoint "$BACKBONE_PACK" --output "$BACKBONE"
[ -f "$OUT/osprey-init/model.safetensors" ] || $OSPREY convert --backbone "$BACKBONE" --target $TARGET \
  --draft-vocab-from $SHIPPED --output "$OUT/osprey-init"
case $DRAFTER in
  scratch|eagle3) [ -f "$OUT/$DRAFTER-init/model.safetensors" ] || $OSPREY baseline "$DRAFTER" \
    --like "$OUT/osprey-init" --output "$OUT/$DRAFTER-init" ;;
esac

# The budget in steps of the config's batch, from the feature cache's own token count; the curve's points are
# fractions of it.
plan() {
  .venv/bin/python - "$FEATURES/feature_cache.json" "$TOKEN_PASSES" "$CONFIG" <<'PY'
import json, math, sys, yaml
train = json.load(open(sys.argv[1]))["splits"]["train"]
config = yaml.safe_load(open(sys.argv[3]))
batch = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
steps = math.ceil(int(sys.argv[2]) * train["num_sequences"] / (batch * train["num_tokens"]))
print(steps, *(steps // d for d in (16, 8, 4, 2)))
PY
}

curve() {  # tau of each kept point (and the final drafter) with no row yet in its results file
  local kept step
  for kept in "$OUT/$DRAFTER/kept"/step-* "$OUT/$DRAFTER"; do
    [ -f "$kept/model.safetensors" ] || continue
    step=$(step_of "$kept")
    tau_subset "benchmarks/results/full-budget-$TARGET-step$step.json" --drafter "$DRAFTER=$kept"
  done
}
if [ "$MODE" = curve ]; then curve; exit 0; fi

features
read -r STEPS KEEP <<< "$(plan)"
[ -n "$KEEP" ] || { log "could not read the budget from $FEATURES/feature_cache.json"; exit 1; }
log "$DRAFTER: $STEPS steps ($TOKEN_PASSES token-passes), curve points at steps $KEEP and $STEPS"
PACK_ARGS=(--reference "$OUT/$DRAFTER-init" --delta-bits 4)
rc=0
train_in_chunks "$OUT/$DRAFTER" "$PACKED/$DRAFTER" $OSPREY distill --config "$CONFIG" --feature-cache "$FEATURES" \
  --drafter "$OUT/$DRAFTER-init" --output "$OUT/$DRAFTER" --max-steps "$STEPS" --keep-steps $KEEP || rc=$?
[ "${CURVE:-1}" = 1 ] && curve  # CURVE=0 leaves the benches for later (`curve`)
[ $rc -eq 3 ] && exit 0  # chunks ran out: rerun to continue
exit $rc
