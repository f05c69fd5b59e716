#!/usr/bin/env bash
# Stage 2 — training on the pipeline's output, then export of a consolidated model for serving.
#   STRATEGY=fsdp WORKERS=8 STEPS=2000 cluster/jobs/submit_train.sh [--config train.yaml] [--resume]
# Size the job first: python -m cluster.plan --config cluster/jobs/plan_gpt2_small_8xa10g.yaml
set -euo pipefail

RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
SHARED="${SHARED:-/mnt/shared/raylm}"   # Ray Train checkpoints need storage shared by all nodes
STRATEGY="${STRATEGY:-ddp}"             # single | ddp | fsdp
WORKERS="${WORKERS:-8}"                 # 8 = two g5.12xlarge GPU workers
STEPS="${STEPS:-2000}"
RUN="$SHARED/runs/gpt-$STRATEGY"

ray job submit \
  --address "$RAY_ADDRESS" \
  --working-dir . \
  --runtime-env cluster/jobs/runtime_env.yaml \
  --submission-id "raylm-train-$(date +%Y%m%d-%H%M%S)" \
  -- python -m train --data "$SHARED/data" --output "$RUN" \
       --strategy "$STRATEGY" --workers "$WORKERS" --steps "$STEPS" "$@"

ray job submit \
  --address "$RAY_ADDRESS" \
  --working-dir . \
  --runtime-env cluster/jobs/runtime_env.yaml \
  --submission-id "raylm-export-$(date +%Y%m%d-%H%M%S)" \
  -- python -m train.export --run "$RUN" --output "$SHARED/models/gpt-$STRATEGY"
