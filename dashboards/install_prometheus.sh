#!/usr/bin/env bash
# Installs Debian's `prometheus` package (the server and promtool) for the dashboards/alerts tests.
# Idempotent: does nothing when both binaries are already on PATH. `ray metrics launch-prometheus`
# downloads a release tarball and fails without internet, so the distribution package is the route.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "prometheus and promtool already installed: $(command -v prometheus), $(command -v promtool)"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "error: need root or sudo to apt-get install prometheus" >&2
    exit 1
fi

# noninteractive: the package's postinst must not prompt inside CI or `make test`.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends prometheus

# The package starts a system service where an init system exists; the tests run their own server
# on a free loopback port, so a running service is harmless but not needed.
command -v promtool >/dev/null 2>&1 || { echo "error: promtool missing after install" >&2; exit 1; }
echo "installed: $(command -v prometheus) $(prometheus --version 2>&1 | head -n 1)"
