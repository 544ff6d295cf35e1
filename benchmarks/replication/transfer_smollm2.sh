#!/usr/bin/env bash
# Issue 54's second target family: the finished stage-2 backbone (osprey/backbones/osprey-backbone-qwen2.5-0.5b-2l,
# the zoo's `osprey-backbone-qwen2.5-0.5b-2l`: Qwen2 blocks and vocabulary) adapted to SmolLM2-135M-Instruct (Llama
# blocks, 49,152-token vocabulary), against the body-random and EAGLE-3 controls built like it, each distilled for TOKEN_PASSES (1.25 M)
# token-passes on the same features of the first EXAMPLES (2,600) answers the target wrote, in the same order with the
# same seed and settings (distill-transfer-smollm2.yaml, the Qwen full budget's), then one bench. Resumable across
# machines like full_budget_qwen.sh: each stage skips what is done and resumes what was cut; products are packed into
# benchmarks/checkpoints (COMMIT=1 commits them), and a fresh machine restores them first. Keep RUNS (default
# /work/runs) the same across machines: the checkpoint packs record their init by path.
#
#   transfer_smollm2.sh answers        # target-written answers, one chunk: rerun until it says done
#   transfer_smollm2.sh init           # the three inits
#   transfer_smollm2.sh features       # the target's features of the first EXAMPLES answers
#   transfer_smollm2.sh train DRAFTER  # chunks of distillation: rerun until it says done
#   transfer_smollm2.sh curve DRAFTER  # tau of every kept curve point not yet benched
#   transfer_smollm2.sh bench          # the one bench, then the groups' ratios
#   transfer_smollm2.sh all            # init, features, the three trainings, bench: rerun until it says done
#
# - answers: regenerate_qwen.sh with TARGET=smollm2-135m-instruct (greedy `osprey regenerate` of ShareGPT openings,
#   48 held-out and EXAMPLES training ones, batches of BATCH_SIZE on THREADS threads) for one CHUNK_MINUTES chunk,
#   packed gzipped into benchmarks/checkpoints/regenerated-sharegpt-smollm2-135m-instruct. Measured alone at batch
#   48 on 2 threads: ~64 answers a minute (528 in 491 s, 198 answer tokens/s): ~35 min for the rest of 2,600.
# - init: the backbone unpacked (if missing) and converted with a 32,000-token draft vocabulary (the Qwen run's size;
#   its list is Qwen's tokens) counted on the ShareGPT training text, then `osprey baseline scratch|eagle3 --like` it;
#   prints the vocabulary alignment's counts. Measured: 81 s (beside the answers' first batch).
# - features: bf16 target, sequences up to 640 tokens. Measured: 9 min.
# - train: stages.sh's train_in_chunks (CHUNK_MINUTES, MAX_CHUNKS); each chunk's checkpoint packed as int4 changes
#   against the drafter's init into benchmarks/checkpoints/transfer-smollm2-135m-instruct/DRAFTER. The curve's points
#   (1/16, 1/8, 1/4, 1/2 of the steps, and the end) are evaluated on the held-out answers, kept, and their tau benched
#   on the 25-prompt subset as each chunk ends (CURVE=0: later, with `curve`). Measured: Osprey's 1,126 steps in 72 min
#   (~3.8 s a step), the body-random control's at ~4 s a step.
# - bench: osprey, scratch and eagle3 (chains, and trees with --draft-topk 3) and the target alone decode the
#   replication's 50 prompts in one run (library drafting defaults, nothing tuned) into
#   benchmarks/results/transfer-smollm2-135m-instruct.json, beside the SmolLM2 pilot's Osprey drafter as a reference
#   (`pilot`: its own SmolLM2 backbone, 150 steps on ShareGPT conversations, 8k draft vocabulary); ratios.py's groups
#   in ...-ratios.txt; the curves and sample efficiency (full_budget_curves.py --run transfer) in ...-curves.*.
#   Measured: the three trainings 72, 73 and 28 min (Osprey, body-random, EAGLE-3); the bench 20 min.
#
# DRAFTER: osprey, scratch or eagle3.
#
# Budget (a token-pass is one token of a training sequence, opening and answer, read once: stages.sh, budget_plan).
# SmolLM2-135M's first 528 training answers average 259 tokens a conversation with its chat template (184 of them the
# answer; 39% end before the 256-token cap). EXAMPLES=2,600 conversations are then ~673 k tokens, and 1.25 M
# token-passes are ~1.86 epochs of them (~1,210 steps of 4 sequences); 2,400 would need 2.01 epochs.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
PYTHON=${PYTHON:-.venv/bin/python}
TARGET=smollm2-135m-instruct
BACKBONE_PACK=osprey/backbones/osprey-backbone-qwen2.5-0.5b-2l
BACKBONE=$RUNS/full-budget/backbone  # shared with full_budget_qwen.sh
ANSWERS=benchmarks/checkpoints/regenerated-sharegpt-$TARGET
CONFIG=benchmarks/replication/distill-transfer-smollm2.yaml
EXAMPLES=${EXAMPLES:-2600}
TOKEN_PASSES=${TOKEN_PASSES:-1250000}
DRAFT_VOCAB=32000
OUT=$RUNS/transfer-$TARGET
PACKED=${PACKED:-benchmarks/checkpoints/transfer-$TARGET}
RESULTS=benchmarks/results/transfer-$TARGET.json
ANSWERS_HINT="run $0 answers first"
CURVE_RESULTS=benchmarks/results/transfer-$TARGET
CURVE_TITLE="Transfer to $TARGET"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export TAU_TARGET=$TARGET  # tau_subset's target
source benchmarks/replication/stages.sh  # log, sharegpt_text, answer_openings, commit_results, features, train, curve, finished
mkdir -p "$OUT"

usage() {
  echo "usage: $0 answers | init | features | train DRAFTER | curve DRAFTER | bench | all   (DRAFTER: osprey, scratch" \
    "or eagle3)" >&2
  exit 2
}
MODE=${1:-}
case $MODE in
  answers|init|features|bench|all) [ $# -eq 1 ] || usage ;;
  train|curve) [ $# -eq 2 ] || usage; case $2 in osprey|scratch|eagle3) ;; *) usage ;; esac ;;
  *) usage ;;
esac

init() {  # init [DRAFTER]: the inits, rebuilt the same way on every machine
  [ -f "$BACKBONE/model.safetensors" ] || $OSPREY unpack --checkpoint "$BACKBONE_PACK" --output "$BACKBONE" || return 1
  if [ ! -f "$OUT/osprey-init/model.safetensors" ]; then
    sharegpt_text "$RUNS/sharegpt-train.txt" || return 1
    log "convert $BACKBONE for $TARGET -> $OUT/osprey-init"
    $OSPREY convert --backbone "$BACKBONE" --target $TARGET --draft-vocab-size $DRAFT_VOCAB \
      --draft-vocab-corpus "$RUNS/sharegpt-train.txt" --output "$OUT/osprey-init" || return 1
  fi
  local control
  for control in scratch eagle3; do
    [ -z "${1:-}" ] || [ "$1" = "$control" ] || continue
    [ -f "$OUT/$control-init/model.safetensors" ] || $OSPREY baseline $control --like "$OUT/osprey-init" \
      --output "$OUT/$control-init" || return 1
  done
}

FEATURES=$OUT/features-$EXAMPLES

bench() {  # the one bench (chains, and trees with --draft-topk 3), then the groups' tau ratios
  local drafter drafters=()
  for drafter in osprey scratch eagle3; do
    finished $drafter || return 1
    drafters+=(--drafter "$drafter=$OUT/$drafter")
  done
  drafters+=(--drafter pilot=benchmarks/checkpoints/pilot-smollm2-135m-instruct)  # a reference, not a control
  log "the bench (osprey, scratch, eagle3, pilot, target) -> $RESULTS"
  three_drafter_bench "$RESULTS" "${drafters[@]}" --baselines target || return 1
  commit_results "Transfer to $TARGET: the bench (osprey, scratch, eagle3, pilot, target)" "${RESULTS%.json}".*
  $PYTHON benchmarks/replication/full_budget_curves.py --run transfer --target $TARGET --token-passes "$TOKEN_PASSES" \
    --output "${RESULTS%.json}-curves" || return 1
  commit_results "Transfer to $TARGET: the bench's ratios, the curves and the sample efficiency" \
    "${RESULTS%.json}-ratios.txt" "${RESULTS%.json}"-curves.*
}

rc=0
case $MODE in
  answers) answer_openings "$ANSWERS" "$EXAMPLES" || rc=$? ;;
  init)
    init || rc=$?
    [ $rc -ne 0 ] || $PYTHON -c 'import json, sys; r = json.load(open(sys.argv[1])); d = r["draft_vocab"]
print("alignment:", r["alignment"]["counts"], "| draft vocabulary:", d["size"], "coverage", d.get("corpus_coverage"))' \
      "$OUT/osprey-init/alignment_report.json" ;;
  features) features && log "done: $FEATURES" || rc=$? ;;
  curve) curve "$2" ;;
  train) train "$2" || rc=$?; [ $rc -eq 3 ] && rc=0 ;;  # chunks ran out: rerun to continue
  bench) bench || rc=$? ;;
  all)
    init && features || rc=$?
    if [ $rc -eq 0 ]; then
      for drafter in osprey scratch eagle3; do
        train "$drafter" || rc=$?
        [ $rc -eq 0 ] || break
      done
    fi
    if [ $rc -eq 0 ]; then bench && log "done" || rc=$?; fi
    [ $rc -eq 3 ] && { log "rerun to continue"; rc=0; } ;;
esac
exit $rc
