"""ground.logsetup: the console the CLIs draw their report tables on keeps each row on one line where stderr is not
a terminal (`ray job logs`, CI), instead of rich's 80-column wrap."""

import subprocess
import sys

from conftest import REPO

REASONS = "record_type:request (37), record_type:warcinfo (6), record_type:resource (4)"


def test_a_report_table_row_stays_on_one_line_off_a_terminal() -> None:
    code = (
        "from rich.table import Table\n"
        "from ground.logsetup import stderr_console\n"
        "table = Table(title='pipeline report')\n"
        "for name in ('stage', 'in', 'out', 'dropped', 'rate', 's', 'top reasons'):\n"
        "    table.add_column(name)\n"
        f"table.add_row('extract', '150', '101', '49', '32.7%', '0.07', {REASONS!r})\n"
        "stderr_console().print(table)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stderr.splitlines() if "extract" in line]
    assert len(rows) == 1 and REASONS in rows[0], done.stderr
