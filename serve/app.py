"""The serving application: vLLM, hosted by Ray Serve LLM, under raylm's own OpenAI ingress.

Two deployments, built from ``ray.serve.llm``'s public pieces: the engine (``serve.engine.ExportServer``, vLLM on the
export) and the ingress (``serve.ingress.RayLMIngress``: caps, keys, accounting, lineage, canary, traces). This module
lays them out: the engine's ``LLMConfig`` (vLLM's arguments, resources, replicas) and the application.

Deploy with ``python -m serve --model DIR`` or ``serve run serve/serve_config.yaml`` (``build_app``).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.llm import LLMConfig, build_llm_deployment
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

from serve.api_key_file import key_digest, read_key_digests
from serve.config import DEFAULT_AUTOSCALING, DEFAULT_MAX_ONGOING_REQUESTS, AppArgs, chat_template_jinja
from serve.engine import ExportServer, ModelDirOnTheNode
from serve.ingress import ENDPOINTS, RayLMIngress, api
from serve.model_dir import ExportInfo, check_cpu_attention, read_export

log = logging.getLogger(__name__)


def llm_config(opts: AppArgs, export: ExportInfo) -> LLMConfig:
    """The engine's ``LLMConfig``: the export as the model source, vLLM's arguments, resources and replicas."""
    engine_kwargs = {
        "dtype": "float32",  # the export's precision (serve/config.py: engine_kwargs); overridable
        **opts.engine_kwargs,
        **({"max_num_seqs": opts.max_batch_size} if opts.max_batch_size else {}),  # else vLLM's default for the device
        "chat_template": chat_template_jinja(opts.chat_message_template, opts.chat_assistant_prefix),
        # Each non-streamed response's system_fingerprint names the weights that answered it, the export's lineage
        # id: during a rolling update the ingress is already new while old engine replicas still answer (the canary
        # discards a run that mixed the two).
        "fingerprint_mode": "custom",
        "fingerprint_value": export.lineage_id,
    }
    if opts.tracing.endpoint:
        # vLLM's own span per request (llm_request: its queue, prefill and decode times), a child of the ingress's
        # engine span through the traceparent the ingress sends along (serve/tracing.py).
        engine_kwargs["otlp_traces_endpoint"] = opts.tracing.endpoint
    if opts.replica_gpus:
        engine_kwargs["tensor_parallel_size"] = opts.replica_gpus
        bundles = [{"CPU": opts.replica_cpus, "GPU": 1}] + [{"GPU": 1}] * (opts.replica_gpus - 1)
    else:
        bundles = [{"CPU": opts.replica_cpus}]
    deployment: dict[str, Any] = {
        "max_ongoing_requests": opts.max_ongoing_requests or DEFAULT_MAX_ONGOING_REQUESTS,
        # The replica actor itself reserves nothing: Ray Serve LLM adds its reservation to the engine's first bundle,
        # and the engine (vLLM's worker, a child of the replica) is what uses the replica_cpus the bundle reserves.
        "ray_actor_options": {"num_cpus": 0},
    }
    if opts.max_replicas_per_node is not None:
        deployment["max_replicas_per_node"] = opts.max_replicas_per_node
    deployment["max_surge_percent"] = opts.max_surge_percent  # a rolling update: new replicas ready before old stop
    if opts.num_replicas is not None:
        deployment["num_replicas"] = opts.num_replicas
    else:
        deployment["autoscaling_config"] = opts.autoscaling_config or DEFAULT_AUTOSCALING
    experimental: dict[str, Any] = {}
    if opts.stream_batching_interval_ms is not None:
        experimental["stream_batching_interval_ms"] = opts.stream_batching_interval_ms
    return LLMConfig(
        model_loading_config={"model_id": export.name, "model_source": export.uri},
        engine_kwargs=engine_kwargs,
        # One node holds the whole replica: the model directory is made there (ModelDirOnTheNode), and tensor
        # parallelism's all-reduces need the node's own interconnect.
        placement_group_config={"bundles": bundles, "strategy": "STRICT_PACK"},
        callback_config={"callback_class": ModelDirOnTheNode},
        # vLLM's CPU build sizes its KV cache from this variable (the CUDA build ignores it).
        runtime_env={
            "env_vars": {
                **opts.tracing.engine_env(),
                **opts.engine_env,
                "VLLM_CPU_KVCACHE_SPACE": str(opts.cpu_kv_cache_gib),
            }
        },
        deployment_config=deployment,
        experimental_configs=experimental,
        log_engine_metrics=True,
    )


def build_app(args: dict[str, Any]) -> Application:
    """Application builder for ``serve run serve.app:build_app model=DIR`` and serve_config.yaml.

    Takes a plain dict (not an annotated pydantic model) because Serve only converts the args for builders whose
    annotation is a class, and postponed annotations here are strings; and only that dict, because Serve calls a
    builder with exactly one parameter.
    """
    return compose_app(args, ExportServer, RayLMIngress)


def compose_app(args: dict[str, Any], engine_cls: type[ExportServer], ingress_cls: type[RayLMIngress]) -> Application:
    """The application of ``build_app``, with the two deployments' classes given (a subclass wraps one, as the
    fault-injecting tests do)."""
    opts = AppArgs.model_validate(args)
    # Read here, on the driver: a relative path means the caller's working directory, not the replica's; a URI stays
    # one, and each replica fetches the export into its own node's cache.
    export = read_export(opts.model, opts.model_name)
    if not opts.replica_gpus:
        check_cpu_attention(export)
    digests = read_key_digests(opts.api_key_file) if opts.api_key_file else ()
    canary, canary_key = None, None
    if digests:
        # The canary's own key, made for this deployment and gone with it: no operator key leaves the driver.
        canary_key = secrets.token_urlsafe(32)
        digests = (*digests, key_digest(canary_key))
    if opts.canary_evalset:
        from serve.canary import CanaryDeployment

        canary = CanaryDeployment.bind(  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment
            endpoint=opts.canary_endpoint or "http://127.0.0.1:8000",
            evalset=opts.canary_evalset,
            interval=opts.canary_interval,
            min_score=opts.canary_min_score,
            metrics_host=opts.metrics_host,
            metrics_sd_dir=opts.metrics_sd_dir,
            api_key=canary_key,
        )
    config = llm_config(opts, export)
    engine = build_llm_deployment(config, deployment_cls=engine_cls, name_prefix="ExportServer:")
    ingress = serve.deployment(make_fastapi_ingress(ingress_cls, endpoint_map=ENDPOINTS, app=api), name="RayLMIngress")
    options = OpenAiIngress.get_deployment_options([config])
    options["ray_actor_options"] = {"num_cpus": opts.ingress_cpus}
    options["max_surge_percent"] = opts.max_surge_percent
    return ingress.options(**options).bind(  # type: ignore[attr-defined]  # serve.deployment's stub: a decorator
        llm_deployments={export.name: engine},
        model_cards={export.name: export.name},  # OpenAiIngress looks only at the keys; the cards are ours
        args=opts,
        export=export,
        api_key_digests=digests,
        canary=canary,
    )
