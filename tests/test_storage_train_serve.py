"""Training, export and serving with object storage as the system of record: a moto S3 server on loopback is the
only storage the stages share, as on a cluster without a shared filesystem.

One local Ray (2 CPUs) and one moto server for the module. The AWS variables and ``RAYLM_CACHE_DIR`` (the node's
cache: this machine is the one node) are set before Ray starts, so every worker and replica inherits them; the
driver works in an empty directory that must stay empty. Two runs (DDP-2, 8 steps, the tiny model, dropout 0.1),
started once:

- ``local``: data and run dir on local paths, the reference.
- ``bucket``: the same run with ``--data s3://… --output s3://…``, with rank 0 SIGKILLed after step 5 (no
  restarts, so the run fails); then everything on this node is wiped (the cache, rank 0's working dir: the
  cluster is gone), and ``python -m train … --resume`` (the CLI's ``main`` in this process, a new driver)
  continues from what the bucket holds. It must end bitwise where the local run ends. After the crash, a fresh run
  into the same run dir is refused (it needs --resume); after the resume, the checkpoints CLI verifies and inspects
  the checkpoints there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch
from ray.train import WorkerGroupError
from remote_servers import make_bucket, moto_server, upload_dir, use_s3_endpoint
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from step_callbacks import KillOnce
from train_fixtures import tiny_overrides

from checkpoints.manifest import checkpoint_names
from ground.cache import CACHE_ENV, CorruptDownload
from ground.storage import Location
from serve.__main__ import main as serve_main
from serve.model_dir import ModelDirError, hf_model_dir, local_export
from train.__main__ import main as train_main
from train.config import load_config
from train.export import export
from train.export import main as export_main
from train.launch import launch
from train.layout import FINAL_DIR, FINAL_INFO, FINAL_MODEL, FINAL_PROBE
from train.metrics import read_metrics
from train.parallel import DistContext
from train.preflight import PreflightError, check_data
from train.trainer import Trainer

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
BUCKET = "raylm-storage"
STEPS = 8
REPO = Path(__file__).resolve().parents[1]
# One 32-wide head: the model is served by vLLM, whose CPU attention has kernels for head sizes from 32 up. Dropout:
# every rank's RNG stream must resume from the bucket too.
DDP2 = {"parallel.strategy": "ddp", "parallel.workers": 2, "checkpoint.interval_steps": 4, "model.n_head": 1,
        "model.dropout": 0.1}  # fmt: skip


@dataclass
class Cluster:
    endpoint: str
    client: object  # boto3's S3 client, for what a test does to the bucket behind the stack's back
    cache: Path  # RAYLM_CACHE_DIR of every process on this node
    workdir: Path  # the driver's working directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir, cache = tmp_path_factory.mktemp("driver-cwd"), tmp_path_factory.mktemp("node-cache")
    with moto_server() as endpoint, pytest.MonkeyPatch.context() as env:
        use_s3_endpoint(env, endpoint)
        env.setenv(CACHE_ENV, str(cache))
        client = make_bucket(endpoint, BUCKET)
        ray.init(num_cpus=2, include_dashboard=False)
        # After Ray starts: its workers put the driver's directory at the start (the checkout) on their path.
        env.chdir(workdir)
        try:
            yield Cluster(endpoint, client, cache, workdir)
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def data_uri(cluster: Cluster, token_dir: Path) -> str:
    return upload_dir(cluster.endpoint, token_dir, BUCKET, "data")


def config_for(data: str | Path, out: str | Path, **extra: object):
    return load_config(None, tiny_overrides(data, out, steps=STEPS) | DDP2 | extra)


def cli_args(data: str, out: str) -> list[str]:
    """``python -m train`` arguments for ``config_for``'s run."""
    settings = tiny_overrides(data, out, steps=STEPS) | DDP2
    flags = {"data_dir": "--data", "output_dir": "--output", "steps": "--steps"}
    args = [item for key, flag in flags.items() for item in (flag, str(settings.pop(key)))]
    return args + [f"--set={key}={value}" for key, value in settings.items()]


def cached_downloads(uri: str) -> int:
    """How many times a worker on this node downloaded ``uri`` into the cache: ``ground.cache`` logs each download,
    and Ray keeps each worker's stderr in its session's log dir (found through the driver's node: other Ray
    instances may run on this machine, so not ``/tmp/ray/session_latest``)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    line = f"cached {uri} ("
    return sum(path.read_text(errors="replace").count(line) for path in logs.glob("worker-*.err"))


@dataclass
class Runs:
    local: Path
    bucket: str
    train_shard_downloads: int  # by the bucket run's two ranks before the crash


@pytest.fixture(scope="module")
def runs(cluster: Cluster, data_uri: str, token_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    local = tmp_path_factory.mktemp("local") / "run"
    launch(config_for(token_dir, local))

    bucket = f"s3://{BUCKET}/runs/run"
    with pytest.raises(WorkerGroupError):  # no restarts allowed: the run fails
        launch(config_for(data_uri, bucket, **{"checkpoint.max_failures": 0}), on_step_end=KillOnce(step=5, rank=0))
    downloads = cached_downloads(f"{data_uri}/tokens/train-00000.bin")
    # A fresh run into a run dir whose bucket holds checkpoints must not silently continue it.
    with pytest.raises(PreflightError, match=rf"{bucket} already holds checkpoints .*: pass --resume"):
        launch(config_for(data_uri, bucket))
    for entry in cluster.cache.iterdir():  # the node is gone: its cache and rank 0's working dir with it
        shutil.rmtree(entry)
    assert train_main([*cli_args(data_uri, bucket), "--resume"]) == 0
    return Runs(local, bucket, downloads)


def objects(uri: str) -> dict[str, bytes]:
    location = Location(uri)
    return {name: location.join(name).read_bytes() for name in location.files()}


def assert_same_weights(stored: bytes, local: Path) -> None:
    """The safetensors bytes ``stored`` hold bitwise the tensors of the local file."""
    got, expected = load_safetensors(stored), load_file(str(local))
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_a_run_on_the_bucket_resumed_from_the_bucket_alone_trains_exactly_the_run_on_local_paths(runs: Runs) -> None:
    stored = objects(runs.bucket)
    assert_same_weights(stored[f"{FINAL_DIR}/{FINAL_MODEL}"], runs.local / FINAL_DIR / FINAL_MODEL)
    # The records before the restored checkpoint came back from the bucket; one record per step, as uninterrupted.
    assert [(r["step"], r["loss"]) for r in read_metrics(runs.bucket)] == [
        (r["step"], r["loss"]) for r in read_metrics(runs.local)
    ]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "loss_curve.png", f"{FINAL_DIR}/{FINAL_PROBE}"):
        assert name in stored, name
    assert json.loads(stored["summary.json"])["steps"] == STEPS
    # final.json is the manifest of final/: the other files with their sha256, as they are in the bucket.
    info = json.loads(stored[f"{FINAL_DIR}/{FINAL_INFO}"])
    for name, entry in info["files"].items():
        assert hashlib.sha256(stored[f"{FINAL_DIR}/{name}"]).hexdigest() == entry["sha256"], name
    assert [r["step"] for r in info["resumed_from"]] == [4]
    # Checkpoints went to Ray Train's storage, which is the run dir in the bucket; preflight's write probe is gone.
    assert checkpoint_names(runs.bucket)
    assert not [name for name in stored if ".raylm-storage-probe" in name]


def test_the_checkpoints_cli_verifies_and_inspects_checkpoints_in_the_bucket(runs: Runs, cluster: Cluster) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        # The AWS variables pointing at moto are in this process's environment (the cluster fixture).
        return subprocess.run([sys.executable, "-m", "checkpoints", *args], capture_output=True, text=True, cwd=REPO)

    verified = cli("verify", runs.bucket)
    assert verified.returncode == 0, verified.stderr
    assert f"OK   {runs.bucket}/checkpoint_step_000000008: step 8" in verified.stdout
    step4 = f"{runs.bucket}/checkpoint_step_000000004"
    inspected = cli("inspect", "--json", step4)
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert info["manifest"]["step"] == 4 and any(e["key"].startswith("model.") for e in info["entries"])

    # One flipped byte in a stored shard: verify streams it, finds it and names the file.
    shard = Location(step4).join("__1_0.distcp")
    honest = shard.read_bytes()
    flipped = bytearray(honest)
    flipped[len(flipped) // 2] ^= 0xFF
    key = shard.uri.removeprefix(f"s3://{BUCKET}/")
    cluster.client.put_object(Bucket=BUCKET, Key=key, Body=bytes(flipped))
    try:
        failed = cli("verify", step4)
    finally:
        cluster.client.put_object(Bucket=BUCKET, Key=key, Body=honest)
    assert failed.returncode == 1
    assert "sha256 does not match the manifest (file: __1_0.distcp)" in failed.stderr


def test_each_shard_is_downloaded_once_per_node_and_cached_once(runs: Runs, cluster: Cluster, token_dir: Path) -> None:
    assert runs.train_shard_downloads == 1  # two ranks on this node, one download
    manifest = json.loads((token_dir / "manifest.json").read_text())
    for shard in manifest["shards"]:
        entry = cluster.cache / "sha256" / shard["sha256"]
        # Beside the file: its download lock and its hold file (ground/cache.py), empty.
        assert [p.name for p in entry.iterdir() if p.suffix not in {".lock", ".hold"}] == [Path(shard["path"]).name]
        assert hashlib.sha256((entry / Path(shard["path"]).name).read_bytes()).hexdigest() == shard["sha256"]
    assert not [p for p in cluster.cache.rglob("*") if ".tmp-" in p.name]


def test_a_lazily_fetched_shard_that_changed_in_the_bucket_is_refused(
    cluster: Cluster, token_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh-cache"))  # this process only: a node that has nothing yet
    data = upload_dir(cluster.endpoint, token_dir, BUCKET, "corrupt")
    val = Location(f"{data}/tokens/val-00000.bin")
    flipped = bytearray(val.read_bytes())
    flipped[100] ^= 0x01
    cluster.client.put_object(Bucket=BUCKET, Key="corrupt/tokens/val-00000.bin", Body=bytes(flipped))

    config = load_config(None, tiny_overrides(data, tmp_path / "run", **{"checkpoint.enabled": False}))
    check_data(config)  # the size in the listing is right: only the bytes are not
    trainer = Trainer.from_config(config, DistContext(rank=0, world_size=1, device=torch.device("cpu")))
    try:
        shards = tmp_path / "fresh-cache" / "sha256"
        cached = lambda: sorted(p.name for p in shards.glob("*/*.bin"))  # noqa: E731
        assert cached() == []  # nothing fetched before the first read
        trainer.train_step()
        assert cached() == ["train-00000.bin"]  # the val shard waits for the first evaluation
        with pytest.raises(CorruptDownload, match=rf"{val.uri}: sha256 \w+ of the bytes fetched, the manifest says"):
            trainer.evaluate()
        assert cached() == ["train-00000.bin"]
    finally:
        trainer.close()


def test_preflight_names_the_uri_of_what_is_wrong(
    cluster: Cluster, data_uri: str, token_dir: Path, tmp_path: Path
) -> None:
    def refused(data: str, match: str, output: str | Path = tmp_path / "run") -> None:
        with pytest.raises(PreflightError, match=match):
            launch(config_for(data, output))

    refused(f"s3://{BUCKET}/nothing-here", rf"data dir s3://{BUCKET}/nothing-here does not exist")
    refused("s3://no-such-bucket/data", r"data dir s3://no-such-bucket/data does not exist: no bucket no-such-bucket")
    upload_dir(cluster.endpoint, token_dir, BUCKET, "no-manifest", files=["tokenizer.json"])
    refused(f"s3://{BUCKET}/no-manifest", rf"s3://{BUCKET}/no-manifest has no manifest\.json")
    upload_dir(
        cluster.endpoint,
        token_dir,
        BUCKET,
        "no-val",
        files=["manifest.json", "tokenizer.json", "tokens/train-00000.bin"],
    )
    refused(
        f"s3://{BUCKET}/no-val",
        rf"s3://{BUCKET}/no-val/manifest\.json: shard tokens/val-00000\.bin is listed "
        "but missing",
    )
    refused(
        data_uri,
        r"run dir s3://no-such-bucket/runs/x is not writable: .*no-such-bucket",
        output="s3://no-such-bucket/runs/x",
    )


@pytest.mark.parametrize("scheme", ["ftp", "hdfs"])
def test_unsupported_schemes_are_refused_not_taken_for_local_paths(
    scheme: str, data_uri: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    uri = f"{scheme}://host/runs/x"
    assert train_main(["--data", data_uri, "--output", uri, "--steps", "2"]) == 2
    assert train_main(["--data", uri, "--output", str(tmp_path / "run"), "--steps", "2"]) == 2
    assert export_main(["--run", uri]) == 2
    assert export_main(["--run", str(tmp_path), "--output", uri]) == 2
    assert serve_main(["--model", uri]) == 2
    errors = capsys.readouterr().err.splitlines()  # nothing else: no import-time notes from vLLM either
    assert len(errors) == 5 and all(f"{uri}: unsupported scheme '{scheme}'" in line for line in errors), errors


@pytest.fixture(scope="module")
def exports(runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | Path]:
    local = tmp_path_factory.mktemp("exports")
    out = {"local": local / "model", "local-hf": local / "model-hf"}
    export(runs.local, out["local"])
    export(runs.local, out["local-hf"], "hf")
    out["bucket"], out["bucket-hf"] = f"s3://{BUCKET}/models/run", f"s3://{BUCKET}/models/run-hf"
    assert export_main(["--run", runs.bucket, "--output", out["bucket"]]) == 0
    export(runs.bucket, out["bucket-hf"], "hf")
    return out


@pytest.mark.parametrize("fmt", ["", "-hf"])
def test_an_export_to_the_bucket_lists_every_file_with_its_sha256(exports: dict, fmt: str) -> None:
    stored = objects(exports[f"bucket{fmt}"])
    lineage = json.loads(stored.pop("lineage.json"))
    assert set(lineage["files"]) == set(stored)
    for name, blob in stored.items():
        assert lineage["files"][name] == {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    # The same weights trained on local paths export to the same files.
    local = json.loads((Path(exports[f"local{fmt}"]) / "lineage.json").read_text())
    assert local["files"] == lineage["files"]
    assert lineage["run_dir"] == f"s3://{BUCKET}/runs/run" and lineage.get("format") == ("hf" if fmt else None)


def test_an_incomplete_or_corrupted_export_is_refused_naming_the_uri(
    exports: dict, cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "fresh-cache"))
    local = Path(exports["local"])
    incomplete = upload_dir(
        cluster.endpoint,
        local,
        BUCKET,
        "models/incomplete",
        files=["model.safetensors", "config.json", "tokenizer.json"],
    )
    with pytest.raises(ModelDirError, match=rf"{incomplete}: no lineage\.json, so no complete output"):
        local_export(incomplete)
    assert serve_main(["--model", incomplete]) == 2  # the driver refuses it before any replica starts
    assert f"{incomplete} has no lineage.json: not a complete export" in capsys.readouterr().err

    corrupt = upload_dir(cluster.endpoint, local, BUCKET, "models/corrupt")
    blob = bytearray((local / "model.safetensors").read_bytes())
    blob[-1] ^= 0x01
    cluster.client.put_object(Bucket=BUCKET, Key="models/corrupt/model.safetensors", Body=bytes(blob))
    with pytest.raises(ModelDirError, match=rf"{corrupt}/model\.safetensors: sha256 \w+ of the bytes fetched"):
        local_export(corrupt)
    assert not list((tmp_path / "fresh-cache").rglob("model.safetensors"))  # nothing unverified is kept


def test_a_replica_pulls_the_export_from_the_bucket_as_the_local_runs_bytes(exports: dict, cluster: Cluster) -> None:
    """What an engine replica does before its vLLM engine starts (serve/engine.py: ``serve.model_dir.hf_model_dir``),
    in a Ray worker on this node: the export in the bucket is pulled into the node's cache, and what it pulled is byte
    for byte the export of the same run on local paths (only lineage.json differs, naming the run dir); the directory
    vLLM loads is converted from it, the same files as the local export's conversion. So the bucket's export serves
    what the local one serves. vLLM itself serving an export from a bucket, on a cluster's worker nodes while the
    driver's node holds none of it: tests/test_cluster_data_path.py."""
    hf_dir = Path(ray.get(ray.remote(hf_model_dir).remote(exports["bucket"])))
    lineage = Location(exports["bucket"]).join("lineage.json").read_bytes()
    pulled = cluster.cache / "published" / hashlib.sha256(lineage).hexdigest()
    names = ["config.json", "lineage.json", "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in pulled.iterdir()) == names
    local = Path(exports["local"])
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (pulled / name).read_bytes() == (local / name).read_bytes(), name
    pulled_lineage = json.loads((pulled / "lineage.json").read_text())
    assert pulled_lineage["files"] == json.loads((local / "lineage.json").read_text())["files"]
    assert pulled_lineage["run_dir"] == f"s3://{BUCKET}/runs/run"
    assert hf_dir.parent == cluster.cache / "hf"
    assert json.loads((hf_dir / "lineage.json").read_text())["converted_from"] == exports["bucket"]
    local_hf = hf_model_dir(local, cache=cluster.cache)
    converted = sorted(p.name for p in local_hf.iterdir() if p.name != "lineage.json")
    assert converted == sorted(p.name for p in hf_dir.iterdir() if p.name != "lineage.json") and converted
    for name in converted:
        assert (hf_dir / name).read_bytes() == (local_hf / name).read_bytes(), name


def test_nothing_was_written_in_the_working_directory(runs: Runs, exports: dict, cluster: Cluster) -> None:
    assert sorted(cluster.workdir.iterdir()) == []
