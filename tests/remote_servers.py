"""Real remote endpoints on 127.0.0.1 for tests: moto's standalone S3 server, and an HTTP server (a directory, or
a proxy in front of another server such as moto) that answers Range requests and fails on purpose.

* :func:`moto_server` / :func:`use_s3_endpoint` / :func:`upload_dir`, or all three at once :func:`s3_prefix`; a
  server with one bucket made: :func:`s3_bucket`.
* :func:`http_server` serves a directory with Range support; :func:`http_proxy` relays to an upstream server;
  both take a :class:`FaultPlan` (the first K requests per path get an error status, then the first R GETs per
  path reset the connection after M bytes of body) and record every request in ``server.log``.
"""

from __future__ import annotations

import http.client
import io
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

FAKE_KEY_ID = "AKIDRAYLMTEST"
FAKE_SECRET = "raylm-test-secret"
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


# ---- S3 (moto) ----


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 (and every other AWS service) on 127.0.0.1, a free port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def use_s3_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str, region: str = "us-east-1") -> None:
    """Point every S3 client of this process at ``endpoint`` through the standard AWS environment variables."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_REGION", region)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probing for credentials


@contextmanager
def s3_bucket(bucket: str) -> Iterator[Any]:
    """moto's S3 server with ``bucket`` made, and this process's S3 clients pointed at it for the block (a
    module-scoped fixture's body); yields a boto3 client of the server."""
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        use_s3_endpoint(env, endpoint)
        yield make_bucket(endpoint, bucket)


def make_bucket(endpoint: str, bucket: str) -> Any:
    """Create ``bucket`` on ``endpoint`` if it does not exist; returns a boto3 S3 client for that endpoint."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=FAKE_KEY_ID,
        aws_secret_access_key=FAKE_SECRET,
    )
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    return client


def upload_dir(
    endpoint: str, local_dir: str | Path, bucket: str, prefix: str, files: list[str | Path] | None = None
) -> str:
    """Create ``bucket`` (if needed) and upload ``local_dir``'s files (all, recursively, or ``files``) under
    ``prefix``, keeping their relative paths; return ``s3://bucket/prefix``."""
    client = make_bucket(endpoint, bucket)
    root = Path(local_dir)
    chosen = [root / f for f in files] if files is not None else sorted(p for p in root.rglob("*") if p.is_file())
    for path in chosen:
        key = f"{prefix.strip('/')}/{path.relative_to(root).as_posix()}".lstrip("/")
        client.upload_file(str(path), bucket, key)
    return f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")


@contextmanager
def s3_prefix(
    monkeypatch: pytest.MonkeyPatch,
    local_dir: str | Path,
    prefix: str = "sample",
    bucket: str | None = None,
    endpoint: str | None = None,
) -> Iterator[str]:
    """``local_dir`` uploaded to a moto S3 server (a new one unless ``endpoint`` is given) with the AWS
    environment pointing at it; yields ``s3://bucket/prefix``."""
    bucket = bucket or f"raylm-{uuid.uuid4().hex[:12]}"
    with nullcontext(endpoint) if endpoint else moto_server() as ep:
        use_s3_endpoint(monkeypatch, ep)
        yield upload_dir(ep, local_dir, bucket, prefix)


# ---- HTTP ----


@dataclass
class FaultPlan:
    fail_first: int = 0  # the first K requests (any method) for each path are answered with `status`
    status: int = 503
    body: bytes = b""  # of those error responses (e.g. SLOW_DOWN for S3)
    reset_first: int = 0  # then the first R GETs for each path send `reset_after` body bytes and reset the connection
    reset_after: int = 1000
    reset_delay_s: float = 0.0  # pause between those bytes and the reset (lets the client consume them first)
    ignore_range: bool = False  # answer 200 with the whole file to Range requests, as some servers do
    only: str | None = None  # apply to paths containing this (None: every path)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class FaultyServer:
    base_url: str
    plan: FaultPlan
    log: list[Request] = field(default_factory=list)
    _seen: Counter = field(default_factory=Counter)
    _gets: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def decide(self, method: str, path: str) -> str | None:
        """'status', 'reset' or None for this request."""
        if self.plan.only is not None and self.plan.only not in path:
            return None
        with self._lock:
            self._seen[path] += 1
            if self._seen[path] <= self.plan.fail_first:
                return "status"
            if method == "GET":
                self._gets[path] += 1
                if self._gets[path] <= self.plan.reset_first:
                    return "reset"
        return None

    def record(self, handler: SimpleHTTPRequestHandler, status: int) -> None:
        path = urlsplit(handler.path).path
        with self._lock:
            self.log.append(
                Request(
                    handler.command,
                    path,
                    handler.headers.get("Range"),
                    status,
                    {k.lower(): v for k, v in handler.headers.items()},
                )
            )


def _reset(connection: socket.socket) -> None:
    """Abort the TCP connection with an RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


class _FaultyHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so clients reuse connections as they would with a real server
    state: FaultyServer

    def log_message(self, format: str, *args) -> None:
        pass

    def _path(self) -> str:
        return urlsplit(self.path).path

    def _fault(self) -> str | None:
        fault = self.state.decide(self.command, self._path())
        if fault == "status":
            body = self.state.plan.body
            self.send_response(self.state.plan.status)
            self.send_header("Content-Length", str(len(body)))
            if body:
                self.send_header("Content-Type", "application/xml")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            self.state.record(self, self.state.plan.status)
        return fault

    def _send_body(self, body: bytes, fault: str | None) -> None:
        if fault == "reset":
            self.wfile.write(body[: self.state.plan.reset_after])
            self.wfile.flush()
            time.sleep(self.state.plan.reset_delay_s)
            self.close_connection = True
            _reset(self.connection)
        else:
            self.wfile.write(body)


class _DirectoryHandler(_FaultyHandler):
    """SimpleHTTPRequestHandler plus single-range requests (``bytes=a-``, ``bytes=a-b``, ``bytes=-n``)."""

    def send_head(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.state.record(self, 404)
            return super().send_head()  # directories and 404s as http.server does them
        data = Path(path).read_bytes()
        start, end, status = 0, len(data), 200
        requested = None if self.state.plan.ignore_range else self.headers.get("Range")
        if requested:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", requested.strip())
            if m is None or not (m.group(1) or m.group(2)):
                self.send_error(400, "unsupported Range")
                return None
            if m.group(1):
                start = int(m.group(1))
                end = min(len(data), int(m.group(2)) + 1) if m.group(2) else len(data)
            else:
                start = max(0, len(data) - int(m.group(2)))
            if start >= len(data) or start >= end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                self.state.record(self, 416)
                return None
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        self.state.record(self, status)
        return io.BytesIO(data[start:end])

    def do_GET(self) -> None:
        fault = self._fault()
        if fault == "status":
            return
        body = self.send_head()
        if body is not None:
            self._send_body(body.read(), fault)

    def do_HEAD(self) -> None:
        if self._fault() == "status":
            return
        self.send_head()


class _ProxyHandler(_FaultyHandler):
    """Relays GET/HEAD to ``upstream`` (host:port), faults applied in front of it."""

    upstream: str

    def _relay(self) -> None:
        fault = self._fault()
        if fault == "status":
            return
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, headers=headers)
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server"):
                self.send_header(key, value)
        length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(body))
        self.send_header("Content-Length", length or "0")
        self.end_headers()
        self.state.record(self, response.status)
        if self.command != "HEAD":
            self._send_body(body, fault)

    do_GET = do_HEAD = _relay


@contextmanager
def _serve(handler: type[_FaultyHandler], plan: FaultPlan | None, **attrs) -> Iterator[FaultyServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    state = FaultyServer(f"http://127.0.0.1:{httpd.server_port}", plan or FaultPlan())
    httpd.RequestHandlerClass = type(handler.__name__, (handler,), {"state": state, **attrs})
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@contextmanager
def http_server(root: str | Path, plan: FaultPlan | None = None) -> Iterator[FaultyServer]:
    """Serve ``root`` on 127.0.0.1 (a free port) with Range support and ``plan``'s faults; ``.base_url``."""

    class Rooted(_DirectoryHandler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

    with _serve(Rooted, plan) as state:
        yield state


@contextmanager
def http_proxy(upstream_url: str, plan: FaultPlan | None = None) -> Iterator[FaultyServer]:
    """A faulty HTTP proxy in front of ``upstream_url`` (e.g. moto: point AWS_ENDPOINT_URL at ``.base_url``)."""
    with _serve(_ProxyHandler, plan, upstream=urlsplit(upstream_url).netloc) as state:
        yield state
