"""Autoscaling under load: the engine deployment (``ExportServer:<model>``, vLLM under Ray Serve LLM) starts with one
replica, as ``python -m serve``'s default autoscaling does (serve/config.py: DEFAULT_AUTOSCALING, min 1, max 2), and
Serve adds the second once the load asks for it; no request fails while it does.

The autoscaling block is the default's, with a target of 1 request per replica and short windows, so that a few
concurrent streams are enough load and the test waits seconds rather than the default's minutes. Each client
sends streamed completions one after another, each bounded. Once Serve has added the second replica, the clients
take turns until it runs: one request in flight at a time, 2 s apart. Requests keep flowing through the start, and
the new engine's start (three processes importing vLLM) is not left to compete with six streams for the 2 cores,
which made it take minutes. The load stops once Serve reports two RUNNING engine replicas and each client has had
one more request answered by the scaled deployment, all of them at once again.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import requests
from multinode import wait_for
from serve_fixtures import fast_start, running_app, sse_events

from serve.config import DEFAULT_AUTOSCALING

pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]

CLIENTS = 6
MAX_TOKENS = 200
TURN_GAP_S = 2.0
SCALE_UP_TIMEOUT_S = 240  # a second vLLM engine's start on a busy 2-core machine included


def engine_replicas(deployment: str) -> dict[str, int]:
    """Serve's count of the engine deployment's replicas by state (RUNNING, STARTING, ...)."""
    from ray import serve

    app = serve.status().applications.get("raylm")
    found = app.deployments.get(deployment) if app else None
    states = found.replica_states if found else {}
    return {getattr(state, "value", state): n for state, n in states.items() if n}


def stream_one(base: str, prompt: str) -> tuple[int, int, bool]:
    """(HTTP status, tokens generated, whether the stream ended with [DONE]) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=(10, 120)) as resp:
        if resp.status_code != 200:
            return resp.status_code, 0, False
        events = list(sse_events(resp.iter_lines()))
    usage = next((e["usage"] for e in events if isinstance(e, dict) and e.get("usage")), None)
    return 200, usage["completion_tokens"] if usage else 0, events[-1:] == ["[DONE]"]


def test_load_scales_the_engine_from_one_replica_to_two_without_a_failed_request(
    long_context_export: Path, tmp_path: Path
) -> None:
    autoscaling = DEFAULT_AUTOSCALING | {
        "target_ongoing_requests": 1,
        "upscale_delay_s": 1,
        # The ingress's router reports its requests to the controller every metrics_interval_s (10 s by default,
        # deprecated in favour of environment variables that Ray 2.60 does not read yet): a report every 0.5 s.
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
        # One request at a time while the second replica starts is below the target for two: without a long
        # downscale delay, Serve would stop the replica it is starting once the default's 120 s had passed.
        "downscale_delay_s": 600,
    }
    args = {
        "model": str(long_context_export),
        "autoscaling_config": autoscaling,
        "max_batch_size": 4,
        "max_ongoing_requests": 16,
        "metrics_sd_dir": str(tmp_path / "sd"),
    }
    engine = f"ExportServer:{long_context_export.name}"
    with running_app(fast_start(args)) as base:
        assert engine_replicas(engine) == {"RUNNING": 1}  # the default's min_replicas: one engine at rest

        added, scaled = threading.Event(), threading.Event()
        turns = threading.Semaphore(1)  # between added and scaled: one request in flight at a time
        results: list[tuple[int, int, bool]] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            rounds_after_scaling = 0
            while rounds_after_scaling < 1:  # stop after one request sent once two replicas were serving
                was_scaled = scaled.is_set()
                taking_turns = added.is_set() and not was_scaled
                with turns if taking_turns else contextlib.nullcontext():
                    outcome = stream_one(base, f"Client {i} asks about the weather, round {len(results)}.")
                    if taking_turns:
                        scaled.wait(TURN_GAP_S)  # the engine idles between turns; the new one's start takes that
                with lock:
                    results.append(outcome)
                if was_scaled:
                    rounds_after_scaling += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: sum(engine_replicas(engine).values()) == 2, SCALE_UP_TIMEOUT_S, "Serve to add a replica")
            added.set()
            wait_for(lambda: engine_replicas(engine) == {"RUNNING": 2}, SCALE_UP_TIMEOUT_S, "a second engine replica")
        finally:
            scaled.set()
            for t in threads:
                t.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a client never finished"

    assert results and all(r == (200, MAX_TOKENS, True) for r in results), [r for r in results if r[0] != 200][:5]
    assert len(results) >= 2 * CLIENTS  # load before the scale-up, and a round on the two replicas after it
