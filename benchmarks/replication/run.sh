#!/usr/bin/env bash
# The small-scale replication of the paper's table (issue 6 §2): Osprey vs. the body-random (scratch) control vs. an
# EAGLE-3 drafter, all for Qwen2.5-Coder-1.5B-Instruct, distilled on the same feature cache with the same budget, then
# benchmarked in one process. Every stage is skipped when its output is complete and resumes when it was killed, so
# rerun this script until it prints "done". Long stages run for hours on a CPU: start it with nohup.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=qwen2.5-coder-1.5b-instruct
FEATURES=$RUNS/features-qwen2.5-coder-1.5b-sharegpt
BACKBONE=$RUNS/pretrain-smollm2-2l  # stage 2: osprey pretrain --config trainers/configs/pretrain-smollm2-2l.yaml
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

if [ ! -f "$FEATURES/feature_cache.json" ]; then
  log "target features (resumes after the last complete shard)"
  $OSPREY features --target_model $TARGET --dataset_name sharegpt --output_dir "$FEATURES" --max_length 1024 \
    --max_examples 1000 --batch_size 1 --target_dtype bfloat16 --shard_size_mb 256
fi
if [ ! -f "$BACKBONE/model.safetensors" ]; then
  log "the pretrained backbone is not finished: resume stage 2 first (docs/training.md)"; exit 1
fi

VOCAB_CORPUS=$RUNS/sharegpt-train.txt
if [ ! -f "$VOCAB_CORPUS" ]; then
  log "draft-vocabulary corpus: the ShareGPT training conversations as text"
  .venv/bin/python -c "
import sys; from trainers.data import DatasetArguments, load_text_dataset
dataset = load_text_dataset(DatasetArguments(dataset_name='sharegpt'))['train']
with open(sys.argv[1] + '.partial', 'w') as out:
    for messages in dataset['messages']:
        out.write('\n'.join(message['content'] for message in messages) + '\n')
" "$VOCAB_CORPUS" && mv "$VOCAB_CORPUS.partial" "$VOCAB_CORPUS"
fi

OSPREY_DRAFTER=$RUNS/replication/osprey-init
[ -f "$OSPREY_DRAFTER/model.safetensors" ] || $OSPREY convert --backbone "$BACKBONE" --target $TARGET \
  --draft-vocab-size 32000 --draft-vocab-corpus "$VOCAB_CORPUS" --output "$OSPREY_DRAFTER"
[ -f "$RUNS/replication/scratch-init/model.safetensors" ] || $OSPREY baseline scratch --like "$OSPREY_DRAFTER" \
  --output "$RUNS/replication/scratch-init"
[ -f "$RUNS/replication/eagle3-init/model.safetensors" ] || $OSPREY baseline eagle3 --like "$OSPREY_DRAFTER" \
  --target $TARGET --output "$RUNS/replication/eagle3-init"

for drafter in osprey scratch eagle3; do
  output=$RUNS/replication/$drafter
  [ -f "$output/model.safetensors" ] && continue
  resume=()
  compgen -G "$output/checkpoint-*" > /dev/null && resume=(--resume_from_checkpoint true)
  extra=()
  [ $drafter = eagle3 ] && extra=(--freeze_embeddings true)
  log "distill $drafter"
  $OSPREY distill --config benchmarks/replication/distill-common.yaml --drafter "$RUNS/replication/$drafter-init" \
    --output_dir "$output" "${extra[@]}" "${resume[@]}" 2>&1 | tee -a "$RUNS/replication/$drafter.log"
done
log "done: benchmark with the commands in docs/results.md"
