#!/usr/bin/env bash
# The Qwen-backbone Osprey drafter for Qwen2.5-Coder-1.5B-Instruct (issue 17), stage by stage, resumable across
# machines. Its product is committed: benchmarks/checkpoints/qwen-drafter-round3 (shipped as osprey/demo_drafter_qwen
# until issue 53 shipped the full-budget drafter instead), packed against qwen2.5-coder-0.5b-instruct (the
# frozen embedding rebuilt from the zoo and checked by SHA-256, blocks and head as int4 changes from the tensors they
# started as; 36 MiB). So on a fresh machine this script only restores (`osprey unpack`) unless FROM_SCRATCH=1, which
# redoes every stage (~4 h of 2 cores, so run it twice: each stage resumes) in the order it was run:
#
#   1. prune: Qwen2.5-Coder-0.5B-Instruct's first 2 blocks (no stage 2: at 13 tokens/s with its parent as teacher
#      the CPU could not afford it then; since session 16 it runs at ~127 tokens/s, see stage2_qwen.sh);
#   2. convert for the 1.5B target with the shipped drafter's 32k draft vocabulary (--draft-vocab-from), which was
#      counted on target answers, ShareGPT and multilingual text;
#   3. round 1: features of 240 regenerated conversations, 60 + 120 distillation steps (distill-qwen-q05b-*.yaml);
#   4. round 2: features of the first 816 regenerated conversations, 500 more steps (distill-qwen-q05b-regen816.yaml);
#   5. round 3: features of all 1,616, 800 more steps (distill-qwen-q05b-regen1616.yaml);
#   6. pack against the zoo backbone.
#
# The regenerated answers are restored from benchmarks/checkpoints/regenerated-sharegpt-qwen2.5-coder-1.5b-instruct.
# Each stage is skipped when its product exists, so a killed run resumes. The draft vocabulary is taken from the
# shipped drafter, not counted again: its corpus was assembled by hand from those three sources (alignment_report.json:
# 9.9 M tokens, 96.4% coverage), and a scripted rebuild of them (8.6 M tokens) chose 6,454 of the 32,000 tokens
# differently, so every drafter of the curves predicts the same tokens on any machine.
#
#   nohup benchmarks/replication/qwen_drafter.sh > /work/runs/qwen-drafter.log 2>&1 &
#
# `qwen_drafter.sh controls` distils the two controls of the paper's table from the same osprey-init on exactly
# Osprey's three rounds (same configs, data, order and seeds: 680 steps and ~0.73 M token-passes after round 2, 1,480
# and ~1.55 M after round 3), side by side with one thread each: the body-random `scratch` drafter and an `eagle3`
# drafter (one block at the target's width). Their held-out TTT accuracy at steps 60, 180, 430 and 680 (and round 3's
# evaluations) are Osprey's learning curve's points at equal budget (benchmarks/replication/qwen_curves.py), and τ of
# the three drafters is benchmarked after the first 60 steps and after each round on a fixed 25-prompt subset
# (~3 h of 2 cores to round 2, ~2 h more for round 3; rerun to resume).
#
# `qwen_drafter.sh early BACKBONE NAME` asks what another backbone changes at the start of the learning curve: it
# converts BACKBONE (e.g. a stage-2 checkpoint of stage2_qwen.sh; copy it out of the rotating checkpoints first) for
# the target exactly as osprey-init was (same draft vocabulary), distils Osprey's round 1 from it (same configs, data,
# order and seeds: 73 k and 218 k token-passes), and adds the drafter as osprey-NAME to the two committed equal-budget
# benches of those points, beside the drafters from the pruned backbone (~1 h of one core).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
TARGET=qwen2.5-coder-1.5b-instruct
BACKBONE_PARENT=qwen2.5-coder-0.5b-instruct
SHIPPED=benchmarks/checkpoints/qwen-drafter-round3
OUT=$RUNS/qwen-drafter
REGEN=$RUNS/regen/$TARGET
source benchmarks/replication/stages.sh  # log, restore_answers, tau_subset
mkdir -p "$OUT"

MODE=${1:-drafter}
case $MODE in
  drafter|controls) ;;
  early)
    if [ $# -ne 3 ] || [ ! -f "$2/config.json" ]; then
      echo "usage: $0 early BACKBONE NAME, BACKBONE a model folder (config.json, model.safetensors)" >&2; exit 2
    fi ;;
  *) echo "usage: $0 [drafter|controls|early BACKBONE NAME]" >&2; exit 2 ;;
esac
if [ "$MODE" = drafter ] && [ "${FROM_SCRATCH:-0}" != 1 ]; then
  [ -d "$OUT/drafter" ] || $OSPREY unpack --drafter "$SHIPPED" --output "$OUT/drafter"
  log "restored $OUT/drafter from $SHIPPED"
  exit 0
fi

restore_answers benchmarks/checkpoints/regenerated-sharegpt-$TARGET "$REGEN"  # the committed answers
[ -d "$OUT/backbone" ] || $OSPREY prune --backbone $BACKBONE_PARENT --num-layers 2 --output "$OUT/backbone"
[ -d "$OUT/osprey-init" ] || $OSPREY convert --backbone "$OUT/backbone" --target $TARGET \
  --draft-vocab-from $SHIPPED --output "$OUT/osprey-init"
features() {  # $1: output folder, then extra flags
  local output=$1; shift
  [ -f "$output/feature_cache.json" ] || $OSPREY features --target $TARGET --dataset-name "$REGEN" --max-length 640 \
    --batch-size 4 --target-dtype bfloat16 --output "$output" "$@"
}
distill() {  # $1: config, $2: from, $3: to, $4: features, then extra flags; the yaml's feature_cache is overridden
  local config=$1 from=$2 to=$3 cache=$4 resume=(); shift 4
  [ -f "$to/model.safetensors" ] && return
  compgen -G "$to/checkpoint-*" > /dev/null && resume=(--resume_from_checkpoint true)  # a killed run goes on
  $OSPREY distill --config "$config" --feature_cache "$cache" --drafter "$from" --output "$to" "${resume[@]}" "$@"
}
round1() {  # $1: initial drafter, $2: output prefix; Osprey's round 1
  distill benchmarks/replication/distill-qwen-q05b-epoch1.yaml "$1" "$2round1-epoch1" "$OUT/features-240"
  distill benchmarks/replication/distill-qwen-q05b-epochs2-3.yaml "$2round1-epoch1" "$2round1" \
    "$OUT/features-240" --seed 1
}
round2() {  # $1: output prefix; Osprey's round 2, from round 1's drafter
  distill benchmarks/replication/distill-qwen-q05b-regen816.yaml "$1round1" "$1round2" "$OUT/features-816"
}
round3() {  # $1: round 2's drafter, $2: output; Osprey's round 3, on all committed answers
  distill benchmarks/replication/distill-qwen-q05b-regen1616.yaml "$1" "$2" "$OUT/features-1616"
}
equal_budget() {  # $1: round1-epoch1|round1|round2|round3, then --drafter NAME=DIR...: τ at equal budget on the
  # fixed 25-prompt subset (stages.sh: tau_subset)
  local stage=$1; shift
  tau_subset benchmarks/results/equal-budget-$TARGET-$stage.json "$@"
}
features "$OUT/features-240" --max-examples 240
if [ "$MODE" = early ]; then
  init=$OUT/$3-init
  [ -d "$init" ] || $OSPREY convert --backbone "$2" --target $TARGET --draft-vocab-from $SHIPPED --output "$init"
  round1 "$init" "$OUT/$3-"
  equal_budget round1-epoch1 --drafter "osprey-$3=$OUT/$3-round1-epoch1"  # 73 k token-passes
  equal_budget round1 --drafter "osprey-$3=$OUT/$3-round1"  # 218 k
  log "benched osprey-$3 after round 1: benchmarks/results/equal-budget-$TARGET-round1{-epoch1,}.json"
  exit 0
fi
features "$OUT/features-816" --max-examples 816  # the first 816: what round 2 saw
if [ "$MODE" = controls ]; then
  [ -d "$OUT/scratch-init" ] || $OSPREY baseline scratch --like "$OUT/osprey-init" --output "$OUT/scratch-init"
  [ -d "$OUT/eagle3-init" ] || $OSPREY baseline eagle3 --like "$OUT/osprey-init" --output "$OUT/eagle3-init"
  controls() {  # $1: round1|round2|round3, for both controls side by side, one thread each (see docs/training.md);
    # round 3 one after the other: side by side on its 1,616 answers the two processes left no room on the machine's
    # 23 GB (EAGLE-3's reached 14.5 GB, body-random's 10 GB) and the kernel killed one whenever anything else ran
    local pids=() control
    for control in scratch eagle3; do
      log "$1 of $control (log: $OUT/$control.log)"
      case $1 in
        round1) (OMP_NUM_THREADS=1 round1 "$OUT/$control-init" "$OUT/$control-" >> "$OUT/$control.log" 2>&1) & ;;
        round2) (OMP_NUM_THREADS=1 round2 "$OUT/$control-" >> "$OUT/$control.log" 2>&1) & ;;
        round3) round3 "$OUT/$control-round2" "$OUT/$control-round3" >> "$OUT/$control.log" 2>&1 ;;
      esac
      [ "$1" = round3 ] || pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
  }
  controls round1
  round1 "$OUT/osprey-init" "$OUT/"  # Osprey's own round 1 (the machine that distilled the shipped drafter kept only
  # its end: its 60-step point was distilled again, in session 12, by this line)
  three() {  # $1: round1-epoch1|round1|round2|round3, $2: Osprey's drafter then, benched beside the controls'
    equal_budget "$1" --drafter osprey="$2" --drafter scratch="$OUT/scratch-$1" --drafter eagle3="$OUT/eagle3-$1"
  }
  three round1-epoch1 "$OUT/round1-epoch1"  # 73 k token-passes
  three round1 "$OUT/round1"  # 218 k
  controls round2
  three round2 "$OUT/round2"  # 731 k
  features "$OUT/features-1616" --max-examples 1616
  controls round3
  # 1.55 M: Osprey's round 3 is the drafter as distilled, before packing (on a fresh machine, FROM_SCRATCH=1 redoes it;
  # the restored, packed one differs by its int4 deltas)
  three round3 "$OUT/drafter"
  log "controls distilled and benchmarked: $OUT/{scratch,eagle3}-round3"
  exit 0
fi
round1 "$OUT/osprey-init" "$OUT/"
round2 "$OUT/"
features "$OUT/features-1616" --max-examples 1616  # all committed answers
round3 "$OUT/round2" "$OUT/drafter"
[ -d "$OUT/packed" ] || $OSPREY pack --drafter "$OUT/drafter" --reference $BACKBONE_PARENT --delta-bits 4 \
  --output "$OUT/packed"
log "packed: $OUT/packed (copy it to $SHIPPED to ship it)"
