"""``python -m serve --smoke``, run as the README's demo runs it in a terminal (a subprocess with a tty for stdin, its
own local Ray): one streamed completion, one canary run, where to look; then it keeps serving until SIGTERM, drains the
streams in flight, and exits 0, leaving no Ray or vLLM process behind."""

import os
import pty
import queue
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from serve_fixtures import split_documents

from ground.dist import free_port
from serve.evalset import build_evalset

pytestmark = pytest.mark.ray


def process_tree(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def still_running(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{p.pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return alive


def lines_of(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def stream_completion(base: str, model: str, first_chunk: threading.Event) -> list:
    """A streamed completion through the openai SDK (which raises on an SSE error event); its chunks."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = []
    stream = client.completions.create(
        model=model, prompt="The library", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        chunks.append(chunk)
        first_chunk.set()
    return chunks


def test_serve_smoke_prints_the_completion_the_canary_and_where_to_look_then_drains_on_sigterm(
    tiny_export: Path, tmp_path: Path
) -> None:
    data = tmp_path / "pipeline-out"
    (data / "documents").mkdir(parents=True)
    _, held_out = split_documents()
    pq.write_table(pa.table({"text": held_out[:4]}), data / "documents" / "val-00000.parquet")
    evalset = tmp_path / "canary.jsonl"
    build_evalset(data, evalset, items=4, max_chars=250)  # each item fits the tiny model's 128-token context
    sd_dir = tmp_path / "sd"
    port = free_port()
    terminal, tty = pty.openpty()  # a terminal on stdin: after the smoke it keeps serving, as in the README's demo
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "--model", str(tiny_export), "--port", str(port), "--canary-evalset",
         str(evalset), "--canary-interval", "60", "--metrics-sd-dir", str(sd_dir), "--smoke",
         "--smoke-prompt", "The library", "--enforce-eager", "--shutdown-timeout", "60"],
        cwd=REPO, stdin=tty, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    os.close(tty)
    stdout: queue.Queue = queue.Queue()
    stderr: list[str] = []
    threading.Thread(target=lines_of, args=(proc.stdout, stdout), daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        printed = []
        while (line := stdout.get(timeout=300)) is not None and line != "serving; Ctrl-C to stop\n":
            printed.append(line)
        assert line is not None, "".join(stderr)[-4000:]
        # Everything it started: its local Ray's daemons and workers, the replicas, vLLM's engine core.
        tree = process_tree(proc.pid)
        names = " ".join(" ".join([p.name(), *p.cmdline()]) for p in tree)
        assert "raylet" in names and "gcs_server" in names and "EngineCore" in names, names
        # Two streams in flight, then SIGTERM: both run to their end, and the server exits 0 by itself.
        base = f"http://127.0.0.1:{port}"
        started = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(2) as pool:
            streams = [pool.submit(stream_completion, base, tiny_export.name, event) for event in started]
            assert all(event.wait(60) for event in started)
            proc.send_signal(signal.SIGTERM)
            for stream in streams:
                chunks = stream.result(timeout=120)
                assert chunks[-1].choices[0].finish_reason == "length", chunks  # every one of its 100 tokens came
        assert proc.wait(timeout=120) == 0, "".join(stderr)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(terminal)
    log = "".join(stderr)
    assert "SIGTERM: draining for up to 60 s" in log, log[-4000:]
    assert re.search(r"drained [0-2], aborted 0, in \d+\.\d s", log), log[-4000:]
    assert "SIGTERM received" not in log and "*** " not in log, log[-4000:]  # Ray's abort handler did not run
    out = "".join(printed)
    assert "--- streamed completion for 'The library' ---\nThe library" in out, out
    # The canary ran and scored every item, against the lineage it read from the endpoint.
    assert re.search(r"canary \S+: score -?\d+\.\d{3} nats/token \(4/4 items, lineage [0-9a-f]{12}\)", out), out
    assert f"endpoint:   http://127.0.0.1:{port}/v1/completions" in out, out
    assert out.count("metrics:    http://") >= 1, out  # the replica's scrape endpoint, from its file_sd file
    assert "dashboard:  " in out and "raylm-serving.json" in out and "prometheus: prometheus --config.file=" in out
    assert still_running(tree) == []  # its own local Ray went with it, and so did its vLLM engine
