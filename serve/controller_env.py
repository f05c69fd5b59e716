"""The Serve controller's environment for raylm, in one place: ``python -m serve``, ``serve/serve_config.yaml`` and
the tests start Serve with it (``controller_options.runtime_env.env_vars``). The HTTP proxies the controller starts
inherit it.

* serve/proxy_guard.py's hook, so that a request whose replica is lost mid-request gets an answer, not a cut.
* Start-up and health timeouts that a busy node meets. Serve kills an HTTP proxy that is not ready within
  ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` of its start (5 s by default), and ``serve.start`` then fails
  ("ProxyActor ... killed by ray.kill"). That happened here every time with two busy-loop processes on the 2 cores
  (tests/test_serve_api.py's fixture); a node that also trains, curates or compiles is that busy. A proxy's health
  check gets ``RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S`` (10 s) before it counts as a failure, three in a row as
  unhealthy. Both are raised to what a loaded node answers within; a proxy that is really dead is still found
  (its actor dies, which Serve sees without a timeout).
"""

from __future__ import annotations

from serve.proxy_guard import CALLBACK, CALLBACK_ENV

BUSY_NODE_TIMEOUTS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
}


def controller_env() -> dict[str, str]:
    """The Serve controller's ``env_vars``: the proxy guard's hook and the busy-node timeouts."""
    return {CALLBACK_ENV: CALLBACK, **BUSY_NODE_TIMEOUTS}
