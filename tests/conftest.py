import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SAMPLE = REPO / "data" / "sample"


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

# `make test` runs the suite on two pytest-xdist workers, each starting its own Rays. ray.init() without an address
# joins the Ray recorded in <RAY_TMPDIR>/ray/ray_current_cluster (a `ray start` or a test cluster's head): under one
# shared temp dir, a worker's local ray.init() could join the other worker's cluster. Each worker (and every Ray, job
# and subprocess it starts, which inherit this) gets a temp dir of its own.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix=f"ray-{worker}-"))

# Shared fixtures (token_dir; tiny_export, long_context_export, worse_export_dir) for every test module,
# without importing them by name into each one.
pytest_plugins = ["train_fixtures", "serve_fixtures", "no_missing_module_skips", "pytester"]


@pytest.fixture(scope="session")
def ccnet_texts() -> list[str]:
    """Real Common Crawl documents (cc_net head, English), shipped in data/sample as WET; read from the source."""
    from ccnet import load_ccnet_texts

    return load_ccnet_texts()


@pytest.fixture(autouse=True)
def _ray_marker_is_true(request: pytest.FixtureRequest):
    """The ``ray`` marker is what `make test-fast` (``-m "not ray"``) leaves out: a test that starts Ray in this
    process (itself, or through a fixture) without the marker fails, naming the marker to add."""
    yield
    if request.node.get_closest_marker("ray") is None and "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            pytest.fail(f"{request.node.nodeid} started Ray but is not marked: add pytest.mark.ray to its module")


# `make test` runs the suite on two pytest-xdist workers. A worker takes a module at a time, so that a module-scoped
# fixture (a Ray cluster, a served app, a training run) is set up once. The modules that start vLLM engines (these,
# and one test of the bench smokes) are one unit instead, run on one worker one after another: two engines starting
# together on the 2 cores each took 1.6-1.9x as long (an attempt with --dist loadfile). The other worker meanwhile
# runs the rest; an engine's start is mostly single-threaded imports in three processes. test_cluster_run.py, whose
# chain ends in one engine's start, stays outside the unit, which would otherwise hold over half of the suite's time.
VLLM_TESTS = (
    "tests/test_serve_api.py",
    "tests/test_serve_observability.py",
    "tests/test_serve_autoscaling.py",
    "tests/test_serve_node_loss.py",
    "tests/test_lm_eval_harness.py",
    "tests/test_cluster_data_path.py",
    "tests/test_bench_smoke.py::test_serve_bench_smoke",
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndEngines(LoadScopeScheduling):
        """xdist's scheduler by scope, its scopes being the modules and the engines' unit (VLLM_TESTS)."""

        def _split_scope(self, nodeid: str) -> str:
            return "vllm" if nodeid.startswith(VLLM_TESTS) else nodeid.split("::", 1)[0]

    return ModulesAndEngines(config, log)
