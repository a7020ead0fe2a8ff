"""The server's Prometheus metrics: vLLM's names under the ``dsv4:`` prefix (docs/server.md).

Gauges and counters are read from the engine after every step (`Engine.stats`, the
schedulers' queues, the allocators' usage); the histograms and the finished requests by reason
from the outputs of each step (`RequestOutput.metrics`). `ServerMetrics.observe_step` runs on
the engine driver's thread; a scrape reads the last snapshot.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.outputs import RequestOutput

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip

# name -> (help, engine snapshot key), the gauges then the counters
_GAUGES = {
    "num_requests_running": ("sequences running (in the batch)", "running"),
    "num_requests_waiting": ("sequences waiting to be admitted", "waiting"),
    "kv_cache_usage_perc": ("fraction of KV-cache blocks in use (1 = full)", "kv_usage"),
}
_COUNTERS = {
    "prompt_tokens": ("prompt tokens of admitted requests", "num_prompt_tokens"),
    "generation_tokens": ("tokens generated", "num_generation_tokens"),
    "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    "prefix_cache_hits": ("of them, tokens found in the prefix cache", "prefix_cache_hits"),
    "num_preemptions": ("preemptions", "num_preemptions"),
    "spec_decode_num_drafts": ("speculative verifications", "spec_num_drafts"),
    "spec_decode_num_draft_tokens": ("draft tokens verified", "spec_num_draft_tokens"),
    "spec_decode_num_accepted_tokens": ("draft tokens accepted", "spec_num_accepted_tokens"),
}


class ServerMetrics:
    """The metrics of one served model, in their own registry (``registry``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.snapshot: dict[str, float] = {}
        self.registry.register(self)  # `collect` below: the engine's gauges and counters
        labels = ["model_name"]
        self.success = Counter(
            "dsv4:request_success",
            "finished sequences, by finish reason",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        hist = dict(labelnames=labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        # the histograms' one labelled series each, looked up once rather than per observation
        self.ttft = Histogram(
            "dsv4:time_to_first_token_seconds", "arrival to first token", **hist
        ).labels(model_name)
        self.itl = Histogram(
            "dsv4:inter_token_latency_seconds", "time between a request's outputs", **hist
        ).labels(model_name)
        self.e2e = Histogram(
            "dsv4:e2e_request_latency_seconds", "arrival to finish", **hist
        ).labels(model_name)
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, engine, outputs: list[RequestOutput]) -> None:
        """After a step (on the driver thread): the engine's figures and the outputs' times."""
        for out in outputs:
            self._observe_output(out)
        shards = getattr(engine.scheduler, "shards", [engine.scheduler])
        managers = engine.kv_cache_managers
        snap = {k: getattr(engine.stats, k) for _, k in _COUNTERS.values()}
        snap["running"] = sum(len(s.running) for s in shards)
        snap["waiting"] = sum(len(s.waiting) for s in shards)
        snap["kv_usage"] = sum(m.usage for m in managers) / len(managers)
        self.snapshot = snap

    def _observe_output(self, out: RequestOutput) -> None:
        m, rid, name = out.metrics, out.request_id, self.model_name
        if m is None:
            return
        if m.last_token_time is not None:
            last = self._last_token_time.get(rid)
            if last is None and m.ttft is not None:
                self.ttft.observe(m.ttft)
            elif last is not None and m.last_token_time > last:
                self.itl.observe(m.last_token_time - last)
            self._last_token_time[rid] = m.last_token_time
        if out.finished:
            self._last_token_time.pop(rid, None)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            for c in out.outputs:
                self.success.labels(name, c.finish_reason or "abort").inc()

    def collect(self):
        """The snapshot as Prometheus families (the registry calls this on a scrape)."""
        snap, labels = self.snapshot, [self.model_name]
        for name, (help_, key) in _GAUGES.items():
            family = GaugeMetricFamily(f"dsv4:{name}", help_, labels=["model_name"])
            family.add_metric(labels, snap.get(key, 0))
            yield family
        for name, (help_, key) in _COUNTERS.items():
            family = CounterMetricFamily(f"dsv4:{name}", help_, labels=["model_name"])
            family.add_metric(labels, snap.get(key, 0))
            yield family
