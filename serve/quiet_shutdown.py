"""Shutting Ray Serve down without the line of noise that ``serve.shutdown()`` leaves on every clean stop.

Serve's controller ends its own life at the end of the ``graceful_shutdown`` call that ``serve.shutdown()`` waits on.
The driver sees that call's actor die under it and reports it as a failed task: "(raylet) Task
ServeController.graceful_shutdown failed ... killed by `ray.kill`". So the call is made without waiting (it returns
once the shutdown has begun), the controller's end is watched in the named-actor list, which makes no call to the
dying actor, and only then does ``serve.shutdown()`` drop this process's client.
"""

from __future__ import annotations

import time

CONTROLLER = {"name": "SERVE_CONTROLLER_ACTOR", "namespace": "serve"}  # Ray Serve's named controller actor
POLL_S = 0.1


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Every Serve app and Serve's own actors on this Ray, as ``serve.shutdown()`` (whose own path, with its line,
    finishes the job if the controller has not ended within ``timeout_s``)."""
    import ray
    from ray import serve

    try:
        controller = ray.get_actor(CONTROLLER["name"], namespace=CONTROLLER["namespace"])
    except ValueError:  # no Serve on this Ray
        serve.shutdown()
        return
    try:
        ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass  # gone already, or stuck: serve.shutdown() below says which, as it always has
    else:
        deadline = time.monotonic() + timeout_s
        while CONTROLLER in ray.util.list_named_actors(all_namespaces=True) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    serve.shutdown()
