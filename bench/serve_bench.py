"""Serving benchmark: TTFT / TPOT / throughput at concurrency 1, 4, 16; batched vs unbatched; Serve vs in-process.

    python bench/serve_bench.py --model EXPORT_DIR          # an export from python -m train.export
    python bench/serve_bench.py --random-model /tmp/bench-model   # or build an untrained one first

Four configurations, each at every concurrency level, all streaming ``max_tokens`` tokens per request
with ``ignore_eos`` (so every request does the same work) and greedy decoding:

- ``engine`` batched / unbatched: serve.engine.Engine called directly in this process (asyncio tasks,
  no HTTP), with ``max_batch_size`` = the largest concurrency, or 1;
- ``serve`` batched / unbatched: the same engine inside the Ray Serve app (one replica, one CPU),
  driven over HTTP by an aiohttp client that parses the SSE stream.

TTFT is arrival (client send, or engine submit) to the first token; TPOT is (e2e - TTFT) / (tokens - 1)
per request; tokens/s is all generated tokens over the level's wall time. Ratios: batched/unbatched
tokens/s, and serve/engine latency (the cost of the HTTP proxy, routing and SSE framing).
Timing goals live here, never in tests. Results vary with machine load: run on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python bench/serve_bench.py` from anywhere

from ground.dist import free_port  # noqa: E402


@dataclass
class Level:
    mode: str
    batched: bool
    concurrency: int
    requests: int
    ttft_p50: float
    ttft_p95: float
    tpot_p50: float
    tpot_p95: float
    tokens_per_s: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(mode: str, batched: bool, c: int, samples: list[tuple[float, float, int]], wall: float) -> Level:
    ttfts = [t for t, _, _ in samples]
    tpots = [(e - t) / (n - 1) for t, e, n in samples if n > 1]
    return Level(
        mode,
        batched,
        c,
        len(samples),
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.95),
        percentile(tpots, 0.5),
        percentile(tpots, 0.95),
        sum(n for _, _, n in samples) / wall,
    )


async def drive(one_request: Any, concurrency: int, total: int) -> tuple[list[tuple[float, float, int]], float]:
    """``concurrency`` closed-loop clients share ``total`` requests; returns per-request (ttft, e2e, tokens)."""
    samples: list[tuple[float, float, int]] = []
    remaining = iter(range(total))

    async def client() -> None:
        for i in remaining:
            samples.append(await one_request(i))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def engine_levels(model_dir: str, levels: list[int], total: int, max_tokens: int, batched: bool) -> list[Level]:
    import torch

    from serve.engine import Engine, SamplingParams
    from serve.model_dir import load_model_dir

    torch.set_num_threads(1)  # what one Serve replica with num_cpus=1 uses
    loaded = load_model_dir(model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []

    async def run(c: int) -> Level:
        engine = Engine(loaded, max_batch_size=max(levels) if batched else 1)

        async def one(i: int) -> tuple[float, float, int]:
            start = time.perf_counter()
            first, n = None, 0
            async for event in engine.generate(engine.encode_prompt(f"Request {i}: the"), params, time.monotonic()):
                first = first or time.perf_counter()
                n = event.completion_tokens
            return first - start, time.perf_counter() - start, n

        await one(-1)  # warm-up
        samples, wall = await drive(one, c, total)
        await engine.shutdown()
        return summarize("engine", batched, c, samples, wall)

    for c in levels:
        out.append(asyncio.run(run(c)))
    return out


def serve_levels(base_url: str, levels: list[int], total: int, max_tokens: int, batched: bool) -> list[Level]:
    import aiohttp

    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}

    async def run(c: int) -> Level:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> tuple[float, float, int]:
                start = time.perf_counter()
                first, n = None, 0
                payload = {**body, "prompt": f"Request {i}: the", "stream_options": {"include_usage": True}}
                async with session.post(f"{base_url}/v1/completions", json=payload) as resp:
                    assert resp.status == 200, await resp.text()
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            first = first or time.perf_counter()
                        elif chunk.get("usage"):
                            n = chunk["usage"]["completion_tokens"]
                return first - start, time.perf_counter() - start, n

            await one(-1)
            samples, wall = await drive(one, c, total)
        return summarize("serve", batched, c, samples, wall)

    return [asyncio.run(run(c)) for c in levels]


def make_random_model(out: Path) -> Path:
    """An untrained GPT (6 x 384, 512-token context) with a BPE tokenizer trained on the cc_net sample."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from train.model import GPT, GPTConfig

    texts = []
    # Parenthesised: without them ``.glob`` binds to the string "ccnet-text" (AttributeError: 'str' ... 'glob').
    for path in sorted((REPO.parent / "shared" / "data" / "ccnet-text").glob("*.jsonl.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            texts += [json.loads(line)["text"] for line in fh if line.strip()]
    if not texts:
        raise SystemExit(f"{REPO.parent / 'shared' / 'data' / 'ccnet-text'}: no *.jsonl.gz to train the tokenizer on")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    config = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 512, "dropout": 0.0, "bias": True}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**config, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True)))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "vocab_size": model.config.vocab_size}))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "lineage.json").write_text(json.dumps({"step": 0, "note": "untrained, bench/serve_bench.py"}))
    return out


def table(results: list[Level]) -> str:
    rows = [
        "| mode | batching | conc | req | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.mode} | {'batched' if r.batched else 'unbatched'} | {r.concurrency} | {r.requests} | "
            f"{r.ttft_p50 * 1e3:.1f} | {r.ttft_p95 * 1e3:.1f} | {r.tpot_p50 * 1e3:.2f} | {r.tpot_p95 * 1e3:.2f} | "
            f"{r.tokens_per_s:.0f} |"
        )
    return "\n".join(rows)


def ratios(results: list[Level]) -> str:
    by = {(r.mode, r.batched, r.concurrency): r for r in results}
    rows = [
        "| conc | batched/unbatched tokens/s (serve) | batched/unbatched tokens/s (engine) "
        "| serve/engine TTFT p50 (batched) | serve/engine TPOT p50 (batched) | serve/engine tokens/s (batched) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sorted({r.concurrency for r in results}):
        sb, su, eb, eu = (
            by.get(k) for k in (("serve", True, c), ("serve", False, c), ("engine", True, c), ("engine", False, c))
        )
        if not all((sb, su, eb, eu)):
            continue
        rows.append(
            f"| {c} | {sb.tokens_per_s / su.tokens_per_s:.2f} | {eb.tokens_per_s / eu.tokens_per_s:.2f} | "
            f"{sb.ttft_p50 / eb.ttft_p50:.2f} | {sb.tpot_p50 / eb.tpot_p50:.2f} | "
            f"{sb.tokens_per_s / eb.tokens_per_s:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_bench.py", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="export dir to serve")
    source.add_argument("--random-model", help="write an untrained 6x384 export here and benchmark it")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--output", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = args.model or str(make_random_model(Path(args.random_model)))

    results: list[Level] = []
    for batched in (True, False):
        results += engine_levels(model_dir, levels, args.requests, args.max_tokens, batched)
        print(table(results[-len(levels) :]), flush=True)

    import ray
    from ray import serve

    from serve.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as sd:
        try:
            for batched in (True, False):
                app = {
                    "model": model_dir,
                    "num_replicas": 1,
                    "max_batch_size": max(levels) if batched else 1,
                    "max_ongoing_requests": 4 * max(levels),
                    "metrics_sd_dir": sd,
                }
                serve.run(build_app(app), name="bench", route_prefix="/")
                results += serve_levels(base, levels, args.requests, args.max_tokens, batched)
                print(table(results[-len(levels) :]), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()

    print("\n" + table(results) + "\n\n" + ratios(results))
    if args.output:
        Path(args.output).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
