#!/usr/bin/env bash
# Stage 2 of the same-tokenizer backbone (issue 17 §2), resumable across machines: Qwen2.5-Coder-0.5B-Instruct
# pruned to NUM_LAYERS blocks (STRATEGY: first | block-influence), trained on the `multilingual` corpus with
# self-distillation from the unpruned parent, in chunks of at most CHUNK_MINUTES. After each chunk the latest
# checkpoint is packed into $PACKED/checkpoint (`osprey pack --reference` the parent: the blocks as int8 deltas, the
# frozen embedding, LM head and tokenizer as sha256-checked references to the zoo model), and with COMMIT=1 committed.
# On a machine without the runs folder, the committed pack is unpacked and training resumes from it (same step and
# learning-rate schedule; Adam's moments restart). The finished backbone is packed into $PACKED/final with its training
# record (the last checkpoint's trainer_state.json), and the resume pack, now superseded, is removed.
#
#   nohup benchmarks/replication/stage2_qwen.sh > /work/runs/stage2-qwen.log 2>&1 &
#   NUM_LAYERS=2 MAX_CHUNKS=1 CHUNK_MINUTES=10 benchmarks/replication/stage2_qwen.sh --max-steps 4 --save-steps 2
#
# One invocation runs at most MAX_CHUNKS chunks (no process here may live 3 hours): rerun it until it prints "done".
# When a chunk's time is up, `timeout` sends SIGTERM: `osprey pretrain` finishes the running update, checkpoints it and
# stops (a few minutes past CHUNK_MINUTES), so no paid-for update is lost; one still running 10 minutes later is killed.
# Arguments are passed on to `osprey pretrain` (TrlParser flags overriding the config).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
PARENT=qwen2.5-coder-0.5b-instruct
NUM_LAYERS=${NUM_LAYERS:-2}
STRATEGY=${STRATEGY:-first}
CONFIG=${CONFIG:-trainers/configs/pretrain-qwen2.5-coder-0.5b-multilingual.yaml}
CHUNK_MINUTES=${CHUNK_MINUTES:-45}
MAX_CHUNKS=${MAX_CHUNKS:-3}
COMMIT=${COMMIT:-0}
NAME=${NAME:-stage2-qwen2.5-coder-0.5b-${NUM_LAYERS}l-$STRATEGY}
OUT=$RUNS/$NAME
PACKED=${PACKED:-benchmarks/checkpoints/$NAME}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
source benchmarks/replication/stages.sh  # log
mkdir -p "$OUT" "$PACKED"
if [ -f "$PACKED/final/osprey_pack.json" ]; then log "done: $PACKED/final"; exit 0; fi

# 1. The corpus; a rebuild is compared with the committed manifest (packages that moved on are reported).
lock=()
[ -f "$PACKED/corpus-manifest.json" ] && lock=(--lock "$PACKED/corpus-manifest.json")
CORPUS=$($OSPREY data multilingual --tokenizer $PARENT "${lock[@]}" | tail -1)
[ -f "$PACKED/corpus-manifest.json" ] || cp "$CORPUS/manifest.json" "$PACKED/corpus-manifest.json"

# 2. The pruned backbone (deterministic: block influence is scored on the corpus's own calibration text).
INIT=$OUT/init
if [ ! -f "$INIT/model.safetensors" ]; then
  log "prune $PARENT to $NUM_LAYERS blocks ($STRATEGY)"
  calibration=()
  [ "$STRATEGY" = block-influence ] && calibration=(--calibration-file "$CORPUS/calibration.txt")
  rm -rf "$INIT.partial"
  $OSPREY prune --backbone $PARENT --num-layers "$NUM_LAYERS" --strategy "$STRATEGY" "${calibration[@]}" \
    --output "$INIT.partial" && mv "$INIT.partial" "$INIT"
fi

step_of() { grep -o '"global_step": *[0-9]*' "$1/trainer_state.json" | grep -o '[0-9]*$'; }
complete() {  # a checkpoint a killed save did not leave half-written
  for file in model.safetensors optimizer.pt scheduler.pt trainer_state.json; do [ -s "$1/$file" ] || return 1; done
}
latest_checkpoint() {  # the newest complete local checkpoint; half-written ones are moved aside
  local dir
  for dir in $(ls -d "$OUT"/checkpoint-* 2>/dev/null | sort -t- -k2 -n -r); do
    if complete "$dir"; then echo "$dir"; return; fi
    log "moving the incomplete $dir aside"; mv "$dir" "$OUT/incomplete-$(basename "$dir")-$(date +%s)"
  done
}
pack_into() {  # pack_into CHECKPOINT DEST: a staging pack swapped in whole, so a killed pack loses nothing
  rm -rf "$2.staging"
  $OSPREY pack --checkpoint "$1" --output "$2.staging" --reference $PARENT
  rm -rf "$2" && mv "$2.staging" "$2"
  local size; size=$(du -sm "$2" | cut -f1)
  [ "$size" -le 50 ] || log "warning: $2 is $size MB, above the 50 MB a committed stage product may take"
  if [ "$COMMIT" = 1 ]; then
    git add "$2" "$PACKED/corpus-manifest.json" && git commit -q -m "$NAME: $3 packed ($size MB)" -- "$PACKED"
  fi
}

# 3. A fresh machine resumes from the committed pack.
if [ -z "$(latest_checkpoint)" ] && [ -f "$PACKED/checkpoint/osprey_pack.json" ]; then
  step=$(step_of "$PACKED/checkpoint")
  log "no local checkpoint: resuming from the committed pack (step $step)"
  $OSPREY unpack --checkpoint "$PACKED/checkpoint" --output "$OUT/checkpoint-$step"
fi

# 4. Chunks of training, each followed by a pack of its latest checkpoint.
for chunk in $(seq "$MAX_CHUNKS"); do
  resume=()
  [ -n "$(latest_checkpoint)" ] && resume=(--resume-from-checkpoint true)
  log "chunk $chunk/$MAX_CHUNKS: osprey pretrain for at most $CHUNK_MINUTES min -> $OUT.log"
  rc=0
  timeout --kill-after=10m "${CHUNK_MINUTES}m" $OSPREY pretrain --config "$CONFIG" --backbone "$INIT" --output "$OUT" \
    "${resume[@]}" "$@" >> "$OUT.log" 2>&1 || rc=$?
  checkpoint=$(latest_checkpoint)
  # a resume point, unless training finished (then the final backbone below supersedes it)
  if [ $rc -ne 0 ] && [ -n "$checkpoint" ] && { [ ! -f "$PACKED/checkpoint/trainer_state.json" ] \
       || [ "$(step_of "$checkpoint")" != "$(step_of "$PACKED/checkpoint")" ]; }; then
    log "pack $checkpoint -> $PACKED/checkpoint"
    pack_into "$checkpoint" "$PACKED/checkpoint" "checkpoint at step $(step_of "$checkpoint")"
  fi
  # after the pack: a run killed or failed after a save keeps that checkpoint
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 143 ]; then log "osprey pretrain failed (exit $rc): see $OUT.log"; exit 1; fi
  if [ $rc -eq 0 ]; then  # training finished: the final model (no optimizer) is the stage's product
    log "pack the finished backbone -> $PACKED/final"
    # the training record (losses per step) travels with the backbone
    [ -n "$checkpoint" ] && cp "$checkpoint/trainer_state.json" "$OUT/"
    rm -rf "$PACKED/checkpoint"
    pack_into "$OUT" "$PACKED/final" "final backbone"
    log "done: $PACKED/final"
    exit 0
  fi
done
log "$MAX_CHUNKS chunk(s) run: rerun to continue"
