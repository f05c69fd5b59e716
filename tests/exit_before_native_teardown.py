"""A pytest plugin: once pytest is done, a process that loaded Ray's core worker exits without the interpreter's own
teardown.

The suite starts and stops many Ray sessions in its one process (local ``ray.init``, drivers of multi-node clusters).
Ray's core worker leaves native state behind after ``ray.shutdown()``: the driver's C++ log stays open
(ray-project/ray#20991), and the interpreter's teardown (Ray's own ``atexit`` hook, module teardown, C++ static
destructors) can run into what is left. CI saw it once (stop 44): "692 passed", then ``[ray_log_sink] Failed
writing to file .../python-core-driver-..._PID.log: Bad file descriptor`` and a segmentation fault, which failed the
run.

The verdict is pytest's exit status, final once pytest returns. This registers, last, an ``atexit`` hook, which
therefore runs first: it flushes Python's streams and ends the process with that status, before any teardown that
could crash. Everything pytest does (summary, reports, junit XML, cache) has run by then.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

import pytest


class _ExitWithTheVerdict:
    def __init__(self) -> None:
        self.session: pytest.Session | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        # Only where Ray's native library is loaded: other processes keep the interpreter's normal exit.
        if self.session is not None and "ray._raylet" in sys.modules:
            atexit.register(self._exit, int(self.session.exitstatus))

    @staticmethod
    def _exit(status: int) -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_ExitWithTheVerdict(), "exit_before_native_teardown_verdict")
