"""The canary: a fixed, versioned eval set scored against the live endpoint, exported for Prometheus.

    python -m serve.canary --endpoint http://127.0.0.1:8000 --evalset FILE [--interval S | --once]
    python -m serve.canary build --data PIPELINE_OUTPUT_DIR --output FILE

Each run asks ``GET /v1/models`` which model (lineage id) is live, scores every held-out text through
``POST /v1/completions`` with ``echo`` and ``logprobs`` (the prompt's own log-probabilities, as
lm-evaluation-harness scores text: :func:`score_text`) and publishes the token-weighted mean log-likelihood
(nats/token; higher is better)
as ``raylm_canary_score``, with items passed/total, run duration and last-success timestamp, labelled
``eval_set="<name>@<version>"``, ``gen_ai_request_model`` and ``raylm_lineage_id``. Scoring is
deterministic (no sampling), so a changed score means a changed model, not noise.

A run counts only if every item scored, the lineage id was the same before and after, and every item was
scored by that lineage's weights (each response's ``system_fingerprint`` is the lineage id of the engine replica
that answered it: during a rolling update the new ingress already reports the new lineage while old engine
replicas still answer some requests): a run that straddles a model swap measures neither model. Failed runs leave
the gauges alone (the staleness alert then fires on ``raylm_canary_last_success_timestamp_seconds``) and bump
``raylm_canary_runs_total{result="failure"}``.

The gauges use prometheus_client directly, not the OTel SDK the server uses: when the served lineage
changes, the old lineage's series must disappear (or its frozen last-success time would look stale
forever), and prometheus_client can remove a label set while the OTel metrics API cannot.

Scheduling: ``python -m serve --canary-evalset FILE --canary-interval S`` deploys ``CanaryDeployment``
(one replica, no CPU reserved) in the same Serve application as the model; it runs the loop on a thread
and exposes its scrape port through the same file-based service discovery as the model replicas.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from typing import Any, NamedTuple

import requests
from prometheus_client import CollectorRegistry, Counter, Gauge
from ray import serve

from ground.scrape_targets import DEFAULT_SD_DIR, ScrapeEndpoint, safe_name
from serve.api_key_file import ApiKeyError, read_keys
from serve.config import DEFAULT_CANARY_INTERVAL_S
from serve.evalset import EvalSet, EvalSetError, build_evalset, load_evalset

log = logging.getLogger(__name__)

MODEL_LABELS = ("eval_set", "gen_ai_request_model", "raylm_lineage_id")


class CanaryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.score = Gauge(
            "raylm_canary_score",
            "Mean per-token log-likelihood (nats) of the eval set's held-out text; higher is better.",
            MODEL_LABELS,
            registry=registry,
        )
        self.items_passed = Gauge(
            "raylm_canary_items_passed", "Items scored in the last successful run.", MODEL_LABELS, registry=registry
        )
        self.items_total = Gauge("raylm_canary_items_total", "Items in the eval set.", MODEL_LABELS, registry=registry)
        self.duration = Gauge(
            "raylm_canary_duration_seconds", "Wall time of the last successful run.", MODEL_LABELS, registry=registry
        )
        self.last_success = Gauge(
            "raylm_canary_last_success_timestamp_seconds",
            "Unix time the last successful run finished.",
            MODEL_LABELS,
            registry=registry,
        )
        self.interval = Gauge(
            "raylm_canary_interval_seconds", "Seconds between canary runs.", ("eval_set",), registry=registry
        )
        self.min_score = Gauge(
            "raylm_canary_min_score", "Score below which the canary alert fires.", ("eval_set",), registry=registry
        )
        self.runs = Counter("raylm_canary_runs", "Canary runs by result.", ("eval_set", "result"), registry=registry)
        self._model_gauges = (self.score, self.items_passed, self.items_total, self.duration, self.last_success)
        self._labels: tuple[str, ...] | None = None

    def publish(self, labels: tuple[str, str, str], score: float, passed: int, total: int, seconds: float) -> None:
        if self._labels != labels:
            # A different model (or eval set): drop the previous lineage's series rather than leave them frozen.
            for gauge in self._model_gauges:
                gauge.clear()
            self._labels = labels
        self.score.labels(*labels).set(score)
        self.items_passed.labels(*labels).set(passed)
        self.items_total.labels(*labels).set(total)
        self.duration.labels(*labels).set(seconds)
        self.last_success.labels(*labels).set(time.time())


class ScoreError(RuntimeError):
    pass


class TextScore(NamedTuple):
    logprob: float  # the sum of the text's tokens' log-probabilities
    tokens: int  # how many tokens were scored
    lineage_id: str | None  # the response's system_fingerprint: the lineage of the weights that answered


def score_text(session: requests.Session, endpoint: str, model: str, text: str, timeout: float) -> TextScore:
    """The text's log-likelihood as a document, from the endpoint's prompt logprobs.

    The server puts the document-start token before a text prompt (the export's tokenizer does); the engine has no
    log-probability for the first position, so the text's own tokens, every one conditioned on what precedes it,
    are what is summed. ``max_tokens`` 1: the one generated token is not part of the text and is left out."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": text,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 0,
        "temperature": 0.0,
    }
    resp = session.post(f"{endpoint}/v1/completions", json=body, timeout=timeout)
    try:
        data = resp.json()
    except ValueError:
        data = {}
    if resp.status_code != 200:
        raise ScoreError(f"HTTP {resp.status_code} {data.get('error', {}).get('message', resp.text[:200])}")
    prompt_tokens = data["usage"]["prompt_tokens"]
    logprobs = data["choices"][0]["logprobs"]["token_logprobs"][:prompt_tokens]
    scored = [lp for lp in logprobs[1:] if lp is not None]
    if len(scored) != prompt_tokens - 1 or not scored or not all(math.isfinite(lp) for lp in scored):
        raise ScoreError(f"the endpoint returned {len(scored)} finite log-probabilities for {prompt_tokens - 1} tokens")
    return TextScore(float(sum(scored)), len(scored), data.get("system_fingerprint"))


class Canary:
    def __init__(
        self,
        endpoint: str,
        evalset: EvalSet,
        interval: float,
        min_score: float | None = None,
        registry: CollectorRegistry | None = None,
        timeout: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.evalset = evalset
        self.interval = interval
        self.timeout = timeout
        self.registry = registry or CollectorRegistry()
        self.metrics = CanaryMetrics(self.registry)
        self.metrics.interval.labels(evalset.label).set(interval)
        if min_score is not None:
            self.metrics.min_score.labels(evalset.label).set(min_score)
        self.last: dict[str, Any] = {"status": "not run yet", "eval_set": evalset.label}
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def _model(self) -> tuple[str, str]:
        resp = self._session.get(f"{self.endpoint}/v1/models", timeout=self.timeout)
        resp.raise_for_status()
        card = resp.json()["data"][0]
        return card["id"], card["lineage_id"]

    def run_once(self) -> dict[str, Any]:
        """One pass over the eval set; returns (and keeps, for /v1/canary) a summary of the run."""
        start = time.monotonic()
        label = self.evalset.label
        try:
            model, lineage = self._model()
            total_logprob, total_tokens, passed, failures = 0.0, 0, 0, []
            for item in self.evalset.items:
                try:
                    scored = score_text(self._session, self.endpoint, model, item.text, self.timeout)
                except ScoreError as exc:
                    failures.append(f"{item.id}: {exc}")
                    continue
                if scored.lineage_id != lineage:
                    failures.append(f"{item.id}: scored by lineage {scored.lineage_id}, not the served {lineage}")
                    continue
                passed += 1
                total_logprob += scored.logprob
                total_tokens += scored.tokens
            if self._model() != (model, lineage):
                failures.append("the served model changed during the run")
        except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
            model, lineage, passed, failures = "", "", 0, [f"{type(exc).__name__}: {exc}"]
        seconds = time.monotonic() - start
        result: dict[str, Any] = {
            "eval_set": label,
            "model": model,
            "lineage_id": lineage,
            "items_passed": passed,
            "items_total": len(self.evalset.items),
            "duration_s": seconds,
            "finished_at": time.time(),
        }
        if failures or total_tokens == 0:
            self.metrics.runs.labels(label, "failure").inc()
            result.update(status="failure", errors=failures[:5])
        else:
            score = total_logprob / total_tokens
            self.metrics.publish((label, model, lineage), score, passed, len(self.evalset.items), seconds)
            self.metrics.runs.labels(label, "success").inc()
            result.update(status="success", score=score, tokens=total_tokens)
        self.last = result
        return result


def expose(registry: CollectorRegistry, host: str, port: int, sd_dir: str | None, name: str) -> ScrapeEndpoint:
    """Scrape endpoint for the canary's registry, plus a file_sd target next to the replicas' ones."""
    return ScrapeEndpoint(
        registry, host=host, port=port, sd_dir=sd_dir, filename=f"raylm-canary-{safe_name(name)}.json",
        labels={"raylm_component": "canary"},
    )  # fmt: skip


@serve.deployment(num_replicas=1, max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class CanaryDeployment:
    """The scheduled canary inside the Serve application: a loop on a thread, status over a handle."""

    def __init__(
        self,
        endpoint: str,
        evalset: str,
        interval: float,
        min_score: float | None = None,
        metrics_host: str = "127.0.0.1",
        metrics_sd_dir: str | None = str(DEFAULT_SD_DIR),
        api_key: str | None = None,
    ) -> None:
        self.canary = Canary(endpoint, load_evalset(evalset), interval, min_score, api_key=api_key)
        self.endpoint = expose(
            self.canary.registry, metrics_host, 0, metrics_sd_dir, f"{socket.gethostname()}-{os.getpid()}"
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raylm-canary", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            result = self.canary.run_once()
            log.info("canary %s", {k: v for k, v in result.items() if k != "errors"})
            self._stop.wait(self.canary.interval)

    def status(self) -> dict[str, Any]:
        return {**self.canary.last, "metrics_port": self.endpoint.port, "interval_s": self.canary.interval}

    def __del__(self) -> None:
        self._stop.set()
        self.endpoint.close()


def _build_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serve.canary build",
        description="Write a versioned JSONL eval set from a pipeline output dir's val documents.",
    )
    parser.add_argument("--data", required=True, help="pipeline output dir (has documents/val-*.parquet)")
    parser.add_argument("--output", required=True, help="eval set file to write (.jsonl)")
    parser.add_argument("--name", default="val-loglik", help="eval set name (default: val-loglik)")
    parser.add_argument("--items", type=int, default=16, help="number of documents (default: 16)")
    parser.add_argument("--max-chars", type=int, default=1200, help="truncate each document (default: 1200)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        help="also cut each document to this many tokens of the data's tokenizer: at most the served model's context "
        "minus 2 (the document-start token, and the one token the scoring request generates); the engine refuses "
        "a longer item (default: no cut)",
    )
    args = parser.parse_args(argv)
    try:
        evalset = build_evalset(
            args.data, args.output, args.name, args.items, max_chars=args.max_chars, max_tokens=args.max_tokens
        )
    except EvalSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {evalset.label}, {len(evalset.items)} items")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build"]:
        return _build_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m serve.canary",
        description="Score a fixed eval set against a live endpoint and export the result for Prometheus. "
        "`python -m serve.canary build --help` makes an eval set.",
    )
    parser.add_argument("--endpoint", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--evalset", required=True, help="JSONL eval set (python -m serve.canary build)")
    when = parser.add_mutually_exclusive_group()
    interval = DEFAULT_CANARY_INTERVAL_S
    when.add_argument("--interval", type=float, default=interval, help="seconds between runs (default: %(default)s)")
    when.add_argument("--once", action="store_true", help="run once, print the result as JSON, exit 0/1")
    parser.add_argument("--min-score", type=float, help="export raylm_canary_min_score (the alert threshold)")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", help="the API key file of the endpoint (python -m serve --api-key-file)")
    keys.add_argument("--api-key-env", default="RAYLM_API_KEY", help="env var with the endpoint's API key, if any")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--metrics-port", type=int, default=9466, help="scrape port (default: 9466; 0 = any)")
    parser.add_argument("--metrics-sd-dir", default=str(DEFAULT_SD_DIR), help="file_sd dir ('' to skip)")
    args = parser.parse_args(argv)
    try:
        evalset = load_evalset(args.evalset)
    except (OSError, EvalSetError, KeyError, json.JSONDecodeError) as exc:
        print(f"error: cannot read eval set: {exc}", file=sys.stderr)
        return 2
    try:
        api_key = read_keys(args.api_key_file)[0] if args.api_key_file else os.environ.get(args.api_key_env)
    except ApiKeyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    canary = Canary(args.endpoint, evalset, args.interval, args.min_score, api_key=api_key)
    if args.once:
        result = canary.run_once()
        print(json.dumps(result, indent=2))
        return 0 if result["status"] == "success" else 1
    endpoint = expose(
        canary.registry, args.metrics_host, args.metrics_port, args.metrics_sd_dir or None, f"cli-{os.getpid()}"
    )
    print(f"canary metrics on http://{args.metrics_host}:{endpoint.port}/metrics", flush=True)
    try:
        while True:
            print(json.dumps(canary.run_once()), flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        endpoint.close()


if __name__ == "__main__":
    sys.exit(main())
