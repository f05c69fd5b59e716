"""HTTP error plumbing and request accounting for the serving app's ingress (``serve/ingress.py``).

Errors become OpenAI's body (``{"error": {"message", "type", "param", "code"}}``) in one place, the exception
handlers here, which ``install_error_handlers`` puts on the FastAPI app: ``APIError`` from the routes, the
router's own HTTP errors (unknown route, wrong method), FastAPI's parameter validation, and anything unhandled.

Every request to a counted route is accounted for by one ``RequestAccount``, an ``async with`` around its whole life
in the app, from its arrival to its last byte:

- ``admit()``, once it has passed the caps and goes to the engine: counted in flight in the replica's drain
  (``serve.drain.ReplicaDrain``), or, while the app drains, refused with a 503 (``server_shutting_down``) and
  counted as rejected;
- on the way out, exactly once, whatever ended it (a response, a stream's last chunk, an error, a failure after a
  stream's headers went out, a client that went away: status 499, nginx's "client closed request"): its ``Ending``
  is counted in ``raylm_server_requests_total`` by status and finish reason, and an admitted request leaves the
  in-flight count, as drained, or as aborted when the drain's deadline cut it.

The handler tells the account what only the handler knows (a generation's finish reason, a stream that failed after
its 200) through the request's ``Outcome``. ``RequestAccounting``, the ASGI middleware that opens the account, also
caps the request body, before it is read (Content-Length) and while it is read, so one large request cannot hold up
the others sharing the replica's event loop. Serve's HTTP proxy watches its responses through the same class
(``serve/proxy_guard.py``), so this module loads neither vLLM nor the app at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.drain import RETRY_AFTER_S, ReplicaDrain, ShutdownCut

if TYPE_CHECKING:  # imported at run time only by install_error_handlers (see there why)
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from vllm.exceptions import VLLMClientError

log = logging.getLogger(__name__)

T = TypeVar("T")


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
ACCOUNT_KEY = "raylm.account"  # where a counted request's RequestAccount lives in its ASGI scope
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
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body", whose cause says which
        cause = exc.__cause__
        return error_response(APIError(400, f"the body is not valid UTF-8 JSON: byte {cause.start} ({cause.reason})"))
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
    if first.get("type") == "json_invalid":  # the body as a whole: its location is a character, not a field
        why = first.get("ctx", {}).get("error", "invalid")
        return error_response(APIError(400, f"the body is not valid JSON: {why} at character {first['loc'][-1]}"))
    param = str(first.get("loc", ("", ""))[-1]) or None
    return error_response(APIError(400, f"{param}: {first.get('msg', 'invalid request')}", param=param))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Render every error ``app`` raises, whatever raised it, as OpenAI's error body."""
    # Imported here, where only the ingress comes: Serve's HTTP proxy imports this module (serve/proxy_guard.py),
    # and vLLM's exceptions would load vLLM and torch into it. openai_api_models.OpenAIHTTPException: what
    # ray.serve.llm's OpenAiIngress raises when the engine answers with an error (a prompt longer than the context, a
    # bad sampling value), with vLLM's status and message; only this internal module defines it.
    from ray.llm._internal.serve.core.configs import openai_api_models
    from vllm import exceptions as vllm_exceptions

    # Each handler takes the exception class it is registered for (Any: Starlette types every handler as taking any
    # Exception).
    handlers: dict[type[Exception], Callable[[Request, Any], Awaitable[JSONResponse]]] = {
        APIError: _api_error,
        StarletteHTTPException: _http_error,
        openai_api_models.OpenAIHTTPException: _engine_error,
        vllm_exceptions.VLLMClientError: _engine_client_error,
        RequestValidationError: _route_validation_error,
        Exception: _internal_error,
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)


@dataclass
class Outcome:
    """What only the handler knows about how its request ended, read by its ``RequestAccount``.

    ``finish_reason``: stop | length for a generation. ``status``: set when the HTTP status that went out
    is not the truth, i.e. a stream that failed (500) or lost its client (499) after its 200 was sent.
    """

    status: int | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class Ending:
    """How a request ended, as ``raylm_server_requests_total`` counts it.

    ``finish_reason``: stop | length | none (a response that is not a generation) | abort (the client went away) |
    error (4xx/5xx before or during generation)."""

    status: int
    finish_reason: str


class RequestAccount:
    """One request's accounting over its whole life in the app: ``async with`` around the ASGI app's call, which gets
    the account's ``receive`` and ``send`` (see the module's docstring).

    What went out and came in: ``start`` (the response's start message), ``complete`` (its last body part was
    sent), ``client_gone`` (the client's disconnect was received). ``admit()`` lets the request into the engine;
    ``until_cut`` and ``chunks_until_cut`` race its work with the drain's deadline, noting a cut. Leaving the
    ``async with`` finishes the account: once, with the ``Ending``, the ``count`` (the metrics' request counter)
    and, for an admitted request, the drain's counts.
    """

    def __init__(
        self,
        receive: Receive,
        send: Send,
        *,
        drain: ReplicaDrain | None = None,
        count: Callable[[int, str], None] | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """``drain``: the replica's, for requests that go to the engine; ``count(status, finish_reason)``: called
        with the ``Ending``; ``headers``: added to the response's start."""
        self._receive, self._send = receive, send
        self._drain, self._count, self._headers = drain, count, list(headers)
        self.outcome = Outcome()
        self.start: Message | None = None
        self.complete = False
        self.client_gone = False
        self.admitted = False
        self.cut = False
        self.ending: Ending | None = None

    @property
    def status(self) -> int | None:
        """The HTTP status that went out; None before the response started."""
        return None if self.start is None else int(self.start["status"])

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.client_gone = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            if self._headers:
                message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    def admit(self) -> None:
        """The request goes to the engine: counted in flight until the account finishes. While the app drains it is
        refused instead: counted as rejected, and ``APIError`` 503 raised (with ``Retry-After``)."""
        drain = self._engine_drain()
        if drain.draining:
            drain.counts.rejected += 1
            drain.report()
            raise APIError(
                503,
                "the server is shutting down and takes no new requests; retry (another replica, or this address once "
                "it is back)",
                type="server_error",
                code="server_shutting_down",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        drain.counts.in_flight += 1
        self.admitted = True

    async def until_cut(self, work: Awaitable[T]) -> T:
        """``await work``, unless the drain's deadline comes first: then it is cancelled, the request noted as cut
        and ``ShutdownCut`` raised."""
        try:
            return await self._engine_drain().until_cut(work)
        except ShutdownCut:
            self.cut = True
            raise

    async def chunks_until_cut(self, chunks: AsyncIterator[T]) -> AsyncIterator[T]:
        """The chunks of a stream until it ends, or until the drain's deadline: then the engine's generator is closed,
        the request noted as cut and ``ShutdownCut`` raised."""
        async with contextlib.aclosing(self._engine_drain().chunks_until_cut(chunks)) as racing:
            try:
                async for chunk in racing:
                    yield chunk
            except ShutdownCut:
                self.cut = True
                raise

    async def __aenter__(self) -> RequestAccount:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(exc)

    def finish(self, error: BaseException | None = None) -> Ending:
        """Close the account, once (a later call returns the same ``Ending``): ``error`` is what ended the app's call,
        if anything did."""
        if self.ending is not None:
            return self.ending
        self.ending = self._ending(error)
        if self.admitted and self._drain is not None:
            drain = self._drain
            drain.counts.in_flight -= 1
            if drain.draining:
                if self.cut:
                    drain.counts.aborted += 1
                else:
                    drain.counts.drained += 1
                drain.report()
        if self._count is not None:
            self._count(self.ending.status, self.ending.finish_reason)
        return self.ending

    def _ending(self, error: BaseException | None) -> Ending:
        outcome, status = self.outcome, self.status
        if isinstance(error, asyncio.CancelledError):
            return Ending(CLIENT_CLOSED, "abort")
        if isinstance(error, Exception):
            if outcome.status is not None:
                # The handler saw how the stream ended before the exception reached us: its client left (499), or
                # its own error went out as an SSE error event (500).
                return Ending(outcome.status, outcome.finish_reason or "error")
            if status is not None and not self.complete:
                # The response had started and the handler recorded nothing: sending failed because the client
                # left, which the transport reports as an exception rather than a cancellation when the disconnect
                # races a send.
                return Ending(CLIENT_CLOSED, "abort")
        if error is not None:
            return Ending(500, "error")  # a server error (ServerErrorMiddleware renders its 500 body)
        if status is None:
            return Ending(500, "error")  # the app returned without answering: a bug of ours
        if status >= 400:
            return Ending(status, "error")
        if outcome.status is not None:
            return Ending(outcome.status, outcome.finish_reason or "error")
        if not self.complete:
            return Ending(CLIENT_CLOSED, "abort")  # the response started and never finished: the client left
        return Ending(status, outcome.finish_reason or "none")

    def _engine_drain(self) -> ReplicaDrain:
        if self._drain is None:
            raise RuntimeError("this request's account has no drain: only the ingress's accounts admit requests")
        return self._drain


def request_account(request: Request) -> RequestAccount:
    """The account ``RequestAccounting`` opened for ``request``, a request to a counted route."""
    return cast(RequestAccount, request.scope[ACCOUNT_KEY])


class RequestAccounting:
    """Pure ASGI middleware: the body cap, and a ``RequestAccount`` around each request to a counted route.

    Pure ASGI rather than ``BaseHTTPMiddleware`` so streams pass through untouched and a cancellation
    (client gone) reaches it as ``CancelledError``. It sits inside Starlette's ``ServerErrorMiddleware``: an
    exception escaping here is turned into the 500 body by ``_internal_error`` after the account has counted it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        server = cast(Any, serve.get_replica_context().servable_object)  # RayLMIngress (serve/ingress.py)
        cap = server.args.max_request_bytes
        account = RequestAccount(
            receive,
            send,
            drain=server.drain,
            count=server.metrics.count_request,
            headers=[(REPLICA_HEADER, server.replica.encode())],
        )
        scope[ACCOUNT_KEY], scope[OUTCOME_KEY] = account, account.outcome
        async with account:
            declared = _content_length(scope)
            if declared is not None and declared > cap:
                await error_response(_too_large(cap))(scope, account.receive, account.send)
            elif declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body = await _read_capped(account.receive, cap)
                if body is None:
                    await error_response(_too_large(cap))(scope, account.receive, account.send)
                else:
                    await self.app(scope, _replay(body, account.receive), account.send)
            else:
                await self.app(scope, _capped(account.receive, cap), account.send)


def _capped(receive: Receive, cap: int) -> Receive:
    """A receive that stops a body longer than its Content-Length claimed at the cap, rather than buffer it."""
    received = 0

    async def capped_receive() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > cap:
                raise _too_large(cap)
        return message

    return capped_receive


async def _read_capped(receive: Receive, cap: int) -> bytes | None:
    """A body without Content-Length (chunked), read up to the cap: the bytes, or None past the cap. Read before the
    route runs because FastAPI turns any error raised while it reads a body into its own 400 ("error parsing the
    body"), which would hide the 413."""
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
