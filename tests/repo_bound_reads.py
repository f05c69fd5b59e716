"""A pytest plugin: the suite fails if a test opens or lists anything in a folder beside the checkout.

A clone must test with nothing beside it: every file a test reads is bundled in the repository (``data/``, with its
sources and licenses in data/README.md). A path like ``../shared/data`` works on a developer's machine that happens
to hold that folder and fails at collection in a fresh clone, so this watches the whole run for it.

It listens to Python's audit events for opening a file and listing a folder (``open``, ``os.listdir``,
``os.scandir``) in the pytest process, and records every path in a folder that stood beside the checkout when the
session started (``../shared``, say), unless it is where the run writes on its own: the interpreter's prefix,
pytest's temporary folders, Ray's (``/tmp/ray``), or a hidden folder (tool caches such as ``~/.cache`` when the
checkout sits in a home folder). Folders that appear during the run are the run's own (a checkout in ``/tmp`` sees
its tests' temporary folders appear beside it), and a checkout right in the system's temporary folder has only
scratch beside it, so nothing is watched there. At the end of the session, each such path is listed with the test
that touched it, and the run fails. Processes the tests start (Ray workers, CLIs) are not watched; what they read
comes from the paths the tests hand them, which are.
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest

WATCHED_EVENTS = frozenset({"open", "os.listdir", "os.scandir"})


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


class RepoBoundReads:
    def __init__(self, root: Path, allowed: list[Path]) -> None:
        self.root = os.path.realpath(root)
        self.parent = os.path.dirname(self.root)
        # A folder that holds the checkout itself cannot be the run's own: it would hold what stands beside it too.
        self.allowed = [f for f in map(os.path.realpath, allowed) if not _under(self.root, f)]
        # What stood beside the checkout before the run: the folders a test must not read. A checkout right in the
        # system's temporary folder has only other processes' scratch beside it (compiler caches, earlier runs'
        # folders, which the libraries the tests use read on their own), no data folder, so nothing is watched there.
        scratch = self.parent == os.path.realpath(tempfile.gettempdir())
        self.beside = {
            name
            for name in ([] if scratch else os.listdir(self.parent))
            if not name.startswith(".") and os.path.join(self.parent, name) != self.root
        }
        self.current_test = "(collection)"
        self.active = True
        self.outside: dict[str, str] = {}  # path -> the first test that touched it

    def audit(self, event: str, args: tuple) -> None:
        if not self.active or event not in WATCHED_EVENTS or not args:
            return
        target = args[0]
        if not isinstance(target, str | bytes | os.PathLike):
            return  # a file descriptor, or None for the current folder
        path = os.path.abspath(os.fsdecode(target))
        if not _under(path, self.parent) or _under(path, self.root):
            return
        path = os.path.realpath(path)
        if not _under(path, self.parent) or _under(path, self.root):
            return
        if os.path.relpath(path, self.parent).split(os.sep, 1)[0] not in self.beside:
            return
        if any(_under(path, folder) for folder in self.allowed):
            return
        self.outside.setdefault(path, self.current_test)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.current_test = nodeid

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.outside and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after --durations' list: a CI log's tail then shows why the run failed
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.outside:
            return
        terminalreporter.section("paths outside the repository", red=True)
        terminalreporter.write_line(f"the tests read beside the checkout ({self.root}); bundle what they need in data/")
        for path, test in sorted(self.outside.items()):
            terminalreporter.write_line(f"{path}  (first by {test})")


def pytest_configure(config: pytest.Config) -> None:
    system_tmp = Path(tempfile.gettempdir())
    # The run's own places: the interpreter, pytest's temporary folders (a given --basetemp, as pytester's inner runs
    # have, or the default's root), and Ray's temporary folder.
    allowed = [
        Path(sys.prefix),
        Path(sys.base_prefix),
        system_tmp / f"pytest-of-{getpass.getuser()}",
        system_tmp / "ray",
    ]
    if config.option.basetemp:
        allowed.append(Path(config.option.basetemp))
    watcher = RepoBoundReads(config.rootpath, allowed)
    # An audit hook cannot be removed: after this session (a pytester run inside the suite) it stays, inert.
    sys.addaudithook(watcher.audit)
    config.pluginmanager.register(watcher, "repo_bound_reads_watcher")
    config.add_cleanup(lambda: setattr(watcher, "active", False))
