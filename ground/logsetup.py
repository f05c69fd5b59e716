"""One logging set-up for every entry point (the CLIs, and each Ray Train worker).

Modules log through ``logging.getLogger(__name__)`` and never configure logging themselves; each
``main()`` calls ``setup_logging()`` once. Records go to stderr (stdout stays free for a command's
output, e.g. ``--json``): through rich's handler on a terminal, as plain lines in the one format below
otherwise (files, CI, and Ray workers, whose stderr Ray forwards to the driver).

The handler sits on our packages' loggers, not on the root logger: Ray and other libraries configure
their own loggers and many of them also propagate to the root, so a root handler would print their
records a second time. Our records still propagate, so pytest's log capture sees them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PACKAGES = ("train", "checkpoints", "serve", "cluster", "pipeline", "ground")
# Where there is no terminal (ray job logs, CI), a long job logs a progress line this often (pipeline, train).
PROGRESS_LOG_EVERY_S = 30.0
_MARK = "_raylm_handler"  # set on our handler, so a second call does not add another


# Columns of a console that is not a terminal: rich would wrap a report table at 80 in `ray job logs` and CI.
LOG_COLUMNS = 160


def stderr_console() -> Console:
    """The rich console on stderr every CLI draws its progress and report tables on: the terminal's width in a
    terminal, ``LOG_COLUMNS`` elsewhere (a job's log, CI), so that a table's row stays one line."""
    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else LOG_COLUMNS)


def _handler(console: Console | None) -> logging.Handler:
    handler: logging.Handler
    if console.is_terminal if console is not None else sys.stderr.isatty():
        from rich.logging import RichHandler  # imported only for terminals; it renders time and level itself

        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
    setattr(handler, _MARK, True)
    return handler


def setup_logging(level: int = logging.INFO, propagate: bool = True, console: Console | None = None) -> None:
    """Log our packages' records at ``level`` and above to stderr (idempotent: once per process).

    ``propagate=False`` where the root logger already writes to the same stream: Ray worker processes
    install a root handler, and every record would reach the driver twice. ``console``: the rich console a
    live progress bar draws on, so that log lines print above the bar instead of through it."""
    handler = None
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        if not any(getattr(h, _MARK, False) for h in logger.handlers):
            handler = handler or _handler(console)  # one handler object shared by the packages
            logger.addHandler(handler)


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """The root logger's handlers and level as they were, once the block ends: around an import of a library that
    replaces them (``ray.serve.llm`` installs a JSON stream handler on the root logger when imported, and every
    record of this process would print a second time, as JSON, after our packages' own line)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
