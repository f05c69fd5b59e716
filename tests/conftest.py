import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # every file a test reads lives in the repository (data/README.md: sources, licenses)
SAMPLE = DATA / "sample"


def sample_copies(folder: Path, copies: int = 2) -> Path:
    """``folder`` filled with the sample ``copies`` times (``0-NAME``, ``1-NAME``, ...): enough input files that a
    run can be caught part-way through a pass."""
    folder.mkdir(parents=True, exist_ok=True)
    for copy in range(copies):
        for f in sorted(SAMPLE.iterdir()):
            (folder / f"{copy}-{f.name}").write_bytes(f.read_bytes())
    return folder


sys.path.insert(0, str(Path(__file__).parent))  # tests/wet_builder.py and other test helpers

# Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default), and a run's
# start, each checkpoint report and its end wait for a poll: seconds of idling per launch, which the suite pays
# dozens of times. Every Ray the suite starts (in this process, by `ray start`, a job's driver) inherits it from
# here. Measured: tests/test_train_distributed.py (two launches) 47 s with the default, 33 s with 0.2 s.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

# Shared fixtures (token_dir; tiny_export, long_context_export, worse_export_dir) for every test module, without
# importing them by name into each one; and the suite's plugins: a skip for a missing module fails the run, so does a
# read beside the checkout, every module's time at the end, and an exit past Ray's native teardown (each module
# says why).
pytest_plugins = [
    "train_fixtures",
    "serve_fixtures",
    "no_missing_module_skips",
    "repo_bound_reads",
    "module_durations",
    "exit_before_native_teardown",
    "pytester",
]


@pytest.fixture(scope="session")
def ccnet_texts() -> list[str]:
    """Real Common Crawl documents (cc_net head, English), shipped in data/sample as WET; read from the source."""
    from ccnet import load_ccnet_texts

    return load_ccnet_texts()


@pytest.fixture(autouse=True)
def _ray_marker_is_true(request: pytest.FixtureRequest):
    """The ``ray`` marker is one of the two that `make test-fast` (``-m "not ray and not slow"``) leaves out: a test
    that starts Ray in this process (itself, or through a fixture) without the marker fails, naming the marker."""
    yield
    if request.node.get_closest_marker("ray") is None and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            pytest.fail(f"{request.node.nodeid} started Ray but is not marked: add pytest.mark.ray to its module")


@pytest.fixture(scope="session")
def multinode(tmp_path_factory: pytest.TempPathFactory):
    """One multi-node cluster (tests/multinode.py) for every module that uses one: starting a head with the Jobs API,
    its workers and moto costs each module tens of seconds, and each module takes it whole (``module_cluster``)."""
    from multinode import multinode_cluster

    with multinode_cluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared multi-node cluster run last and together (in their modules' order), so that its driver
    connection never meets a module's own local Ray, and the cluster stops when the session does."""
    items.sort(key=lambda item: "multinode" in getattr(item, "fixturenames", ()))
