"""A run that stops on its own verdict ends once, not ``checkpoint.max_failures`` times.

Ray Train restarts a worker group after any worker error, up to ``FailureConfig(max_failures)``, and 2.60 has no
error type it leaves alone. That is right for a lost node or a crashed process, and wrong for a verdict the run
reached itself: ``TrainingDiverged`` (the guard rails) and ``ReplicaMismatch`` recur from the last checkpoint,
deterministically, each restart only burning time. Both are reached by every rank together (they are decided on
all-reduced values), so the workers catch them and return normally, rank 0 having written the verdict into the
run dir as ``stopped.json``; ``train.launch`` then raises it on the driver as the error it was.
"""

from __future__ import annotations

import json
import logging

from ground.storage import Location
from train.guard import TrainingDiverged
from train.layout import STOPPED
from train.parallel import ReplicaMismatch

log = logging.getLogger(__name__)

StopVerdict = TrainingDiverged | ReplicaMismatch
STOP_VERDICTS = (TrainingDiverged, ReplicaMismatch)  # for `except`, which takes a tuple, not a union
_BY_NAME: dict[str, type[RuntimeError]] = {cls.__name__: cls for cls in STOP_VERDICTS}


def record_stop(run_dir: Location, verdict: StopVerdict, step: int) -> None:
    """Write the verdict into the run dir (rank 0), whole at its final name."""
    record = {"error": type(verdict).__name__, "message": str(verdict), "step": step}
    run_dir.join(STOPPED).write_json(record)
    log.error("training stopped at step %d: %s: %s", step, record["error"], record["message"])


def clear_stop(run_dir: Location) -> None:
    """Forget an earlier attempt's verdict (a run resumed with a changed config may well finish)."""
    run_dir.join(STOPPED).delete()


def raise_recorded_stop(run_dir: Location) -> None:
    """Raise the verdict the workers recorded, if they recorded one."""
    stopped = run_dir.join(STOPPED)
    if not stopped.is_file():
        return
    record = json.loads(stopped.read_text())
    raise _BY_NAME[record["error"]](record["message"])
