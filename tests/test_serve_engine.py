"""serve/decoding.py and serve/engine.py without Ray: the cached forward must equal GPT.forward, and the
batching engine must produce exactly what a plain uncached greedy loop produces."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from serve.decoding import KVCache, decode, prefill, sample, token_logprobs
from serve.detok import TextOffsets, TextStream, TokenBytes
from serve.engine import Engine, SamplingParams
from serve.model_dir import ModelDirError, load_model_dir
from train.model import GPT, GPTConfig

ATOL = 1e-5


@pytest.fixture(scope="module")
def random_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=48, vocab_size=97)).eval()


@pytest.fixture(scope="module")
def loaded(tiny_export):
    return load_model_dir(tiny_export)


def test_prefill_matches_forward_at_every_position(random_gpt: GPT) -> None:
    ids = torch.randint(0, 97, (40,))
    cache = KVCache(random_gpt, n_slots=2)
    cached = prefill(random_gpt, cache, 1, ids)
    full, _ = random_gpt(ids[None])
    assert cached.shape == (40, 97)
    torch.testing.assert_close(cached, full[0], atol=ATOL, rtol=0)


def test_incremental_decode_matches_forward_at_every_position(random_gpt: GPT) -> None:
    """Prefill 5 tokens, then feed the rest one at a time: logits at every position equal the full pass."""
    ids = torch.randint(0, 97, (48,))  # the whole context: the last position is block_size - 1
    full, _ = random_gpt(ids[None])
    cache = KVCache(random_gpt, n_slots=3)
    got = [prefill(random_gpt, cache, 2, ids[:5])]
    for pos in range(5, 48):
        step = decode(random_gpt, cache, torch.tensor([2]), torch.tensor([pos]), ids[pos : pos + 1])
        got.append(step)
    torch.testing.assert_close(torch.cat(got), full[0], atol=ATOL, rtol=0)


def test_batched_decode_of_unequal_sequences_matches_forward(random_gpt: GPT) -> None:
    """Three sequences of different lengths in non-adjacent slots advance in one batched step each."""
    lengths, slots = [3, 17, 9], [4, 0, 2]
    seqs = [torch.randint(0, 97, (n + 6,)) for n in lengths]
    cache = KVCache(random_gpt, n_slots=5)
    for seq, n, slot in zip(seqs, lengths, slots, strict=True):
        prefill(random_gpt, cache, slot, seq[:n])
    for step in range(6):
        positions = torch.tensor([n + step for n in lengths])
        tokens = torch.stack([seq[n + step] for seq, n in zip(seqs, lengths, strict=True)])
        logits = decode(random_gpt, cache, torch.tensor(slots), positions, tokens)
        for i, seq in enumerate(seqs):
            full, _ = random_gpt(seq[None, : lengths[i] + step + 1])
            torch.testing.assert_close(logits[i], full[0, -1], atol=ATOL, rtol=0)


def test_decode_refuses_positions_beyond_the_context(random_gpt: GPT) -> None:
    cache = KVCache(random_gpt, n_slots=1)
    with pytest.raises(ValueError, match="block_size"):
        decode(random_gpt, cache, torch.tensor([0]), torch.tensor([48]), torch.tensor([1]))


def test_token_logprobs_equal_forward_log_softmax_across_windows(random_gpt: GPT) -> None:
    ids = torch.randint(0, 97, (120,))  # three windows of 48
    got = token_logprobs(random_gpt, ids)
    assert got.shape == (119,)
    want = []
    for start in range(0, 119, 48):
        window = ids[start : start + 49]
        logits, _ = random_gpt(window[None, :-1])
        want.append(torch.log_softmax(logits[0], -1).gather(1, window[1:, None])[:, 0])
    torch.testing.assert_close(got, torch.cat(want), atol=ATOL, rtol=0)


def test_sampling_is_greedy_at_zero_seeded_otherwise_and_nucleus_truncates() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample(logits, 0.0, 1.0, None) == 1
    draws = [sample(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    many = {sample(logits, 1.0, 1.0, g) for g in [torch.Generator().manual_seed(0)] for _ in range(200)}
    assert many == {0, 1, 2, 3}
    # top_p=0.5 keeps only the most likely token (it alone holds ~50%): always index 1.
    top = {sample(logits, 1.0, 0.5, g) for g in [torch.Generator().manual_seed(0)] for _ in range(100)}
    assert top == {1}
    assert sample(logits, 1e-30, 1.0, None) == 1  # tiny temperature: one-hot, not NaN


def test_text_stream_holds_back_partial_stop_strings(loaded) -> None:
    tok = loaded.tokenizer
    ids = tok.encode("the cat sat on the mat").ids
    stream = TextStream(tok, stops=("on the",))
    out = "".join(stream.push(i) for i in ids if not stream.stopped)
    assert stream.stopped
    assert out == "the cat sat "
    # A partial UTF-8 character is never released: "é" is two bytes, possibly two byte-level tokens.
    ids = tok.encode("café au lait").ids
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + stream.flush() == "café au lait"


def reference_greedy(model: GPT, prompt_ids: list[int], n: int) -> list[int]:
    """Uncached greedy decoding with the training forward: the ground truth for the engine."""
    ids = list(prompt_ids)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


async def _generate(engine: Engine, prompt: str, params: SamplingParams) -> tuple[str, str, int]:
    text, reason, n = "", None, 0
    async for event in engine.generate(engine.encode_prompt(prompt), params, time.monotonic()):
        text += event.text
        reason, n = event.finish_reason, event.completion_tokens
    return text, reason, n


def test_concurrent_requests_share_decode_steps_and_match_uncached_greedy(loaded) -> None:
    prompts = ["The city council", "In 2012 the company", "Water is", "A new study of"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list, dict]:
        engine = Engine(loaded, max_batch_size=4)
        results = await asyncio.gather(*(_generate(engine, p, params) for p in prompts))
        stats = engine.snapshot()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(run())
    assert stats["max_batch"] > 1, stats  # sequences advanced together in one decode step
    assert stats["free_slots"] == 4 and stats["running"] == 0
    for prompt, (text, reason, n) in zip(prompts, results, strict=True):
        ids = [loaded.eot_id, *loaded.tokenizer.encode(prompt).ids]
        want = loaded.tokenizer.decode(reference_greedy(loaded.model, ids, 12))
        assert (text, reason, n) == (want, "length", 12)


def test_seeded_sampling_is_reproducible_whatever_the_batch(loaded) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)

    async def run() -> tuple[str, list]:
        engine = Engine(loaded, max_batch_size=4)
        alone = await _generate(engine, "The weather", params)
        others = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
        crowd = await asyncio.gather(
            _generate(engine, "The weather", params),
            _generate(engine, "Something else entirely", others),
            _generate(engine, "The weather", params),
        )
        await engine.shutdown()
        return alone, crowd

    alone, crowd = asyncio.run(run())
    assert crowd[0] == alone and crowd[2] == alone


async def wait_until(condition, timeout: float = 30.0) -> None:
    """Yield to the event loop until ``condition()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.001)


def test_cancelled_request_frees_its_slot_and_waiting_requests_proceed(loaded) -> None:
    async def run() -> dict:
        engine = Engine(loaded, max_batch_size=1)
        prompt = engine.encode_prompt("Hello")
        # As many tokens as the context allows: the slot stays taken until the request is closed.
        long = SamplingParams(max_tokens=loaded.block_size - (len(prompt) - 1), temperature=0.0, ignore_eos=True)
        gen = engine.generate(prompt, long, time.monotonic())
        first = await gen.__anext__()
        assert first.completion_tokens == 1
        assert engine.snapshot()["free_slots"] == 0
        # A second request waits for the only slot; closing the first (what a disconnect does) frees it.
        waiter = asyncio.create_task(_generate(engine, "Next", SamplingParams(max_tokens=3, temperature=0.0)))
        await wait_until(lambda: engine.num_waiting == 1)
        assert engine.num_running == 1  # the long request still holds the slot
        await gen.aclose()
        _, reason, _ = await asyncio.wait_for(waiter, timeout=30)
        assert reason in ("length", "stop")
        stats = engine.snapshot()
        await engine.shutdown()
        return stats

    stats = asyncio.run(run())
    assert stats["cancelled"] == 1 and stats["free_slots"] == 1 and stats["running"] == 0


def test_stop_sequence_and_eos_end_generation(loaded) -> None:
    async def run() -> tuple:
        engine = Engine(loaded, max_batch_size=2)
        free = await _generate(engine, "The", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        # Stop on a piece of what greedy decoding is known to produce: the output ends right before it.
        stop = free[0][5:8]
        stopped = await _generate(engine, "The", SamplingParams(max_tokens=20, temperature=0.0, stop=(stop,)))
        await engine.shutdown()
        return free, stop, stopped

    free, stop, stopped = asyncio.run(run())
    assert stopped[1] == "stop"
    assert stopped[0] == free[0][: free[0].index(stop)]


def test_logprobs_are_the_forward_pass_log_softmax_for_prompt_and_generated_tokens(loaded) -> None:
    """Echo scoring (prefill logits) and greedy generation (decode logits) report log_softmax(GPT.forward)."""
    prompt = "The city council met on"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=True)

    async def run() -> list:
        engine = Engine(loaded, max_batch_size=2)
        ids = engine.encode_prompt(prompt)
        events = [e async for e in engine.generate(ids, params, time.monotonic())]
        scored_only = [e async for e in engine.generate(ids, SamplingParams(0, logprobs=0, prompt_logprobs=True), 0.0)]
        await engine.shutdown()
        return ids, events, scored_only

    ids, events, scored_only = asyncio.run(run())
    generated = [lp for e in events for lp in e.logprobs]
    full = ids + [lp.token for lp in generated]
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([full[:-1]]))
    want = torch.log_softmax(logits[0].float(), -1)  # row t predicts full[t + 1]
    prompt_lps = events[0].prompt_logprobs
    assert [lp.token for lp in prompt_lps] == ids[1:] and prompt_lps[0].logprob is None  # OpenAI: first is null
    for t, lp in enumerate(prompt_lps[1:] + generated, start=1):
        assert lp.logprob == pytest.approx(float(want[t, full[t + 1]]), abs=ATOL)
        top = want[t].topk(3)
        assert [tok for tok, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=ATOL)
    assert all(lp.token == lp.top[0][0] for lp in generated)  # greedy: the sampled token is the argmax
    # max_tokens 0: the prefill alone, same prompt logprobs, nothing generated.
    (only,) = scored_only
    assert (only.finish_reason, only.completion_tokens, only.text) == ("length", 0, "")
    assert [lp.logprob for lp in only.prompt_logprobs] == pytest.approx([lp.logprob for lp in prompt_lps], abs=ATOL)


def test_token_bytes_and_offsets_cover_the_text_exactly(loaded) -> None:
    """Byte-level tokens: their raw bytes concatenate to the text; offsets are character positions in it."""
    tokens = TokenBytes(loaded.tokenizer)
    text = "naïve café — 東京 🙂 end"
    ids = loaded.tokenizer.encode(text).ids
    assert tokens.byte_level and b"".join(tokens.raw(i) for i in ids) == text.encode()
    offsets = TextOffsets(tokens)
    starts = [offsets.advance(i) for i in ids]
    assert starts[0] == 0 and starts == sorted(starts) and offsets.chars == len(text)
    for i, start in zip(ids, starts, strict=True):
        shown = tokens.text(i)
        if not shown.startswith("bytes:"):  # a whole-character token sits at its offset
            assert text[start : start + len(shown)] == shown
    assert tokens.text(loaded.eot_id) == "<|endoftext|>"


def test_model_dir_errors_are_clear(tmp_path, tiny_export) -> None:
    with pytest.raises(ModelDirError, match=r"lineage\.json"):
        (tmp_path / "config.json").write_text((tiny_export / "config.json").read_text())
        load_model_dir(tmp_path)


def test_lineage_id_distinguishes_exports(loaded, worse_export_dir) -> None:
    worse = load_model_dir(worse_export_dir)
    assert worse.name == loaded.name and worse.lineage_id != loaded.lineage_id
