#!/usr/bin/env bash
# Seconds per distillation step on real features, the trainers of BASELINE (a git worktree) against this checkout's,
# alternating ROUNDS times: the Qwen round-1 config (benchmarks/replication/distill-qwen-q05b-epoch1.yaml) from
# osprey-init on the features of 240 regenerated conversations (both made by benchmarks/replication/qwen_drafter.sh),
# STEPS steps each, one thread; prints each run's step times, their mean from step 3 on, and its logged losses.
#
#   benchmarks/distill_ab_real.sh      (BASELINE=dafc157 RUNS=/work/runs STEPS=8 ROUNDS=2)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-/work/runs}
BASELINE=${BASELINE:-dafc157}
PY=$PWD/.venv/bin/python
OUT=$RUNS/distill-ab-real
mkdir -p "$OUT"
[ -d "$OUT/baseline-src" ] || git worktree add --detach "$OUT/baseline-src" "$BASELINE"
HARNESS='
import json, sys, time, transformers
times = []
class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs): self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kwargs): times.append(time.perf_counter() - self.start)
init = transformers.Trainer.__init__
transformers.Trainer.__init__ = lambda self, *a, callbacks=None, **k: init(self, *a, callbacks=(callbacks or []) + [Timer()], **k)
from trainers.distill import main
main(sys.argv[1:])
print("STEPS", json.dumps([round(t, 2) for t in times]), "mean from step 3", round(sum(times[2:]) / len(times[2:]), 3))
'
for round in $(seq "${ROUNDS:-2}"); do
  for version in baseline current; do
    src=$PWD; [ $version = baseline ] && src=$OUT/baseline-src
    rm -rf "$OUT/$version"
    (cd "$src" && OMP_NUM_THREADS=1 PYTHONPATH=$src $PY -c "$HARNESS" \
      --config "$PWD/benchmarks/replication/distill-qwen-q05b-epoch1.yaml" \
      --feature_cache "$RUNS/qwen-drafter/features-240" --drafter "$RUNS/qwen-drafter/osprey-init" \
      --output "$OUT/$version" --max_steps "${STEPS:-8}" --logging_steps 4 --save_strategy no --eval_strategy no \
      --disable_tqdm true 2>&1 | grep -E "STEPS|'loss'" | sed "s/^/$version $round /")
  done
done
git worktree remove --force "$OUT/baseline-src"
