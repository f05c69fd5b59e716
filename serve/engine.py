"""Continuous batching over a KV cache: the replica's decode loop.

Requests wait in a FIFO queue until a cache slot is free; between two decode steps the loop admits
waiting requests (prefill, first token), then runs one batched ``decode`` step for every running
sequence. A request that arrives while others are generating therefore joins the running batch at the
next step instead of waiting for the batch to drain (what ``@serve.batch`` would do: it batches calls,
not tokens).

Threading: the forward passes are blocking torch calls, so they run on one worker thread
(``run_in_executor``) while the event loop keeps serving HTTP, streaming chunks and accepting requests.
Only the loop task touches the running set and the cache, so admission, cancellation and slot freeing
need no locks. A cancelled request (client disconnect) is only *marked*; the loop frees its slot
before the next step. An exception in a step fails the requests of that step, never the loop.
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
from serve.decoding import KVCache, decode, prefill, sample, token_logprobs
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


@dataclass
class Event:
    """What a request's consumer receives: new text, and at the end a finish reason."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    scheduled_at: float | None = None  # monotonic time the request got a slot (first event only)


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

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt token ids, after the end-of-text token that starts every document in training data."""
        return [self.loaded.eot_id, *self.loaded.tokenizer.encode(text).ids]

    async def generate(self, prompt_ids: list[int], params: SamplingParams, arrival: float) -> AsyncIterator[Event]:
        """Stream events for one request; closing or cancelling the iterator aborts it and frees its slot."""
        if len(prompt_ids) - 1 + params.max_tokens > self.loaded.block_size:
            raise ValueError("prompt and max_tokens exceed the context")  # the app checks this first, with a 400
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

    async def score(self, text: str) -> tuple[list[int], list[float]]:
        """Token ids of ``text`` and log p of each given the document start, on the engine's thread."""
        ids = self.encode_prompt(text)
        loop = asyncio.get_running_loop()
        tensor = torch.tensor(ids, device=self.device)
        logps = await loop.run_in_executor(self._executor, token_logprobs, self.model, tensor)
        return ids[1:], logps.cpu().tolist()

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
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
                self.stats.failed += 1
            return
        for seq, token in results:
            self._accept(seq, token)

    def _prefill_step(self, seq: _Sequence) -> list[tuple[_Sequence, int]]:
        ids = torch.tensor(seq.prompt_ids, device=self.device)
        # Sampling runs on the CPU, where the per-request torch.Generator lives: one vocab-sized copy per token.
        logits = prefill(self.model, self.cache, seq.slot, ids)[-1].cpu()
        seq.position = len(seq.prompt_ids)
        return [(seq, sample(logits, seq.params.temperature, seq.params.top_p, seq.generator))]

    def _decode_step(self, batch: list[_Sequence]) -> list[tuple[_Sequence, int]]:
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
            out.append((seq, sample(logits[i], seq.params.temperature, seq.params.top_p, seq.generator)))
        return out

    def _accept(self, seq: _Sequence, token: int) -> None:
        """Record a sampled token; emits text and decides whether the sequence is done."""
        if seq.finished or seq.cancelled:
            return
        first = seq.completion_tokens == 0
        scheduled = seq.scheduled_at if first else None
        if token == self.loaded.eot_id and not seq.params.ignore_eos:
            # The end-of-text token is a stop, not output (OpenAI does not count or return it either).
            self._finish(seq, "stop", scheduled_at=scheduled)
            return
        seq.completion_tokens += 1
        seq.last_token = token
        text = seq.stream.push(token)
        if seq.stream.stopped:
            self._finish(seq, "stop", text=text, scheduled_at=scheduled)
        elif seq.completion_tokens >= seq.params.max_tokens:
            self._finish(seq, "length", text=text + seq.stream.flush(), scheduled_at=scheduled)
        else:
            seq.events.put_nowait(Event(text, seq.completion_tokens, scheduled_at=scheduled))

    def _finish(
        self,
        seq: _Sequence,
        reason: str,
        text: str = "",
        error: str | None = None,
        scheduled_at: float | None = None,
    ) -> None:
        seq.finished = True
        self.stats.finished += 1
        self._release(seq)
        seq.events.put_nowait(Event(text, seq.completion_tokens, reason, error=error, scheduled_at=scheduled_at))

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
