#!/usr/bin/env bash
# Stage 3 — serve the exported model with Ray Serve and keep a canary evaluating it.
#   ROOT=s3://my-bucket/raylm EVALSET=path/to/evalset.jsonl cluster/jobs/submit_serve.sh
# Each replica pulls the export from the bucket into its node's cache, verified, and loads it from there.
# Then, locally: `ray attach ray_cluster.yaml --port-forward 8000` and
#   curl -s localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 16}'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL="${MODEL:-$ROOT/models/gpt-ddp}"
EVALSET="${EVALSET:?set EVALSET to the evaluation set file of the canary}"
PORT="${PORT:-8000}"

# Serving runs until stopped (`ray job stop <id>`), so do not wait on it.
submit serve --no-wait -- python -m serve --model "$MODEL" --port "$PORT"

# With Serve's default proxy placement a proxy runs on the Serve controller's node (the head) as well as on
# nodes with replicas; job drivers also run on the head, so the canary reaches the API on localhost. The
# interval is the canary's default (serve/config.py).
submit canary --no-wait -- python -m serve.canary --endpoint "http://127.0.0.1:$PORT" --evalset "$EVALSET"
