#!/usr/bin/env bash
# The evidence for `osprey adapt` (docs/adapt.md): from an empty directory on this machine, timed, then measured
# against the EAGLE-3 control trained on the same target's answers to the same corpora for >= 10x the token-passes,
# and against the shipped full-budget drafter.
#
#   benchmarks/adapt/run.sh qwen2.5-coder-1.5b-instruct   # ~30 min of adapt, then ~15 min of held-out tau and demo
#   benchmarks/adapt/run.sh smollm2-135m-instruct
#
# 1. `osprey adapt --target TARGET --output RUNS/adapt-TARGET` from an empty directory with the defaults (SmolLM2:
#    `--prompts sharegpt`, the corpus its EAGLE-3 control's answers were written for); its stage times and wall-clock.
# 2. Held-out tau (chains, greedy, 48 new tokens, bf16 target) of the adapted drafter on the sets the controls were
#    measured on, in one results file each with them: the runs resume a copy of the committed results, so only the
#    adapted drafter's requests run and every method decodes the same prompts the same way.
#    - Qwen: the held-out multilingual-chat openings (8 per language group) and the replication's mixed 25-prompt set (16 not English)
#      (languages_qwen.sh measure): the EAGLE-3 control `eagle3-mixed-step1095` (1.25 M token-passes on 2,600
#      answers, half ShareGPT, half multilingual-chat), the shipped drafter `shipped-full-budget` (5 M), the converted
#      backbone `converted` (0 token-passes).
#    - SmolLM2: the 25-prompt subset (transfer_smollm2.sh curve): `eagle3` and `osprey` at step 1126 (1.25 M
#      token-passes on 2,600 ShareGPT answers).
# 3. `osprey demo --drafter RUNS/adapt-TARGET/drafter` (its recorded decoding shape) beside the target alone.
# 4. benchmarks/results/adapt-TARGET.json (record.py) and the curves of tau against minutes (Qwen).
# COMMIT=1 commits the results.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=${1:?usage: $0 TARGET}
OUT=$RUNS/adapt-$TARGET
RESULTS=benchmarks/results/adapt-$TARGET
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
source benchmarks/replication/stages.sh  # log, tau_subset, commit_results
mkdir -p "$RUNS"

case $TARGET in
  qwen2.5-coder-1.5b-instruct)
    ADAPT_ARGS=()
    HELD_OUT=(multilingual english)
    CONTROLS=benchmarks/results/languages-$TARGET ;;
  smollm2-135m-instruct)
    ADAPT_ARGS=(--prompts sharegpt)
    HELD_OUT=(english)
    CONTROLS=benchmarks/results/transfer-$TARGET-step1126 ;;
  *) echo "no committed controls for $TARGET" >&2; exit 2 ;;
esac

if [ ! -f "$OUT/adapt.json" ] || ! grep -q '"evaluate"' "$OUT/adapt.json"; then
  [ -e "$OUT" ] && [ ! -f "$OUT/adapt.json" ] && { log "$OUT exists and is no adapt run: move it away"; exit 1; }
  [ -f "$OUT/adapt.json" ] && log "resuming $OUT: its wall-clock is no longer one uninterrupted run"
  log "osprey adapt --target $TARGET --output $OUT ${ADAPT_ARGS[*]}"
  start=$(date +%s)
  rc=0
  $OSPREY adapt --target "$TARGET" --output "$OUT" "${ADAPT_ARGS[@]}" > "$OUT.log" 2>&1 || rc=$?
  grep -E '^\[|^  |^adapted' "$OUT.log" || true
  [ $rc = 0 ] || { log "osprey adapt failed (exit $rc): $OUT.log"; exit 1; }
  echo "$(( $(date +%s) - start ))" > "$OUT/wall_clock_s"
fi

for set in "${HELD_OUT[@]}"; do
  results=$RESULTS-heldout-$set.json
  if [ "$set" = english ] && [ "$TARGET" = smollm2-135m-instruct ]; then source_file=$CONTROLS.json
  else source_file=$CONTROLS-$set.json; fi
  [ -f "$results" ] || cp "$source_file" "$results"
  log "held-out tau ($set) of the adapted drafter -> $results"
  if [ "$set" = multilingual ]; then
    $OSPREY bench --target "$TARGET" --drafter "adapt=$OUT/drafter" --baselines "" --prompts multilingual_chat \
      --per-category 8 --max-new-tokens 48 --dtype bfloat16 --output "$results" > /dev/null
  else
    TAU_TARGET=$TARGET tau_subset "$results" --drafter "adapt=$OUT/drafter" > /dev/null
  fi
done

demo=$RESULTS-demo.json
[ -f "$demo" ] || { log "osprey demo --drafter $OUT/drafter -> $demo"; $OSPREY demo --drafter "$OUT/drafter" --output "$demo" | tail -5; }

$PYTHON benchmarks/adapt/record.py "$TARGET" "$OUT" --results "$RESULTS" --held-out "${HELD_OUT[@]}"
commit_results "osprey adapt evidence ($TARGET)" "$RESULTS".* "$RESULTS"-*
