"""API keys: requests to ``/v1/*`` carry ``Authorization: Bearer KEY`` with a key from the operator's file, or get 401.

The file (``--api-key-file``, or ``api_key_file`` in serve_config.yaml) holds one key per line; blank lines and lines
starting with ``#`` are skipped. It is read on the driver (serve/api_key_file.py), and only the keys' sha256 digests
go to the replicas, so no key appears in the Serve config, the deployment's arguments or the dashboard. A presented
key is hashed and compared with each digest in constant time (``hmac.compare_digest``). ``/health`` stays open for
load balancers, and ``/v1/canary`` too: it reports a score, never a completion.

The check is plain ASGI middleware (OpenAI's 401 body, counted by ``serve.accounting``) rather than a FastAPI
dependency, so it runs before the request body is read or parsed: an unauthenticated client costs no parsing.
"""

from __future__ import annotations

import hmac
from typing import Any, cast

from ray import serve
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.accounting import APIError, error_response
from serve.api_key_file import key_digest

OPEN_PATHS = frozenset({"/health", "/v1/canary"})


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class ApiKeyAuth:
    """ASGI middleware: 401 for a ``/v1/*`` request without a valid key, when the server has keys."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        ingress = cast(Any, serve.get_replica_context().servable_object)  # RayLMIngress (serve/ingress.py)
        digests: tuple[str, ...] = ingress.api_key_digests
        if digests:
            token = _bearer(scope)
            presented = key_digest(token) if token else ""
            # Every digest is compared, so the time taken does not say which key (or how much of one) matched.
            if not any([hmac.compare_digest(presented, d) for d in digests]):
                message = "a valid API key is required: send it as 'Authorization: Bearer KEY'"
                if token is None:
                    message = "no API key: send one as 'Authorization: Bearer KEY'"
                await error_response(APIError(401, message, code="invalid_api_key"))(scope, receive, send)
                return
        await self.app(scope, receive, send)
