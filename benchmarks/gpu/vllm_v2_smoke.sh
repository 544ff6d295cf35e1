#!/usr/bin/env bash
# Smoke test of the osprey-vllm plugin in vLLM's V2 model runner, on any CUDA machine (see README.md here):
#
#   OSPREY_PYTHON=python-with-osprey OSPREY_VLLM_PYTHON=python-with-vllm benchmarks/gpu/vllm_v2_smoke.sh [OUT]
#
# OSPREY_VLLM_PYTHON is a Python with `pip install vllm ./serving/vllm` (vLLM pins an older transformers than osprey,
# hence two environments; defaults: .venv/bin/python and .venv-vllm/bin/python). A tiny exported Osprey drafter is
# served by vLLM in its default multi-process engine; the check wants greedy output equal to vLLM alone and to
# transformers, and drafts accepted. vLLM 0.34 runs V2 only; VLLM_USE_V2_MODEL_RUNNER=1 selects it in 0.32 and 0.33.
# A vLLM that falls back to its V1 runner (it logs "using the V1 model runner") fails the smoke, unless
# ALLOW_V1_RUNNER=1 (a dry run of the pipeline on vLLM's CPU build, which has no V2 without Triton).
set -euo pipefail
cd "$(dirname "$0")/../.."
OSPREY_PYTHON=${OSPREY_PYTHON:-.venv/bin/python}
OSPREY_VLLM_PYTHON=${OSPREY_VLLM_PYTHON:-.venv-vllm/bin/python}
OUT=${1:-${OUT:-/tmp/vllm-v2-smoke}}
mkdir -p "$OUT"
if [ "${ALLOW_V1_RUNNER:-0}" != 1 ]; then
    export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-1}
fi

"$OSPREY_PYTHON" benchmarks/gpu/vllm_v2_smoke.py prepare "$OUT"
for job in alone osprey; do
    # vLLM's environment runs without osprey's on the path (tests/vllm_engine.py imports nothing of osprey).
    env -u PYTHONPATH -u VIRTUAL_ENV "$OSPREY_VLLM_PYTHON" tests/vllm_engine.py "$OUT/$job.json" \
        >"$OUT/$job.log" 2>&1 || {
        tail -50 "$OUT/$job.log"
        echo "vLLM failed on the $job job; its log: $OUT/$job.log" >&2
        exit 1
    }
    if grep -q "using the V1 model runner" "$OUT/$job.log" && [ "${ALLOW_V1_RUNNER:-0}" != 1 ]; then
        grep "V1 model runner" "$OUT/$job.log" | head -3
        echo "vLLM ran its V1 model runner, not V2 (log: $OUT/$job.log)" >&2
        exit 1
    fi
done
"$OSPREY_PYTHON" benchmarks/gpu/vllm_v2_smoke.py check "$OUT"
