"""Test models for serve/: a tiny GPT trained briefly on real Common Crawl text, in train.export's layout.

``build_export`` trains a byte-level BPE tokenizer and a 2-layer GPT with plain torch (AdamW, a few
hundred steps, a few seconds on one core) on the cc_net documents in data/ccnet-text,
holding every 5th document out, and writes ``model.safetensors`` (the model's state dict),
``config.json`` (GPTConfig fields), ``tokenizer.json`` and ``lineage.json`` — the files
``train.export.load_exported`` and serve.model_dir read. ``worse_export`` writes the same model with
its weight matrices' entries shuffled: same shapes and tokenizer, a clearly worse language model,
which is what the canary must catch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ccnet import load_ccnet_texts
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ground.dist import free_port
from ground.storage import Location
from train.export import LINEAGE
from train.model import GPT, GPTConfig
from train.run_dir import publish_files

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128, "dropout": 0.0, "bias": True}


def documents() -> list[str]:
    return load_ccnet_texts()


def split_documents() -> tuple[list[str], list[str]]:
    """(train, held-out): every 5th document is held out, as the canary's unseen text."""
    docs = documents()
    return [d for i, d in enumerate(docs) if i % 5 != 1], [d for i, d in enumerate(docs) if i % 5 == 1]


def train_tokenizer(docs: list[str], vocab_size: int = 512) -> Tokenizer:
    # The pipeline's own BPE trainer, so served test models tokenize like real ones. Imported here, not at
    # the top: conftest loads this module for every session, and tests of other stages must not need it.
    from pipeline.steps.tokenize import TokenizeConfig
    from pipeline.steps.tokenize import train_tokenizer as train_pipeline_tokenizer

    return train_pipeline_tokenizer(docs, TokenizeConfig(vocab_size=vocab_size, min_frequency=1))


def train_model(tokenizer: Tokenizer, docs: list[str], steps: int = 150, batch: int = 8, seed: int = 0) -> GPT:
    """A hundred-odd AdamW steps on random block_size windows of the training documents.

    One torch thread: the test machine's two cores are shared, and two threads contending with other
    processes made a step five times slower than one thread did.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from ground.formats import EOT

    torch.manual_seed(seed)
    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for doc in docs:
        ids.extend([eot, *tokenizer.encode(doc).ids])
    data = torch.tensor(ids)
    config = GPTConfig(**TINY, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    block = config.block_size
    for _ in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (batch,))
        x = torch.stack([data[s : s + block] for s in starts])
        y = torch.stack([data[s + 1 : s + block + 1] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    return model.eval()


def write_export(model: GPT, tokenizer: Tokenizer, out: Path, lineage: dict) -> Path:
    """The layout of train.export.export(): the files load_exported and the server read."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(model.config), indent=2))
    tokenizer.save(str(out / "tokenizer.json"))
    publish_files(out, Location(out), LINEAGE, lineage)  # lineage.json last, listing every file's size and sha256
    return out


def build_export(out: Path, steps: int = 150) -> Path:
    train_docs, _ = split_documents()
    tokenizer = train_tokenizer(train_docs)
    model = train_model(tokenizer, train_docs, steps=steps)
    lineage = {
        "data_manifest_sha256": None,
        "data_dir": "tests/serve_fixtures.py (cc_net head documents, every 5th held out)",
        "step": steps,
        "train_config": {"model": TINY, "optimizer": "AdamW lr=3e-3", "batch": 8},
    }
    return write_export(model, tokenizer, out, lineage)


def random_export(out: Path, seed: int = 0, **config: Any) -> Path:
    """An untrained GPT (any shape, either arch) with the cc_net tokenizer: for tests that need a long context or a
    slow model rather than a good one (a 1024-token generation takes seconds, long enough to disconnect from)."""
    train_docs, _ = split_documents()
    tokenizer = train_tokenizer(train_docs)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**config, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))).eval()
    lineage = {"step": 0, "note": f"untrained, seed {seed}", "train_config": {"model": config}}
    return write_export(model, tokenizer, out, lineage)


def worse_export(src: Path, out: Path, seed: int = 1) -> Path:
    """Same shapes and tokenizer, every weight matrix's entries permuted: a broken model that still loads."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    state = load_file(str(src / "model.safetensors"))
    shuffled = {
        k: (v.flatten()[torch.randperm(v.numel(), generator=gen)].view_as(v) if v.dim() >= 2 else v).contiguous()
        for k, v in state.items()
    }
    save_file(shuffled, str(out / "model.safetensors"))
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(src / name, out / name)
    lineage = {k: v for k, v in json.loads((src / LINEAGE).read_text()).items() if k != "files"}
    lineage["note"] = f"weights shuffled (seed {seed}) from {src}"
    publish_files(out, Location(out), LINEAGE, lineage)
    return out


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained tiny model's export dir, built once per test session (about 10 s on one core)."""
    return build_export(tmp_path_factory.mktemp("serve-models") / "tiny-ccnet")


@pytest.fixture(scope="session")
def long_context_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve-models-long") / "long-context"
    return random_export(out, n_layer=4, n_head=4, n_embd=128, block_size=1024)


@pytest.fixture(scope="session")
def llama_long_context_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """long_context_export's size as a Llama-style model: grouped-query attention (2 k/v heads for 4 query heads)
    and an untied output projection, so that serving it exercises every part of the llama export."""
    out = tmp_path_factory.mktemp("serve-models-llama") / "long-context"
    shape = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 1024}
    return random_export(out, **shape, arch="llama", n_kv_head=2, tie_embeddings=False)


@pytest.fixture(scope="session")
def worse_export_dir(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return worse_export(tiny_export, tmp_path_factory.mktemp("serve-models-worse") / "tiny-ccnet")


def one_replica_args(export: Path, sd_dir: Path, **extra: Any) -> dict:
    """build_app's args for the API tests: one replica of ``export``, 4 batch slots, 16 requests in flight."""
    return {
        "model": str(export),
        "num_replicas": 1,
        "max_batch_size": 4,
        "max_ongoing_requests": 16,
        "metrics_sd_dir": str(sd_dir),
        **extra,
    }


def fast_start(app_args: dict) -> dict:
    """``app_args`` with vLLM in eager mode (no torch.compile): the engine starts in seconds rather than a minute,
    which is what a test pays once per module; what is served is the same function."""
    return {**app_args, "engine_kwargs": {"enforce_eager": True, **app_args.get("engine_kwargs", {})}}


@contextlib.contextmanager
def running_app(
    app_args: dict, app_name: str = "raylm", port: int | None = None, build: Callable[[dict], Any] | None = None
) -> Iterator[str]:
    """A local Ray (2 CPUs) with Serve's HTTP proxy on a free loopback port, running build_app(app_args)
    (or ``build(app_args)``, a test's variant of it).

    Yields the base URL. Module-scoped fixtures use it, so each test module pays one Ray start.
    """
    import ray
    from ray import serve

    from serve.app import build_app
    from serve.controller_env import controller_env

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = port or free_port()
        serve.start(  # as python -m serve starts it
            http_options={"host": "127.0.0.1", "port": port},
            controller_options={"runtime_env": {"env_vars": controller_env()}},
        )
        serve.run((build or build_app)(fast_start(app_args)), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def sse_events(lines: Iterable[bytes | str]) -> Iterator[dict | str]:
    """Parse an SSE body: yields each ``data:`` payload (dicts, and the final "[DONE]")."""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)
