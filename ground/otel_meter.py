"""One process's OpenTelemetry meter, exported into its own ``prometheus_client`` registry.

Serving replicas and training ranks each build one (OTel's Prometheus exporter has no multiprocess mode, so
every process has its own provider, registry and scrape port); ``ground.scrape_targets.ScrapeEndpoint``
serves the registry. A module of its own, not part of ``scrape_targets``: that one must stay light to import
(the serving config imports it), and the OTel SDK is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry


@dataclass(frozen=True)
class PrometheusMeter:
    registry: CollectorRegistry
    provider: MeterProvider
    meter: Meter


def prometheus_meter(service: str, instance: str, scope: str, *, scope_labels: bool = True) -> PrometheusMeter:
    """A meter named ``scope`` whose instruments appear in a fresh registry; the resource names the service
    (``service.name``) and this process (``service.instance.id``). ``scope_labels=False`` drops OTel's
    ``otel_scope_*`` labels, for registries that also hold plain ``prometheus_client`` collectors (both kinds
    of series then carry the same label set). Shut ``provider`` down when the process is done with it."""
    # auto_describe: a collector registered later whose names clash with the exporter's is refused at once.
    registry = CollectorRegistry(auto_describe=True)
    reader = PrometheusMetricReader(registry=registry, scope_info_enabled=scope_labels)
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    provider = MeterProvider(metric_readers=[reader], resource=resource)
    return PrometheusMeter(registry, provider, provider.get_meter(scope))
