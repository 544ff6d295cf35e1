# Sourced by run.sh and the ablations (which set OSPREY): the two inputs every distillation for a target shares,
# each built once and skipped when complete.

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
