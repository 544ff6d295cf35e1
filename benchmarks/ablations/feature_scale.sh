#!/usr/bin/env bash
# Does a faster-moving feature path help the Osprey drafter read the target's taps within the pilot's budget? (issue 6)
# At init the q/k/v feature half is zero, so the feature RMSNorm weight does not change the function; with Adam it
# scales how fast that half moves (each update is ~lr in weight, times the norm's output in activation). Two runs
# from the pilot's converted drafter with layer 0's `hidden_norm.weight` multiplied by 8 and by 32, distilled exactly
# like the pilot (benchmarks/replication/distill-common.yaml on the SmolLM2 feature cache, 150 steps). Compare the
# held-out eval_ttt_loss_k / eval_ttt_acc_k with the pilot's Osprey run; the script writes the three runs' final
# held-out metrics to benchmarks/results/ablation-feature-scale.json (docs/results.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
RUNS=${RUNS:-/work/runs}
OSPREY=${OSPREY:-.venv/bin/osprey}
source benchmarks/replication/stages.sh
PILOT=$RUNS/replication/smollm2-135m-instruct  # benchmarks/replication/run.sh smollm2-135m-instruct
OUT=$RUNS/feature-scale
mkdir -p "$OUT"
for scale in 8 32; do
  init=$OUT/osprey-init-x$scale run=$OUT/osprey-x$scale
  if [ ! -f "$init/model.safetensors" ]; then
    rm -rf "$init.partial" && cp -r "$PILOT/osprey-init" "$init.partial"
    .venv/bin/python - "$init.partial/model.safetensors" "$scale" <<'PY'
import sys
from safetensors.torch import load_file, save_file
path, scale = sys.argv[1], float(sys.argv[2])
weights = load_file(path)
weights["model.layers.0.hidden_norm.weight"] *= scale
save_file(weights, path, metadata={"format": "pt"})
PY
    mv "$init.partial" "$init"
  fi
  [ -f "$run/model.safetensors" ] && continue
  OMP_NUM_THREADS=1 distill "$init" "$run" "$RUNS/features-smollm2-135m-sharegpt" &
done
wait
.venv/bin/python - "$PILOT/osprey" "$OUT" benchmarks/results/ablation-feature-scale.json <<'PY'
import json, sys
pilot, out, results = sys.argv[1:]
runs = {"pilot (x1)": pilot, "x8": f"{out}/osprey-x8", "x32": f"{out}/osprey-x32"}
report = {
    "command": "benchmarks/ablations/feature_scale.sh",
    "budget": "150 steps x 4 ShareGPT conversations (<=1024 tokens), benchmarks/replication/distill-common.yaml",
    "eval": "ShareGPT test split, 172 conversations, SmolLM2-135M-Instruct feature cache",
    "runs": {},
}
for name, run in runs.items():
    with open(f"{run}/trainer_state.json") as file:
        final_eval = [entry for entry in json.load(file)["log_history"] if "eval_loss" in entry][-1]
    report["runs"][name] = {
        key: round(value, 4) for key, value in final_eval.items()
        if key.startswith("eval_ttt") or key in ("eval_loss", "step")
    }
with open(results, "w") as file:
    json.dump(report, file, indent=1)
PY
