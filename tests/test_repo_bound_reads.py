"""A test that reads beside the checkout fails the run; one that reads inside it passes (tests/repo_bound_reads.py)."""

import pytest

READS = """
from pathlib import Path

def test_reads(request):
    root = Path(request.config.rootpath)
    print((root / {inside!r}).read_text())
"""


@pytest.mark.parametrize(("where", "passes"), [("inside.txt", True), ("../beside/data.txt", False)])
def test_a_read_beside_the_checkout_fails_the_run(pytester: pytest.Pytester, where: str, passes: bool) -> None:
    (pytester.path / "inside.txt").write_text("bundled")
    beside = pytester.path.parent / "beside"
    beside.mkdir(exist_ok=True)
    (beside / "data.txt").write_text("not bundled")
    pytester.makepyfile(test_reader=READS.format(inside=where))
    # Without the plugin the read succeeds either way: the test itself passes.
    assert pytester.runpytest("-p", "no:repo_bound_reads").ret == 0
    result = pytester.runpytest("-p", "repo_bound_reads")
    assert result.parseoutcomes().get("passed") == 1
    if passes:
        assert result.ret == 0
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*paths outside the repository*", f"*{beside / 'data.txt'}*test_reader.py*"])
