#!/usr/bin/env bash
# One device-machine call (see README.md here): install the pinned pure-Python stack from .whl/, then the CUDA
# check (exactness + step costs) and the trainer tests, which run on CUDA there (bf16 by default on a GPU).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
python3 benchmarks/gpu/check.py --output "$OUT/gpu-check.json" 2>&1 | tee "$OUT/gpu-check.log"
check=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider tests/test_trainers.py tests/test_losses.py tests/test_feature_cache.py tests/test_resume.py tests/test_replay.py -k "not cpu_safe" 2>&1 | tail -25 | tee "$OUT/trainer-tests.log"
exit $check
