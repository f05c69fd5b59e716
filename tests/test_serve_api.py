"""The OpenAI-compatible API on a real Ray Serve and a real vLLM engine, driven by the official ``openai`` SDK and by
raw HTTP.

One module-scoped app (one Ray start, one vLLM engine in eager mode): the untrained 4-layer, 1024-context
Llama-style model of ``llama_long_context_export`` (grouped-query attention, an untied output projection; GPT-2's
export is compared with transformers through vLLM in test_cluster_run.py), served through ``serve.app.build_app``
with both deployments wrapped by test-only subclasses that fail or hold on demand (a marker model name makes the
ingress raise; a marker seed makes the engine fail before or in the middle of a stream, or hold a stream after its
first event until the test lets it go), so that 500s and requests in flight can be provoked without any switch in
production code.

Covered here: /health and /v1/models with the lineage; the SDK's completions, streaming, chat and chat streaming,
n > 1, lists of prompts, token-id prompts, logprobs and echo; prompt and generated logprobs equal to ``transformers``
on the same export within 1e-4, for 32 greedy tokens too; the chat template; the request caps (413, 400) checked
before any work; a near-cap prompt that must not hold up a running stream or /health; /health at 200 while slow
streams hold every engine slot; API keys; every response counted once in ``raylm_server_requests_total``; bad inputs
that all get OpenAI error bodies while the replicas survive; and, last (it stops the app), draining (serve/drain.py):
three streams are open when ``drain()`` starts, two the test then lets finish, one it never does, which the deadline
must cut.
``python -m serve`` itself draining on SIGTERM (the signal, the exit code, no processes left) is tested in
test_cluster_run.py's rerun, as `make demo` runs it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import torch
from multinode import wait_for
from serve_fixtures import documents, one_replica_args, running_app, sse_events

from ground.formats import EOT
from serve.app import compose_app
from serve.drain import RETRY_AFTER_S, drain, get_control, remove_control
from serve.engine import ExportServer
from serve.ingress import ENGINE_HEALTH_TIMEOUT_S, RayLMIngress
from serve.model_dir import hf_model_dir, read_export

pytestmark = pytest.mark.ray

MODEL = "long-context"  # llama_long_context_export's directory name, which the server reports as its model id
MAX_PROMPT_CHARS = 1_000_000  # large, so that tokenizing a near-cap prompt takes seconds
MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_CHOICES = 16
API_KEY = "sk-test-4f1c"
RAISE_IN_INGRESS = "<test: raise in the ingress>"  # FaultyIngress raises for a request naming this model
FAIL_IN_ENGINE_SEED = 777_777  # FaultyEngine fails a request with this seed (a stream after its first chunk)
RELEASED_SEED, HELD_SEED = 101, 202  # streams the drain test lets finish, and the one it never does
SLOW_SEED = 303  # FaultyEngine sends this stream's events one at a time, SLOW_EVENT_S apart
SLOW_EVENT_S = 0.5
DRAIN_TIMEOUT_S = 10.0  # the drain's deadline: far longer than the test's checks between drain start and release
LOGPROB_TOL = 1e-4  # vLLM and transformers run the same fp32 weights through different kernels


def build_faulty(gate: Path):
    """build_app's application, with both deployments subclassed so that they fail or hold on demand (test-only).

    The engine fails a request with seed FAIL_IN_ENGINE_SEED (before or in the middle of its stream), holds a
    stream with seed RELEASED_SEED or HELD_SEED after its first event until ``gate`` / ``<seed>`` exists (the drain
    test's streams in flight), and slows a stream with seed SLOW_SEED to one event every SLOW_EVENT_S. Defined
    inside the builder: cloudpickle sends local classes by value, and the replicas cannot import this module.
    """
    import asyncio

    class FaultyIngress(RayLMIngress):
        def _check_model(self, requested: str | None) -> None:
            if requested == RAISE_IN_INGRESS:
                raise RuntimeError("injected by the test: a bug in the ingress")
            super()._check_model(requested)

    class FaultyEngine(ExportServer):
        async def completions(self, request, raw_request_info=None):
            stream = await super().completions(request, raw_request_info)
            if request.seed == FAIL_IN_ENGINE_SEED:
                return failing(request, stream)
            if request.seed in (RELEASED_SEED, HELD_SEED):
                return held(request, stream)
            if request.seed == SLOW_SEED:
                return slow(stream)
            return stream

    async def failing(request, stream):
        if not request.stream:
            raise RuntimeError("injected by the test: the engine failed")
        async for item in stream:
            # An item is a batch of SSE events (Ray Serve LLM's stream batching): the first batch can hold the whole
            # stream and [DONE], so only its first event goes out before the failure.
            yield item[:1]
            raise RuntimeError("injected by the test: the engine failed mid-stream")

    async def held(request, stream):
        first = True
        async for item in stream:
            if not first:
                yield item
                continue
            # On a slow machine the first batch held all eight tokens and [DONE], and the client was done before the
            # hold: only its first event goes out before the gate.
            yield item[:1]
            while not (gate / str(request.seed)).exists():
                await asyncio.sleep(0.05)
            first = False
            if item[1:]:
                yield item[1:]

    async def slow(stream):
        async for item in stream:
            for event in item:
                yield [event]
                await asyncio.sleep(SLOW_EVENT_S)

    def build(args: dict):
        return compose_app(args, FaultyEngine, FaultyIngress)

    return build


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sd")


@pytest.fixture(scope="module")
def base_url(
    llama_long_context_export: Path, sd_dir: Path, gate: Path, tmp_path_factory: pytest.TempPathFactory
) -> str:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the test's key\n{API_KEY}\n")
    caps = {"max_prompt_chars": MAX_PROMPT_CHARS, "max_request_bytes": MAX_REQUEST_BYTES, "max_choices": MAX_CHOICES}
    args = one_replica_args(llama_long_context_export, sd_dir, api_key_file=str(keys), **caps)
    with running_app(args, build=build_faulty(gate)) as url:
        try:
            yield url
        finally:
            remove_control("raylm")  # the drain's control actor (detached), left by the drain test


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(llama_long_context_export: Path):
    """``transformers`` on the Hugging Face directory vLLM serves (the same conversion, made here): the oracle."""
    import transformers

    hf_dir = hf_model_dir(llama_long_context_export)
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return model, tokenizer


def reference_logprobs(reference, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over ``ids``: row t is the distribution of the token after ids[t]."""
    model, _ = reference
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def post(base_url: str, path: str = "/v1/completions", key: str | None = API_KEY, **body) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{base_url}{path}", json=body, headers=headers, timeout=120)


def get(base_url: str, path: str, key: str | None = API_KEY) -> requests.Response:
    return requests.get(f"{base_url}{path}", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)


# ---- the model and its lineage ---------------------------------------------------------------------------------


def test_health_and_models_list_the_lineage(
    base_url: str, client: openai.OpenAI, llama_long_context_export: Path
) -> None:
    export = read_export(llama_long_context_export)
    health = requests.get(f"{base_url}/health", timeout=10).json()  # open: a load balancer carries no key
    assert health == {"status": "ok", "model": MODEL, "lineage_id": export.lineage_id}
    (card,) = get(base_url, "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["lineage_id"] == export.lineage_id and card["lineage"] == export.lineage
    assert card["context_length"] == 1024 and card["owned_by"] == "raylm"
    assert client.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"
    # Each answer names the weights that gave it (what the canary checks through a rolling update).
    completion = client.completions.create(model=MODEL, prompt="The town", max_tokens=2)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert completion.system_fingerprint == chat.system_fingerprint == export.lineage_id


def test_api_keys_are_required_on_the_api_and_not_on_health(base_url: str) -> None:
    missing = post(base_url, key=None, prompt="x", max_tokens=1)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    wrong = post(base_url, key="sk-not-a-key", prompt="x", max_tokens=1)
    assert wrong.status_code == 401 and "valid API key" in wrong.json()["error"]["message"]
    assert get(base_url, "/v1/models", key=None).status_code == 401
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert post(base_url, prompt="x", max_tokens=1).status_code == 200


# ---- the SDK against the live server ---------------------------------------------------------------------------


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
    prompts = ["Once upon a time", "In the beginning"]
    both = client.completions.create(prompt=prompts, n=2, **kwargs)
    # OpenAI's order: prompt-major, index = prompt * n + sample.
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.usage.completion_tokens == 4 * 8
    streamed = client.completions.create(prompt=prompts, n=2, stream=True, **kwargs)
    texts = collections.defaultdict(str)
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert sorted(texts) == [0, 1, 2, 3] and all(texts.values())


def test_sdk_token_id_prompts_equal_text_prompts(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    text = "The river flows"
    ids = tokenizer(text).input_ids  # what the server's tokenizer makes of a text: the document start, then the text
    assert ids[0] == tokenizer.convert_tokens_to_ids(EOT)
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = client.completions.create(prompt=text, **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == by_text
    pair = client.completions.create(prompt=[ids, ids[:2]], **kwargs)
    assert pair.choices[0].text == by_text and len(pair.choices) == 2


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


def test_sdk_chat_renders_the_configured_template_and_stops_the_turn(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    # The default template: "{role}: {content}\n" per message, then "assistant:" (serve/config.py), after EOT.
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    want = tokenizer(f"{EOT}user: Hello\nassistant:", add_special_tokens=False).input_ids
    assert chat.usage.prompt_tokens == len(want)
    # The chat stops end the turn: whatever the model writes, "\nuser:" never appears in a reply.
    long = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=1.0, seed=3, n=4)
    assert all("\nuser:" not in c.message.content for c in long.choices)


# ---- logprobs come from the model ------------------------------------------------------------------------------


def test_echo_logprobs_equal_transformers_on_the_export(client: openai.OpenAI, reference) -> None:
    """How lm-evaluation-harness and the canary score text: echo, logprobs, max_tokens 1."""
    _, tokenizer = reference
    text = "The quick brown fox jumps over the lazy dog. Then it slept."
    scored = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True, logprobs=3, temperature=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    ids = tokenizer(text).input_ids  # EOT, then the text
    assert scored.usage.prompt_tokens == len(ids) and choice.text.startswith(text)
    assert lp.tokens[0] == EOT and lp.token_logprobs[0] is None  # the document start has no log-probability
    assert "".join(lp.tokens[1 : len(ids)]) == text
    want = reference_logprobs(reference, ids)
    for t in range(1, len(ids)):  # token ids[t] is predicted by row t - 1
        assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, ids[t]]), abs=LOGPROB_TOL)
        assert lp.tokens[t] in lp.top_logprobs[t]  # OpenAI: the scored token is always among them
        for value in lp.top_logprobs[t].values():
            assert value <= float(want[t - 1].max()) + LOGPROB_TOL


def test_a_token_prompt_is_scored_as_sent(client: openai.OpenAI, reference) -> None:
    """lm-evaluation-harness sends its own token ids: the server adds no document-start token to them."""
    _, tokenizer = reference
    ids = tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    scored = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = scored.choices[0].logprobs
    assert scored.usage.prompt_tokens == len(ids) and len(lp.token_logprobs) == len(ids) + 1
    want = reference_logprobs(reference, ids)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, ids[t]]), abs=LOGPROB_TOL)


def test_greedy_generated_logprobs_equal_transformers(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    prompt = "In 2012 the company"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    prompt_ids = tokenizer(prompt).input_ids
    ids = list(prompt_ids)
    for i in range(len(lp.tokens)):
        row = reference_logprobs(reference, ids)[-1]
        token = int(row.argmax())  # greedy: transformers' most likely next token
        assert lp.token_logprobs[i] == pytest.approx(float(row[token]), abs=LOGPROB_TOL)
        # lm-eval's is_greedy: no listed alternative is more likely. (>=, not ==: top_logprobs is keyed by text, and
        # two byte-fragment tokens that both decode to "" keep one entry, which may not be the chosen one's.)
        assert lp.token_logprobs[i] >= max(lp.top_logprobs[i].values())
        ids.append(token)
    # The same text, up to how each decoder shows bytes of an unfinished UTF-8 character at the end (U+FFFD).
    text = tokenizer.decode(ids[len(prompt_ids) :])
    assert text.rstrip("\ufffd") == out.choices[0].text.rstrip("\ufffd")


# ---- caps, and a large prompt that must not hold up the others ---------------------------------------------------


def test_caps_reject_before_work(base_url: str) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    over = requests.post(
        f"{base_url}/v1/completions", data=b'{"prompt": "' + b"x" * MAX_REQUEST_BYTES + b'"}', headers=auth, timeout=60
    )
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap is enforced on the bytes as they are read
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 1):
            yield b"x" * 65536
        yield b'"}'

    streamed = requests.post(f"{base_url}/v1/completions", data=chunked(), headers=auth, timeout=60)
    assert streamed.status_code == 413, streamed.text
    too_long = post(base_url, prompt="x" * (MAX_PROMPT_CHARS + 1))
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "prompt_too_long"
    chat_long = post(
        base_url, "/v1/chat/completions", messages=[{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]
    )
    assert chat_long.status_code == 400 and chat_long.json()["error"]["param"] == "messages"
    many = post(base_url, prompt=["x"] * (MAX_CHOICES + 1), max_tokens=1)
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"
    too_many_n = post(base_url, prompt="x", n=MAX_CHOICES + 1, max_tokens=1)
    assert too_many_n.status_code == 400 and too_many_n.json()["error"]["param"] == "n"
    assert post(base_url, prompt="still fine", max_tokens=2).status_code == 200


def test_a_near_cap_prompt_does_not_hold_up_a_stream_or_health(base_url: str) -> None:
    """While a stream runs, ~1 MB prompts under the character cap are tokenized by the engine (about a second each
    here) and refused for their length; meanwhile /health answers and the stream's chunks keep coming. Events, not a
    clock: answers and chunks are counted that arrived while a big request was still being worked on. Ray Serve LLM
    sends a stream's events in batches, so one short window can fall between two batches: up to `big_tries` big
    requests are sent one after another while the stream runs, and it is a failure only if no window saw a chunk."""
    big_tries = 6
    corpus = " ".join(documents())
    big = (corpus * (MAX_PROMPT_CHARS // len(corpus) + 1))[: MAX_PROMPT_CHARS - 10]
    body = {"prompt": "Long", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    started, stream_over, stop = threading.Event(), threading.Event(), threading.Event()
    in_flight = threading.Event()  # set only while a big request is being worked on
    chunks_during: list[int] = []

    def consume() -> None:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        try:
            with requests.post(f"{base_url}/v1/completions", json=body, headers=auth, stream=True, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        started.set()
                        if in_flight.is_set():
                            chunks_during.append(1)
                    if stop.is_set():
                        return
        finally:
            stream_over.set()

    health_during, refusals = 0, []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(consume)
        assert started.wait(120), "the stream never started"
        for _ in range(big_tries):
            if chunks_during or stream_over.is_set():
                break
            big_done = threading.Event()
            in_flight.set()
            big_request = pool.submit(post, base_url, prompt=big, max_tokens=1)
            big_request.add_done_callback(lambda _, done=big_done: (in_flight.clear(), done.set()))
            while not big_done.is_set():
                assert requests.get(f"{base_url}/health", timeout=30).status_code == 200
                health_during += not big_done.is_set()
                time.sleep(0.05)
            refusals.append(big_request.result())
        stop.set()
        streaming.result()
    for resp in refusals:
        assert resp.status_code == 400 and "context length" in resp.json()["error"]["message"], resp.text
    assert health_during >= 1 and chunks_during, (len(refusals), health_during, len(chunks_during))


def test_health_stays_200_while_every_engine_slot_holds_a_stream(base_url: str, client: openai.OpenAI) -> None:
    """Every one of the engine replica's max_ongoing_requests slots holds a slow stream, each longer than the
    ingress's health timeout: the engine's own health check then queues behind them, and only the streams' chunks
    show it is alive. A busy engine is not a dead one: /health answers 200 throughout, and every stream still runs to
    its last token."""
    slots = one_replica_args(Path(), Path())["max_ongoing_requests"]
    tokens = int(4 * ENGINE_HEALTH_TIMEOUT_S / SLOW_EVENT_S)  # each stream outlasts four health timeouts
    started = [threading.Event() for _ in range(slots)]

    def slow_stream(first_chunk: threading.Event) -> str | None:
        stream = client.completions.create(
            model=MODEL,
            prompt="The library",
            max_tokens=tokens,
            stream=True,
            seed=SLOW_SEED,
            extra_body={"ignore_eos": True},
        )
        finish_reason = None
        for chunk in stream:
            first_chunk.set()
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return finish_reason

    with concurrent.futures.ThreadPoolExecutor(slots) as pool:
        streams = [pool.submit(slow_stream, event) for event in started]
        for event in started:
            assert event.wait(120), "a stream never sent its first chunk"
        answers, polled_at = [], []
        while not any(stream.done() for stream in streams):  # every slot still held
            polled_at.append(time.monotonic())
            health = requests.get(f"{base_url}/health", timeout=30)
            answers.append(health.status_code if health.status_code == 200 else (health.status_code, health.text))
            time.sleep(0.5)
        finish_reasons = [stream.result(timeout=120) for stream in streams]
    assert answers and all(answer == 200 for answer in answers), answers
    # The polls spanned more than a health timeout with every slot held: a queued health check would have timed out.
    assert polled_at[-1] - polled_at[0] > ENGINE_HEALTH_TIMEOUT_S, polled_at
    assert finish_reasons == ["length"] * slots, finish_reasons  # and every stream ran to its last token


# ---- every response counted once --------------------------------------------------------------------------------


def ingress_metrics_port(sd_dir: Path) -> int:
    files = sd_dir.glob("raylm-serve-*.json")
    (target,) = [t for f in files for group in json.loads(f.read_text()) for t in group["targets"]]
    return int(target.rsplit(":", 1)[1])


def request_counts(port: int) -> collections.Counter:
    """raylm_server_requests_total by (status_code, finish_reason), scraped from the ingress's own endpoint."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts: collections.Counter = collections.Counter()
    for line in text.splitlines():
        if line.startswith("raylm_server_requests_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
            key = (labels["status_code"].strip('"'), labels["finish_reason"].strip('"'))
            counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_every_response_is_counted_once(base_url: str, sd_dir: Path) -> None:
    port = ingress_metrics_port(sd_dir)
    # Earlier tests' abandoned streams are counted (499) when the ingress next writes to them: start once the counts
    # have settled.
    before, deadline = request_counts(port), time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(2)
        if (now := request_counts(port)) == before:
            break
        before = now
    sent: collections.Counter = collections.Counter()

    def expect(resp: requests.Response, status: int, reason: str) -> None:
        assert resp.status_code == status, resp.text
        sent[(str(status), reason)] += 1

    expect(post(base_url, prompt="a", max_tokens=2, ignore_eos=True), 200, "length")
    expect(post(base_url, prompt="a", max_tokens=2, ignore_eos=True, stream=True), 200, "length")
    expect(get(base_url, "/v1/models"), 200, "none")
    expect(post(base_url, prompt="a", max_tokens="two"), 400, "error")
    expect(post(base_url, prompt="a", model="gpt-4"), 404, "error")
    expect(get(base_url, "/v1/models/gpt-4"), 404, "error")
    expect(get(base_url, "/v1/nothing-here"), 404, "error")
    expect(get(base_url, "/v1/completions"), 405, "error")
    expect(post(base_url, key=None, prompt="a"), 401, "error")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    too_big = requests.post(f"{base_url}/v1/completions", data=b"x" * (MAX_REQUEST_BYTES + 1), headers=auth, timeout=60)
    expect(too_big, 413, "error")
    expect(post(base_url, prompt="a", model=RAISE_IN_INGRESS), 500, "error")  # an unhandled exception in the ingress
    expect(post(base_url, prompt="a", seed=FAIL_IN_ENGINE_SEED), 500, "error")  # the engine failed
    failed_stream = post(base_url, prompt="a", seed=FAIL_IN_ENGINE_SEED, max_tokens=20, ignore_eos=True, stream=True)
    assert failed_stream.status_code == 200  # the headers went out first; the error is an SSE event, then [DONE]
    events = list(sse_events(failed_stream.iter_lines()))
    assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]", events
    sent[("500", "error")] += 1
    # A client that leaves mid-stream: counted as an abort.
    gone = requests.post(
        f"{base_url}/v1/completions",
        json={"prompt": "Long", "max_tokens": 900, "ignore_eos": True, "stream": True},
        headers=auth,
        stream=True,
        timeout=60,
    )
    next(gone.iter_lines())
    gone.close()
    sent[("499", "abort")] += 1

    deadline = time.monotonic() + 30
    while (delta := request_counts(port) - before) != sent and time.monotonic() < deadline:
        time.sleep(0.2)
    assert delta == sent


# ---- bad inputs ---------------------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    {"prompt": []},
    {"prompt": [1, "a"]},
    {"prompt": "x", "n": 0},
    {"prompt": [-1]},
    {"prompt": [10**9]},
    {"prompt": "x", "logprobs": -1},
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "word " * 1100, "max_tokens": 1, "echo": True},
    {"prompt": None},
    {"prompt": "x", "temperature": -1},
]

BAD_CHATS = [
    {},
    {"messages": "hi"},
    {"messages": [{"content": "hi"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"},
]


def test_bad_inputs_get_openai_errors_and_the_replicas_survive(base_url: str) -> None:
    cases = [("/v1/completions", body) for body in BAD_COMPLETIONS] + [("/v1/chat/completions", b) for b in BAD_CHATS]
    auth = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    for path, body in cases:
        resp = requests.post(f"{base_url}{path}", data=json.dumps(body).encode(), headers=auth, timeout=60)
        assert 400 <= resp.status_code < 500, (path, body, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (path, body, error)
    # Each named: the body as sent (json.dumps writes a lone surrogate as its \\u escape, as any JSON encoder may), the
    # field the error must name, a word its message must say.
    named = [
        ("/v1/completions", json.dumps({"prompt": "a\ud800b", "max_tokens": 2}).encode(), "prompt", "Unicode"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x\udfff"}]}).encode(),
         "messages[0].content", "Unicode"),
        ("/v1/completions", json.dumps({"prompt": "x", "max_token": 2}).encode(), "max_token", "unrecognized"),
        ("/v1/completions", json.dumps({"prompt": "x", "n": MAX_CHOICES + 1}).encode(), "n", "at most"),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), "messages", "empty"),
        ("/v1/completions", b'{"prompt": "a\xff\xfeb", "max_tokens": 2}', None, "JSON"),  # not UTF-8
        ("/v1/completions", b"prompt=hello", None, "JSON"),  # not JSON
    ]  # fmt: skip
    for path, raw, param, word in named:
        resp = requests.post(f"{base_url}{path}", data=raw, headers=auth, timeout=60)
        assert 400 <= resp.status_code < 500, (path, raw, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert (param is None or error["param"] == param) and word in error["message"], (path, raw, error)
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert post(base_url, prompt="fine", max_tokens=2).status_code == 200


# ---- draining: last, since it stops the app ----------------------------------------------------------------------


def open_stream(client: openai.OpenAI, seed: int, first_chunk: threading.Event) -> tuple[list, Exception | None]:
    """A streamed completion through the openai SDK; sets ``first_chunk`` once its first chunk is in. Returns the
    chunks and the error the SDK raised (an SSE error event), if any."""
    chunks: list = []
    try:
        stream = client.completions.create(
            model=MODEL, prompt="The library", max_tokens=8, stream=True, seed=seed, extra_body={"ignore_eos": True}
        )
        for chunk in stream:
            chunks.append(chunk)
            first_chunk.set()
    except openai.APIError as exc:
        return chunks, exc
    return chunks, None


def test_drain_finishes_the_streams_in_flight_refuses_new_ones_and_cuts_at_the_deadline(
    base_url: str, client: openai.OpenAI, gate: Path
) -> None:
    seeds = (RELEASED_SEED, RELEASED_SEED, HELD_SEED)
    started = [threading.Event() for _ in seeds]
    with concurrent.futures.ThreadPoolExecutor(len(seeds) + 1) as pool:
        streams = [pool.submit(open_stream, client, seed, event) for seed, event in zip(seeds, started, strict=True)]
        for event in started:
            assert event.wait(60), "a stream never sent its first chunk"
        assert requests.get(f"{base_url}/health", timeout=30).status_code == 200  # serving, three streams held
        drained = pool.submit(drain, "raylm", DRAIN_TIMEOUT_S)

        # While draining: /health says so at once (a load balancer stops routing), a new request gets 503 + Retry-After.
        def draining_health() -> dict | None:  # the body of a 503
            health = requests.get(f"{base_url}/health", timeout=30)
            return health.json() if health.status_code == 503 else None

        assert wait_for(draining_health, 30, "/health to answer 503")["status"] == "draining"
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="The library", max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "server_shutting_down"
        assert refused.value.response.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert not drained.done()  # three requests are still in flight

        (gate / str(RELEASED_SEED)).touch()  # the two released streams run to their end
        for stream in streams[:2]:
            chunks, error = stream.result(timeout=60)
            assert error is None and chunks[-1].choices[0].finish_reason == "length", (chunks, error)  # all 8 tokens
        assert not drained.done()  # the held one is still in flight until the deadline

        # Cut at the deadline: the SDK reads the stream's error event and raises it (not a hang, not a silent end).
        chunks, error = streams[2].result(timeout=DRAIN_TIMEOUT_S + 60)
        assert len(chunks) >= 1 and isinstance(error, openai.APIError), (chunks, error)
        assert error.code == "server_shutting_down" and "shutdown timeout" in error.message, error
        result = drained.result(timeout=60)
    # The held stream's generator still waits in the engine: let it end, or the app's shutdown waits out the
    # replica's graceful shutdown timeout for it.
    (gate / str(HELD_SEED)).touch()
    assert (result.drained, result.aborted, result.rejected) == (2, 1, 1), result
    assert result.seconds >= DRAIN_TIMEOUT_S and result.unreported == 0 and result.replicas == 1
    assert result.line().startswith("drained 2, aborted 1, in ")


def test_a_drain_cut_short_is_undone_by_the_next_deploy(base_url: str, client: openai.OpenAI) -> None:
    """``python -m serve`` killed mid-drain (SIGTERM, then SIGKILL when a grace period is shorter than
    ``--shutdown-timeout``) leaves the app's drain control draining, and the replicas answering 503. The next deploy
    removes that control first (``serve_until_stopped``); the replicas follow their control, so they find a fresh one
    and serve again rather than answer 503 forever."""
    import ray

    ray.get(get_control("raylm").start.remote())  # a drain began, and its driver is gone
    wait_for(lambda: requests.get(f"{base_url}/health", timeout=30).status_code == 503, 30, "/health to answer 503")
    assert remove_control("raylm")  # what a deploy does before serve.run
    wait_for(lambda: requests.get(f"{base_url}/health", timeout=30).status_code == 200, 60, "/health to answer 200")
    assert client.completions.create(model=MODEL, prompt="The library", max_tokens=4).choices[0].text
