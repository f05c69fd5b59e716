"""Spawned processes that form a gloo group on loopback: the tests' stand-in for a multi-rank job."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

from ground.dist import free_port


def run_gloo_ranks(worker: Callable[..., None], world: int, *args: object, timeout_s: float = 300) -> list:
    """``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes; returns what each put on the
    queue (once each), in the order they put it.

    The results are read before the processes are joined: a child that has put on a queue does not exit until its
    item is flushed to the pipe, so joining first can wait on a reader that never comes. A rank that reported but
    then fails to exit within a minute is terminated: its result is what the test checks, its teardown is not."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=timeout_s) for _ in range(world)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return results
