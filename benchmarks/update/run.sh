#!/usr/bin/env bash
# The evidence for updating a target (docs/adapt.md, "Updating a target"): V1 = Qwen2.5-Coder-0.5B-Instruct and its
# drafter from `osprey adapt` with the defaults; V2 = V1 fine-tuned on Spanish and French Wikipedia leads
# (make_target_update.py); on V2, (b) `osprey adapt` from the backbone with the defaults and (c) `--from-drafter` of
# V1's drafter on a quarter of (b)'s openings and token-passes; then one `osprey bench` of (a) V1's drafter unchanged,
# (b) and (c) beside V2 alone on V2's held-out prompts, the differ check, and record.py.
#
#   benchmarks/update/run.sh        # RUNS=/work/runs by default; every step resumes or skips when rerun
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
PYTHON=${PYTHON:-.venv/bin/python}
V1=qwen2.5-coder-0.5b-instruct
HELD_OUT=benchmarks/update/heldout_prompts.jsonl
mkdir -p "$RUNS"
$OSPREY adapt --target $V1 --output "$RUNS/adapt-$V1" --export vllm                                       # V1's drafter
$PYTHON benchmarks/update/make_target_update.py train --base $V1 --output "$RUNS/v2"                        # V2
$OSPREY adapt --target "$RUNS/v2/model" --output "$RUNS/update-backbone" --no-evaluate                      # (b)
$OSPREY adapt --target "$RUNS/v2/model" --output "$RUNS/update-warm" --no-evaluate \
  --from-drafter "$RUNS/adapt-$V1/drafter" --num-prompts 64 --token-passes 20k                                # (c)
# (a) is V1's drafter as --from-drafter takes it (the same weights, recording V2): update-warm/drafter-init
$OSPREY bench --target "$RUNS/v2/model" --prompts $HELD_OUT --per-category 10 --max-new-tokens 48 \
  --confidence-threshold 0 --dtype bfloat16 --drafter old="$RUNS/update-warm/drafter-init" \
  --drafter backbone="$RUNS/update-backbone/drafter" --drafter warm="$RUNS/update-warm/drafter" \
  --output "$RUNS/update-bench.json"
$PYTHON benchmarks/update/make_target_update.py differ --base $V1 --update "$RUNS/v2/model" --prompts $HELD_OUT \
  --output "$RUNS/v2/differ.json"
for ext in json md png; do cp "$RUNS/update-bench.$ext" "benchmarks/results/update-$V1-bench.$ext"; done
$PYTHON benchmarks/update/record.py $V1 --update "$RUNS/v2" --v1 "$RUNS/adapt-$V1" --backbone "$RUNS/update-backbone" \
  --warm "$RUNS/update-warm" --bench benchmarks/results/update-$V1-bench.json --output benchmarks/results/update-$V1
