"""The completions app on a real Ray Serve (local Ray, 2 CPUs, HTTP proxy on a free loopback port).

The model is an untrained 4-layer GPT with a 1024-token context: quality is irrelevant here, and its
long generations (seconds) leave time to disconnect mid-stream. Correctness of the text is checked
against an uncached greedy loop over the same weights.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
import requests
import torch
from serve_fixtures import one_replica_args, running_app, sse_events

from serve.model_dir import load_model_dir

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def base_url(long_context_export, tmp_path_factory) -> str:
    with running_app(one_replica_args(long_context_export, tmp_path_factory.mktemp("sd"))) as url:
        yield url


@pytest.fixture(scope="module")
def loaded(long_context_export):
    return load_model_dir(long_context_export)


def complete(base_url: str, **body) -> requests.Response:
    return requests.post(f"{base_url}/v1/completions", json=body, timeout=60)


def stats(base_url: str) -> dict:
    return requests.get(f"{base_url}/v1/engine/stats", timeout=10).json()


def greedy_reference(loaded, prompt: str, n: int) -> str:
    ids = [loaded.eot_id, *loaded.tokenizer.encode(prompt).ids]
    start = len(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = loaded.model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return loaded.tokenizer.decode(ids[start:])


def test_health_and_models_list_the_lineage(base_url: str, loaded) -> None:
    assert requests.get(f"{base_url}/health", timeout=10).json()["status"] == "ok"
    models = requests.get(f"{base_url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == "long-context" and card["object"] == "model"
    assert card["lineage"] == loaded.lineage and card["lineage_id"] == loaded.lineage_id
    assert card["context_length"] == 1024


def test_completion_is_openai_shaped_and_equals_uncached_greedy(base_url: str, loaded) -> None:
    resp = complete(base_url, prompt="The history of the town", max_tokens=16, temperature=0, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "long-context" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    n_prompt = len(loaded.tokenizer.encode("The history of the town").ids)
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 16, "total_tokens": n_prompt + 16}
    assert choice["text"] == greedy_reference(loaded, "The history of the town", 16)


def test_streaming_sends_sse_chunks_usage_and_done(base_url: str) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = complete(base_url, **body).json()["choices"][0]["text"]
    with requests.post(
        f"{base_url}/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        stream=True,
        timeout=60,
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and len({c["id"] for c in chunks}) == 1 for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12


def test_seed_makes_sampling_reproducible(base_url: str) -> None:
    body = {"prompt": "A", "max_tokens": 20, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    first = complete(base_url, **body, seed=42).json()["choices"][0]["text"]
    again = complete(base_url, **body, seed=42).json()["choices"][0]["text"]
    other = complete(base_url, **body, seed=43).json()["choices"][0]["text"]
    assert first == again
    assert first != other  # 20 tokens from a 512-token vocabulary: a collision would be astonishing


def test_concurrent_requests_are_decoded_in_one_batch(base_url: str) -> None:
    before = stats(base_url)["batch_sizes"]
    body = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, base_url, prompt=f"Request number {i}", **body) for i in range(4)]
        results = [f.result() for f in futures]
    assert all(r.status_code == 200 for r in results)
    after = stats(base_url)["batch_sizes"]
    multi = {k: after[k] - before.get(k, 0) for k in after if int(k) > 1 and after[k] > before.get(k, 0)}
    # Four 200-token requests arriving together: many decode steps ran several sequences at once.
    assert multi, after
    assert stats(base_url)["running"] == 0


def test_client_disconnect_mid_stream_frees_the_slot(base_url: str) -> None:
    before = stats(base_url)
    body = {"prompt": "Long", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
    resp = requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=60)
    lines = resp.iter_lines()
    got = [next(lines) for _ in range(3)]  # a few chunks arrive: the request holds a slot and is decoding
    assert got[0].startswith(b"data: {")
    resp.close()  # the client goes away ~1000 tokens early
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = stats(base_url)
        if now["cancelled"] > before["cancelled"] and now["running"] == 0:
            break
        time.sleep(0.1)
    assert now["cancelled"] == before["cancelled"] + 1, now
    assert now["finished"] == before["finished"], "the request ran to completion instead of being aborted"
    assert now["free_slots"] == now["max_batch_size"]
    assert complete(base_url, prompt="still alive?", max_tokens=2).status_code == 200


BAD_REQUESTS = [
    ({"max_tokens": 5}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": 123}, 400, "prompt"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "temperature": 5.0}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "seed": -3}, 400, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options"),
    ({"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "word " * 1100, "max_tokens": 1}, 400, "prompt"),  # longer than the 1024-token context
    ({"prompt": "word " * 500, "max_tokens": 600}, 400, "prompt"),  # fits alone, not with the completion
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_openai_error_bodies(base_url: str, body: dict, status: int, param: str) -> None:
    resp = complete(base_url, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and error["type"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
def test_unparseable_bodies_are_400(base_url: str, raw: bytes) -> None:
    resp = requests.post(f"{base_url}/v1/completions", data=raw, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"


def test_context_errors_say_why_and_wrong_methods_keep_the_error_shape(base_url: str) -> None:
    error = complete(base_url, prompt="word " * 1100, max_tokens=1).json()["error"]
    assert error["code"] == "context_length_exceeded" and "1024" in error["message"]
    resp = requests.get(f"{base_url}/v1/completions", timeout=10)
    assert resp.status_code == 405 and "error" in resp.json()
    resp = requests.get(f"{base_url}/v1/nothing-here", timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"


def test_replica_survives_every_bad_request(base_url: str) -> None:
    replica = stats(base_url)["replica"]
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert complete(base_url, prompt="fine", max_tokens=3).status_code == 200
    assert stats(base_url)["replica"] == replica  # same process: nothing crashed or restarted


def test_score_returns_per_token_loglikelihood(base_url: str, loaded) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    body = requests.post(f"{base_url}/v1/score", json={"text": text}, timeout=30).json()
    ids = [loaded.eot_id, *loaded.tokenizer.encode(text).ids]
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([ids[:-1]]))
    want = torch.log_softmax(logits[0], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert body["tokens"] == len(ids) - 1 and body["token_ids"] == ids[1:]
    torch.testing.assert_close(torch.tensor(body["token_logprobs"]), want, atol=1e-4, rtol=0)
    assert body["mean_logprob"] == pytest.approx(body["sum_logprob"] / body["tokens"])
    bad = requests.post(f"{base_url}/v1/score", json={"text": ""}, timeout=30)
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "text"
