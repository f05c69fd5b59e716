# Sourced by cluster/jobs/submit_*.sh: the one `ray job submit` preamble every stage's job uses.
# Run the snippets from the repository root: --working-dir . uploads the checkout, so the job runs this code.

RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"   # the dashboard's job API (`ray dashboard ray_cluster.yaml`)
# Outputs must live on storage every node can reach (an EFS/NFS mount, or object storage the stage supports):
# job drivers (on the head node) write them, and training workers on other nodes read them.
SHARED="${SHARED:-/mnt/shared/raylm}"

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
