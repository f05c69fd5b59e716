"""The check a person makes right after deploying: one streamed completion, one canary run, where to look.

``python -m serve --smoke`` runs it against the app it just deployed (``make demo`` ends with it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import requests

from serve.canary import Canary
from serve.evalset import load_evalset

REPO = Path(__file__).resolve().parents[1]


def wait_healthy(base_url: str, timeout: float = 600.0) -> None:
    # /health answers 200 once the engine is ready: vLLM's start takes about a minute on a small CPU machine.
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


def stream_completion(base_url: str, prompt: str, max_tokens: int, seed: int = 0, api_key: str | None = None) -> str:
    """POST a streaming completion and print each server-sent text chunk as it arrives."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": seed,
        "stream": True,
    }
    text = []
    print(f"\n--- streamed completion for {prompt!r} ---\n{prompt}", end="", flush=True)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with requests.post(f"{base_url}/v1/completions", json=body, headers=headers, stream=True, timeout=120) as resp:
        resp.raise_for_status()
        # str lines: the event stream's content type names its charset, which decode_unicode uses.
        for line in cast(Iterator[str], resp.iter_lines(decode_unicode=True)):
            if not line or not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)["choices"][0]["text"]
            text.append(chunk)
            print(chunk, end="", flush=True)
    print("\n---")
    return "".join(text)


def metrics_targets(sd_dir: str | Path) -> list[str]:
    """The scrape URLs the replicas (and canary) advertised in their Prometheus file_sd files."""
    urls = []
    for path in sorted(Path(sd_dir).glob("raylm-*.json")):
        for group in json.loads(path.read_text()):
            urls += [f"http://{target}/metrics" for target in group["targets"]]
    return urls


def run_smoke(
    base_url: str, prompt: str, max_tokens: int, evalset: str | None, sd_dir: str, api_key: str | None = None
) -> dict:
    wait_healthy(base_url)
    completion = stream_completion(base_url, prompt, max_tokens, api_key=api_key)
    result: dict = {"completion_chars": len(completion)}
    if evalset:
        canary = Canary(base_url, load_evalset(evalset), interval=0, api_key=api_key).run_once()
        result["canary"] = canary
        if canary["status"] == "success":
            print(
                f"canary {canary['eval_set']}: score {canary['score']:.3f} nats/token "
                f"({canary['items_passed']}/{canary['items_total']} items, lineage {canary['lineage_id']})"
            )
        else:
            print(f"canary failed: {canary.get('errors')}")
    # One line per thing a person opens: the API, the dashboard, and the Prometheus that feeds it (which finds every
    # replica's scrape endpoint in the file_sd folder, so the endpoints themselves are counted, not listed).
    targets = metrics_targets(sd_dir)
    print(f"endpoint:   {base_url}/v1/completions   (models: {base_url}/v1/models)")
    print(f"dashboard:  {REPO / 'dashboards' / 'grafana' / 'raylm-serving.json'}   (import it into Grafana)")
    print(
        f"prometheus: prometheus --config.file={REPO / 'dashboards' / 'prometheus.yml'}   "
        f"({len(targets)} scrape targets in {sd_dir})"
    )
    return result
