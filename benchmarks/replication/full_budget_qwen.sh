#!/usr/bin/env bash
# The full distillation budget of issue 17 §3 for Qwen2.5-Coder-1.5B-Instruct, resumable across machines: Osprey from
# the finished stage-2 backbone (osprey/backbones/osprey-backbone-qwen2.5-0.5b-2l, converted with the
# shipped drafter's draft vocabulary) and the two controls built like it (`osprey baseline scratch|eagle3 --like`),
# each distilled for TOKEN_PASSES (5 M) token-passes on the same features of the first EXAMPLES (4,800) regenerated
# answers, in the same order with the same seed and settings (distill-qwen-full-budget.yaml).
#
#   full_budget_qwen.sh init                       # the three inits (also languages_qwen.sh's)
#   full_budget_qwen.sh features                   # the feature cache (~1.5 h of 2 cores, ~20 GB; recomputable)
#   full_budget_qwen.sh train osprey|scratch|eagle3  # chunks of distillation (~3.2 h each): rerun until it says done
#   full_budget_qwen.sh curve osprey|scratch|eagle3  # tau of every learning-curve point not yet benched
#   full_budget_qwen.sh tune                       # each method's drafting, tuned on held-out prompts (bench's first part)
#   full_budget_qwen.sh bench                      # tune (what is not tuned yet), then the bench
#   full_budget_qwen.sh speed                      # interim: the finished Osprey's tokens/s against target, PLD, SpS
#   full_budget_qwen.sh all                        # all of the above in order (run.sh's): rerun until it says done
#
# `bench` (~4 h, resumable): first each method's best draft length, early stop and tree shape are measured on
# prompts the bench never decodes (tune_methods.py: the next seeded prompt of each category), then the three drafters
# (chains, trees, trees with a prompt-lookup branch), the target alone, PLD and SpS decode the bench's 50 prompts in
# one `osprey bench` run, each method with its tuned settings (--method-settings, recorded in the results):
# benchmarks/results/replication-qwen2.5-coder-1.5b-instruct.{json,md,png}, and ratios.py's tables. `tune` (~1.5 h)
# is that first part alone, so that the bench can have a session to itself. DRAFTERS (default "osprey scratch
# eagle3") names the drafters that `tune` and `bench` take, so that Osprey's bench need not wait for a control that
# is still training. The tuning resumes, so a drafter added later only tunes its own candidates. A bench without
# Osprey is a later run of controls beside the target alone, into replication-...-also-DRAFTERS.json: its drafters
# join the tau tables (`ratios.py --also`) only if the target decoded there exactly as in the bench, and their
# tokens/s, timed in another run, are compared with nothing.
#
# `speed` (~35 min, resumable) is an interim read of the speed goal while a control is still training: Osprey's
# finished drafter (chains, trees, trees with a prompt-lookup branch, each with the library's drafting defaults: nothing
# tuned), the target alone, PLD and SpS decode the curve's 25-prompt subset in one `osprey bench` run, 64 new tokens
# each: benchmarks/results/full-budget-qwen2.5-coder-1.5b-instruct-speed.{json,md,png} and its ratios. It does not
# replace `bench`, whose 50 prompts and tuned settings decide the goal.
#
# `train` cuts the run into chunks (stages.sh: train_in_chunks, CHUNK_MINUTES, MAX_CHUNKS); after each one its latest
# checkpoint is packed against the drafter's own init (int4 changes, 3-bit for EAGLE-3; the init is rebuilt here from
# committed products by deterministic commands, and every rebuilt tensor is checked by SHA-256 at unpack) into
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
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=qwen2.5-coder-1.5b-instruct
SHIPPED=osprey/demo_drafter_qwen
BACKBONE_PACK=osprey/backbones/osprey-backbone-qwen2.5-0.5b-2l
ANSWERS=benchmarks/checkpoints/regenerated-sharegpt-$TARGET
CONFIG=benchmarks/replication/distill-qwen-full-budget.yaml
EXAMPLES=${EXAMPLES:-4800}
TOKEN_PASSES=${TOKEN_PASSES:-5000000}
OUT=$RUNS/full-budget
PACKED=${PACKED:-benchmarks/checkpoints/full-budget-$TARGET}
ANSWERS_HINT="run regenerate_qwen.sh first"
CURVE_RESULTS=benchmarks/results/full-budget-$TARGET
CURVE_TITLE="Full-budget learning curve"
# int4 changes against the init; EAGLE-3's 106 M trained parameters (its head, an MLP and `fc` at the target's width)
# would make a 55 MB int4 pack, above the 50 MB a committed product may take: 3-bit changes (~41 MB)
EAGLE3_DELTA_BITS=3
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
source benchmarks/replication/stages.sh  # log, commit_results, features, train, curve, finished, tau_subset
mkdir -p "$OUT"

usage() {
  echo "usage: $0 init | features | train DRAFTER | curve DRAFTER | tune | bench | speed | all   (DRAFTER: osprey, scratch or eagle3)" >&2
  exit 2
}
MODE=${1:-}
case $MODE in
  init|features|tune|bench|speed|all) [ $# -eq 1 ] || usage ;;
  train|curve) [ $# -eq 2 ] || usage; case $2 in osprey|scratch|eagle3) ;; *) usage ;; esac ;;
  *) usage ;;
esac

FEATURES=$OUT/features-$EXAMPLES
if [ "$MODE" = features ]; then features || exit 1; log "done: $FEATURES"; exit 0; fi

init() {  # init DRAFTER: its init, rebuilt the same way on every machine
  local backbone=$OUT/backbone
  [ -f "$backbone/model.safetensors" ] || $OSPREY unpack --checkpoint "$BACKBONE_PACK" --output "$backbone" || return 1
  [ -f "$OUT/osprey-init/model.safetensors" ] || $OSPREY convert --backbone "$backbone" --target $TARGET \
    --draft-vocab-from $SHIPPED --output "$OUT/osprey-init" || return 1
  case $1 in
    scratch|eagle3) [ -f "$OUT/$1-init/model.safetensors" ] || $OSPREY baseline "$1" \
      --like "$OUT/osprey-init" --output "$OUT/$1-init" || return 1 ;;
  esac
}

SUITES=(--prompts spec_bench --prompts mt_bench --prompts humaneval --prompts mmath)
TUNED=benchmarks/results/tuned-methods-full-budget-$TARGET.json
RESULTS=benchmarks/results/replication-$TARGET.json
# How `bench` and `speed` decode, once, so that the interim read compares with the bench: the baselines, the trees'
# and the lookup branch's settings, the suites and lengths (in `bench`, each method's tuned settings override them)
DECODING=(--baselines target,pld,sps:qwen2.5-coder-0.5b-instruct --draft-topk 3 --prompt-lookup-num-tokens 8
  --drafter-quantization int8 "${SUITES[@]}" --max-new-tokens 64 --dtype bfloat16)
read -r -a BENCHED <<< "${DRAFTERS:-osprey scratch eagle3}"
for drafter in "${BENCHED[@]}"; do case $drafter in osprey|scratch|eagle3) ;; *) usage ;; esac; done
methods_of() {  # methods_of RESULTS...: the method names of bench results files
  $PYTHON -c 'import json, sys; print(*{m for f in sys.argv[1:] for m in json.load(open(f))["methods"]})' "$@"
}

bench_drafters() {  # the --drafter NAME=DIR arguments of DRAFTERS, each finished (trained, or unpacked here)
  local drafter
  BENCH_DRAFTERS=()
  for drafter in "${BENCHED[@]}"; do
    finished "$drafter" || return 1
    BENCH_DRAFTERS+=(--drafter "$drafter=$OUT/$drafter")
  done
}

tune() {  # each method's drafting tuned on held-out prompts; resumes, and only tunes what is not tuned yet
  bench_drafters || return 1
  log "tuning each method's drafting on held-out prompts (${BENCHED[*]}, sps, pld) -> $TUNED"
  $PYTHON benchmarks/replication/tune_methods.py --target $TARGET --dtype bfloat16 "${BENCH_DRAFTERS[@]}" \
    --sps qwen2.5-coder-0.5b-instruct --pld 2,4,8 "${SUITES[@]}" --bench-per-category 2 --seed 0 \
    --num-draft-tokens 3,5 --confidence-threshold 0,0.3 --draft-topk 3 --tree-size 4,8 --prompt-lookup 8 \
    --drafter-quantization int8 --max-new-tokens 32 --output "$TUNED" || return 1
  commit_results "Full-budget Qwen: each method's drafting tuned on held-out prompts (${BENCHED[*]}, sps, pld)" \
    "${TUNED%.json}".*
}

bench() {  # the tuning on held-out prompts, then the one-run bench with each method's tuned settings (or, without
  # Osprey, a later run of controls beside the target alone), then the tau and speed tables of all that is benched
  local suffix drafter other benched results=$RESULTS baselines=() controls others=() missing=()
  tune || return 1
  if [[ " ${BENCHED[*]} " != *" osprey "* ]]; then
    results=${RESULTS%.json}-also-$(IFS=-; echo "${BENCHED[*]}").json
    baselines=(--baselines target)
  fi
  benched=$([ ! -f "$results" ] || methods_of "$results") || return 1
  for drafter in "${BENCHED[@]}"; do
    [[ -z "$benched" || " $benched " == *" $drafter "* ]] || missing+=("$drafter")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "$results holds a bench without ${missing[*]}: they would decode in a later run beside it. Bench"
    log "them without osprey (a later run of controls, DRAFTERS=...), or move $results aside for one run of all."
    return 1
  fi
  log "the bench (${BENCHED[*]}, ${baselines[1]:-target, pld, sps}) -> $results"
  $OSPREY bench --target $TARGET "${BENCH_DRAFTERS[@]}" "${DECODING[@]}" "${baselines[@]}" \
    --method-settings "$TUNED" --per-category 2 --seed 0 --output "$results" || return 1
  commit_results "Full-budget Qwen: the replication bench (${BENCHED[*]}, ${baselines[1]:-target, pld, sps})" \
    "${results%.json}".*
  [ -f "$RESULTS" ] || { log "Osprey is not benched yet: DRAFTERS=osprey $0 bench"; return 0; }
  for other in "${RESULTS%.json}"-also-*.json; do [ -f "$other" ] && others+=("$other"); done
  benched=$(methods_of "$RESULTS" "${others[@]}") || return 1
  {  # chains against every control, then each tree shape against the controls' same shape
    for suffix in "" -tree -tree-lookup; do
      controls=()
      for drafter in scratch eagle3; do
        [[ " $benched " == *" $drafter$suffix "* ]] && controls+=("$drafter$suffix")
      done
      [ -n "$suffix" ] || controls+=(sps pld target)
      [ ${#controls[@]} -gt 0 ] || continue
      $PYTHON benchmarks/replication/ratios.py "$RESULTS" "${others[@]/#/--also=}" --drafter "osprey$suffix" \
        --controls "${controls[@]}" || return 1
    done
  } > "${RESULTS%.json}-ratios.txt" || return 1
  cat "${RESULTS%.json}-ratios.txt"
  commit_results "Full-budget Qwen: the replication bench's ratios" "${RESULTS%.json}-ratios.txt"
}

SPEED=benchmarks/results/full-budget-$TARGET-speed.json
speed() {  # the interim read of the speed goal (header): one run, drafting defaults, the curve's 25-prompt subset
  finished osprey || return 1
  log "Osprey's speed against the target alone, PLD and SpS -> $SPEED"
  $OSPREY bench --target $TARGET --drafter "osprey=$OUT/osprey" "${DECODING[@]}" --per-category 1 --output "$SPEED" \
    || return 1
  $PYTHON benchmarks/replication/ratios.py "$SPEED" --controls sps pld target > "${SPEED%.json}-ratios.txt" || return 1
  cat "${SPEED%.json}-ratios.txt"
  commit_results "Full-budget Qwen: Osprey's speed against the target alone, PLD and SpS (interim)" \
    "${SPEED%.json}".* "${SPEED%.json}-ratios.txt"
}

rc=0
case $MODE in
  init) for drafter in osprey scratch eagle3; do init $drafter || { rc=1; break; }; done ;;
  curve) curve "$2" ;;
  train) train "$2" || rc=$?; [ $rc -eq 3 ] && rc=0 ;;  # chunks ran out: rerun to continue
  tune) tune || rc=$? ;;
  bench) bench || rc=$? ;;
  speed) speed || rc=$? ;;
  all)
    for drafter in osprey scratch eagle3; do
      train "$drafter" || rc=$?
      [ $rc -eq 0 ] || break
    done
    if [ $rc -eq 0 ]; then bench && log "done" || rc=$?; fi
    [ $rc -eq 3 ] && { log "rerun to continue"; rc=0; } ;;
esac
exit $rc
