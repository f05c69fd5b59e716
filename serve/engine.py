"""The engine deployment: ``ExportServer``, a ``ray.serve.llm.deployment.LLMServer`` running vLLM on the export.

Before its engine starts, each replica makes the directory vLLM loads on its own node (``serve.model_dir.hf_model_dir``:
fetched from object storage into the node's cache and verified, converted from the raylm layout if needed).
Everything else is Ray Serve LLM's: the placement group, vLLM's continuous batching and paged KV cache, and vLLM's
engine metrics (TTFT, TPOT, queue time, running and waiting requests, KV-cache usage).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve.llm import LLMConfig
from ray.serve.llm.deployment import LLMServer

from serve.model_dir import hf_model_dir
from serve.tracing import add_engine_phase_spans

log = logging.getLogger(__name__)


class ModelDirOnTheNode(CallbackBase):
    """Ray Serve LLM's node initialisation, skipped: ``ExportServer`` has already made the model directory on the
    replica's node (fetched, verified, converted) before the engine starts, and the replica's placement group is
    strictly packed, so every engine worker runs on that node. Ray Serve LLM's own step would start a task on the node
    only to find that local path, at the cost of a worker process importing vLLM on every engine start.
    ``LLMConfig.callback_config`` is public; this base class is the one Ray Serve LLM ships for it (Ray is pinned)."""

    async def on_before_node_init(self) -> None:
        self.ctx.run_init_node = False


class ExportServer(LLMServer):
    """Ray Serve LLM's vLLM server, on the directory this node makes from the export (``model_source``)."""

    async def __init__(self, llm_config: LLMConfig, **kwargs: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        # LLMConfig's validator has made the loading config a model, and llm_config() gave it the export's URI.
        source = cast(str, cast(Any, llm_config.model_loading_config).model_source)
        local = await asyncio.to_thread(hf_model_dir, source)
        config = llm_config.model_copy(deep=True)
        cast(Any, config.model_loading_config).model_source = str(local)
        config._engine_config = None  # derived from the model source and cached by LLMConfig: derive it anew
        log.info("vLLM loads %s (export %s)", local, source)
        await super().__init__(config, **kwargs)
        if config.engine_kwargs.get("otlp_traces_endpoint") and not add_engine_phase_spans():
            log.warning("tracing is on but vLLM set no tracer provider: its spans are not split into phases")
