"""The step-progress watchdog on its own: it reports a rank that stops making progress, with every thread's
stack, and stays quiet while progress keeps coming. (The Ray Train restart after a hang is in
tests/test_checkpoint_ray.py.)"""

from __future__ import annotations

import threading
import time

from train.watchdog import StepWatchdog


def stuck_in_a_read(release: threading.Event) -> None:
    release.wait()


def test_a_rank_without_progress_is_reported_with_the_stacks_of_its_threads(caplog) -> None:
    hangs: list[str] = []
    fired = threading.Event()
    release = threading.Event()
    worker = threading.Thread(target=stuck_in_a_read, args=(release,), name="data-reader")
    worker.start()
    watchdog = StepWatchdog(0.5, rank=3, on_hang=lambda report: (hangs.append(report), fired.set()))
    watchdog.beat("step 41 done")
    try:
        assert fired.wait(5)
    finally:
        release.set()
        worker.join()
        watchdog.close()
    assert len(hangs) == 1
    assert hangs[0].startswith("rank 3: no training progress for ")
    assert "last progress: step 41 done" in hangs[0]
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name == "train.watchdog")
    assert "Thread data-reader" in logged and "stuck_in_a_read" in logged  # where the rank is stuck


class StepClock:
    """A clock the test moves: the watchdog measures progress against it, so a loaded machine cannot fake a hang."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def polls(watchdog: StepWatchdog, count: int = 5) -> None:
    """Wait (in real time) for a few of the watchdog's polls: its verdict on the clock as it stands."""
    time.sleep(count * max(0.05, watchdog.timeout_s / 10))


def test_beats_keep_it_quiet_and_close_stops_it() -> None:
    hangs: list[str] = []
    clock = StepClock()
    watchdog = StepWatchdog(0.4, rank=0, on_hang=hangs.append, clock=clock)
    for step in range(20):  # a step every 0.3 clock-seconds, inside the bound, for 6 s of clock time
        clock.now += 0.3
        watchdog.beat(f"step {step} done")
        polls(watchdog, 1)
    assert hangs == []
    clock.now += 0.39
    polls(watchdog)
    assert hangs == []  # just inside the bound
    watchdog.close()
    clock.now += 10.0  # far past the bound with no beats: a closed watchdog says nothing
    polls(watchdog)
    assert hangs == []


def test_no_beat_past_the_bound_fires_once_whatever_the_wall_clock() -> None:
    hangs: list[str] = []
    clock = StepClock()
    watchdog = StepWatchdog(0.4, rank=1, on_hang=hangs.append, clock=clock)
    watchdog.beat("step 7 done")
    clock.now += 0.41
    deadline = time.monotonic() + 10
    while not hangs and time.monotonic() < deadline:
        time.sleep(0.01)
    clock.now += 5.0
    polls(watchdog)
    watchdog.close()
    assert len(hangs) == 1 and "last progress: step 7 done" in hangs[0]
