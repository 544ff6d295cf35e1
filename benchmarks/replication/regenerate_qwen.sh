#!/usr/bin/env bash
# Target-generated distillation data for Qwen2.5-Coder-1.5B-Instruct (issue 17 §3), resumable across machines: the
# target answers ShareGPT openings greedily (`osprey regenerate`), one JSON line per conversation, for at most
# CHUNK_MINUTES per invocation. The answers are committed gzipped in $PACKED (COMMIT=1); on a machine without the
# runs folder the committed lines are restored first, so no answer is generated twice.
#
#   COMMIT=1 nohup benchmarks/replication/regenerate_qwen.sh > /work/runs/regen.log 2>&1 &
#
# TARGET, TRAIN_CONVERSATIONS (8,000) and BATCH_SIZE (48) may be set to answer for another target (transfer_smollm2.sh
# does), and DATASET (sharegpt) to answer another corpus's openings (languages_qwen.sh: multilingual-chat, built by
# `osprey data multilingual-chat` if missing); the defaults are the Qwen answers'. The other settings are fixed: a
# resumed run with others is refused.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=${TARGET:-qwen2.5-coder-1.5b-instruct}
TRAIN_CONVERSATIONS=${TRAIN_CONVERSATIONS:-8000}
DATASET=${DATASET:-sharegpt}
BATCH_SIZE=${BATCH_SIZE:-48}
CHUNK_MINUTES=${CHUNK_MINUTES:-45}
THREADS=${THREADS:-1}
COMMIT=${COMMIT:-0}
if [ "$DATASET" = sharegpt ]; then OUT=$RUNS/regen/$TARGET; else OUT=$RUNS/regen/$DATASET-$TARGET; fi
PACKED=${PACKED:-benchmarks/checkpoints/regenerated-$DATASET-$TARGET}
source benchmarks/replication/stages.sh  # log, restore_answers
mkdir -p "$OUT" "$PACKED"

# 1. A fresh machine starts from the committed answers.
restore_answers "$PACKED" "$OUT"

# 2. One chunk of answering (the same settings as the committed answers, or the manifest check refuses).
log "regenerate for at most $CHUNK_MINUTES min"
timeout --signal=INT "${CHUNK_MINUTES}m" $OSPREY regenerate --target $TARGET --dataset-name "$DATASET" --output "$OUT" \
  --splits test train --max-test-conversations 48 --max-train-conversations "$TRAIN_CONVERSATIONS" \
  --batch-size "$BATCH_SIZE" --max-new-tokens 256 --max-prompt-tokens 384 --threads "$THREADS" \
  || log "chunk ended (exit $?)"

# 3. Pack: gzip every split (a torn last line is left out) and commit.
pack() {
  cp "$OUT/manifest.json" "$PACKED/manifest.json"
  for file in "$OUT"/*.jsonl; do
    .venv/bin/python - "$file" <<'PY' | gzip -n -9 > "$PACKED/$(basename "$file").gz.staging"
import json, sys
for line in open(sys.argv[1], encoding="utf-8"):
    try:
        json.loads(line)
    except json.JSONDecodeError:
        break
    sys.stdout.write(line)
PY
    mv "$PACKED/$(basename "$file").gz.staging" "$PACKED/$(basename "$file").gz"
  done
  local counts; counts=$(for f in "$PACKED"/*.jsonl.gz; do echo -n "$(basename "$f" .jsonl.gz) $(gunzip -c "$f" | wc -l) "; done)
  log "packed: $counts"
  if [ "$COMMIT" = 1 ]; then
    git add "$PACKED" && git commit -q -m "Regenerated $DATASET answers of $TARGET: $counts" -- "$PACKED" || true
  fi
}
pack
