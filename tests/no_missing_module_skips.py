"""A pytest plugin: a test skipped because a module is missing fails instead.

``pytest.importorskip`` turns a missing dependency into a skip, which CI would report as a pass with a footnote.
Every test dependency is declared (pyproject.toml's ``dev`` and ``bench`` extras, installed by ``make env``), so a
missing module is a broken environment, and the run must say so.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

MISSING_MODULE = "could not import"  # the start of pytest.importorskip's skip reason


def _missing_module(report: pytest.TestReport | pytest.CollectReport) -> bool:
    return report.skipped and MISSING_MODULE in str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if _missing_module(report):
        report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()
    if _missing_module(report):  # a module-level importorskip skips the whole file at collection
        report.outcome = "failed"
