"""A real multi-process Ray cluster on loopback: `ray start --head`, then `ray job submit` for each stage."""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from conftest import REPO, SAMPLE

from cluster.trainer_memory import predict_trainer_state_bytes
from ground.dist import free_port
from pipeline.executor import PASS_STEPS

pytestmark = pytest.mark.ray  # starts Ray (in this process or in the CLIs it runs)

RAY = str(Path(sys.executable).with_name("ray"))
RUNTIME_ENV = REPO / "cluster" / "jobs" / "runtime_env.yaml"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A Ray head started with the `ray start` CLI (not ray.init), stopped by the test that started it.

    `--block` keeps `ray start` in the foreground so that terminating it stops exactly this head, never
    another Ray instance on the machine (`ray stop` would kill them all).
    """
    dashboard = free_port()
    temp_dir = tmp_path_factory.mktemp("ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Ray 2.5x+ job servers want a token; one made for this head authenticates the CLI calls below.
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # Job entrypoints say `python`: make it this environment's, as an activated venv would.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={free_port()}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            # The job agent listens here; Ray's fixed default (52365) may belong to another Ray on this machine, and
            # then no agent ever takes a job ("No available agent to submit job": 30 tries in one CI run).
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        probe = subprocess.run([RAY, "job", "list", "--address", address], capture_output=True, env=env)
        if probe.returncode == 0:
            break
        if proc.poll() is not None:
            pytest.fail(f"ray start exited: {proc.stdout.read().decode()[-2000:]}")
        time.sleep(2)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        pytest.fail("the Ray head's job server did not come up within 120 s")
    yield address, env
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # `ray start --block` stops its processes one after another on SIGTERM (half a minute here); the jobs are
        # done, so the rest of its session group goes at once.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def submit_job(address: str, env: dict, root: Path, spec: str, *args: str) -> str:
    """cluster/jobs/submit_job.sh SPEC ARGS with ROOT=root: the chain as one `ray job submit`."""
    script_env = env | {"RAY_ADDRESS": address, "ROOT": str(root)}
    for _ in range(30):
        result = subprocess.run(
            ["bash", "cluster/jobs/submit_job.sh", spec, *args],
            capture_output=True, text=True, env=script_env, cwd=REPO, timeout=600,
        )  # fmt: skip
        # The job server answers before the head's job agent is up; Ray says so and asks to retry.
        if "No available agent to submit job" not in result.stderr:
            break
        time.sleep(2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout
    return result.stdout


def test_the_chain_runs_as_one_job_on_a_started_cluster(head, tmp_path):
    address, env = head
    root = tmp_path / "root"
    # The shipped mixture demo spec, smaller: its relative paths (inputs, base configs) resolve inside the uploaded
    # checkout. Two sources (the sample's HTML and its WET files), each curated by its own pipeline run, mixed 1:3.
    overrides = ["--set", "train.steps=4", "--set", "train.parallel.strategy=fsdp", "--set", "train.parallel.workers=2"]
    stdout = submit_job(address, env, root, "cluster/jobs/demo_mixture.yaml", "--until", "eval", *overrides)
    assert "[train  ] done" in stdout and "[eval   ] done" in stdout
    # The Ray dashboard lists the job by its spec, and its datasets by the spec, the stage and the source.
    submission = re.search(r"Job '(raylm-demo_mixture-\d{8}-\d{6})' submitted successfully", stdout)
    assert submission, stdout
    auth = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    jobs = requests.get(f"{address}/api/jobs/", headers=auth, timeout=30).json()
    (job_id,) = [j["job_id"] for j in jobs if j["submission_id"] == submission[1]]
    datasets = requests.get(f"{address}/api/data/datasets/{job_id}", headers=auth, timeout=60).json()["datasets"]
    names = {d["dataset"].rsplit("_", 2)[0] for d in datasets}  # a dataset id: <name>_<uuid>_<run index>
    for source in ("html", "wet"):
        assert {n for n in names if n.endswith(f" for demo_mixture curate {source}")} == {
            f"raylm {p} ({PASS_STEPS[p]}) for demo_mixture curate {source}" for p in ("filter", "dedup", "tokenize")
        }, names
    # The export and eval stages are the job's tasks of those names (Ray's state API, which the dashboard reads).
    query = {"filter_keys": "job_id", "filter_predicates": "=", "filter_values": job_id, "limit": 10000}
    listed = requests.get(f"{address}/api/v0/tasks", params=query, headers=auth, timeout=60).json()
    tasks = {(t["name"], t["state"]) for t in listed["data"]["result"]["result"]}
    assert {("demo_mixture export", "FINISHED"), ("demo_mixture eval", "FINISHED")} <= tasks, sorted(tasks)
    assert re.search(r"^\[curate\s*\] done\s+wet: in ", stdout, re.M) and re.search(
        r"^\[curate\s*\] done\s+html: in ", stdout, re.M
    )
    lineage = json.loads((root / "lineage.json").read_text())
    sources = lineage["data"]["mixture"]
    assert [(s["name"], s["weight"]) for s in sources] == [("html", 1), ("wet", 3)]
    manifests = [json.loads((Path(s["dir"]) / "manifest.json").read_text()) for s in sources]
    # Each source read its own files, and the second loaded the first's tokenizer: one vocabulary for the model.
    read = {s["name"]: {Path(i["path"]).name for i in lineage["inputs"] if i["source"] == s["name"]} for s in sources}
    assert read == {
        "wet": {p.name for p in SAMPLE.glob("*.wet.gz")},
        "html": {p.name for p in SAMPLE.glob("*.warc.gz")},
    }
    assert manifests[0]["tokenizer"]["sha256"] == manifests[1]["tokenizer"]["sha256"]
    # The WET source's own key (tokenize.val_fraction 0.3, over the section's 0.1, at which its four small files
    # leave no val document): its curation kept some for validation, the HTML source's the section's share.
    assert [m["config"]["tokenize"]["val_fraction"] for m in manifests] == [0.1, 0.3]
    # The eval stage scores the sources' val documents in turn, so both give items, and the canary set it wrote
    # says which line by line.
    items = lineage["eval"]["items"]
    canary = [json.loads(line) for line in (Path(lineage["eval"]["dir"]) / "tasks" / "canary-evalset.jsonl").open()]
    assert set(items) == {s["dir"] for s in sources} and all(items.values()), items
    assert sum(items.values()) == len(canary)
    for n, s in enumerate(sources):
        assert [c["id"].split("/")[0] for c in canary if c["source"] == s["dir"]] == [str(n)] * items[s["dir"]]
    assert lineage["eval"]["scores"]["raylm_val_ppl"]["word_perplexity"] > 1
    assert all(sum(s["tokens"] for s in m["shards"]) > 1_000 for m in manifests)
    run = Path(lineage["train"]["run_dir"])
    # The dashboard's Train page lists the run by the spec's name (its directory's): the job's runtime env turns
    # Ray Train's state tracking on.
    runs = requests.get(f"{address}/api/train/v2/runs/v1", headers=auth, timeout=60).json()["train_runs"]
    assert run.name.startswith("demo_mixture-") and run.name in {r["name"] for r in runs}, runs
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert [(m["name"], m["path"], m["weight"]) for m in config["data"]["mixture"]] == [
        (s["name"], s["dir"], s["weight"]) for s in sources
    ]
    manifest = manifests[0]  # the tokenizer's source, whose vocabulary the model has
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert sorted({m["step"] for m in steps}) == [0, 1, 2, 3] and steps[-1]["world_size"] == 2
    assert all(np.isfinite(m["loss"]) for m in steps)

    # The capacity planner's per-rank prediction for this very run, against what each rank measured: the
    # largest rank's bytes exactly (both count the same tensors of the same model), the other within padding.
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    predicted = predict_trainer_state_bytes(
        model["n_layer"],
        model["n_head"],
        model["n_embd"],
        model["block_size"],
        manifest["tokenizer"]["vocab_size"],
        model["bias"],
        "fsdp",
        2,
    )
    measured = steps[-1]["state_bytes"]
    assert max(measured) == predicted and min(measured) >= 0.95 * predicted, (predicted, measured)


# A job's entrypoint that, like the serving job's `python -m serve`, takes a while to finish after SIGTERM: longer
# than the 3 s Ray gives a stopped job by default before its SIGKILL.
SLOW_TO_STOP = """
import pathlib, signal, sys, time

def drain(signum, frame):
    time.sleep({drain_s})
    pathlib.Path(sys.argv[1]).write_text("drained")
    sys.exit(0)

signal.signal(signal.SIGTERM, drain)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def test_ray_job_stop_gives_a_draining_job_the_runtime_envs_grace(head, tmp_path):
    """`ray job stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s unless set): the project's
    runtime env sets it for every job, so a job that drains for longer than Ray's default still ends by itself."""
    address, env = head
    job_env = env | {"RAY_ADDRESS": address}
    drain_s = 6
    work = tmp_path / "job"
    work.mkdir()
    (work / "slow_to_stop.py").write_text(SLOW_TO_STOP.format(drain_s=drain_s))
    marker = tmp_path / "drained.txt"
    job_id = f"raylm-stop-{secrets.token_hex(4)}"
    submit = [RAY, "job", "submit", "--address", address, "--working-dir", str(work), "--runtime-env",
              str(RUNTIME_ENV), "--submission-id", job_id, "--no-wait",
              "--", "python", "slow_to_stop.py", str(marker)]  # fmt: skip
    for _ in range(30):
        result = subprocess.run(submit, capture_output=True, text=True, env=job_env, timeout=120)
        if "No available agent to submit job" not in result.stderr:
            break
        time.sleep(2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert int(yaml.safe_load(RUNTIME_ENV.read_text())["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) > drain_s

    def logs() -> str:
        return subprocess.run([RAY, "job", "logs", "--address", address, job_id], capture_output=True, text=True,
                              env=job_env, timeout=60).stdout  # fmt: skip

    deadline = time.monotonic() + 120
    while "ready" not in logs():  # its SIGTERM handler is in place
        assert time.monotonic() < deadline, logs()
        time.sleep(0.5)
    stopped = subprocess.run([RAY, "job", "stop", "--address", address, job_id], capture_output=True, text=True,
                             env=job_env, timeout=120)  # fmt: skip
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    auth = {"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    job = requests.get(f"{address}/api/jobs/{job_id}", headers=auth, timeout=30).json()
    assert job["status"] == "STOPPED", job
    # The drain ran to its end: with Ray's default wait the SIGKILL would have come halfway through it.
    assert marker.read_text() == "drained"
