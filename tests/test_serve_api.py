"""The OpenAI-compatible API on a real Ray Serve, driven by the official ``openai`` SDK and by raw HTTP.

One module-scoped app (one Ray start): the untrained 4-layer, 1024-context GPT of ``long_context_export``,
behind a test-only subclass of the server whose engine fails on demand (a marker prompt makes its
tokenizer raise, a marker seed makes its prefill raise), so that 500s can be provoked without any switch
in production code. Covered here: the SDK's completions, streaming, chat and chat streaming, n > 1, lists
of prompts, token-id prompts, logprobs and echo; logprobs checked against ``GPT.forward``; the request
caps (413, 400) and a near-cap prompt that must not stall a running stream or /health; every response
counted once in ``raylm_server_requests_total``; and a sweep of bad inputs that all get OpenAI error bodies.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import logging
import threading
import time

import openai
import pytest
import requests
import torch
from serve_fixtures import documents, one_replica_args, running_app, sse_events

from serve.app import server_deployment
from serve.config import AppArgs
from serve.detok import TokenBytes
from serve.model_dir import load_model_dir

pytestmark = pytest.mark.ray
log = logging.getLogger(__name__)

MODEL = "long-context"  # long_context_export's directory name, which the server reports as its model id
MAX_PROMPT_CHARS = 1_000_000  # large, so that tokenizing a near-cap prompt takes long enough to notice a stall
MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_CHOICES = 16
RAISE_IN_HANDLER = "<test: raise in the handler>"  # FaultyServer's tokenizer raises on a prompt containing it
FAIL_IN_ENGINE_SEED = 777_777  # FaultyServer's prefill raises for a sequence with this seed


def build_faulty(args: dict):  # -> ray.serve.Application
    """build_app's application, with the server subclassed so that its engine fails on demand (test-only)."""
    opts = AppArgs.model_validate(args)
    deployment = server_deployment(opts)

    # Defined here, not at module level: cloudpickle sends a local class by value, and the replica cannot
    # import this test module.
    class FaultyServer(deployment.func_or_class):  # type: ignore[misc, name-defined]
        async def __init__(self, *a, **kw) -> None:
            await super().__init__(*a, **kw)
            engine = self.engine
            tokenize, prefill_step = engine.tokenize, engine._prefill_step

            async def raising_tokenize(texts: list[str]) -> list[list[int]]:
                if any(RAISE_IN_HANDLER in t for t in texts):
                    raise RuntimeError("injected by the test: a bug in a handler")
                return await tokenize(texts)

            def failing_prefill(seq):
                if seq.params.seed == FAIL_IN_ENGINE_SEED:
                    raise RuntimeError("injected by the test: a failing forward pass")
                return prefill_step(seq)

            engine.tokenize = raising_tokenize
            engine._prefill_step = failing_prefill

    return deployment.options(func_or_class=FaultyServer).bind(opts)


@pytest.fixture(scope="module")
def base_url(long_context_export, tmp_path_factory) -> str:
    caps = {"max_prompt_chars": MAX_PROMPT_CHARS, "max_request_bytes": MAX_REQUEST_BYTES, "max_choices": MAX_CHOICES}
    args = one_replica_args(long_context_export, tmp_path_factory.mktemp("sd"), **caps)
    with running_app(args, build=build_faulty) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def loaded(long_context_export):
    return load_model_dir(long_context_export)


@pytest.fixture(scope="module")
def token_of(loaded) -> dict[str, int]:
    """Token id of each token string the API shows (decoded text, or "bytes:..." for a partial character)."""
    tokens = TokenBytes(loaded.tokenizer)
    return {tokens.text(i): i for i in range(loaded.tokenizer.get_vocab_size(with_added_tokens=True))}


def post(base_url: str, path: str = "/v1/completions", **body) -> requests.Response:
    return requests.post(f"{base_url}{path}", json=body, timeout=60)


def stats(base_url: str) -> dict:
    return requests.get(f"{base_url}/v1/engine/stats", timeout=10).json()


def forward_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """log_softmax of GPT.forward over ``ids``: row t is the distribution of the token after ids[t]."""
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([ids]))
    return torch.log_softmax(logits[0].float(), dim=-1)


# ---- (a) the official SDK against the live server ------------------------------------------------------


def test_sdk_completion_and_stream_agree(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "prompt": "The history of the town", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    (choice,) = full.choices
    assert full.object == "text_completion" and choice.finish_reason == "length" and full.usage.completion_tokens == 12
    stream = client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_sdk_n_samples_and_prompt_lists_are_ordered_and_reproducible(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 1234, "extra_body": {"ignore_eos": True}}
    two = client.completions.create(prompt="Once upon a time", n=2, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text != two.choices[1].text  # independent samples
    again = client.completions.create(prompt="Once upon a time", n=2, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]  # seeded: reproducible
    one = client.completions.create(prompt="Once upon a time", **kwargs)
    assert one.choices[0].text == two.choices[0].text  # sample 0 uses the request's own seed
    prompts = ["Once upon a time", "In the beginning"]
    both = client.completions.create(prompt=prompts, n=2, **kwargs)
    # OpenAI's order: prompt-major, index = prompt * n + sample; each prompt's samples as if sent alone.
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    second = client.completions.create(prompt=prompts[1], n=2, **kwargs)
    assert [c.text for c in both.choices] == [c.text for c in two.choices] + [c.text for c in second.choices]
    assert both.usage.completion_tokens == 4 * 8
    streamed = client.completions.create(prompt=prompts, n=2, stream=True, **kwargs)
    texts = collections.defaultdict(str)
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(4)] == [c.text for c in both.choices]


def test_sdk_token_id_prompts_equal_text_prompts(client: openai.OpenAI, loaded) -> None:
    text = "The river flows"
    ids = loaded.tokenizer.encode(text).ids
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = client.completions.create(prompt=text, **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == by_text
    pair = client.completions.create(prompt=[ids, ids[:2]], **kwargs)
    assert pair.choices[0].text == by_text and len(pair.choices) == 2
    echoed = client.completions.create(prompt=ids, echo=True, **kwargs).choices[0].text
    assert echoed == text + by_text


def test_sdk_chat_and_chat_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0}
    chat = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens <= 10
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    two = client.chat.completions.create(**{**kwargs, "temperature": 1.0}, n=2, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    with_logprobs = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    content_lps = with_logprobs.choices[0].logprobs.content
    assert content_lps and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content_lps)


def test_sdk_chat_uses_the_configured_template(client: openai.OpenAI, loaded) -> None:
    # The default template: "{role}: {content}\n" per message, then "assistant:" (serve/config.py).
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    want = len(loaded.tokenizer.encode("user: Hello\nassistant:").ids)
    assert chat.usage.prompt_tokens == want


def test_sdk_accepts_neutral_defaults(client: openai.OpenAI, base_url: str) -> None:
    neutral = {
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
        "user": "test",
        "seed": None,
        "stop": None,
    }
    done = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, best_of=1, echo=False, logprobs=None, suffix=None, **neutral
    )
    assert done.choices[0].finish_reason in ("stop", "length")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=False, **neutral
    )
    assert chat.choices[0].message.role == "assistant"
    # Explicit nulls for every optional field, as some clients send them: the defaults apply.
    shared = ("model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user")
    nulls = dict.fromkeys((*shared, "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "best_of"))
    assert post(base_url, prompt="x", suffix=None, echo=None, **nulls).status_code == 200
    chat_nulls = {k: v for k, v in nulls.items() if k != "best_of"}
    resp = post(base_url, "/v1/chat/completions", messages=[{"role": "user", "content": "x"}], **chat_nulls)
    assert resp.status_code == 200, resp.text
    assert post(base_url, prompt="x", best_of=2, n=2, max_tokens=1).status_code == 200  # best_of == n


def test_sdk_model_routes(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"


# ---- (b) logprobs come from the model --------------------------------------------------------------------


def test_echo_logprobs_with_max_tokens_0_equal_the_forward_pass(client: openai.OpenAI, loaded, token_of) -> None:
    """How lm-evaluation-harness scores a loglikelihood: echo, logprobs, max_tokens 0."""
    text = "The quick brown fox jumps over the lazy dog. Then it slept."
    scored = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=3)
    (choice,) = scored.choices
    lp = choice.logprobs
    ids = [loaded.eot_id, *loaded.tokenizer.encode(text).ids]
    assert choice.text == text and scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert len(lp.tokens) == len(ids) - 1 and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI: the first token has none
    assert lp.text_offset == [len(loaded.tokenizer.decode(ids[1 : i + 1])) for i in range(len(ids) - 1)]
    want = forward_logprobs(loaded, ids)
    for t in range(1, len(ids) - 1):  # token ids[t + 1] is predicted by row t
        assert lp.token_logprobs[t] == pytest.approx(float(want[t, ids[t + 1]]), abs=1e-5)
        kth = float(want[t].topk(3).values[-1])
        assert lp.tokens[t] in lp.top_logprobs[t]  # OpenAI: the scored token is always among them
        for token, value in lp.top_logprobs[t].items():
            assert value == pytest.approx(float(want[t, token_of[token]]), abs=1e-5)
            assert value >= kth - 1e-5 or token == lp.tokens[t]  # the top 3, plus the scored token


def test_a_token_prompt_that_starts_a_document_is_scored_as_sent(client: openai.OpenAI, loaded) -> None:
    """lm-evaluation-harness sends [<|endoftext|>, tokens...] with echo, logprobs and max_tokens 1: the server must
    not add a second document-start token (it would shift every position), and the echo starts with the client's."""
    ids = [loaded.eot_id, *loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids]
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    assert scored.usage.prompt_tokens == len(ids)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None  # the prompt, then 1 generated
    want = forward_logprobs(loaded, ids)  # the forward pass over exactly the ids sent
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, ids[t]]), abs=1e-5)


def test_greedy_generated_logprobs_equal_the_forward_pass(client: openai.OpenAI, loaded, token_of) -> None:
    prompt = "In 2012 the company"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    prompt_ids = [loaded.eot_id, *loaded.tokenizer.encode(prompt).ids]
    generated = [token_of[t] for t in lp.tokens]
    assert loaded.tokenizer.decode(generated) == out.choices[0].text
    want = forward_logprobs(loaded, prompt_ids + generated)
    for i, token in enumerate(generated):
        row = len(prompt_ids) - 1 + i
        assert lp.token_logprobs[i] == pytest.approx(float(want[row, token]), abs=1e-5)
        # Greedy: the sampled token is the most likely one; lm-eval's is_greedy compares exactly this way.
        assert lp.token_logprobs[i] == max(lp.top_logprobs[i].values())
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


# ---- (1) caps and a large prompt that must not stall the replica ------------------------------------------


def test_near_cap_prompt_does_not_stall_a_stream_or_health(base_url: str) -> None:
    """While a stream runs, a ~1 MB prompt is tokenized (seconds on this VM) and rejected for its length;
    /health and the stream's chunks keep flowing. Synchronous tokenization stalled both for the whole time."""
    corpus = " ".join(documents())
    big = (corpus * (MAX_PROMPT_CHARS // len(corpus) + 1))[: MAX_PROMPT_CHARS - 10]
    body = {"prompt": "Long", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    chunk_times: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def consume() -> None:
        with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=120) as resp:
            for line in resp.iter_lines():
                if line:
                    chunk_times.append(time.monotonic())
                    if len(chunk_times) == 5:
                        started.set()
                if stop.is_set():
                    return

    health: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(consume)
        assert started.wait(60), "the stream never started"
        t0 = time.monotonic()
        big_request = pool.submit(post, base_url, prompt=big, max_tokens=1)
        while not big_request.done():
            sent = time.monotonic()
            assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - sent)
            time.sleep(0.05)
        t1 = time.monotonic()
        resp = big_request.result()
        stop.set()
        streaming.result()
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    gaps = [b - a for a, b in itertools.pairwise(chunk_times) if t0 <= b <= t1 + 0.5]
    measured = f"big request {t1 - t0:.2f}s, /health max {max(health):.3f}s, stream gap max {max(gaps):.3f}s"
    log.info(measured)  # --log-cli-level=INFO shows the numbers behind the bounds
    # Generous bounds for a shared 2-core VM; a stall lasts as long as the tokenization (seconds).
    assert max(health) < 1.0, measured
    assert gaps and max(gaps) < 1.0, measured


def test_caps_reject_before_work_and_the_replica_stays_healthy(base_url: str) -> None:
    replica = stats(base_url)["replica"]
    over = requests.post(
        f"{base_url}/v1/completions", data=b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}', timeout=60
    )
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap is enforced on the bytes as they are read
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    streamed = requests.post(f"{base_url}/v1/completions", data=chunked(), timeout=60)
    assert streamed.status_code == 413, streamed.text
    too_long = post(base_url, prompt="x" * (MAX_PROMPT_CHARS + 1))
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "prompt_too_long"
    chat_long = post(base_url, "/v1/chat/completions", messages=[{"role": "user", "content": "x" * MAX_PROMPT_CHARS}])
    assert chat_long.status_code == 400 and chat_long.json()["error"]["param"] == "messages"
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert post(base_url, prompt="still fine", max_tokens=2).status_code == 200
    assert stats(base_url)["replica"] == replica


# ---- (2) every response counted once ------------------------------------------------------------------------


def request_counts(base_url: str) -> collections.Counter:
    """raylm_server_requests_total by (status_code, finish_reason), scraped from the replica's own endpoint."""
    port = stats(base_url)["metrics_port"]
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if line.startswith("raylm_server_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
            key = (labels["status_code"].strip('"'), labels["finish_reason"].strip('"'))
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_every_response_is_counted_once(base_url: str) -> None:
    # Earlier tests' aborted streams are counted when the replica notices them: start from a quiet replica.
    deadline = time.monotonic() + 30
    while stats(base_url)["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    before = request_counts(base_url)
    sent: collections.Counter = collections.Counter()

    def expect(resp: requests.Response, status: int, reason: str) -> None:
        assert resp.status_code == status, resp.text
        sent[(str(status), reason)] += 1

    expect(post(base_url, prompt="a", max_tokens=2, ignore_eos=True), 200, "length")
    streamed = requests.post(
        f"{base_url}/v1/completions",
        json={"prompt": "a", "max_tokens": 2, "ignore_eos": True, "stream": True},
        timeout=60,
    )
    expect(streamed, 200, "length")
    expect(requests.get(f"{base_url}/v1/models", timeout=10), 200, "none")
    expect(post(base_url, prompt="a", max_tokens="2"), 400, "error")
    surrogate = requests.post(
        f"{base_url}/v1/completions",
        data=b'{"prompt": "a\\ud800b"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    expect(surrogate, 400, "error")
    assert "surrogate" in surrogate.json()["error"]["message"]
    expect(post(base_url, prompt="a", model="gpt-4"), 404, "error")
    expect(requests.get(f"{base_url}/v1/models/gpt-4", timeout=10), 404, "error")
    expect(requests.get(f"{base_url}/v1/nothing-here", timeout=10), 404, "error")
    expect(requests.get(f"{base_url}/v1/completions", timeout=10), 405, "error")
    expect(requests.post(f"{base_url}/v1/completions", data=b"x" * (MAX_REQUEST_BYTES + 1), timeout=60), 413, "error")
    expect(post(base_url, prompt=RAISE_IN_HANDLER), 500, "error")  # an unhandled exception in the handler
    expect(post(base_url, prompt="a", seed=FAIL_IN_ENGINE_SEED), 500, "error")  # a failed engine step
    failed_stream = requests.post(
        f"{base_url}/v1/completions", json={"prompt": "a", "seed": FAIL_IN_ENGINE_SEED, "stream": True}, timeout=60
    )
    assert failed_stream.status_code == 200  # the headers went out first; the error is an SSE event
    events = list(sse_events(failed_stream.iter_lines()))
    assert events[0]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
    sent[("500", "error")] += 1
    # A client that leaves mid-stream: counted as an abort once the replica notices.
    gone = requests.post(
        f"{base_url}/v1/completions",
        json={"prompt": "Long", "max_tokens": 900, "ignore_eos": True, "stream": True},
        stream=True,
        timeout=60,
    )
    next(gone.iter_lines())
    gone.close()
    sent[("499", "abort")] += 1

    deadline = time.monotonic() + 30
    while (delta := request_counts(base_url) - before) != sent and time.monotonic() < deadline:
        time.sleep(0.2)
    assert delta == sent


# ---- (c) bad inputs ----------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1], ["a"]]}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [[1, 2], []], "n": 0}, "n"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [[5], [70000]]}, "prompt"),
    ({"prompt": ["x"] * (MAX_CHOICES + 1)}, "prompt"),
    ({"prompt": "x", "n": MAX_CHOICES + 1}, "n"),
    ({"prompt": ["x", "y"], "n": MAX_CHOICES // 2 + 1}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"50": 5}}, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": -1}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "word " * 1100, "max_tokens": 0, "echo": True}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "x", "stop": ["a\ud800"]}, "stop"),
]

BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, "model"),
]


def test_bad_inputs_get_openai_errors_and_the_replica_survives(base_url: str) -> None:
    replica = stats(base_url)["replica"]
    cases = [("/v1/completions", body, param) for body, param in BAD_COMPLETIONS]
    cases += [("/v1/chat/completions", body, param) for body, param in BAD_CHATS]
    for path, body, param in cases:
        raw = json.dumps(body).encode()  # json.dumps writes a lone surrogate as the escape a client would send
        resp = requests.post(f"{base_url}{path}", data=raw, headers={"content-type": "application/json"}, timeout=60)
        assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (path, body, error)
        assert error["param"] == param, (path, body, error)
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert post(base_url, prompt="fine", max_tokens=2).status_code == 200
    assert stats(base_url)["replica"] == replica  # same process: nothing crashed or restarted
