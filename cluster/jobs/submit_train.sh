#!/usr/bin/env bash
# Stage 2 — training on the pipeline's output, then export of a consolidated model for serving.
#   STRATEGY=fsdp WORKERS=8 STEPS=2000 cluster/jobs/submit_train.sh [--config train.yaml] [--resume]
# Size the job first: python -m cluster.plan --config cluster/jobs/plan_gpt2_small_8xa10g.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # SHARED: Ray Train checkpoints need storage all nodes share

STRATEGY="${STRATEGY:-ddp}"             # single | ddp | fsdp
WORKERS="${WORKERS:-8}"                 # 8 = two g5.12xlarge GPU workers
STEPS="${STEPS:-2000}"
RUN="$SHARED/runs/gpt-$STRATEGY"
# Optional: checkpoints on object storage, which outlives the cluster (s3://bucket/prefix; see checkpoints/README.md).
CHECKPOINT_STORAGE="${CHECKPOINT_STORAGE:-}"

submit train -- python -m train --data "$SHARED/data" --output "$RUN" \
  --strategy "$STRATEGY" --workers "$WORKERS" --steps "$STEPS" \
  ${CHECKPOINT_STORAGE:+--set "checkpoint.storage=$CHECKPOINT_STORAGE"} "$@"

submit export -- python -m train.export --run "$RUN" --output "$SHARED/models/gpt-$STRATEGY"
