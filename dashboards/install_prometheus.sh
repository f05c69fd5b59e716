#!/usr/bin/env bash
# Installs Debian's `prometheus` (the server and promtool) and `prometheus-alertmanager` (the server,
# /usr/bin/prometheus-alertmanager, and amtool) for the dashboards, alerts and alert-routing tests.
# Idempotent: installs only what is missing. `ray metrics launch-prometheus` and the upstream release
# tarballs need internet access beyond the package mirrors, so the distribution packages are the route.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/bin/$1" ]; }

missing=()
{ have prometheus && have promtool; } || missing+=(prometheus)
{ have prometheus-alertmanager && have amtool; } || missing+=(prometheus-alertmanager)
if [ ${#missing[@]} -eq 0 ]; then
    echo "prometheus, promtool, prometheus-alertmanager and amtool already installed"
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "error: need root or sudo to apt-get install ${missing[*]}" >&2
    exit 1
fi

# noninteractive: the packages' postinst must not prompt inside CI or `make test`.
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${missing[@]}"

# The packages start system services where an init system exists; the tests run their own servers on
# free loopback ports with the repo's configs, so those services are harmless but not needed.
for binary in prometheus promtool prometheus-alertmanager amtool; do
    have "$binary" || { echo "error: $binary missing after installing ${missing[*]}" >&2; exit 1; }
done
echo "installed: ${missing[*]}"
