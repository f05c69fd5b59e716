#!/usr/bin/env bash
# Installs Debian's `prometheus-alertmanager` package (the server, /usr/bin/prometheus-alertmanager, and
# `amtool`) for the alert-routing tests. Idempotent: does nothing when both binaries are already there.
# Like install_prometheus.sh, the distribution package is the route: the upstream release tarball needs
# internet access beyond the package mirrors.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ]; }

if have prometheus-alertmanager && have amtool; then
    echo "alertmanager and amtool already installed: $(command -v prometheus-alertmanager || echo /usr/bin/prometheus-alertmanager)"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "error: need root or sudo to apt-get install prometheus-alertmanager" >&2
    exit 1
fi

# noninteractive: the package's postinst must not prompt inside CI or `make test`.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends prometheus-alertmanager

# The package starts a system service (on :9093) where an init system exists; the tests run their own
# Alertmanager on a free loopback port with the repo's config, so that service is not needed.
have amtool || { echo "error: amtool missing after install" >&2; exit 1; }
echo "installed: $(prometheus-alertmanager --version 2>&1 | head -n 1)"
