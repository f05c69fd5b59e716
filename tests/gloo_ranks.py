"""Spawned processes that form a gloo group on loopback: the tests' stand-in for a multi-rank job."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ground.dist import DistContext, free_port


class FlushedQueue:
    """What a rank's worker reports through: ``put`` returns once the item is in the pipe.

    A ``multiprocessing.Queue.put`` only hands the item to a feeder thread. A worker that then tears down its
    process group (``dist.destroy_process_group`` is a C++ call that can block holding the GIL) may never let
    that thread run, and its result never arrives although the worker finished."""

    def __init__(self, queue: mp.Queue) -> None:
        self.queue = queue

    def put(self, item: Any) -> None:
        self.queue.put(item)
        self.queue.close()
        self.queue.join_thread()


@contextlib.contextmanager
def cpu_rank(rank: int, world: int, port: int) -> Iterator[DistContext]:
    """In a spawned worker: join the gloo group on loopback as ``rank`` with one torch thread, yield the rank's
    ``DistContext`` on CPU, and leave the group after."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield DistContext(rank, world, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _rank_main(worker: Callable[..., None], rank: int, world: int, port: int, args: tuple, queue: mp.Queue,
               dump_after_s: float) -> None:  # fmt: skip
    # A rank still running near the parent's deadline prints every thread's stack to the test's stderr, so a
    # hang names where it is instead of only timing out.
    faulthandler.dump_traceback_later(dump_after_s, exit=False, file=sys.stderr)
    worker(rank, world, port, *args, FlushedQueue(queue))


def run_gloo_ranks(worker: Callable[..., None], world: int, *args: object, timeout_s: float = 300) -> list:
    """``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes; returns what each put on the
    queue (once each), in the order they put it.

    The results are read before the processes are joined: a child that has put on a queue does not exit until its
    item is flushed to the pipe, so joining first can wait on a reader that never comes. A rank that reported but
    then fails to exit within a minute is terminated: its result is what the test checks, its teardown is not."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(worker, rank, world, port, args, queue, max(1.0, timeout_s - 15)))
        for rank in range(world)
    ]
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
