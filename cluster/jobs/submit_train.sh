#!/usr/bin/env bash
# Stage 2 — training on the pipeline's output, then export of a consolidated model for serving.
#   ROOT=s3://my-bucket/raylm STRATEGY=fsdp WORKERS=8 STEPS=2000 cluster/jobs/submit_train.sh [--config train.yaml] [--resume]
# Reads $ROOT/data (each node caches the shards it reads, verified); the run dir and its checkpoints go to
# $ROOT/runs/gpt-$STRATEGY, the export to $ROOT/models/gpt-$STRATEGY.
# Size the job first: python -m cluster.plan --config cluster/jobs/plan_gpt2_small_8xa10g.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

STRATEGY="${STRATEGY:-ddp}"             # single | ddp | fsdp
WORKERS="${WORKERS:-8}"                 # 8 = two g5.12xlarge GPU workers
STEPS="${STEPS:-2000}"
RUN="$ROOT/runs/gpt-$STRATEGY"
# Optional: checkpoints somewhere else than the run dir (s3://bucket/prefix; see checkpoints/README.md).
CHECKPOINT_STORAGE="${CHECKPOINT_STORAGE:-}"

submit train -- python -m train --data "$ROOT/data" --output "$RUN" \
  --strategy "$STRATEGY" --workers "$WORKERS" --steps "$STEPS" \
  ${CHECKPOINT_STORAGE:+--set "checkpoint.storage=$CHECKPOINT_STORAGE"} "$@"

submit export -- python -m train.export --run "$RUN" --output "$ROOT/models/gpt-$STRATEGY"
