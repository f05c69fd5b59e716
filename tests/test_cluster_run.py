"""python -m cluster.run: one spec drives plan, curate, train, export, eval and serve on the sample, with a small model.

One chain runs (to eval) for the module; the tests then rerun it unchanged (every stage verified and skipped, then
served under the lineage's model id), change a train key (curation kept, training and what follows redone), tamper
with a finished output (redone), and run the same chain on a moto S3 bucket with its driver SIGKILLed during training
and submitted again (the same data bytes and the same final weights as the uninterrupted local chain). Specs that
cannot run are refused before anything starts, naming the key.

While the rerun serves, lm-evaluation-harness scores the live endpoint (``local-completions``) on the eval stage's
tasks: every metric must be the one the eval stage got from the Hugging Face export (the harness's ``hf`` backend),
and the canary's own scorer must give the harness's log-likelihood of each item.
"""

from __future__ import annotations

import json
import math
import os
import pty
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import requests
import yaml
from conftest import REPO, SAMPLE
from remote_servers import make_bucket, moto_server, use_s3_endpoint
from wet_builder import write_wet

from cluster.ablate import main as ablate_main
from cluster.run import main
from cluster.run_spec import load_job
from cluster.stages import KEY_CHARS
from ground.dist import free_port
from ground.hashing import sha256_file
from ground.storage import Location
from serve.canary import Canary, score_text
from serve.evalset import load_evalset
from serve.harness_tasks import CLOZE_TASK, PPL_TASK, build_tasks
from serve.model_dir import read_export
from train.metrics import read_metrics

STEPS = 12
# The served model and the Hugging Face export run the same weights through different code (vLLM's, transformers'),
# in fp32.
HARNESS_REL_TOL = 1e-4
SPEC: dict[str, Any] = {
    "data": {"inputs": str(SAMPLE), "base": "pipeline/configs/demo.yaml"},
    "train": {
        "base": "train/configs/demo.yaml",
        "steps": STEPS,
        # A checkpoint every 4 steps: the killed chain below has one to resume from.
        "checkpoint": {"interval_steps": 4},
        "data": {"eval_interval": 6},
        "metrics": {"progress": False},
    },
    "eval": {"items": 4},
}


# The sample as a mixture of two sources (cluster/jobs/demo_mixture.yaml's; run end to end in test_cluster_jobs.py).
MIXTURE: dict[str, Any] = {
    "base": "pipeline/configs/demo.yaml",
    "sources": [
        {"name": "html", "inputs": str(SAMPLE / "*.warc.gz"), "weight": 1},
        {"name": "wet", "inputs": str(SAMPLE / "*.wet.gz"), "weight": 3},
    ],
}


def first_source_with(**keys: Any) -> dict[str, Any]:
    """A data section of MIXTURE's first source alone, with ``keys`` added to that source."""
    return {**MIXTURE, "sources": [{**MIXTURE["sources"][0], **keys}]}


def write_spec(path: Path, root: str, **sections: Any) -> Path:
    path.write_text(yaml.safe_dump({"root": root, **SPEC, **sections}))
    return path


def cli(spec: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "cluster.run", str(spec), *args]


def run_to_end(spec: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the chain to its end, its output captured (no terminal, as in `ray job logs` and CI)."""
    done = subprocess.run(cli(spec, *args), cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def run(spec: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Run the chain to its end; returns its stdout and each stage's state ("running", "skipped", ...)."""
    done = run_to_end(spec, *args, env=env)
    return done.stdout, stage_states(done.stdout)


def stage_states(stdout: str) -> dict[str, str]:
    """{stage: its first state}: the lines `[stage  ] state  detail` of the chain's report."""
    states: dict[str, str] = {}
    for stage, state in re.findall(r"^\[(\w+)\s*\] (\w+)", stdout, re.MULTILINE):
        states.setdefault(stage, state)
    return states


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("chain")
    spec = write_spec(base / "job.yaml", str(base / "root"))
    done = run_to_end(spec, "--until", "eval")
    root = base / "root"
    lineage = json.loads((root / "lineage.json").read_text())
    return {"spec": spec, "root": root, "stdout": done.stdout, "stderr": done.stderr,
            "states": stage_states(done.stdout), "lineage": lineage}  # fmt: skip


@pytest.mark.ray
def test_the_chain_runs_every_stage_and_writes_its_lineage(
    chain: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert chain["states"] == {
        "plan": "skipped", "curate": "running", "train": "running", "export": "running", "eval": "running",
        "lineage": "written",
    }  # fmt: skip
    root, lineage = chain["root"], chain["lineage"]
    # Each input's sha256, as the pipeline read it, is the file's.
    assert {Path(s["path"]).name: s["sha256"] for s in lineage["inputs"]} == {
        p.name: sha256_file(p) for p in SAMPLE.iterdir() if p.is_file()
    }
    data = Path(lineage["data"]["dir"])
    assert data.parent == root / "curate" and lineage["data"]["manifest_sha256"] == sha256_file(data / "manifest.json")
    run_dir = Path(lineage["train"]["run_dir"])
    assert run_dir.parent == root / "train" and lineage["train"]["step"] == STEPS
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data_dir"] == str(data) and config["steps"] == STEPS
    for fmt in ("raylm", "hf"):
        export = Path(lineage["export"][fmt]["dir"])
        assert lineage["export"][fmt]["lineage_sha256"] == sha256_file(export / "lineage.json")
        exported = json.loads((export / "lineage.json").read_text())
        assert exported["run_dir"] == str(run_dir)
        assert exported["data_manifest_sha256"] == lineage["data"]["manifest_sha256"]
    scores = lineage["eval"]["scores"]
    assert scores["raylm_val_ppl"]["bits_per_byte"] > 0 and 0 <= scores["raylm_val_cloze"]["acc"] <= 1
    canary = Path(lineage["eval"]["dir"]) / "tasks" / "canary-evalset.jsonl"
    assert len(canary.read_text().splitlines()) == lineage["eval"]["items"][str(data)] >= 1
    # The eval task has no terminal: the harness's progress bars went to its harness.log, not into the job's output.
    bar = re.compile(r"Running loglikelihood requests:\s+\d+%\|")  # a tqdm bar's start
    assert bar.search((Path(lineage["eval"]["dir"]) / "harness.log").read_text())
    assert not bar.search(chain["stderr"] + chain["stdout"]), chain["stderr"][-3000:]
    # Each stage's record names its key, which is its directory's name (training's after the spec's name, job.yaml's
    # "job": Ray Train names the run after its directory); --where names the same directory.
    for stage in ("curate", "train", "export", "eval"):
        (out,) = (root / stage).iterdir()
        record = json.loads((out / "stage.json").read_text())
        key = record["key"][:KEY_CHARS]
        assert record["stage"] == stage and out.name == (f"job-{key}" if stage == "train" else key) and record["files"]
        assert main([str(chain["spec"]), "--where", stage]) == 0
        assert capsys.readouterr().out.strip() == str(out)
    # What a key hashes is recorded with it: the train key, the effective train config and the data's key.
    material = json.loads((run_dir / "stage.json").read_text())["material"]
    assert material["train"]["steps"] == STEPS and material["data"] == lineage["data"]["key"]


def lines_of(stream: Any, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def stream_completion(base: str, model: str, first_chunk: threading.Event) -> list:
    """A streamed completion of 100 tokens through the openai SDK (which raises on an SSE error event); its chunks."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = []
    stream = client.completions.create(
        model=model, prompt="The library", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        chunks.append(chunk)
        first_chunk.set()
    return chunks


def alive(processes: list[psutil.Process]) -> list[str]:
    running = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.fixture(scope="module")
def served(chain: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An unchanged rerun to the serve stage, as `make demo` runs it in a terminal (``serve.smoke``, a pty on stdin):
    every stage verified and skipped, one streamed completion, one canary run over the eval stage's set, where to
    look; then it keeps serving the lineage's model id. The harness scores it, then the last test of the three stops it
    as ``ray job stop`` does."""
    root = chain["root"]
    before = tree(root)
    port = free_port()
    settings = {"port": port, "enforce_eager": "true", "smoke": "true", "smoke_prompt": "The library",
                "shutdown_timeout": 60, "canary_interval": 60,
                "metrics_sd_dir": tmp_path_factory.mktemp("sd")}  # fmt: skip
    terminal, tty = pty.openpty()  # a terminal on stdin: after the smoke it keeps serving, as in the README's demo
    proc = subprocess.Popen(
        cli(chain["spec"], *[arg for key, value in settings.items() for arg in ("--set", f"serve.{key}={value}")]),
        cwd=REPO, stdin=tty, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    os.close(tty)
    output: queue.Queue = queue.Queue()
    printed: list[str] = []
    threading.Thread(target=lines_of, args=(proc.stdout, output), daemon=True).start()
    try:
        while (line := output.get(timeout=300)) is not None and line != "serving; Ctrl-C to stop\n":
            printed.append(line)
        assert line is not None, "".join(printed)[-5000:]
        # Everything it started: its local Ray's daemons and workers, the replicas, vLLM's engine core.
        processes = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        yield {"proc": proc, "base": f"http://127.0.0.1:{port}", "output": output, "printed": printed,
               "processes": processes, "before": before}  # fmt: skip
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(terminal)


@pytest.fixture(scope="module")
def harness(served: dict[str, Any], chain: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-evaluation-harness (the `lm-eval` package, a harness nobody here wrote) through the live endpoint
    (`local-completions`: loglikelihood through ``echo`` + ``logprobs``), on the eval stage's items: the ones the stage
    scored on the Hugging Face export (its ``hf`` backend), which the served model must score alike."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files; nothing may reach a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval

    lineage = chain["lineage"]
    hf_dir = lineage["export"]["hf"]["dir"]
    block = json.loads((Path(lineage["export"]["raylm"]["dir"]) / "config.json").read_text())["block_size"]
    # The harness runs the tasks the stage stored, as a user would: their YAMLs name the stored jsonl (the stage built
    # them in a scratch dir, gone now). Built again from the lineage's data dir, they hold the very same items.
    stored = Path(lineage["eval"]["dir"]) / "tasks"
    rebuilt = build_tasks(lineage["data"]["dir"], tmp_path_factory.mktemp("tasks"), SPEC["eval"]["items"], block - 2)
    for name in ("canary-evalset.jsonl", f"{PPL_TASK}.jsonl", f"{CLOZE_TASK}.jsonl"):
        assert (rebuilt / name).read_bytes() == (stored / name).read_bytes(), name
    for name in (PPL_TASK, CLOZE_TASK):
        task = yaml.safe_load((stored / f"{name}.yaml").read_text())
        assert task["dataset_kwargs"]["data_files"] == {"test": str(stored / f"{name}.jsonl")}, task
    # max_length: the harness keeps one token for generation, so windows are max_length - 1 = block - 1 long.
    model_args = (
        f"model={lineage['model_id']},base_url={served['base']}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={hf_dir},max_length={block},num_concurrent=1,max_retries=1"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=list(lineage["eval"]["scores"]),
        task_manager=lm_eval.tasks.TaskManager(include_path=str(stored)),
        batch_size=4,
        log_samples=True,
        bootstrap_iters=0,
    )
    return {"results": results, "tasks": stored}


@pytest.mark.ray
def test_the_endpoint_scores_every_item_as_the_eval_stage_scored_the_hf_export(
    harness: dict[str, Any], chain: dict[str, Any]
) -> None:
    """The same weights through vLLM (ours, served) and through transformers (the eval stage's ``hf`` backend), in
    fp32: every metric of every task agrees to 1e-4 relative."""
    results, tasks = harness["results"], harness["tasks"]
    items = {PPL_TASK: load_evalset(tasks / "canary-evalset.jsonl").items,
             CLOZE_TASK: (tasks / f"{CLOZE_TASK}.jsonl").read_text().splitlines()}  # fmt: skip
    assert len(items[PPL_TASK]) == len(items[CLOZE_TASK]) == SPEC["eval"]["items"]
    for task, task_items in items.items():
        assert len(results["samples"][task]) == len(task_items), task
    ppl = results["results"][PPL_TASK]["word_perplexity,none"]
    assert math.isfinite(ppl) and ppl > 1
    stage_scores = chain["lineage"]["eval"]["scores"]
    assert set(stage_scores) == {PPL_TASK, CLOZE_TASK}
    for task, metrics in stage_scores.items():
        assert metrics, task
        for key, value in metrics.items():
            assert results["results"][task][f"{key},none"] == pytest.approx(value, rel=HARNESS_REL_TOL), (task, key)


@pytest.mark.ray
def test_the_canary_scores_what_the_harness_scores(
    harness: dict[str, Any], served: dict[str, Any], chain: dict[str, Any]
) -> None:
    """The canary's own scorer (echo + logprobs, serve.canary.score_text) gives the harness's log-likelihood of each
    item, and its score is their total over the tokens scored."""
    lineage = chain["lineage"]
    evalset = load_evalset(harness["tasks"] / "canary-evalset.jsonl")
    harness_loglik = {s["doc"]["text"]: float(s["filtered_resps"][0]) for s in harness["results"]["samples"][PPL_TASK]}
    lineage_id = read_export(lineage["export"]["raylm"]["dir"]).lineage_id
    total_logprob = total_tokens = 0.0
    session = requests.Session()
    for item in evalset.items:
        logprob, tokens, scored_by = score_text(session, served["base"], lineage["model_id"], item.text, timeout=60)
        assert scored_by == lineage_id  # the response names the weights that scored it
        assert logprob == pytest.approx(harness_loglik[item.text], rel=HARNESS_REL_TOL), item.id
        total_logprob += logprob
        total_tokens += tokens
    canary = Canary(served["base"], evalset, interval=60, min_score=None, timeout=60).run_once()
    assert canary["status"] == "success", json.dumps(canary)
    assert canary["score"] == pytest.approx(sum(harness_loglik.values()) / total_tokens, rel=HARNESS_REL_TOL)
    assert canary["score"] == pytest.approx(total_logprob / total_tokens, rel=1e-9)


@pytest.mark.ray
def test_an_unchanged_rerun_skips_every_stage_then_serves_the_lineage_model_as_the_demo_does(
    chain: dict[str, Any], served: dict[str, Any]
) -> None:
    """The serve stage of ``served``: it keeps serving the lineage's model id until SIGTERM (what ``ray job stop``
    sends), drains the streams in flight, and exits 0, leaving no Ray or vLLM process behind."""
    root, proc, output, printed = chain["root"], served["proc"], served["output"], served["printed"]
    processes = served["processes"]
    names = " ".join(" ".join([p.name(), *p.cmdline()]) for p in processes)
    assert "raylet" in names and "gcs_server" in names and "EngineCore" in names, names
    base = served["base"]
    model = chain["lineage"]["model_id"]
    assert [m["id"] for m in requests.get(f"{base}/v1/models", timeout=30).json()["data"]] == [model]
    # Two streams in flight, then SIGTERM: both run to their end, and the job exits 0 by itself.
    started = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_completion, base, model, event) for event in started]
        assert all(event.wait(60) for event in started)
        proc.send_signal(signal.SIGTERM)
        for stream in streams:
            chunks = stream.result(timeout=120)
            assert chunks[-1].choices[0].finish_reason == "length", chunks  # every one of its 100 tokens came
    assert proc.wait(timeout=120) == 0, "".join(printed)[-5000:]
    while (line := output.get(timeout=30)) is not None:
        printed.append(line)
    log = "".join(printed)
    states = stage_states(log)
    assert [states[s] for s in ("curate", "train", "export", "eval", "serve")] == ["skipped"] * 4 + ["running"]
    assert "SIGTERM: draining for up to 60 s" in log and re.search(r"drained [0-2], aborted 0, in \d+\.\d s", log), log
    assert "SIGTERM received" not in log and "*** " not in log, log[-4000:]  # Ray's abort handler did not run
    # Serve stopped without the driver reporting its controller's self-kill as a failed task (serve/quiet_shutdown.py).
    assert "graceful_shutdown failed" not in log, log[-4000:]
    assert "--- streamed completion for 'The library' ---\nThe library" in log, log
    # The canary ran and scored every item of the eval stage's set, against the lineage it read from the endpoint.
    items = len((Path(chain["lineage"]["eval"]["dir"]) / "tasks" / "canary-evalset.jsonl").read_text().splitlines())
    canary = rf"canary \S+: score -?\d+\.\d{{3}} nats/token \({items}/{items} items, lineage [0-9a-f]{{12}}\)"
    assert re.search(canary, log), log
    # One line per thing to open: the endpoint, the dashboard, and Prometheus (which finds the replicas' targets).
    assert f"endpoint:   {base}/v1/completions" in log and "dashboard:  " in log and "raylm-serving.json" in log, log
    assert re.search(r"prometheus: prometheus --config\.file=\S+   \([1-9]\d* scrape targets in ", log), log
    assert "metrics:    http://" not in log, log
    assert alive(processes) == []  # its own local Ray went with it, and so did its vLLM engine
    # The replicas' and vLLM's own output stays in the Ray session's logs (--worker-logs files, the default): none
    # of Ray's forwarded lines, "(ServeReplica:raylm:... pid=N) ...", cuts into the job's output.
    forwarded = re.findall(r"^.*\((?:ServeReplica|ServeController|ProxyActor)[^)]* pid=\d+\).*$", log, re.M)
    assert not forwarded, forwarded[:5]
    assert "Triton" not in log, log  # vLLM's import-time notes on a node without a GPU (serve/__main__.py)
    # Nor Serve's own start-up INFO lines, which the endpoint line says better (serve/__main__.py).
    assert "Serve in namespace" not in log and "is ready at" not in log, log
    after, before = tree(root), served["before"]
    # Nothing was rewritten but the lineage, which says the same.
    changed = {name for name in before if after[name] != before[name]}
    assert changed <= {"lineage.json"} and set(after) == set(before)
    assert json.loads((root / "lineage.json").read_text()) == chain["lineage"]


@pytest.mark.ray
def test_a_changed_train_key_keeps_the_data_and_redoes_training_and_what_follows(chain: dict[str, Any]) -> None:
    root = chain["root"]
    curated_before = tree(root / "curate")
    _, states = run(chain["spec"], "--until", "export", "--set", f"train.steps={STEPS - 2}")
    assert states == {"plan": "skipped", "curate": "skipped", "train": "running", "export": "running",
                      "lineage": "written"}  # fmt: skip
    assert tree(root / "curate") == curated_before
    lineage = json.loads((root / "lineage.json").read_text())
    assert lineage["data"] == chain["lineage"]["data"]
    assert lineage["train"]["step"] == STEPS - 2 and lineage["train"]["run_dir"] != chain["lineage"]["train"]["run_dir"]
    assert lineage["model_id"] != chain["lineage"]["model_id"]
    # The earlier outputs stay where they were: switching back is a skip, not a retrain.
    assert len(list((root / "train").iterdir())) == 2


@pytest.mark.ray
def test_a_finished_output_that_no_longer_verifies_is_redone_and_an_unrecorded_one_is_kept(
    chain: dict[str, Any],
) -> None:
    lineage = chain["lineage"]
    scores = Path(lineage["eval"]["dir"]) / "scores.json"
    honest = scores.read_bytes()
    tampered = {"raylm_val_ppl": {"bits_per_byte": 0.01}}
    scores.write_text(json.dumps(tampered))
    # A job stopped after the pipeline and the training run finished but before it recorded them: their outputs are
    # complete, only stage.json is missing.
    data, run_dir = Path(lineage["data"]["dir"]), Path(lineage["train"]["run_dir"])
    (data / "stage.json").unlink()
    (run_dir / "stage.json").unlink()
    kept = tree(data) | {f"run/{name}": stat for name, stat in tree(run_dir).items()}
    stdout, states = run(chain["spec"], "--until", "eval")
    assert [states[s] for s in ("curate", "train", "export", "eval")] == ["resuming", "resuming", "skipped", "redoing"]
    assert "scores.json changed since the stage finished" in stdout
    # Moved aside whole under a name that says why, never deleted (for training, that keeps the checkpoints).
    (aside,) = scores.parent.parent.glob(f"{scores.parent.name}.unverified-*")
    assert json.loads((aside / "scores.json").read_text()) == tampered and (aside / "stage.json").is_file()
    assert f"the old output moved to {aside}" in stdout
    assert re.search(r"^\[eval\s*\] running", stdout, re.MULTILINE)
    assert scores.read_bytes() == honest  # lm-eval on the same export scores the same
    # Recorded, not redone: nothing of theirs was rewritten.
    assert (data / "stage.json").is_file() and (run_dir / "stage.json").is_file()
    now = tree(data) | {f"run/{name}": stat for name, stat in tree(run_dir).items()}
    assert {name: now[name] for name in kept} == kept


@pytest.mark.ray
def test_watching_a_run_differently_redoes_nothing_and_a_stage_that_fails_says_why_in_one_line(
    chain: dict[str, Any],
) -> None:
    # A price, a profile window and a tracker project only watch a run: the trained run stays the one done. Two val
    # documents are too few for the cloze task's four choices: the eval stage's own error.
    watch = ["train.cost.usd_per_cpu_hour=0.05", "train.profile.steps=0:1", "train.metrics.tracker_project=p2"]
    done = subprocess.run(
        cli(chain["spec"], "--until", "eval", "--set", "eval.items=2", *[a for item in watch for a in ("--set", item)]),
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    states = stage_states(done.stdout)
    assert [states[s] for s in ("plan", "curate", "train", "export")] == ["skipped"] * 4, done.stdout
    assert re.search(r"^\[eval\s*\] failed", done.stdout, re.MULTILINE), done.stdout
    assert "error: eval: need 4+ val documents" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.ray
def test_on_a_bucket_a_chain_killed_in_training_and_submitted_again_ends_like_the_local_one(
    chain: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with moto_server() as endpoint:
        use_s3_endpoint(monkeypatch, endpoint)
        make_bucket(endpoint, "jobs")
        # The inputs stay where the local chain read them: the inputs' URIs are part of the curated data's key.
        spec = write_spec(tmp_path / "job.yaml", "s3://jobs/root")
        runs = Location("s3://jobs/root/train")
        with (tmp_path / "killed.log").open("w") as out:
            proc = subprocess.Popen(
                cli(spec, "--until", "eval"), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            deadline = time.monotonic() + 300
            while not any(re.search(r"checkpoint_step_\d+/", name) for name in runs.files()):
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-5000:]
                assert time.monotonic() < deadline, "no checkpoint in 300 s"
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert not any(name.endswith("/stage.json") for name in runs.files()), "training finished before the kill"

        _, states = run(spec, "--until", "eval")
        redone = [states[s] for s in ("curate", "train", "export", "eval")]
        assert redone == ["skipped", "resuming", "running", "running"]
        lineage = json.loads(Location("s3://jobs/root/lineage.json").read_text())
        local = chain["lineage"]
        # The same keys, so the same directory names under another root; the same bytes in them.
        for stage in ("data", "train"):
            assert lineage[stage]["key"] == local[stage]["key"]
        assert lineage["data"]["manifest_sha256"] == local["data"]["manifest_sha256"]
        for name in ("tokens/train-00000.bin", "tokens/val-00000.bin", "tokenizer.json"):
            remote = Location(lineage["data"]["dir"]).join(name).read_bytes()
            assert remote == (Path(local["data"]["dir"]) / name).read_bytes(), name
        weights = Location(lineage["train"]["run_dir"]).join("final", "model.safetensors").read_bytes()
        assert weights == (Path(local["train"]["run_dir"]) / "final" / "model.safetensors").read_bytes()
        assert lineage["model_id"] == local["model_id"] and lineage["eval"]["scores"] == local["eval"]["scores"]


def junk_pages(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """Boilerplate shop pages: menu words in random order with random item numbers. English enough for language id,
    unlike one another for dedup, and what the quality rules drop (few stop words, no sentences)."""
    rng = random.Random(seed)
    menu = [
        "home", "about", "contact", "login", "register", "cart", "checkout", "wishlist", "privacy", "policy", "terms",
        "shipping", "returns", "sale", "new", "subscribe", "newsletter", "follow", "facebook", "twitter", "instagram",
        "sitemap", "faq", "help", "account", "orders", "track", "compare",
    ]  # fmt: skip
    pages = []
    for i in range(count):
        words = [rng.choice(menu) if rng.random() < 0.8 else f"item{rng.randrange(10**6)}" for _ in range(300)]
        pages.append((f"http://junk.example/{i}", " ".join(words)))
    return pages


@pytest.mark.ray
def test_an_ablation_finds_planted_junk_worse_and_an_aa_twin_no_different(
    chain: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """cluster.ablate over this module's job: the baseline (its curation shared with the chain's: same key), an A/A
    twin on other seeds, and the quality rules off with planted junk pages; a small model, 3 seeds each, judged on
    GSM8K's questions. Then a rerun reuses every trial."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for path in SAMPLE.iterdir():
        if path.is_file() and path.name.endswith(".gz"):
            (inputs / path.name).symlink_to(path)
    write_wet(inputs / "junk.warc.wet.gz", junk_pages(150))
    off = {f"data.quality.{family}.enabled": False for family in ("gopher", "c4", "fineweb")}
    tiny = {"train.model.n_layer": 2, "train.model.n_head": 2, "train.model.n_embd": 32, "train.model.block_size": 32,
            "train.data.micro_batch_size": 4, "train.data.global_batch_size": 8, "train.data.eval_interval": 10,
            "train.data.eval_sequences": 8, "train.optimizer.lr": 3e-3, "train.optimizer.warmup_steps": 5,
            "train.steps": 30, "train.metrics.prometheus": False}  # fmt: skip
    heldout = [{"name": "gsm8k", "path": "data/eval-sets/gsm8k-test.jsonl", "field": "question"}]
    ablation = {
        "job": str(chain["spec"]),
        "output": str(tmp_path / "report"),
        "set": tiny | {"train.data.heldout": heldout},
        "seeds": [1, 2, 3],
        "metrics": ["val_bpb/gsm8k"],
        "variants": [
            {"name": "base"},
            {"name": "twin", "seeds": [4, 5, 6]},
            {"name": "junk", "set": off | {"data.inputs": str(inputs)}},
        ],
    }
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(ablation))
    monkeypatch.chdir(REPO)  # the held-out path is the repository's, as in cluster/jobs/
    curations = set((chain["root"] / "curate").iterdir())
    assert ablate_main([str(path), "--concurrent", "2"]) == 0
    first = json.loads((tmp_path / "report" / "ablation.json").read_text())
    assert ablate_main([str(path)]) == 0
    second = json.loads((tmp_path / "report" / "ablation.json").read_text())
    printed = capsys.readouterr().out

    assert [(t["variant"], t["seed"], t["status"]) for t in first["trials"]] == [
        (v, seed, "trained") for v, seeds in (("base", (1, 2, 3)), ("twin", (4, 5, 6)), ("junk", (1, 2, 3)))
        for seed in seeds
    ]  # fmt: skip
    assert {t["status"] for t in second["trials"]} == {"reused"} and second["verdicts"] == first["verdicts"]
    # The base and the twin curated nothing new (the chain's key); the junk variant curated once for its 3 trials.
    assert len(set((chain["root"] / "curate").iterdir()) - curations) == 1
    verdicts = first["verdicts"]
    junk, twin = verdicts["variants"]["junk"]["val_bpb/gsm8k"], verdicts["variants"]["twin"]["val_bpb/gsm8k"]
    assert junk["verdict"] == "worse" and junk["interval"][0] > 0, junk
    assert twin["verdict"] == "no detectable difference", twin

    # The numbers judged are the trials' own last evaluations, paired by position.
    def last(variant: str) -> list[float]:
        runs = [t["run_dir"] for t in first["trials"] if t["variant"] == variant]
        return [[r for r in read_metrics(d) if "val_loss" in r][-1]["val_bpb/gsm8k"] for d in runs]

    assert junk["delta"] == pytest.approx(
        statistics.fmean(j - b for j, b in zip(last("junk"), last("base"), strict=True))
    )
    assert verdicts["noise"]["val_bpb/gsm8k"] == pytest.approx(statistics.stdev(last("base")))
    assert "val_bpb/data" in verdicts["not_compared"]  # each variant's own val split: never judged
    assert (tmp_path / "report" / "ablation.png").stat().st_size > 0
    assert "| junk |" in (tmp_path / "report" / "ablation.md").read_text() and "worse" in printed


# ---- refused before anything starts (no Ray) ----


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str, **sections: Any) -> str:
    spec = write_spec(tmp_path / "job.yaml", str(tmp_path / "root"), **sections)
    assert main([str(spec), *args]) == 2
    assert not (tmp_path / "root").exists()
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "sections", "named"),
    [
        (["--set", "train.optimizer.lrr=1"], {}, "train.optimizer.lrr: unknown key"),
        (["--set", "data.tokenize.vocab_size=5"], {}, "data.tokenize.vocab_size"),
        (["--set", "train.data_dir=/elsewhere"], {}, "train.data_dir: set by the job"),
        ([], {"serve": {"bogus_option": 1}}, "serve.bogus_option: unknown key"),
        ([], {"serve": {"port": "eighty"}}, "--port: invalid int value"),
        ([], {"serve": {"model": "x"}}, "serve.model: set by the job"),
        (["--set", "evaluation.items=3"], {}, "evaluation: unknown key"),
        ([], {"data": {"base": "pipeline/configs/demo.yaml"}}, "data.inputs"),
        ([], {"data": {**MIXTURE, "inputs": str(SAMPLE)}}, "data.inputs: a mixture's inputs are in data.sources"),
        ([], {"data": {"sources": [MIXTURE["sources"][0]] * 2}}, "data.sources[1].name: 'html' names two sources"),
        ([], {"data": {"sources": [{"name": "wet", "weight": 1}]}}, "data.sources[0].inputs"),
        ([], {"data": {"sources": [{"name": "a b", "inputs": "x", "weight": 1}]}}, "data.sources.0.name"),
        ([], {"data": {"sources": [{"name": "wet", "inputs": "x", "weight": 0}]}}, "data.sources.0.weight"),
        (
            [],
            {"data": first_source_with(pipeline={"tokenize": {"vocab_size": 512}})},
            "data.sources[0].pipeline.tokenize.vocab_size: a mixture's sources share one tokenizer",
        ),
        (
            [],
            {"data": first_source_with(pipeline={"language": {"min_scor": 0.5}})},
            "data.sources[0].pipeline.language.min_scor: unknown key",
        ),
        (
            [],
            {"data": first_source_with(pipeline={"tokenize": {"val_fraction": 2}})},
            "data.sources[0].pipeline.tokenize.val_fraction: Input should be less than 1",
        ),
        (
            ["--set", "train.data.global_batch_size=1", "--set", "train.data.micro_batch_size=1"],
            {"data": MIXTURE},
            "global_batch_size 1 is too small to mix 2 sources",
        ),
    ],
)
def test_a_spec_with_a_bad_key_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], sections: dict[str, Any], named: str
) -> None:
    assert named in refusal(tmp_path, capsys, *args, **sections)


def test_a_spec_whose_model_cannot_fit_its_gpus_is_refused_by_the_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = ["--set", "train.model.n_layer=48", "--set", "train.model.n_embd=6144", "--set", "train.model.n_head=48"]
    err = refusal(tmp_path, capsys, *big, cluster={"gpus": 1, "gpu_type": "L4", "gpus_per_node": 1})
    assert "plan: train.model does not fit on one L4" in err
    err = refusal(tmp_path, capsys, cluster={"gpus": 8, "gpu_type": "A10G"})
    assert "cluster.gpus = 8" in err and "train.parallel.workers" in err
    # A 6.5B model sharded over 8 A10Gs fits; kept gathered through the step (a whole bf16 copy a GPU) it does not.
    seven_b = [f"train.model.{key}={value}" for key, value in (("n_layer", 32), ("n_embd", 4096), ("n_head", 32))]
    seven_b += ["train.parallel.strategy=fsdp", "train.parallel.workers=8", "train.data.micro_batch_size=2"]
    sets = [arg for item in seven_b for arg in ("--set", item)]
    spec = write_spec(tmp_path / "sharded.yaml", str(tmp_path / "root"), cluster={"gpus": 8, "gpu_type": "A10G"})
    assert main([str(spec), "--until", "plan", *sets]) == 0, capsys.readouterr()
    never = ["--set", "train.parallel.fsdp_reshard_after_forward=never"]
    err = refusal(tmp_path, capsys, *sets, *never, cluster={"gpus": 8, "gpu_type": "A10G"})
    assert "plan: train.model with train.data.micro_batch_size" in err and "GB a GPU" in err, err


def test_the_clusters_gpu_hour_price_prices_training_and_serving_unless_they_set_their_own(tmp_path: Path) -> None:
    cluster = {"gpus": 1, "gpu_type": "A10G", "price_per_gpu_hour": 1.25}
    job = load_job(write_spec(tmp_path / "job.yaml", str(tmp_path / "root"), cluster=cluster))
    assert job.train.cost.usd_per_gpu_hour == 1.25
    assert job.serve_argv[-2:] == ["--set", "cost.usd_per_gpu_hour=1.25"]
    own = {"set": {"cost": {"usd_per_gpu_hour": 3.0}}}
    train = {**SPEC["train"], "cost": {"usd_per_gpu_hour": 2.0}}
    job = load_job(write_spec(tmp_path / "own.yaml", str(tmp_path / "root"), cluster=cluster, train=train, serve=own))
    assert job.train.cost.usd_per_gpu_hour == 2.0
    assert job.serve_argv == ["--set", "cost.usd_per_gpu_hour=3.0"]
    assert load_job(write_spec(tmp_path / "none.yaml", str(tmp_path / "root"))).train.cost.usd_per_gpu_hour is None


def test_a_spec_that_fits_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path / "job.yaml", str(tmp_path / "root"), cluster={"gpus": 1, "gpu_type": "A10G"})
    assert main([str(spec), "--until", "plan"]) == 0
    assert re.search(r"^\[plan\s*\] done\s+[\d.]+M parameters on 1 × A10G", capsys.readouterr().out, re.MULTILINE)
    assert not (tmp_path / "root").exists()


def test_the_training_run_is_named_after_the_spec_and_found_by_its_key_under_another_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def where(name: str) -> Path:
        spec = write_spec(tmp_path / f"{name}.yaml", str(tmp_path / "root"))
        assert main([str(spec), "--where", "train"]) == 0
        return Path(capsys.readouterr().out.strip())

    first = where("first run")
    key = first.name.rsplit("-", 1)[-1]
    assert first == tmp_path / "root" / "train" / f"first_run-{key}" and len(key) == KEY_CHARS
    assert where("second") == first.with_name(f"second-{key}")  # nothing there yet: under its own name
    first.mkdir(parents=True)  # the first spec's run: the same key under another name is the same run
    assert where("second") == first
    first.with_name(f"second-{key}").mkdir()  # its own, when there is one
    assert where("second") == first.with_name(f"second-{key}")
    first.rmdir()
    first.with_name(f"second-{key}").rmdir()
    first.with_name(key).mkdir()  # a root from before the name: the run under its key alone
    assert where("second") == first.with_name(key)
    first.with_name("other-0123456789abcdef").mkdir()  # another key's run is not this one
    assert where("second") == first.with_name(key)
    finished = first.with_name(f"third-{key}")  # of several, a finished one
    finished.mkdir()
    (finished / "stage.json").write_text("{}")
    assert where("second") == finished


def test_a_mixture_curates_each_source_keyed_by_its_own_inputs_and_the_first_sources_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def where(stage: str, data: dict[str, Any]) -> list[str]:
        spec = write_spec(tmp_path / "job.yaml", str(tmp_path / "root"), data=data)
        assert main([str(spec), "--where", stage]) == 0
        return capsys.readouterr().out.split()

    curated = where("curate", MIXTURE)
    assert len(set(curated)) == 2 and all(Path(d).parent == tmp_path / "root" / "curate" for d in curated)
    trained = where("train", MIXTURE)
    # Another weight: the same curations, another training run.
    reweighted = {**MIXTURE, "sources": [MIXTURE["sources"][0], {**MIXTURE["sources"][1], "weight": 2}]}
    assert where("curate", reweighted) == curated and where("train", reweighted) != trained
    # The first source's inputs changed: its tokenizer may differ, so the second source's curation is another one.
    first = {**MIXTURE["sources"][0], "inputs": str(SAMPLE / "sample-0000.warc.gz")}
    changed = where("curate", {**MIXTURE, "sources": [first, MIXTURE["sources"][1]]})
    assert changed[0] != curated[0] and changed[1] != curated[1]
    # The second source's inputs changed: the first's curation is the same one.
    second = {**MIXTURE["sources"][1], "inputs": str(SAMPLE / "cc_en_head-*.wet.gz")}
    changed = where("curate", {**MIXTURE, "sources": [MIXTURE["sources"][0], second]})
    assert changed[0] == curated[0] and changed[1] != curated[1]
    # A source's own pipeline key (over the section's): that source's curation is another one, the first's is not.
    own = {**MIXTURE["sources"][1], "pipeline": {"language": {"min_score": 0.5}}}
    changed = where("curate", {**MIXTURE, "sources": [MIXTURE["sources"][0], own]})
    assert changed[0] == curated[0] and changed[1] != curated[1]
    # The same key on the section: both curations change.
    changed = where("curate", {**MIXTURE, "language": {"min_score": 0.5}})
    assert changed[0] != curated[0] and changed[1] != curated[1]
    # Each source's own keys are its alone: the second's config has its own key and the section's for the rest.
    first_own = {**MIXTURE["sources"][0], "pipeline": {"language": {"min_score": 0.5}}}
    second_own = {**MIXTURE["sources"][1], "pipeline": {"tokenize": {"val_fraction": 0.3}}}
    job = load_job(
        write_spec(tmp_path / "own.yaml", str(tmp_path / "root"), data={**MIXTURE, "sources": [first_own, second_own]})
    )
    first, second = (s.config for s in job.sources)
    assert first.language.min_score == 0.5 != job.pipeline.language.min_score
    assert first.tokenize == job.pipeline.tokenize
    assert second.tokenize.val_fraction == 0.3 and second.language == job.pipeline.language


@pytest.mark.slow
def test_inputs_inside_the_checkout_keep_their_key_when_the_checkout_moves(tmp_path: Path) -> None:
    """A `ray job submit` unpacks the checkout under a directory named after its content's hash: the bundled sample,
    named by its path in the checkout, must curate under the same key from two copies of the checkout (each run
    from its own copy, as a job's driver runs), while an input outside the checkout keeps its absolute path."""
    spec = {**SPEC, "data": {**SPEC["data"], "inputs": "data/sample"}}

    def curate_dir(checkout: Path, spec_data: dict[str, Any]) -> str:
        job = write_spec(tmp_path / "job.yaml", str(tmp_path / "root"), **{**spec, "data": spec_data})
        where = subprocess.run([sys.executable, "-m", "cluster.run", str(job), "--where", "curate"], cwd=checkout,
                               capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert where.returncode == 0, where.stderr[-3000:]
        return where.stdout.strip()

    copies = []
    for name in ("checkout-a", "checkout-b"):
        copy = tmp_path / name
        for package in ("ground", "pipeline", "cluster", "train", "serve", "checkpoints", "data"):
            shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
        copies.append(copy)
    assert curate_dir(copies[0], spec["data"]) == curate_dir(copies[1], spec["data"])
    # The same files outside any checkout: named by their absolute paths, so two places are two curations.
    outside = [tmp_path / "outside-a", tmp_path / "outside-b"]
    for place in outside:
        shutil.copytree(SAMPLE, place)
    keyed = {curate_dir(copies[0], {**spec["data"], "inputs": str(place)}) for place in outside}
    assert len(keyed) == 2
