"""A clear, counted error for a request whose replica was lost while serving it, given by Serve's HTTP proxy.

The completions app is its own ingress: the replica that parses a request also generates and streams its answer,
and counts it (``serve/accounting.py``). When that replica's process or node dies mid-request, nothing of it is left
to answer or count, and Ray Serve's proxy (2.60) answers badly: a request whose response had not started gets
uvicorn's bare ``500 Internal Server Error`` in plain text, and a stream whose 200 went out is cut without its last
chunk (the client sees a broken chunked body, ``ChunkedEncodingError``), which Serve's own
``ray_serve_num_http_requests_total`` records as a 200. Serve retries a request on another replica only when the
replica was already dead before it took the request (the router's ``ActorDiedError`` handling); one it had started
is not retried, rightly so for a generation that was half-streamed.

The proxy is the one process on the request's path that outlives the replica, so the fix sits there, through
Serve's hook for proxy middlewares, ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (``python -m serve`` and
``serve/serve_config.yaml`` set it in the Serve controller's environment, which the proxies inherit):
:class:`ReplicaLossGuard` watches each response the proxy sends and, when the proxy gives up on a request without
finishing its response while the client is still there,

* finishes it the way the app itself reports a failure: a 503 with OpenAI's error body (code
  ``replica_unavailable``, the request id that the proxy's log has with the lost replica's name) when nothing was
  sent yet, or, for a stream (``text/event-stream``) whose 200 went out, an SSE error event and ``[DONE]``;
* counts it in ``raylm_proxy_replica_lost_requests`` (a Ray metric: Prometheus reads it from the head node's
  metrics port as ``ray_raylm_proxy_replica_lost_requests_total{status_code, stream}``, next to Serve's own
  ``ray_serve_*`` series), since the replica that would have counted it in ``raylm_server_requests_total`` is gone.

A client that disconnected is left alone (the replica counts it as 499). Answers the proxy completes itself (a 503
while no replica is up, a 408 timeout, its health routes) pass through untouched. What went out and whether the
client left are watched by the request's ``serve.accounting.RequestAccount``, the ingress's own accounting. This
module runs in the proxy process: it imports neither torch nor the app, only the standard library, Ray (Serve, its
Starlette) and ``serve.accounting``, which leaves vLLM to the ingress.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.accounting import APIError, RequestAccount

log = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "serve.proxy_guard:proxy_middlewares"
STATUS = 503  # Service Unavailable: the server failed to finish this request; the same request may succeed if retried
CODE = "replica_unavailable"
REQUEST_ID_HEADER = b"x-request-id"  # Serve's: the proxy's RequestIdMiddleware puts it into the request's headers

_counter: Any = None


def proxy_middlewares() -> list[Middleware]:
    """The callback Serve's proxy calls at start (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    return [Middleware(ReplicaLossGuard)]


def error_body(message: str) -> dict[str, Any]:
    """OpenAI's error body, as the ingress answers its own server errors."""
    return APIError(STATUS, message, type="server_error", code=CODE).body()


def count_lost(stream: bool) -> None:
    global _counter
    if _counter is None:
        from ray.util.metrics import Counter

        _counter = Counter(
            "raylm_proxy_replica_lost_requests",
            description="Requests whose replica was lost before it finished them, answered by the proxy",
            tag_keys=("status_code", "stream"),
        )
    _counter.inc(1, {"status_code": str(STATUS), "stream": "true" if stream else "false"})


class ReplicaLossGuard:
    """Pure ASGI middleware around Serve's proxy app: completes, and counts, a response the proxy left unfinished."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        async with RequestAccount(receive, send) as account:
            try:
                await self.app(scope, account.receive, account.send)
            except Exception:
                # Not expected (the proxy turns a failed request into a status of its own); answer it all the same.
                log.exception("Serve's proxy raised on %s", scope.get("path"))
            if not (account.complete or account.client_gone):
                await _answer_lost(scope, account)


async def _answer_lost(scope: Scope, account: RequestAccount) -> None:
    """Finish, and count, a response the proxy gave up on: the 503, or a stream's SSE error event and ``[DONE]``."""
    request_id = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER, b"").decode("latin-1")
    message = (
        "the replica serving this request was lost before it finished (its process or node failed); the request "
        f"did not complete and can be retried (request id {request_id or 'unknown'})"
    )
    started = account.start
    stream = started is not None and _is_event_stream(started)
    log.warning("request %s on %s: %s", request_id, scope.get("path"), "stream cut" if started else "no answer")
    if started is None:
        body = json.dumps(error_body(message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if request_id:
            headers.append((REQUEST_ID_HEADER, request_id.encode("latin-1")))
        await account.send({"type": "http.response.start", "status": STATUS, "headers": headers})
        await account.send({"type": "http.response.body", "body": body})
    elif stream:
        # The last events, as the ingress ends a stream whose generation failed (ingress.py: _watch_stream).
        events = f"data: {json.dumps(error_body(message), separators=(',', ':'))}\n\ndata: [DONE]\n\n"
        await account.send({"type": "http.response.body", "body": events.encode()})
    # Otherwise a plain body was cut after its first part (the app sends one part, so this is not expected): it
    # cannot be repaired, and uvicorn closes the connection, which the client sees as a truncated body.
    count_lost(stream)


def _is_event_stream(start: Message) -> bool:
    headers = dict(start.get("headers") or ())
    return headers.get(b"content-type", b"").split(b";")[0].strip() == b"text/event-stream"
