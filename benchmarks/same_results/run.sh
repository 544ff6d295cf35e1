#!/usr/bin/env bash
# Two committed commands run by a checkout, for comparing two checkouts byte for byte (a restructuring that must not
# change behaviour): `osprey bench` on tiny models made once (by the first checkout's test helpers), and
# `benchmarks/adapt/record.py` on the committed SmolLM2 and Qwen2.5-Coder adapt records' inputs.
#
#   benchmarks/same_results/run.sh CHECKOUT OUT [MODELS]    # MODELS made when missing (default: OUT/../models)
#   cmp OUT_A/bench/results.masked.json OUT_B/bench/results.masked.json && diff -r -x 'results.*' OUT_A OUT_B
#
# The bench's results.json, .md and .png hold wall-clock timings; results.masked.json is the JSON with those masked.
set -euo pipefail
CHECKOUT=$(cd "$1" && pwd); OUT=$2; MODELS=${3:-$OUT/../models}
HERE=$(cd "$(dirname "$0")" && pwd); PY=${PY:-python}
export PYTHONPATH=$CHECKOUT PYTHONHASHSEED=0 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
[ -d "$MODELS/target" ] || $PY "$HERE/helpers.py" models "$CHECKOUT" "$MODELS"
rm -rf "$OUT"; mkdir -p "$OUT"
cd "$CHECKOUT"
$PY -m osprey.cli bench --target "$MODELS/target" --drafter "osprey=$MODELS/drafter" --baselines target,pld:3 \
  --prompts "$MODELS/prompts.jsonl" --per-category 2 --max-new-tokens 24 --device cpu \
  --output "$OUT/bench/results.json" > /dev/null 2>&1
$PY "$HERE/helpers.py" mask "$OUT/bench/results.json" > "$OUT/bench/results.masked.json"
for RUN in smollm2-135m-instruct:english qwen2.5-coder-1.5b-instruct:english,multilingual; do
  NAME=${RUN%%:*}; SETS=${RUN#*:}; DIR=$OUT/record/$NAME
  mkdir -p "$DIR"
  cp benchmarks/results/adapt-"$NAME"-heldout-*.json benchmarks/results/adapt-"$NAME"-demo.json "$DIR/"
  $PY "$HERE/helpers.py" run-dir "benchmarks/results/adapt-$NAME.json" "$DIR/run"
  $PY benchmarks/adapt/record.py "$NAME" "$DIR/run" --results "$DIR/adapt-$NAME" --held-out ${SETS//,/ } \
    > "$DIR.stdout"
done
