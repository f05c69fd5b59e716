"""HTTP error plumbing and per-response accounting for the serving app's ingress (``serve/ingress.py``).

Errors become OpenAI's body (``{"error": {"message", "type", "param", "code"}}``) in one place, the exception
handlers here, which ``install_error_handlers`` puts on the FastAPI app: ``APIError`` from the routes, the
router's own HTTP errors (unknown route, wrong method), FastAPI's parameter validation, and anything unhandled.

Every response to a counted route goes through ``RequestAccounting``, which counts it exactly once in
``raylm_server_requests_total`` whatever produced it: a success, a validation error, an HTTP error from
the router, an unhandled exception, a failure after a stream's headers went out, or a client that went
away (status 499, nginx's "client closed request"). The handler tells it what only the handler knows (a
generation's finish reason, a stream that failed after its 200) through the request's ``Outcome``.

The same middleware caps the request body, before it is read (Content-Length) and while it is read, so one
large request cannot hold up the others sharing the replica's event loop.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve

# What ray.serve.llm's OpenAiIngress raises when the engine answers with an error (a prompt longer than the context,
# a bad sampling value): vLLM's status and message. Only its internal module defines it.
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from vllm.exceptions import VLLMClientError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an OpenAI-style body; raised anywhere in a request, rendered by the app's one handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


CLIENT_CLOSED = 499
# Operator probes, polled by load balancers, dashboards and tests: counting them in raylm_server_requests_total
# would dilute the 5xx ratio that RayLMErrorRateHigh alerts on. Every other path is counted.
UNCOUNTED_PATHS = frozenset({"/health", "/v1/canary"})
OUTCOME_KEY = "raylm.outcome"  # where a request's Outcome lives in its ASGI scope
# Every counted response names the replica that produced it (its full Serve id, SERVE_REPLICA::app#deployment#id):
# which replica, and so which node, served a request, also a stream whose replica is lost after its headers went out.
REPLICA_HEADER = b"x-raylm-replica"


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods get the same error shape as everything else.
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), type=kind))


async def _engine_error(request: Request, exc: OpenAIHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if 400 <= exc.status_code < 500 else "server_error"
    return error_response(APIError(exc.status_code, exc.message, type=kind))


async def _engine_client_error(request: Request, exc: VLLMClientError) -> JSONResponse:
    # A request vLLM refused (a bad value it validates itself) that reached the ingress as the engine replica's task
    # error: Ray makes that error an instance of the cause's class too, so this handler catches it; its cause holds
    # vLLM's own message and parameter (the wrapper's text would be a traceback).
    cause = getattr(exc, "cause", exc)
    message = str(cause.args[0]) if cause.args else type(cause).__name__
    return error_response(APIError(400, message, param=getattr(cause, "parameter", None)))


async def _route_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own parameter validation (path and query parameters) answers 422 in its own shape otherwise.
    first = exc.errors()[0] if exc.errors() else {}
    param = str(first.get("loc", ("", ""))[-1]) or None
    return error_response(APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


# Each handler takes the exception class it is registered for (Any: Starlette types every handler as taking any
# Exception).
ERROR_HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
    APIError: _api_error,
    StarletteHTTPException: _http_error,
    OpenAIHTTPException: _engine_error,
    VLLMClientError: _engine_client_error,
    RequestValidationError: _route_validation_error,
    Exception: _internal_error,
}


def install_error_handlers(app: FastAPI) -> None:
    """Render every error ``app`` raises, whatever raised it, as OpenAI's error body."""
    for exc_class, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)


@dataclass
class Outcome:
    """What only the handler knows about how its request ended, read by ``RequestAccounting``.

    ``finish_reason``: stop | length for a generation. ``status``: set when the HTTP status that went out
    is not the truth, i.e. a stream that failed (500) or lost its client (499) after its 200 was sent.
    """

    status: int | None = None
    finish_reason: str | None = None


def request_outcome(request: Request) -> Outcome:
    # Requests on uncounted paths (and in-process use without the middleware) get a throwaway Outcome.
    return request.scope.get(OUTCOME_KEY) or Outcome()


class RequestAccounting:
    """Pure ASGI middleware: the body cap, and one ``count_request`` per response of every counted route.

    Pure ASGI rather than ``BaseHTTPMiddleware`` so streams pass through untouched and a cancellation
    (client gone) reaches it as ``CancelledError``. It sits inside Starlette's ``ServerErrorMiddleware``: an
    exception escaping here is turned into the 500 body by ``_internal_error`` after this has counted it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        server = cast(Any, serve.get_replica_context().servable_object)  # RayLMIngress (serve/ingress.py)
        cap = server.args.max_request_bytes
        replica = server.replica.encode()
        outcome = scope[OUTCOME_KEY] = Outcome()
        status: int | None = None
        complete = False
        received = 0

        async def recording_send(message: Message) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, replica)]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        async def capped_receive() -> Message:
            # A body longer than its Content-Length claimed is stopped at the cap, not buffered.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    raise _too_large(cap)
            return message

        async def read_capped() -> bytes | None:
            """A body without Content-Length (chunked), read here up to the cap: the bytes, or None past the cap.
            Read before the route runs because FastAPI turns any error raised while it reads a body into its own
            400 ("error parsing the body"), which would hide the 413."""
            parts: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return b"".join(parts)  # the client left while sending: the route sees a short body
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                if size > cap:
                    return None
                if not message.get("more_body", False):
                    return b"".join(parts)

        # Any other exception escaping the app is a server error (ServerErrorMiddleware renders its 500 body).
        counted = (500, "error")
        try:
            declared = _content_length(scope)
            if declared is not None and declared > cap:
                await error_response(_too_large(cap))(scope, receive, recording_send)
            elif declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body = await read_capped()
                if body is None:
                    await error_response(_too_large(cap))(scope, receive, recording_send)
                else:
                    await self.app(scope, _replay(body, receive), recording_send)
            else:
                await self.app(scope, capped_receive, recording_send)
        except asyncio.CancelledError:
            counted = (CLIENT_CLOSED, "abort")
            raise
        except Exception:
            if outcome.status is not None:
                # The handler saw how the stream ended before the exception reached us: its client left (499),
                # or its own error went out as an SSE error event (500).
                counted = (outcome.status, outcome.finish_reason or "error")
            elif status is not None and not complete:
                # The response had started and the handler recorded nothing: sending failed because the client
                # left, which the transport reports as an exception rather than a cancellation when the
                # disconnect races a send.
                counted = (CLIENT_CLOSED, "abort")
            raise
        else:
            if status is None:
                counted = (500, "error")  # the app returned without answering: a bug of ours
            elif status >= 400:
                counted = (status, "error")
            elif outcome.status is not None:
                counted = (outcome.status, outcome.finish_reason or "error")
            elif not complete:
                counted = (CLIENT_CLOSED, "abort")  # the response started and never finished: the client left
            else:
                counted = (status, outcome.finish_reason or "none")
        finally:
            server.metrics.count_request(*counted)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app ``body`` whole, then passes on what the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _too_large(cap: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {cap} bytes", code="request_too_large")
