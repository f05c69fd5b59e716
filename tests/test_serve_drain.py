"""Draining (serve/drain.py) on the real app: vLLM through Ray Serve LLM under raylm's ingress, on a local Ray.

The engine is wrapped so that a stream holds after its first event until the test lets it go (a file appears), which
makes "in flight when the drain begins" an event the test controls rather than a race with the clock. Three streams
are open when ``drain()`` starts: two the test then lets finish, one it never does, which the deadline must cut.
``python -m serve`` itself (the signal, the exit code, no processes left) is tested in test_serve_smoke_cli.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from multinode import wait_for
from serve_fixtures import one_replica_args, running_app

from serve.app import compose_app
from serve.drain import RETRY_AFTER_S, drain, remove_control
from serve.engine import ExportServer
from serve.ingress import RayLMIngress

pytestmark = pytest.mark.ray

RELEASED_SEED, HELD_SEED = 101, 202  # streams the test lets finish, and the one it never does
TIMEOUT_S = 10.0  # the drain's deadline: far longer than the test's checks between drain start and release


def build_gated(gate: Path):
    """build_app's application with the engine holding each seeded stream after its first chunk until ``gate`` /
    ``<seed>`` exists. Defined inside the builder: cloudpickle sends local classes by value."""
    import asyncio

    class GatedEngine(ExportServer):
        async def completions(self, request, raw_request_info=None):
            stream = await super().completions(request, raw_request_info)
            if request.seed not in (RELEASED_SEED, HELD_SEED):
                return stream

            async def held():
                first = True
                async for item in stream:
                    if not first:
                        yield item
                        continue
                    # An item is a batch of SSE events (Ray Serve LLM's stream batching, a list): on a slow machine
                    # the first batch held all eight tokens and [DONE], and the client was done before the hold. Only
                    # its first event goes out before the gate.
                    yield item[:1]
                    while not (gate / str(request.seed)).exists():
                        await asyncio.sleep(0.05)
                    first = False
                    if item[1:]:
                        yield item[1:]

            return held()

    def build(args: dict):
        return compose_app(args, GatedEngine, RayLMIngress)

    return build


@pytest.fixture(scope="module")
def gated_app(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    gate = tmp_path_factory.mktemp("gate")
    args = one_replica_args(tiny_export, tmp_path_factory.mktemp("sd"))
    with running_app(args, build=build_gated(gate)) as base:
        try:
            yield base, gate
        finally:
            remove_control("raylm")


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def open_stream(base: str, model: str, seed: int, first_chunk: threading.Event) -> tuple[list, Exception | None]:
    """A streamed completion through the openai SDK; sets ``first_chunk`` once its first chunk is in. Returns the
    chunks and the error the SDK raised (an SSE error event), if any."""
    chunks: list = []
    try:
        stream = sdk(base).completions.create(
            model=model, prompt="The library", max_tokens=8, stream=True, seed=seed, extra_body={"ignore_eos": True}
        )
        for chunk in stream:
            chunks.append(chunk)
            first_chunk.set()
    except openai.APIError as exc:
        return chunks, exc
    return chunks, None


def test_drain_finishes_the_streams_in_flight_refuses_new_ones_and_cuts_at_the_deadline(
    gated_app, tiny_export: Path
) -> None:
    base, gate = gated_app
    model = tiny_export.name
    seeds = (RELEASED_SEED, RELEASED_SEED, HELD_SEED)
    started = [threading.Event() for _ in seeds]
    with ThreadPoolExecutor(len(seeds) + 1) as pool:
        streams = [
            pool.submit(open_stream, base, model, seed, event) for seed, event in zip(seeds, started, strict=True)
        ]
        for event in started:
            assert event.wait(60), "a stream never sent its first chunk"
        assert requests.get(f"{base}/health", timeout=30).status_code == 200  # serving, three streams held
        drained = pool.submit(drain, "raylm", TIMEOUT_S)

        # While draining: /health says so at once (a load balancer stops routing), a new request gets 503 + Retry-After.
        def draining_health() -> dict | None:  # the body of a 503 (a Response is falsy when not ok)
            health = requests.get(f"{base}/health", timeout=30)
            return health.json() if health.status_code == 503 else None

        assert wait_for(draining_health, 30, "/health to answer 503")["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as refused:
            sdk(base).completions.create(model=model, prompt="The library", max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "server_shutting_down"
        assert refused.value.response.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert not drained.done()  # three requests are still in flight

        (gate / str(RELEASED_SEED)).touch()  # the two released streams run to their end
        for stream in streams[:2]:
            chunks, error = stream.result(timeout=60)
            assert error is None and chunks[-1].choices[0].finish_reason == "length", (chunks, error)  # all 8 tokens
        assert not drained.done()  # the held one is still in flight until the deadline

        # Cut at the deadline: the SDK reads the stream's error event and raises it (not a hang, not a silent end).
        chunks, error = streams[2].result(timeout=TIMEOUT_S + 60)
        assert len(chunks) >= 1 and isinstance(error, openai.APIError), (chunks, error)
        assert error.code == "server_shutting_down" and "shutdown timeout" in error.message, error
        result = drained.result(timeout=60)
    assert (result.drained, result.aborted, result.rejected) == (2, 1, 1), result
    assert result.seconds >= TIMEOUT_S and result.unreported == 0 and result.replicas == 1
    assert result.line().startswith("drained 2, aborted 1, in ")
