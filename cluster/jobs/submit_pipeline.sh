#!/usr/bin/env bash
# Stage 1 — data: Common Crawl WET shards -> filtered, deduplicated, tokenised shards (DESIGN.md, "Pipeline
# output directory"). Run from the repository root with the dashboard forwarded (`ray dashboard ray_cluster.yaml`).
#   INPUT='s3-or-shared/path/*.warc.wet.gz' cluster/jobs/submit_pipeline.sh [--config pipeline.yaml]
set -euo pipefail

RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
# Outputs must live on storage every node can reach (an EFS/NFS mount, or object storage the stage supports):
# the job driver (on the head node) writes them, and training workers on other nodes read them.
SHARED="${SHARED:-/mnt/shared/raylm}"
INPUT="${INPUT:-data/sample}"   # a directory or a glob; relative paths resolve inside the uploaded working dir

# The glob is passed through unexpanded: `ray job submit` shell-quotes the entrypoint (shlex.join).
ray job submit \
  --address "$RAY_ADDRESS" \
  --working-dir . \
  --runtime-env cluster/jobs/runtime_env.yaml \
  --submission-id "raylm-pipeline-$(date +%Y%m%d-%H%M%S)" \
  -- python -m pipeline run --input "$INPUT" --output "$SHARED/data" "$@"
