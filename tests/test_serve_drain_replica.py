"""An ingress replica's side of the drain (serve/drain.py, ``ReplicaDrain``) on plain asyncio, without Ray: the race of
a request's work against the deadline, what a cut or a client that leaves does to the engine's generator, and the
replica's counts as its requests' accounts (serve/accounting.py, ``RequestAccount``) change them."""

from __future__ import annotations

import asyncio

import pytest

from serve.accounting import APIError, RequestAccount
from serve.drain import ReplicaCounts, ReplicaDrain, ShutdownCut


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Engine:
    """A stream of chunks that waits for ``release`` after the first one, and records how it ended."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.ended = ""

    async def stream(self):
        try:
            yield "chunk 0"
            await self.release.wait()
            yield "chunk 1"
            self.ended = "finished"
        except asyncio.CancelledError:
            self.ended = "cancelled"
            raise
        except GeneratorExit:
            self.ended = "closed"
            raise


def test_admit_counts_in_flight_and_refuses_once_draining() -> None:
    async def scenario():
        drain = ReplicaDrain("app", "replica")

        async def receive():
            raise AssertionError("no ASGI traffic here")

        async def send(message):
            raise AssertionError("no ASGI traffic here")

        first, second, refused = (RequestAccount(receive, send, drain=drain) for _ in range(3))
        async with first, second:
            first.admit()
            second.admit()
            assert drain.counts.in_flight == 2
            drain.draining = True
            async with refused:
                with pytest.raises(APIError):
                    refused.admit()
            assert drain.counts.in_flight == 2
            second.cut = True
        return drain.counts

    assert run(scenario()) == ReplicaCounts(in_flight=0, drained=1, aborted=1, rejected=1)


def test_a_stream_runs_to_its_end_when_no_cut_comes() -> None:
    async def scenario():
        drain, engine = ReplicaDrain("app", "replica"), Engine()
        got = []
        async for chunk in drain.chunks_until_cut(engine.stream()):
            got.append(chunk)
            engine.release.set()
        return got, engine.ended

    assert run(scenario()) == (["chunk 0", "chunk 1"], "finished")


def test_the_cut_ends_a_waiting_stream_and_closes_the_engines_generator() -> None:
    async def scenario():
        drain, engine = ReplicaDrain("app", "replica"), Engine()
        got = []
        with pytest.raises(ShutdownCut):
            async for chunk in drain.chunks_until_cut(engine.stream()):
                got.append(chunk)
                drain._cut.set()  # the deadline passes while the engine holds the next chunk
        return got, engine.ended

    # The pending read was cancelled inside the engine's generator: the engine sees its request end.
    assert run(scenario()) == (["chunk 0"], "cancelled")


def test_a_client_that_leaves_cancels_the_engines_work_as_before() -> None:
    async def scenario():
        drain, engine = ReplicaDrain("app", "replica"), Engine()
        started = asyncio.Event()

        async def consume():
            async for _ in drain.chunks_until_cut(engine.stream()):
                started.set()

        consumer = asyncio.ensure_future(consume())
        await started.wait()
        consumer.cancel()  # what Starlette does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return engine.ended

    assert run(scenario()) == "cancelled"


def test_work_that_answers_before_the_cut_is_returned_and_work_past_it_is_cancelled() -> None:
    async def scenario():
        drain = ReplicaDrain("app", "replica")
        assert await drain.until_cut(asyncio.sleep(0, result="answer")) == "answer"
        slow = asyncio.Event()

        async def held():
            try:
                await asyncio.Event().wait()
            finally:
                slow.set()

        asyncio.get_running_loop().call_later(0.05, drain._cut.set)
        with pytest.raises(ShutdownCut):
            await drain.until_cut(held())
        return slow.is_set()

    assert run(scenario()) is True


def test_a_client_gone_before_its_streams_first_chunk_leaves_nothing_in_flight() -> None:
    """The request was admitted and its engine call is still waiting for the first chunk when the client disconnects:
    Starlette cancels the handler, and the account, closed on the way out, takes the request out of flight (a drain
    would otherwise wait for it until its deadline)."""

    async def scenario():
        drain, never = ReplicaDrain("app", "replica"), asyncio.Event()

        async def receive():
            raise AssertionError("no ASGI traffic here")

        async def send(message):
            raise AssertionError("no ASGI traffic here")

        async def handler():
            async with RequestAccount(receive, send, drain=drain) as account:
                account.admit()
                await account.until_cut(never.wait())  # the engine has not answered yet

        call = asyncio.ensure_future(handler())
        while drain.counts.in_flight == 0:
            await asyncio.sleep(0)
        call.cancel()  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await call
        return drain.counts

    assert run(scenario()) == ReplicaCounts(in_flight=0)
