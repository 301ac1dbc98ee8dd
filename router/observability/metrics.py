"""The HTTP ingress's own Prometheus series, and the merge of every replica's exposition into one ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

# (status, code) series of carpool:http_requests_rejected_total that exist before the first refusal
INGRESS_REFUSALS = (
    (400, "invalid_value"), (401, "invalid_api_key"), (413, "request_too_large"),
    (415, "unsupported_media_type"), (429, "overloaded"), (429, "slo_unattainable"), (503, "unavailable"),
)


class IngressMetrics:
    """The HTTP ingress's own series (the ingress's ``/metrics`` adds them to the replicas').

    ``carpool:http_requests_rejected_total{model_name, replica, status, code}``: requests the
    ingress answered with an error before or instead of serving them (bad input 4xx, 401, 413,
    415, 429 overload or a request shed for its latency target, 503), by HTTP status and OpenAI error ``code``. ``replica`` is the
    ingress replica's id.

    Args:
        model_name: the served model's name.
        replica: this ingress replica's id.
    """

    def __init__(self, model_name: str, replica: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "replica": replica}
        self.http_requests_rejected = Counter(
            "carpool:http_requests_rejected",
            "Requests the HTTP ingress refused with an error status, by status and error code.",
            [*self.labels, "status", "code"],
            registry=self.registry,
        )
        for status, code in INGRESS_REFUSALS:  # present (at 0) from the start, so rate() has data
            self.http_requests_rejected.labels(**self.labels, status=str(status), code=code)

    def on_rejected(self, status: int, code: str | None) -> None:
        """One request answered with ``status`` (OpenAI error ``code``, ``none`` if it has none)."""
        self.http_requests_rejected.labels(**self.labels, status=str(status), code=code or "none").inc()

    def exposition(self) -> bytes:
        """These series in the Prometheus text format."""
        return generate_latest(self.registry)


def merge_expositions(texts: list[str]) -> bytes:
    """Merge several registries' Prometheus text (one per replica) into one valid exposition.

    The text format allows each metric family once, so the families are parsed
    (``prometheus_client.parser``) and their samples joined under one ``# HELP``/``# TYPE``;
    the replicas' series stay apart through their ``replica`` label.
    """
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                families[family.name] = family
            else:
                merged.samples.extend(family.samples)

    class _Merged:
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
