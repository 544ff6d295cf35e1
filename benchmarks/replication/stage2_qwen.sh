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
source benchmarks/replication/stages.sh  # log, train_in_chunks
mkdir -p "$OUT" "$PACKED"
if [ -f "$PACKED/final/osprey_pack.json" ]; then log "done: $PACKED/final"; exit 0; fi  # before any rebuild

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

# 3. Chunks of training (stages.sh: train_in_chunks), each followed by a pack of its latest checkpoint; a fresh
# machine resumes from the committed pack.
PACK_ARGS=(--reference $PARENT)
rc=0
train_in_chunks "$OUT" "$PACKED" $OSPREY pretrain --config "$CONFIG" --backbone "$INIT" --output "$OUT" "$@" || rc=$?
[ $rc -eq 3 ] && exit 0  # chunks ran out: rerun to continue
exit $rc
