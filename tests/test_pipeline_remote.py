"""The pipeline reads its input from S3 (moto's server) and over HTTP from a paths listing, through servers that
fail the first requests and reset connections, and produces the same documents and shards as a local run."""

import gzip
import json
import shutil
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import ray
from conftest import REPO, SAMPLE
from remote_servers import FaultPlan, http_server, moto_server, upload_dir, use_s3_endpoint

from pipeline.config import load_config
from pipeline.executor import run_pipeline

pytestmark = pytest.mark.ray  # starts Ray (in this process or in the CLIs it runs)

DEMO_CONFIG = REPO / "pipeline" / "configs" / "demo.yaml"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server; the AWS variables are set before Ray starts so its workers inherit them."""
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        use_s3_endpoint(env, endpoint)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield endpoint
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def config():
    config = load_config(DEMO_CONFIG)
    config.input.retry.initial_backoff_s = 0.02  # keep the retried runs fast
    return config


@pytest.fixture(scope="module")
def local_run(s3_endpoint, config, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    run_pipeline(str(SAMPLE), out, config)
    return out


def same_output(remote: Path, local: Path) -> None:
    """Same shards, tokenizer and documents; only the sources' names differ."""
    first, second = (json.loads((d / "manifest.json").read_text()) for d in (remote, local))
    assert first["shards"] == second["shards"] and first["tokenizer"] == second["tokenizer"]
    assert [(s["sha256"], s["bytes"], s["records"]) for s in first["sources"]] == [
        (s["sha256"], s["bytes"], s["records"]) for s in second["sources"]
    ]
    for shard in first["shards"]:
        assert (remote / shard["path"]).read_bytes() == (local / shard["path"]).read_bytes()
    for folder in ("documents", "rejected"):
        a, b = (pads.dataset(d / folder, format="parquet").to_table().drop_columns(["source"]) for d in (remote, local))
        assert a.equals(b), folder


def test_s3_prefix_gives_the_local_run(s3_endpoint, config, local_run, tmp_path):
    uri = upload_dir(s3_endpoint, SAMPLE, "crawl", "CC-MAIN-sample/segments")
    out = tmp_path / "out"
    report = run_pipeline(uri, out, config)
    same_output(out, local_run)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(s["path"].startswith(f"{uri}/") for s in manifest["sources"])
    assert report["input"]["read_retries"] == 0


def test_http_paths_listing_with_503s_and_resets_gives_the_local_run(s3_endpoint, config, local_run, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(SAMPLE, served / "crawl")
    names = sorted(p.name for p in SAMPLE.iterdir())
    with gzip.open(served / "wet.paths.gz", "wt") as listing:
        listing.write("".join(f"crawl/{n}\n" for n in names))
    plan = FaultPlan(fail_first=2, status=503, reset_first=1, reset_after=4000, reset_delay_s=0.2, only="/crawl/")
    with http_server(served, plan) as server:
        out = tmp_path / "out"
        report = run_pipeline(
            None, out, config, input_list=f"{server.base_url}/wet.paths.gz", base_url=f"{server.base_url}/"
        )
    same_output(out, local_run)
    assert report["input"]["read_retries"] >= 2 * len(names)  # every file failed twice before it was read
    assert {r.status for r in server.log} >= {503, 206}  # retried reads resumed with Range requests
