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


def test_beats_keep_it_quiet_and_close_stops_it() -> None:
    hangs: list[str] = []
    watchdog = StepWatchdog(0.4, rank=0, on_hang=hangs.append)
    deadline = time.monotonic() + 1.5
    step = 0
    while time.monotonic() < deadline:  # progress every 0.1 s, well inside the bound
        watchdog.beat(f"step {step} done")
        step += 1
        time.sleep(0.1)
    watchdog.close()
    time.sleep(0.8)  # past the bound with no beats: a closed watchdog says nothing
    assert hangs == []
