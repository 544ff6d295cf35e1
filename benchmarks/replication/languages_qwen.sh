#!/usr/bin/env bash
# Issue 54, item 2: an adaptation that keeps the stage-2 backbone's languages, on Qwen2.5-Coder-1.5B-Instruct.
# Distillation on the target's ShareGPT answers (99.3% Latin script, almost all English) takes the converted
# backbone's tau on Arabic and Japanese from 1.15 / 1.27 to 1.00. Each candidate here is distilled from the same init
# as the full-budget run (full_budget_qwen.sh init: the stage-2 backbone converted with the shipped draft vocabulary,
# and the two controls built like it), for TOKEN_PASSES (1.25 M) token-passes with the full budget's settings
# (distill-qwen-full-budget.yaml), and measured on held-out openings in 28 languages that no run trains on
# (`osprey bench --prompts multilingual_chat`: the test split of `osprey data multilingual-chat`, never the bench's
# MT-Bench or MMATH) and on the curve's English 25-prompt subset. Resumable across machines like full_budget_qwen.sh.
#
#   languages_qwen.sh answers          # the target's answers to multilingual-chat openings, one chunk: rerun until done
#   languages_qwen.sh data             # the two distillation sets (en, mixed) from the committed answers
#   languages_qwen.sh features DATA    # the target's features of a set (en or mixed)
#   languages_qwen.sh train VARIANT    # chunks of distillation, then its held-out taus: rerun until it says done
#   languages_qwen.sh init VARIANT     # its init alone
#   languages_qwen.sh evaluate VARIANT # held-out taus of each kept point and the final drafter not yet measured
#   languages_qwen.sh reference        # the same taus of the converted init and of the shipped full-budget drafter
#   languages_qwen.sh table            # tau per language group of everything measured -> RESULTS-table.md
#   languages_qwen.sh bench VARIANT    # the full-budget VARIANT and its controls: one bench, the ratios, the curves
#   languages_qwen.sh curves VARIANT   # the curves and the sample efficiency alone (RESULTS-curves.*)
#
# VARIANT is [scratch-|eagle3-]DATA[-vocab][-replay][-slow]:
# - DATA `en`: the first EXAMPLES (2,600) ShareGPT answers (regenerate_qwen.sh's, committed), what every drafter so
#   far distilled on; `mixed`: the first EXAMPLES/2 of them and the first EXAMPLES/2 answers to multilingual-chat
#   openings (latin 64%, cyrillic 12%, CJK 17%, other scripts 7% of the openings), written by the target itself.
# - `-vocab`: the init converted with a draft vocabulary of the same size (32,000) counted on the mixed training
#   conversations instead of the shipped one (counted on ShareGPT): that one covers 88% of the Qwen tokens of the
#   multilingual-chat openings in Latin script, 87% in Cyrillic, 76% in CJK and 91% in other scripts, and a chain ends
#   at every token outside it. The controls take it with `osprey baseline --like`.
# - `-replay`: `--lm-replay-dataset multilingual --lm-replay-weight REPLAY_WEIGHT` (0.25): every step also trains the
#   drafter, read without target features (where it computes the backbone), on a batch of the stage-2 corpus.
# - `-slow`: `--pretrained-learning-rate-scale SLOW_SCALE` (0.25): the backbone's weights learn at a quarter of the
#   rate of the weights convert added (fc, the feature half of the fusion block's q/k/v); refused for the controls.
# - `scratch-` / `eagle3-`: the body-random and EAGLE-3 controls, on the same data and steps.
# The candidates are en, mixed, mixed-vocab, mixed-replay and mixed-slow, screened at a quarter of the budget
# (TOKEN_PASSES=312500: runs and methods named VARIANT-312k); the winner then runs at the full budget, and the
# controls with the winner's data, vocabulary and replay.
#
# bench: the winner (methods osprey, osprey-tree) and its controls (scratch, eagle3: the winner's data, vocabulary and
# replay), all trained to the full budget, decode the replication's 50 prompts (Spec-Bench, MT-Bench, HumanEval, MMATH;
# 2 per category), chains and trees (--draft-topk 3), as transfer_smollm2.sh's bench, into RESULTS-bench.json; no
# target-alone run (greedy tau needs none); ratios.py's groups in RESULTS-bench-ratios.txt; the curves of the three runs
# (each kept point's tau from the held-out measures) and the sample efficiency in RESULTS-curves.*. A control without a
# committed pack yet is left out: rerun bench once it is trained, and only its requests run (the bench skips those
# already saved).
#
# Products: answers in benchmarks/checkpoints/regenerated-multilingual-chat-TARGET; each full-budget run's checkpoints
# packed (int4 changes against its init, 3-bit for EAGLE-3) in benchmarks/checkpoints/languages-TARGET/VARIANT; taus in
# benchmarks/results/languages-TARGET-{multilingual,english}.json, one method per VARIANT-stepN; COMMIT=1 commits them.
# A screening run's packs stay on this machine ($OUT/packed): its product is its taus, committed as they are measured,
# and a machine change costs one rerun of its ~20 min (the packs would add 35 MB each to every clone).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=qwen2.5-coder-1.5b-instruct
SHIPPED=osprey/demo_drafter_qwen
INITS=$RUNS/full-budget  # full_budget_qwen.sh init writes osprey-init, scratch-init and eagle3-init there
EN_ANSWERS=benchmarks/checkpoints/regenerated-sharegpt-$TARGET
ML_ANSWERS=benchmarks/checkpoints/regenerated-multilingual-chat-$TARGET
CONFIG=benchmarks/replication/distill-qwen-full-budget.yaml
EXAMPLES=${EXAMPLES:-2600}
FULL_BUDGET=1250000
TOKEN_PASSES=${TOKEN_PASSES:-$FULL_BUDGET}
REPLAY_WEIGHT=${REPLAY_WEIGHT:-0.25}
SLOW_SCALE=${SLOW_SCALE:-0.25}
OUT=$RUNS/languages-$TARGET
PACKED=${PACKED:-benchmarks/checkpoints/languages-$TARGET}
RESULTS=benchmarks/results/languages-$TARGET
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export TAU_TARGET=$TARGET
source benchmarks/replication/stages.sh  # log, answer_openings, answer_features, conversations_text, restore_answers, budget_plan, ...
mkdir -p "$OUT"

usage() {
  echo "usage: $0 answers | data | features en|mixed | init VARIANT | train VARIANT | evaluate VARIANT | reference |" \
    "table | bench OSPREY_VARIANT | curves OSPREY_VARIANT" >&2
  echo "  VARIANT: [scratch-|eagle3-](en|mixed)[-vocab][-replay][-slow]; OSPREY_VARIANT: one without the prefix" >&2
  exit 2
}
MODE=${1:-}
case $MODE in
  answers|data|reference|table) [ $# -eq 1 ] || usage ;;
  features) [ $# -eq 2 ] && [[ $2 =~ ^(en|mixed)$ ]] || usage ;;
  init|train|evaluate) [ $# -eq 2 ] && [[ $2 =~ ^((scratch|eagle3)-)?(en|mixed)(-vocab)?(-replay)?(-slow)?$ ]] || usage ;;
  bench|curves) [ $# -eq 2 ] && [[ $2 =~ ^(en|mixed)(-vocab)?(-replay)?(-slow)?$ ]] || usage ;;
  *) usage ;;
esac
# The controls train every weight at the learning rate, as the Osprey run's new weights: the scratch control's blocks
# are random and EAGLE-3 has no backbone, so a lower rate for them (-slow) would only handicap the control.
if [[ ${2:-} =~ ^(scratch|eagle3)- && ${2:-} == *-slow ]]; then
  echo "$2: the controls are distilled without --pretrained-learning-rate-scale (their bodies are random or absent," \
    "so a lower rate would only handicap them): run ${2%-slow}, the control of ${2#*-}" >&2
  exit 2
fi

data() {  # data-en and data-mixed (train.jsonl, test.jsonl), rebuilt the same way from the committed answers
  [ -f "$OUT/data-mixed/train.jsonl" ] && [ -f "$OUT/data-en/train.jsonl" ] && return
  restore_answers "$EN_ANSWERS" "$OUT/answers-en"
  restore_answers "$ML_ANSWERS" "$OUT/answers-multilingual"
  $PYTHON - "$OUT" "$EXAMPLES" <<'PY' || { log "not enough answers: run $0 answers (and regenerate_qwen.sh)"; return 1; }
import json, pathlib, sys
out, examples = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def lines(name, split):
    return (out / f"answers-{name}" / f"{split}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
en, ml = lines("en", "train"), lines("multilingual", "train")
if len(en) < examples or len(ml) < examples // 2:
    sys.exit(f"{len(en)} English and {len(ml)} multilingual answers; {examples} and {examples // 2} are needed")
sets = {
    "en": (en[:examples], lines("en", "test")),
    # first half English, second half multilingual: the trainer's length-grouped sampler shuffles them together
    "mixed": (en[: examples // 2] + ml[: examples // 2], lines("en", "test") + lines("multilingual", "test")),
}
for name, (train, test) in sets.items():
    folder = out / f"data-{name}"
    folder.mkdir(exist_ok=True)
    for split, rows in (("test", test), ("train", train)):  # train last: its presence marks a complete set
        (folder / f"{split}.jsonl.partial").write_text("".join(rows), encoding="utf-8")
        (folder / f"{split}.jsonl.partial").rename(folder / f"{split}.jsonl")
    print(f"data-{name}: {len(train)} train, {len(test)} test conversations")
PY
}

features() {  # features DATA: the target's features of a set, in $OUT/features-DATA
  [ -f "$OUT/features-$1/feature_cache.json" ] && return
  data || return 1
  answer_features "$OUT/data-$1" "$EXAMPLES" "$OUT/features-$1"
}

screening() { [ "$TOKEN_PASSES" != "$FULL_BUDGET" ]; }  # a run below the full budget: it screens a candidate

packed_of() {  # packed_of RUN: where RUN's packs go: committed for the full budget, kept here for a screening run
  if screening; then echo "$OUT/packed/$1"; else echo "$PACKED/$1"; fi
}

run_name() {  # run_name VARIANT: VARIANT at the full budget, VARIANT-312k (its thousands of token-passes) below it
  if screening; then echo "$1-$((TOKEN_PASSES / 1000))k"; else echo "$1"; fi
}

parse() {  # parse VARIANT: sets KIND (osprey|scratch|eagle3), DATA, INIT (its init's folder) and ARGS
  local rest=$1
  KIND=osprey ARGS=()
  case $rest in scratch-*|eagle3-*) KIND=${rest%%-*}; rest=${rest#*-} ;; esac
  DATA=${rest%%-*}
  INIT=$INITS/$KIND-init
  [[ $rest == *-vocab* ]] && INIT=$OUT/$KIND-vocab-init
  [[ $rest == *-replay* ]] && ARGS+=(--lm-replay-dataset multilingual --lm-replay-weight "$REPLAY_WEIGHT")
  [[ $rest == *-slow* ]] && ARGS+=(--pretrained-learning-rate-scale "$SLOW_SCALE")
  return 0
}

init() {  # init VARIANT: its init, rebuilt the same way on every machine
  parse "$1"
  [ -f "$INITS/$KIND-init/model.safetensors" ] || RUNS=$RUNS benchmarks/replication/full_budget_qwen.sh init || return 1
  [ -f "$INIT/model.safetensors" ] && return
  if [ "$KIND" != osprey ]; then  # a control is built like the Osprey init of its vocabulary
    init "${1#*-}" && parse "$1" && $OSPREY baseline "$KIND" --like "$OUT/osprey-vocab-init" --output "$INIT"
    return
  fi
  data && conversations_text "$OUT/data-mixed" "$OUT/mixed-text.txt" || return 1
  log "convert $INITS/backbone for $TARGET with a draft vocabulary counted on data-mixed -> $INIT"
  $OSPREY convert --backbone "$INITS/backbone" --target $TARGET --draft-vocab-size 32000 \
    --draft-vocab-corpus "$OUT/mixed-text.txt" --output "$INIT"
}

train() {  # train VARIANT: 0 when trained, 3 when its chunks ran out (rerun), 1 on failure
  local steps keep rc=0 bits=4
  init "$1" || return 1
  parse "$1"
  features "$DATA" || return 1
  read -r steps keep <<< "$(budget_plan "$OUT/features-$DATA/feature_cache.json" "$TOKEN_PASSES" "$CONFIG")"
  [ -n "$keep" ] || { log "could not read the budget from $OUT/features-$DATA/feature_cache.json"; return 1; }
  # a screening run (below the full budget) keeps no curve: only its final drafter is measured
  if screening; then keep=""; fi
  log "$1: $steps steps ($TOKEN_PASSES token-passes of data-$DATA), curve points at steps ${keep:-(none)} and $steps"
  [ "$KIND" = eagle3 ] && bits=3  # as full_budget_qwen.sh: a 4-bit EAGLE-3 pack would pass 50 MB
  PACK_ARGS=(--reference "$INIT" --delta-bits $bits)
  local run; run=$(run_name "$1")
  local packed commit=0; packed=$(packed_of "$run")
  if ! screening; then commit=${COMMIT:-0}; fi  # a screening run's packs stay here (packed_of)
  COMMIT=$commit train_in_chunks "$OUT/$run" "$packed" $OSPREY distill --config "$CONFIG" \
    --feature-cache "$OUT/features-$DATA" --drafter "$INIT" --output "$OUT/$run" --max-steps "$steps" \
    ${keep:+--keep-steps $keep} "${ARGS[@]}" || rc=$?
  evaluate "$1" || return 1
  return $rc
}

measure() {  # measure NAME DIR: NAME's greedy tau on the held-out multilingual openings (8 of each language group:
  # 29 prompts, as the test split holds 5 in other scripts) and on the English subset
  $OSPREY bench --target $TARGET --drafter "$1=$2" --baselines "" --prompts multilingual_chat --per-category 8 \
    --max-new-tokens 48 --dtype bfloat16 --output "$RESULTS-multilingual.json" || return 1
  tau_subset "$RESULTS-english.json" --drafter "$1=$2" || return 1
  commit_results "Issue 54 languages ($TARGET): held-out taus of $1" "$RESULTS"-multilingual.* "$RESULTS"-english.*
}

evaluate() {  # evaluate VARIANT: each kept point and the final drafter (trained here or unpacked) not measured yet
  local kept
  local run; run=$(run_name "$1")
  local packed; packed=$(packed_of "$run")
  if [ ! -f "$OUT/$run/model.safetensors" ] && [ -f "$packed/final/osprey_pack.json" ]; then
    init "$1" || return 1  # the pack holds changes against the init: rebuild it first
    $OSPREY unpack --checkpoint "$packed/final" --output "$OUT/$run" || return 1
  fi
  for kept in "$OUT/$run/kept"/step-* "$OUT/$run"; do
    [ -f "$kept/model.safetensors" ] || continue
    measure "$run-step$(step_of "$kept")" "$kept" || return 1
  done
}

reference() {  # what distillation starts from and what the full budget on English answers made of it
  [ -f "$INITS/osprey-init/model.safetensors" ] || RUNS=$RUNS benchmarks/replication/full_budget_qwen.sh init || return 1
  measure converted "$INITS/osprey-init" && measure shipped-full-budget "$SHIPPED"
}

table() {  # tau per language group (and English) of every method measured -> RESULTS-table.md
  $PYTHON - "$RESULTS-multilingual.json" "$RESULTS-english.json" > "$RESULTS-table.md" <<'PY' || return 1
import json, statistics, sys
groups = ("latin", "cyrillic", "cjk", "other-scripts")
taus = {}
for path, suite_group in ((sys.argv[1], None), (sys.argv[2], "English subset")):
    for row in json.load(open(path))["requests"]:
        if row["tau"] is not None:
            taus.setdefault(row["method"], {}).setdefault(suite_group or row["category"], []).append(row["tau"])
columns = [*groups, "all non-English", "English subset"]
print("| method | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns))
for method, by_group in taus.items():
    by_group["all non-English"] = [tau for group in groups for tau in by_group.get(group, [])]
    cells = [f"{statistics.mean(by_group[c]):.2f} ({len(by_group[c])})" if by_group.get(c) else "" for c in columns]
    print(f"| {method} | " + " | ".join(cells) + " |")
PY
  cat "$RESULTS-table.md"
  commit_results "Issue 54 languages ($TARGET): the table" "$RESULTS-table.md"
}

compared() {  # compared VARIANT: METHOD=RUN of VARIANT (osprey) and of its controls, on its data, vocabulary and
  # replay (the controls refuse -slow)
  echo "osprey=$1 scratch=scratch-${1%-slow} eagle3=eagle3-${1%-slow}"
}

bench() {  # bench VARIANT: the one bench of VARIANT and its controls at the full budget, the ratios, the curves
  local pair drafters=() bench=$RESULTS-bench.json
  if screening; then log "bench compares full-budget runs: unset TOKEN_PASSES"; return 1; fi
  for pair in $(compared "$1"); do
    if [ "${pair%%=*}" != osprey ] && ! trained "${pair#*=}"; then  # stages.sh
      log "${pair#*=} is not trained yet: the bench goes on without it (after train ${pair#*=}, rerun bench to add it)"
      continue
    fi
    finished "${pair#*=}" || return 1  # unpacked from its committed pack on a fresh machine (stages.sh)
    drafters+=(--drafter "${pair%%=*}=$OUT/${pair#*=}")
  done
  log "the bench (${drafters[*]}) -> $bench"
  three_drafter_bench "$bench" "${drafters[@]}" --baselines "" || return 1  # stages.sh
  commit_results "Issue 54 languages ($TARGET): the bench of $1 and its controls, and its ratios" "${bench%.json}".* \
    "${bench%.json}-ratios.txt"
  curves "$1"
}

curves() {  # curves VARIANT: the learning curves of VARIANT and its controls, and the sample efficiency
  local pair packs=()
  for pair in $(compared "$1"); do packs+=(--pack "$pair"); done
  $PYTHON benchmarks/replication/full_budget_curves.py --run languages "${packs[@]}" --target $TARGET \
    --token-passes "$FULL_BUDGET" --output "$RESULTS-curves" || return 1
  commit_results "Issue 54 languages ($TARGET): the curves of $1 and its controls, the sample efficiency" \
    "$RESULTS"-curves.*
}

rc=0
case $MODE in
  answers) answer_openings "$ML_ANSWERS" $((EXAMPLES / 2)) multilingual-chat || rc=$? ;;  # and 48 held out
  data) data || rc=$? ;;
  init) init "$2" || rc=$? ;;
  features) features "$2" && log "done: $OUT/features-$2" || rc=$? ;;
  train) train "$2" || rc=$?; [ $rc -eq 3 ] && { log "rerun to continue"; rc=0; } ;;
  evaluate) evaluate "$2" || rc=$? ;;
  reference) reference || rc=$? ;;
  table) table || rc=$? ;;
  bench) bench "$2" || rc=$? ;;
  curves) curves "$2" || rc=$? ;;
esac
exit $rc
