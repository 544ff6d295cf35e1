# Sourced by run.sh and the ablations (which set OSPREY): the stages they share, each skipped when complete or
# resumed when it was killed.

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

target_features() {  # target_features TARGET DIR: the target's taps over 1,000 ShareGPT conversations
  [ -f "$2/feature_cache.json" ] && return
  log "target features of $1 (resumes after the last complete shard)"
  $OSPREY features --target_model "$1" --dataset_name sharegpt --output_dir "$2" --max_length 1024 \
    --max_examples 1000 --batch_size 1 --target_dtype bfloat16 --shard_size_mb 256
}

sharegpt_text() {  # sharegpt_text FILE: the ShareGPT training conversations as text, the draft-vocabulary corpus
  [ -f "$1" ] && return
  log "draft-vocabulary corpus: the ShareGPT training conversations as text"
  .venv/bin/python -c "
import sys; from trainers.data import DatasetArguments, load_text_dataset
dataset = load_text_dataset(DatasetArguments(dataset_name='sharegpt'))['train']
with open(sys.argv[1] + '.partial', 'w') as out:
    for messages in dataset['messages']:
        out.write('\n'.join(message['content'] for message in messages) + '\n')
" "$1" && mv "$1.partial" "$1"
}

distill() {  # distill INIT OUTPUT FEATURES [ARGS...]: stage 4 on the replication's budget, logged to OUTPUT.log
  local init=$1 output=$2 features=$3 resume=()
  shift 3
  compgen -G "$output/checkpoint-*" > /dev/null && resume=(--resume_from_checkpoint true)
  log "distill $output"
  $OSPREY distill --config benchmarks/replication/distill-common.yaml --feature_cache "$features" \
    --drafter "$init" --output_dir "$output" "$@" "${resume[@]}" >> "$output.log" 2>&1
}
