#!/usr/bin/env bash
# The whole chain as one Ray job: plan, curate, train, export, eval and serve from one job spec (cluster/run.py).
#   ROOT=s3://my-bucket/raylm cluster/jobs/submit_job.sh JOB.yaml [--until eval] [--set train.steps=4000]
# ROOT replaces the spec's root: on a cluster, object storage (or a mount every node shares). The spec and the files
# it names travel with the checkout (--working-dir .); an input inside the checkout is keyed by its path in it (the
# upload's own directory changes with the checkout's content), and inputs of a crawl's size are named by URI (s3://…).
# Submitting the same spec again resumes it: the finished stages are verified and skipped, a cut-off stage continues.
# The serve stage serves until `ray job stop` (which drains it); give the spec `serve: {host: 0.0.0.0}` to serve
# beyond the head node, or stop at `--until eval` and deploy with submit_serve.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SPEC="${1:?usage: ROOT=s3://bucket/prefix cluster/jobs/submit_job.sh JOB.yaml [--until STAGE] [--set KEY=VALUE]}"
shift

# The Ray dashboard lists the job as raylm-<spec>-<time> (raylm-demo-20261127-054012 for cluster/jobs/demo.yaml).
NAME="$(basename "${SPEC%.*}")"
submit "${NAME//[^A-Za-z0-9_-]/-}" -- python -m cluster.run "$SPEC" --address auto --set "root=$ROOT" "$@"
