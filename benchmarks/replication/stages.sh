# Sourced by run.sh and the ablations (which set OSPREY): the stages they share, each skipped when complete or
# resumed when it was killed.

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

target_features() {  # target_features TARGET DIR: the target's taps over 1,000 ShareGPT conversations
  [ -f "$2/feature_cache.json" ] && return
  log "target features of $1 (resumes after the last complete shard)"
  $OSPREY features --target_model "$1" --dataset_name sharegpt --output_dir "$2" --max_length 1024 \
    --max_examples 1000 --batch_size 1 --target_dtype bfloat16 --shard_size_mb 256
}

conversations_text() {  # conversations_text DATASET FILE: the training conversations of DATASET (a corpus name or a
  # folder of chats) as text, one message a line: a draft-vocabulary corpus
  [ -f "$2" ] && return
  log "draft-vocabulary corpus: the training conversations of $1 as text"
  .venv/bin/python -c "
import sys; from trainers.corpora.loading import DatasetArguments, load_text_dataset
dataset = load_text_dataset(DatasetArguments(dataset_name=sys.argv[1]))['train']
with open(sys.argv[2] + '.partial', 'w') as out:
    for messages in dataset['messages']:
        out.write('\n'.join(message['content'] for message in messages) + '\n')
" "$1" "$2" && mv "$2.partial" "$2"
}

sharegpt_text() { conversations_text sharegpt "$1"; }  # sharegpt_text FILE: ShareGPT's, the usual such corpus

distill() {  # distill INIT OUTPUT FEATURES [ARGS...]: stage 4 on the replication's budget, logged to OUTPUT.log
  local init=$1 output=$2 features=$3 resume=()
  shift 3
  compgen -G "$output/checkpoint-*" > /dev/null && resume=(--resume_from_checkpoint true)
  log "distill $output"
  $OSPREY distill --config benchmarks/replication/distill-common.yaml --feature_cache "$features" \
    --drafter "$init" --output_dir "$output" "$@" "${resume[@]}" >> "$output.log" 2>&1
}

restore_answers() {  # restore_answers PACKED DIR: the committed target-written answers (regenerate_qwen.sh) in DIR
  mkdir -p "$2"
  local file
  for file in "$1"/*.jsonl.gz; do
    [ -e "$file" ] || continue
    [ -s "$2/$(basename "$file" .gz)" ] || { log "restoring $2/$(basename "$file" .gz)"; gunzip -c "$file" > "$2/$(basename "$file" .gz)"; }
  done
  [ -f "$2/manifest.json" ] || [ ! -f "$1/manifest.json" ] || cp "$1/manifest.json" "$2/"
}

tau_subset() {  # tau_subset RESULTS --drafter NAME=DIR...: greedy tau for TAU_TARGET (Qwen2.5-Coder-1.5B-Instruct
  # unless set) on a fixed 25-prompt subset, one per category of the replication's suites (no target-alone run: greedy
  # tau needs none). The bench resumes RESULTS, so a rerun, or another drafter, only measures what is missing.
  local results=$1; shift
  $OSPREY bench --target "${TAU_TARGET:-qwen2.5-coder-1.5b-instruct}" "$@" --baselines "" --prompts spec_bench \
    --prompts mt_bench --prompts humaneval --prompts mmath --per-category 1 --max-new-tokens 48 --dtype bfloat16 \
    --output "$results"
}

# --- Chunked training, resumable across machines (stage2_qwen.sh, full_budget_qwen.sh) ---
# No process here may live 3 hours, and the runs folder does not outlive the machine: a long run is cut into chunks,
# and after each one its latest checkpoint is packed (`osprey pack --checkpoint ... "${PACK_ARGS[@]}"`, set by the
# caller) into a folder that COMMIT=1 commits; a fresh machine unpacks it and resumes (same step and learning-rate
# schedule; Adam's moments restart).

budget_plan() {  # budget_plan CACHE_JSON TOKEN_PASSES CONFIG: the steps of CONFIG's batch that make TOKEN_PASSES
  # token-passes (a token-pass: one token of a training sequence, prompt and answer, read once; the mean tokens per
  # sequence from the feature cache's own count), then the learning curve's points, 1/16, 1/8, 1/4 and 1/2 of them
  .venv/bin/python - "$@" <<'PY'
import json, math, sys, yaml
train = json.load(open(sys.argv[1]))["splits"]["train"]
config = yaml.safe_load(open(sys.argv[3]))
batch = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
steps = math.ceil(int(sys.argv[2]) * train["num_sequences"] / (batch * train["num_tokens"]))
print(steps, *(steps // d for d in (16, 8, 4, 2)))
PY
}

step_of() { grep -o '"global_step": *[0-9]*' "$1/trainer_state.json" | grep -o '[0-9]*$'; }

complete_checkpoint() {  # a checkpoint a killed save did not leave half-written
  for file in model.safetensors optimizer.pt scheduler.pt trainer_state.json; do [ -s "$1/$file" ] || return 1; done
}

latest_checkpoint() {  # latest_checkpoint RUN: RUN's newest complete checkpoint; half-written ones are moved aside
  local dir
  for dir in $(for d in "$1"/checkpoint-*; do [ -d "$d" ] && echo "${d##*-} $d"; done | sort -n -r | cut -d' ' -f2-); do
    if complete_checkpoint "$dir"; then echo "$dir"; return; fi
    log "moving the incomplete $dir aside"; mv "$dir" "$1/incomplete-$(basename "$dir")-$(date +%s)"
  done
}

pack_into() {  # pack_into SOURCE DEST MESSAGE: a staging pack swapped in whole (a killed pack loses nothing), then
  # with COMMIT=1 committed with the rest of DEST's parent folder, unless it is above 50 MB
  rm -rf "$2.staging"
  $OSPREY pack --checkpoint "$1" --output "$2.staging" "${PACK_ARGS[@]}" || return 1
  rm -rf "$2" && mv "$2.staging" "$2" || return 1
  local size; size=$(du -sm "$2" | cut -f1)
  if [ "$size" -gt 50 ]; then  # kept here, not committed: a fresh machine would not have it
    log "warning: $2 is $size MB, above the 50 MB a committed stage product may take: not committed"
    return 0
  fi
  if [ "${COMMIT:-0}" = 1 ]; then
    git add "$(dirname "$2")" && git commit -q -m "$(basename "$(dirname "$2")"): $3 packed ($size MB)" \
      -- "$(dirname "$2")" || return 1
  fi
}

train_in_chunks() {  # train_in_chunks RUN PACKED COMMAND...: runs COMMAND (an `osprey pretrain|distill` writing to
  # RUN) for at most MAX_CHUNKS chunks of CHUNK_MINUTES, each followed by a pack of RUN's latest checkpoint into
  # PACKED/checkpoint; when training finishes, the final model (with its training record) goes to PACKED/final and
  # the superseded resume pack is removed. Returns 0 when finished (at once if PACKED/final exists), 3 when the chunks
  # ran out first (rerun), 1 when COMMAND failed. When a chunk's time is up, `timeout` sends SIGTERM: the trainer
  # finishes the running update, checkpoints it and stops; one still running 10 minutes later is killed. Every step is
  # checked explicitly: `set -e` does not apply inside a function called as `train_in_chunks ... || rc=$?`.
  local run=$1 packed=$2 chunk rc checkpoint resume step
  shift 2
  if [ -f "$packed/final/osprey_pack.json" ]; then log "done: $packed/final"; return 0; fi
  mkdir -p "$packed"
  if [ -z "$(latest_checkpoint "$run")" ] && [ -f "$packed/checkpoint/osprey_pack.json" ]; then
    step=$(step_of "$packed/checkpoint")
    log "no local checkpoint: resuming from the committed pack (step $step)"
    $OSPREY unpack --checkpoint "$packed/checkpoint" --output "$run/checkpoint-$step" || return 1
  fi
  for chunk in $(seq "${MAX_CHUNKS:-3}"); do
    resume=()
    [ -n "$(latest_checkpoint "$run")" ] && resume=(--resume-from-checkpoint true)
    log "chunk $chunk/${MAX_CHUNKS:-3}: at most ${CHUNK_MINUTES:-45} min -> $run.log"
    rc=0
    timeout --kill-after=10m "${CHUNK_MINUTES:-45}m" "$@" "${resume[@]}" >> "$run.log" 2>&1 || rc=$?
    checkpoint=$(latest_checkpoint "$run")
    # a resume point, unless training finished (then the final model below supersedes it)
    if [ $rc -ne 0 ] && [ -n "$checkpoint" ] && { [ ! -f "$packed/checkpoint/trainer_state.json" ] \
         || [ "$(step_of "$checkpoint")" != "$(step_of "$packed/checkpoint")" ]; }; then
      log "pack $checkpoint -> $packed/checkpoint"
      pack_into "$checkpoint" "$packed/checkpoint" "checkpoint at step $(step_of "$checkpoint")" || return 1
    fi
    # after the pack: a run killed or failed after a save keeps that checkpoint
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 143 ]; then log "training failed (exit $rc): see $run.log"; return 1; fi
    if [ $rc -eq 0 ]; then
      log "pack the finished model -> $packed/final"
      [ -n "$checkpoint" ] && cp "$checkpoint/trainer_state.json" "$run/"  # the training record travels with it
      rm -rf "$packed/checkpoint"
      pack_into "$run" "$packed/final" "final model" || return 1
      log "done: $packed/final"
      return 0
    fi
  done
  log "${MAX_CHUNKS:-3} chunk(s) run: rerun to continue"
  return 3
}

# --- A target's three drafters distilled on one budget (full_budget_qwen.sh, transfer_smollm2.sh, languages_qwen.sh) ---
# The caller sets TARGET, OUT, ANSWERS (the committed answers), ANSWERS_HINT (how to make more), EXAMPLES, FEATURES,
# CONFIG, TOKEN_PASSES, PACKED, CURVE_RESULTS (the curve's results files' prefix), CURVE_TITLE (its commit
# messages), optionally EAGLE3_DELTA_BITS (default 4), and defines `init DRAFTER`.

commit_results() {  # commit_results MESSAGE FILE...: with COMMIT=1, results files are committed as they are made
  [ "${COMMIT:-0}" = 1 ] || return 0
  local message=$1; shift
  git add -- "$@" && { git diff --cached --quiet -- "$@" || git commit -q -m "$message" -- "$@"; }
}

answer_openings() {  # answer_openings PACKED COUNT [DATASET]: one chunk of TARGET's answers to the openings of
  # DATASET (default sharegpt; regenerate_qwen.sh, COUNT training and 48 held-out), packed in PACKED; then the count
  DATASET=${3:-sharegpt} TARGET=$TARGET PACKED=$1 TRAIN_CONVERSATIONS=$2 THREADS=${THREADS:-2} \
    BATCH_SIZE=${BATCH_SIZE:-48} benchmarks/replication/regenerate_qwen.sh || return 1
  local have; have=$(gunzip -c "$1/train.jsonl.gz" | wc -l)
  if [ "$have" -ge "$2" ]; then log "done: $have answers in $1"; else log "$have of $2: rerun"; fi
}

answer_features() {  # answer_features DIR EXAMPLES OUTPUT: TARGET's bf16 features of the first EXAMPLES
  # conversations of the chat folder DIR (sequences up to 640 tokens), resuming after OUTPUT's last complete shard
  log "features of the first $2 conversations of $1 -> $3 (resumes after its last complete shard)"
  $OSPREY features --target $TARGET --dataset-name "$1" --max-length 640 --batch-size 4 --target-dtype bfloat16 \
    --max-examples "$2" --shard-size-mb 512 --output "$3"
}

features() {  # the target's features of the first EXAMPLES answers, in FEATURES
  [ -f "$FEATURES/feature_cache.json" ] && return
  restore_answers "$ANSWERS" "$OUT/answers"
  local have; have=$(wc -l < "$OUT/answers/train.jsonl")
  if [ "$have" -lt "$EXAMPLES" ]; then
    log "only $have answers are committed in $ANSWERS, $EXAMPLES are needed: $ANSWERS_HINT"; return 1
  fi
  answer_features "$OUT/answers" "$EXAMPLES" "$FEATURES"
}

curve() {  # curve DRAFTER: tau of each kept point (and the final drafter) with no row yet in its results file
  local kept step results
  for kept in "$OUT/$1/kept"/step-* "$OUT/$1"; do
    [ -f "$kept/model.safetensors" ] || continue
    step=$(step_of "$kept")
    results=$CURVE_RESULTS-step$step.json
    tau_subset "$results" --drafter "$1=$kept"
    commit_results "$CURVE_TITLE: tau of $1 at step $step" "${results%.json}".*
  done
}

train() {  # train DRAFTER: returns 0 when trained, 3 when its chunks ran out (rerun), 1 on failure
  local steps keep rc=0 bits=4
  init "$1" || return 1
  features || return 1
  read -r steps keep <<< "$(budget_plan "$FEATURES/feature_cache.json" "$TOKEN_PASSES" "$CONFIG")"
  [ -n "$keep" ] || { log "could not read the budget from $FEATURES/feature_cache.json"; return 1; }
  log "$1: $steps steps ($TOKEN_PASSES token-passes), curve points at steps $keep and $steps"
  [ "$1" = eagle3 ] && bits=${EAGLE3_DELTA_BITS:-4}
  PACK_ARGS=(--reference "$OUT/$1-init" --delta-bits $bits)  # changes against the init
  train_in_chunks "$OUT/$1" "$PACKED/$1" $OSPREY distill --config "$CONFIG" --feature-cache "$FEATURES" \
    --drafter "$OUT/$1-init" --output "$OUT/$1" --max-steps "$steps" --keep-steps $keep || rc=$?
  if [ "${CURVE:-1}" = 1 ]; then curve "$1"; fi  # CURVE=0 leaves the benches for later (`curve`)
  return $rc
}

three_drafter_bench() {  # three_drafter_bench RESULTS ARGS...: the one bench of a target's three drafters (ARGS: the
  # --drafter osprey=DIR, scratch=DIR, eagle3=DIR, --baselines and any reference) on the replication's 50 prompts
  # (Spec-Bench, MT-Bench, HumanEval, MMATH; 2 per category), chains and trees (--draft-topk 3), into RESULTS; then
  # ratios.py's groups, each shape against the controls' same shape, in RESULTS-ratios.txt
  local results=$1 suffix; shift
  $OSPREY bench --target $TARGET "$@" --prompts spec_bench --prompts mt_bench --prompts humaneval --prompts mmath \
    --per-category 2 --seed 0 --max-new-tokens 64 --draft-topk 3 --drafter-quantization int8 --dtype bfloat16 \
    --output "$results" || return 1
  for suffix in "" -tree; do
    $PYTHON benchmarks/replication/ratios.py "$results" --drafter "osprey$suffix" \
      --controls "scratch$suffix" "eagle3$suffix" || return 1
  done > "${results%.json}-ratios.txt" || return 1
  cat "${results%.json}-ratios.txt"
}

trained() {  # trained DRAFTER: its final model's pack is in $PACKED/DRAFTER (committed when COMMIT=1)
  [ -f "$PACKED/$1/final/osprey_pack.json" ]
}

finished() {  # finished DRAFTER: its final model in $OUT/DRAFTER (trained here, or unpacked from its committed pack)
  trained "$1" || { log "$1 is not trained yet: run train $1"; return 1; }
  [ -f "$OUT/$1/model.safetensors" ] && return 0
  init "$1" && $OSPREY unpack --checkpoint "$PACKED/$1/final" --output "$OUT/$1"
}
