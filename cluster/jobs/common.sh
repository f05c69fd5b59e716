# Sourced by cluster/jobs/submit_*.sh: the one `ray job submit` preamble every stage's job uses.
# Run the snippets from the repository root: --working-dir . uploads the checkout, so the job runs this code.

RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"   # the dashboard's job API (`ray dashboard ray_cluster.yaml`)
# ROOT: where every stage reads and writes, e.g. s3://my-bucket/raylm (or gs://…). Nodes share no filesystem:
# job drivers (on the head), pipeline workers, training ranks and serving replicas all reach the bucket, with the
# credentials of their instance profile (ray_cluster.yaml). A path every node mounts (EFS/NFS) works as well.
ROOT="${ROOT:?set ROOT to the bucket prefix every stage reads and writes, e.g. ROOT=s3://my-bucket/raylm}"
ROOT="${ROOT%/}"

# submit NAME [more `ray job submit` options] -- ENTRYPOINT...
# The entrypoint is passed through as separate words: `ray job submit` shell-quotes it (shlex.join), so a glob
# reaches the job unexpanded.
submit() {
  local name="$1"
  shift
  ray job submit \
    --address "$RAY_ADDRESS" \
    --working-dir . \
    --runtime-env cluster/jobs/runtime_env.yaml \
    --submission-id "raylm-$name-$(date +%Y%m%d-%H%M%S)" \
    "$@"
}
