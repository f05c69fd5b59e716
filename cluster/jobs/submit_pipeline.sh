#!/usr/bin/env bash
# Stage 1 — data: Common Crawl WET shards -> filtered, deduplicated, tokenised shards (docs/formats.md, "Pipeline
# output directory"). Run from the repository root with the dashboard forwarded (`ray dashboard ray_cluster.yaml`).
#   ROOT=s3://my-bucket/raylm INPUT='s3://commoncrawl/crawl-data/.../*.warc.wet.gz' \
#     cluster/jobs/submit_pipeline.sh [--config pipeline.yaml] [--resume]
# Workers write the output straight to $ROOT/data; it is complete once its manifest.json (written last) is there.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

INPUT="${INPUT:-data/sample}"   # a directory or a glob; relative paths resolve inside the uploaded working dir

submit pipeline -- python -m pipeline run --input "$INPUT" --output "$ROOT/data" "$@"
