"""Continuous batching over a KV cache: the replica's decode loop.

Requests wait in a FIFO queue until a cache slot is free; between two decode steps the loop admits
waiting requests (prefill, first token), then runs one batched ``decode`` step for every running
sequence. A request that arrives while others are generating therefore joins the running batch at the
next step instead of waiting for the batch to drain (what ``@serve.batch`` would do: it batches calls,
not tokens).

Threading: the forward passes are blocking torch calls, so they run on one worker thread
(``run_in_executor``) while the event loop keeps serving HTTP, streaming chunks and accepting requests.
Everything per token that costs CPU happens on that thread too: sampling, log-probabilities,
detokenization and stop-string search; the loop only hands the finished events to their consumers.
Only the loop task touches the running set and the cache slots, so admission, cancellation and slot
freeing need no locks; a sequence's decoding state (tokens, text) is touched only by the worker, between
two awaits of the loop. A cancelled request (client disconnect) is only *marked*; the loop frees its slot
before the next step. An exception in a step fails the requests of that step, never the loop.

Tokenizing runs on the default executor (``tokenize``), not the engine's thread: a long prompt must not
hold up everyone's decode step. It uses ``Tokenizer.encode_batch``, which releases the GIL; ``encode``
does not, and a 1 MB prompt encoded on any thread stalled the event loop for its whole ~1.9 s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from serve.config import DEFAULT_MAX_BATCH_SIZE
from serve.decoding import KVCache, TokenLogprob, decode, prefill, sample, token_logprob_entries, token_logprobs
from serve.detok import TextStream
from serve.model_dir import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of generated tokens with this many alternatives each (None: none). With
    # prompt_logprobs, the prompt's tokens get them too, from the prefill logits (echo).
    logprobs: int | None = None
    prompt_logprobs: bool = False
    # The prompt's first token is the client's own document-start token (a token-id prompt that begins with
    # it, as lm-evaluation-harness sends): the server adds none, and the echo includes it (with no logprob).
    client_start: bool = False


@dataclass
class Event:
    """What a request's consumer receives: new text, and at the end a finish reason."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    scheduled_at: float | None = None  # monotonic time the request got a slot (first event only)
    # The token this event adds, when logprobs were asked for. The end-of-text token that stops a sequence
    # is included (a scorer asking for one token must get one), though it is neither text nor counted.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # first event only, with params.prompt_logprobs


@dataclass
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    stream: TextStream
    arrival: float
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    generator: torch.Generator | None = None
    slot: int = -1
    last_token: int = -1
    position: int = 0  # where last_token sits in the cache
    completion_tokens: int = 0
    scheduled_at: float | None = None
    finished: bool = False
    cancelled: bool = False


@dataclass
class EngineStats:
    steps: int = 0
    max_batch: int = 0
    batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


class Engine:
    def __init__(self, loaded: LoadedModel, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.model.wte.weight.device
        self.max_batch_size = max_batch_size
        self.cache = KVCache(self.model, max_batch_size)
        self.free_slots: list[int] = list(range(max_batch_size - 1, -1, -1))
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.running: dict[int, _Sequence] = {}
        self.stats = EngineStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raylm-engine")
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # ---- public API (event-loop side) -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def loop_error(self) -> BaseException | None:
        """The exception that ended the decode loop, if it died (a failing step fails only its requests,
        so this means a bug in the loop itself); None while it runs, before it starts, or after shutdown."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Prompt token ids, each after the end-of-text token that starts every document in training data.

        ``encode_batch`` because it releases the GIL while it works (``encode`` holds it); call it off the
        event loop, through ``tokenize``, in a server.
        """
        return [[self.loaded.eot_id, *enc.ids] for enc in self.loaded.tokenizer.encode_batch(texts)]

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode_prompts([text])[0]

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """``encode_prompts`` on the default executor: neither the event loop nor the decode thread waits."""
        return await asyncio.to_thread(self.encode_prompts, texts)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, arrival: float) -> AsyncIterator[Event]:
        """Stream events for one request; closing or cancelling the iterator aborts it and frees its slot.

        ``max_tokens`` 0 runs the prefill only (for ``prompt_logprobs``) and finishes with "length".
        """
        # The end-of-text start token takes a position; so does every generated token but the last, which is
        # never fed back. The app checks this first, with a 400.
        if len(prompt_ids) + max(params.max_tokens, 1) - 1 > self.loaded.block_size:
            raise ValueError("prompt and max_tokens exceed the context")
        seq = _Sequence(
            prompt_ids=prompt_ids,
            params=params,
            stream=TextStream(self.loaded.tokenizer, params.stop),
            arrival=arrival,
        )
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self.waiting.append(seq)
        self._ensure_loop()
        try:
            while True:
                event = await seq.events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                # Disconnect (CancelledError in the consumer) or early close: the loop frees the slot.
                seq.cancelled = True
                self._wake()

    async def score(self, ids: list[int]) -> list[float]:
        """log p of each of ``ids[1:]`` given what precedes it (``ids`` from ``tokenize``), on the engine's thread."""
        loop = asyncio.get_running_loop()
        tensor = torch.tensor(ids, device=self.device)
        logps = await loop.run_in_executor(self._executor, token_logprobs, self.model, tensor)
        return logps.cpu().tolist()

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        return {
            "max_batch_size": self.max_batch_size,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "free_slots": len(self.free_slots),
            "steps": s.steps,
            "max_batch": s.max_batch,
            "batch_sizes": {str(k): v for k, v in sorted(s.batch_sizes.items())},
            "admitted": s.admitted,
            "finished": s.finished,
            "cancelled": s.cancelled,
            "failed": s.failed,
            "kv_cache_bytes": self.cache.nbytes(),
        }

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=False)

    # ---- the loop ---------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="raylm-engine-loop")
        self._wake()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            self._reap_cancelled()
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admitted = []
            while self.waiting and self.free_slots:
                seq = self.waiting.popleft()
                seq.slot = self.free_slots.pop()
                seq.scheduled_at = time.monotonic()
                self.running[seq.slot] = seq
                admitted.append(seq)
            self.stats.admitted += len(admitted)
            for seq in admitted:
                await self._guarded(loop, [seq], self._prefill_step, seq)
            batch = [s for s in self.running.values() if not s.finished and not s.cancelled and s.last_token >= 0]
            # Sequences admitted in this round already got their first token from prefill; decoding them in
            # the same round is fine (their last_token is set) and keeps the batch as full as possible.
            if batch:
                await self._guarded(loop, batch, self._decode_step, batch)
            # Yield to the event loop even when every step was fast, so HTTP handlers and streams progress.
            await asyncio.sleep(0)

    async def _guarded(self, loop: asyncio.AbstractEventLoop, seqs: list[_Sequence], fn: Any, arg: Any) -> None:
        try:
            results = await loop.run_in_executor(self._executor, fn, arg)
        except Exception as exc:  # a failing step fails its requests, never the replica
            log.exception("engine step failed")
            for seq in seqs:
                self._deliver(seq, Event("", seq.completion_tokens, "error", error=f"{type(exc).__name__}: {exc}"))
                self.stats.failed += 1
            return
        for seq, event in results:
            self._deliver(seq, event)

    # ---- worker thread: one forward pass, then each sequence's token, logprobs and text ------------------

    def _prefill_step(self, seq: _Sequence) -> list[tuple[_Sequence, Event]]:
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        logits = prefill(self.model, self.cache, seq.slot, ids)
        seq.position = len(seq.prompt_ids)
        prompt_logprobs = None
        if seq.params.prompt_logprobs and seq.params.client_start:
            # The client's own first token is the document start: echoed with no logprob, then every later
            # token scored by the logits at the position before it.
            first = TokenLogprob(int(ids[0]), None)
            prompt_logprobs = [first, *token_logprob_entries(logits[:-1], ids[1:], seq.params.logprobs or 0)]
        elif seq.params.prompt_logprobs and len(ids) > 1:
            # ids[0] is the document-start token, not the client's: the client's first token gets no logprob
            # (OpenAI's convention), each later one is scored by the logits at the position before it.
            first = TokenLogprob(int(ids[1]), None)
            prompt_logprobs = [first, *token_logprob_entries(logits[1:-1], ids[2:], seq.params.logprobs or 0)]
        elif seq.params.prompt_logprobs:
            prompt_logprobs = []
        if seq.params.max_tokens == 0:
            event = Event("", 0, "length", scheduled_at=seq.scheduled_at)
        else:
            # Sampling runs on the CPU, where the per-request torch.Generator lives: one vocab-sized copy per token.
            event = self._advance(seq, logits[-1:].cpu())
        event.prompt_logprobs = prompt_logprobs
        return [(seq, event)]

    def _decode_step(self, batch: list[_Sequence]) -> list[tuple[_Sequence, Event]]:
        slots = torch.tensor([s.slot for s in batch], device=self.device)
        positions = torch.tensor([s.position for s in batch], device=self.device)
        tokens = torch.tensor([s.last_token for s in batch], device=self.device)
        logits = decode(self.model, self.cache, slots, positions, tokens).cpu()
        self.stats.steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        self.stats.batch_sizes[len(batch)] += 1
        out = []
        for i, seq in enumerate(batch):
            seq.position += 1
            out.append((seq, self._advance(seq, logits[i : i + 1])))
        return out

    def _advance(self, seq: _Sequence, logits: torch.Tensor) -> Event:
        """Sample the next token from (1, vocab) logits and turn it into the sequence's next event."""
        params = seq.params
        token = sample(logits[0], params.temperature, params.top_p, seq.generator)
        first = seq.completion_tokens == 0
        scheduled = seq.scheduled_at if first else None
        logprobs = []
        if params.logprobs is not None:
            logprobs = token_logprob_entries(logits, torch.tensor([token]), params.logprobs)
        if token == self.loaded.eot_id and not params.ignore_eos:
            # The end-of-text token is a stop, not output (OpenAI does not count or return it as text either).
            return Event("", seq.completion_tokens, "stop", scheduled_at=scheduled, logprobs=logprobs)
        seq.completion_tokens += 1
        seq.last_token = token
        text = seq.stream.push(token)
        if seq.stream.stopped:
            reason = "stop"
        elif seq.completion_tokens >= params.max_tokens:
            reason, text = "length", text + seq.stream.flush()
        else:
            reason = None
        return Event(text, seq.completion_tokens, reason, scheduled_at=scheduled, logprobs=logprobs)

    # ---- event loop: hand events over, free slots -------------------------------------------------------

    def _deliver(self, seq: _Sequence, event: Event) -> None:
        if seq.finished or seq.cancelled:
            return
        if event.finish_reason is not None:
            seq.finished = True
            self.stats.finished += 1
            self._release(seq)
        seq.events.put_nowait(event)

    def _release(self, seq: _Sequence) -> None:
        if seq.slot >= 0 and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.free_slots.append(seq.slot)
        seq.slot = -1

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.running.values() if s.cancelled and not s.finished]:
            self._release(seq)
            seq.finished = True
            self.stats.cancelled += 1
        if any(s.cancelled for s in self.waiting):
            self.stats.cancelled += sum(s.cancelled for s in self.waiting)
            self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
