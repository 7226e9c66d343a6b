"""Prometheus metrics under vLLM's names with a `pagoda:` prefix, and the same series again under vLLM's own
`vllm:` names with its `engine` label, so what reads a vLLM server (its Grafana dashboard, vllm-router's
backend observations, gateways' scrapers) reads Pagoda unchanged.

A dedicated CollectorRegistry keeps them apart from the process-global default registry (tests and
embedders can build several apps in one process without duplicate-metric errors).
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from pagoda.engine.stats import EngineStats
from pagoda.outputs import RequestOutput

# Buckets as vLLM uses them (seconds), trimmed to what a CPU engine sees.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX, VLLM_PREFIX = "pagoda:", "vllm:"
# Pagoda's own series with no vLLM counterpart: not mirrored.
_STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
_PAGODA_ONLY = frozenset({"pagoda:num_free_kv_blocks", "pagoda:engine_step_seconds", "pagoda:model_forward_seconds"})


class ServerMetrics:
    """Implements AsyncEngine's metrics hook; every method is thread-safe (prometheus_client locks)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=r)

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("pagoda:num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("pagoda:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("pagoda:kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (0-1)")
        self.num_free_blocks = gauge("pagoda:num_free_kv_blocks", "Free KV cache blocks")
        # Counters are declared without _total; prometheus_client appends it on exposition.
        self.prompt_tokens = counter("pagoda:prompt_tokens", "Prompt tokens accepted")
        self.generation_tokens = counter("pagoda:generation_tokens", "Tokens generated")
        self.num_preemptions = counter("pagoda:num_preemptions", "Sequences preempted (KV dropped, recomputed)")
        self.prefix_cache_queries = counter("pagoda:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("pagoda:prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.spec_drafts = counter("pagoda:spec_decode_num_drafts",
                                   "Speculative verifications of a request with at least one proposal")
        self.spec_draft_tokens = counter("pagoda:spec_decode_num_draft_tokens", "Speculative tokens proposed")
        self.spec_accepted_tokens = counter("pagoda:spec_decode_num_accepted_tokens", "Speculative tokens accepted")
        self.spec_emitted_tokens = counter("pagoda:spec_decode_num_emitted_tokens",
                                           "Tokens emitted by speculative verifications (accepted + the target's)")
        self.spec_accepted_per_pos = counter("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative tokens accepted, by their position in the proposal",
                                             ["position"])
        self.request_success = counter("pagoda:request_success", "Finished requests by finish reason",
                                       ["finished_reason"])
        self.ttft = hist("pagoda:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.tpot = hist("pagoda:time_per_output_token_seconds", "Mean time per output token after the first",
                         _TPOT_BUCKETS)
        self.e2e = hist("pagoda:e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        self.queue_time = hist("pagoda:request_queue_time_seconds", "Time from arrival to first schedule",
                               _LATENCY_BUCKETS)
        self.prefill_time = hist("pagoda:request_prefill_time_seconds", "Time from first schedule to first token",
                                 _LATENCY_BUCKETS)
        self.decode_time = hist("pagoda:request_decode_time_seconds", "Time from first token to the last",
                                _LATENCY_BUCKETS)
        self.request_prompt_tokens = hist("pagoda:request_prompt_tokens", "Prompt tokens per request",
                                          _TOKEN_BUCKETS)
        self.request_generation_tokens = hist("pagoda:request_generation_tokens", "Generated tokens per request",
                                              _TOKEN_BUCKETS)
        self.iteration_tokens = hist("pagoda:iteration_tokens_total", "Tokens computed per engine step",
                                     _ITERATION_TOKEN_BUCKETS)
        self.step_seconds = hist("pagoda:engine_step_seconds", "Wall time of an engine step that ran the model",
                                 _STEP_BUCKETS)
        self.forward_seconds = hist("pagoda:model_forward_seconds", "Wall time of a step's model forward",
                                    _STEP_BUCKETS)
        self.cache_config_info = Gauge("pagoda:cache_config_info", "The KV cache's configuration (the value is 1)",
                                       ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"],
                                       registry=r)
        self._label = model_name
        self._last_totals: dict[str, int] = {}
        # Touch every unlabelled-by-reason series so a fresh server already exposes them at 0.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage,
                       self.num_free_blocks, self.prompt_tokens, self.generation_tokens, self.num_preemptions,
                       self.prefix_cache_queries, self.prefix_cache_hits, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted_tokens, self.spec_emitted_tokens,
                       self.ttft, self.tpot, self.e2e, self.queue_time, self.prefill_time, self.decode_time,
                       self.request_prompt_tokens, self.request_generation_tokens, self.iteration_tokens,
                       self.step_seconds, self.forward_seconds):
            metric.labels(model_name)
        r.register(VllmNames([m for m in vars(self).values() if isinstance(m, MetricWrapperBase)]))

    def set_cache_config(self, block_size: int, cache_dtype: str, enable_prefix_caching: bool,
                         num_blocks: int) -> None:
        """vLLM's `cache_config_info`: a gauge at 1 whose labels carry the KV cache's configuration (the
        field names are vLLM's, `num_gpu_blocks` included: KV blocks in the pool, on any device)."""
        self.cache_config_info.clear()
        self.cache_config_info.labels(str(block_size), cache_dtype, str(enable_prefix_caching),
                                      str(num_blocks)).set(1)

    # ---- AsyncEngine hook ------------------------------------------------------------------------
    def on_step(self, stats: EngineStats) -> None:
        m = self._label
        self.num_requests_running.labels(m).set(stats.num_running)
        self.num_requests_waiting.labels(m).set(stats.num_waiting)
        self.kv_cache_usage.labels(m).set(stats.kv_cache_usage)
        self.num_free_blocks.labels(m).set(stats.num_free_blocks)
        if stats.num_steps > self._last_totals.get("steps", 0):  # a step that ran the model (not a failure)
            self._last_totals["steps"] = stats.num_steps
            self.iteration_tokens.labels(m).observe(stats.step_tokens)
            self.step_seconds.labels(m).observe(stats.step_seconds)
            self.forward_seconds.labels(m).observe(stats.step_forward_seconds)
        # The engine keeps running totals; counters want increments.
        for name, counter_, total in (("preemptions", self.num_preemptions, stats.num_preemptions),
                                      ("queries", self.prefix_cache_queries, stats.prefix_cache_queries),
                                      ("hits", self.prefix_cache_hits, stats.prefix_cache_hits),
                                      ("drafts", self.spec_drafts, stats.spec_decode_num_drafts),
                                      ("draft_tokens", self.spec_draft_tokens, stats.spec_decode_num_draft_tokens),
                                      ("accepted", self.spec_accepted_tokens, stats.spec_decode_num_accepted_tokens),
                                      ("emitted", self.spec_emitted_tokens, stats.spec_decode_num_emitted_tokens)):
            delta = total - self._last_totals.get(name, 0)
            if delta > 0:
                counter_.labels(m).inc(delta)
                self._last_totals[name] = total
        for pos, total in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            delta = total - self._last_totals.get(f"pos{pos}", 0)
            if delta > 0:
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(delta)
                self._last_totals[f"pos{pos}"] = total

    def on_prompt(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self._label).inc(num_prompt_tokens)

    def on_generated(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self._label).inc(num_tokens)

    def on_aborted(self) -> None:
        """A request ended before it finished (its client left, or shutdown): vLLM's finished_reason "abort"."""
        self.request_success.labels(self._label, "abort").inc()

    def on_finished(self, out: RequestOutput) -> None:
        m = self._label
        reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
        for reason in reasons or {"unknown"}:
            self.request_success.labels(m, reason).inc()
        num_out = max((len(c.token_ids) for c in out.outputs), default=0)
        self.request_prompt_tokens.labels(m).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(m).observe(sum(len(c.token_ids) for c in out.outputs))
        t = out.metrics
        if t is None:
            return
        if t.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
            if t.first_scheduled_time is not None:
                self.prefill_time.labels(m).observe(max(0.0, t.first_token_time - t.first_scheduled_time))
        end = t.finished_time or t.last_token_time
        if end is not None:
            self.e2e.labels(m).observe(max(0.0, end - t.arrival_time))
            if t.first_token_time is not None:
                decode = max(0.0, end - t.first_token_time)
                self.decode_time.labels(m).observe(decode)
                if num_out > 1:
                    self.tpot.labels(m).observe(decode / (num_out - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmNames:
    """A collector that yields each `pagoda:` family again as vLLM names it (`vllm:` prefix, plus vLLM's
    `engine` label: one engine per server, "0"). The values are read at scrape time from the same objects,
    so the two names never disagree."""

    def __init__(self, metrics: list[MetricWrapperBase], engine: str = "0") -> None:
        self.metrics = metrics
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        for metric in self.metrics:
            for family in metric.collect():
                if family.name in _PAGODA_ONLY or not family.name.startswith(PREFIX):
                    continue
                out = Metric(VLLM_PREFIX + family.name[len(PREFIX):], family.documentation, family.type,
                             family.unit)
                for s in family.samples:
                    out.add_sample(VLLM_PREFIX + s.name[len(PREFIX):], {**s.labels, "engine": self.engine},
                                   s.value, s.timestamp, s.exemplar)
                yield out


_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
_QUEUE_DELAY_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class PoolingMetrics:
    """The pooling routes' series (embeddings, score, rerank) and the dynamic batcher's: how many sequences
    and tokens each forward took, and how long each sequence waited for its batch. Implements the batcher's
    BatchObserver."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._label = model_name
        labels = ["model_name"]
        self.requests = Counter("pagoda:pooling_requests", "Pooling requests by endpoint", labels + ["endpoint"],
                                registry=registry)
        self.batch_size = Histogram("pagoda:pooling_batch_size", "Sequences per pooling forward", labels,
                                    buckets=_BATCH_BUCKETS, registry=registry)
        self.batch_tokens = Histogram("pagoda:pooling_batch_tokens", "Tokens per pooling forward", labels,
                                      buckets=_TOKEN_BUCKETS, registry=registry)
        self.queue_delay = Histogram("pagoda:pooling_queue_delay_seconds",
                                     "Time a sequence waited for its pooling batch", labels,
                                     buckets=_QUEUE_DELAY_BUCKETS, registry=registry)
        for metric in (self.batch_size, self.batch_tokens, self.queue_delay):
            metric.labels(model_name)

    def on_pooling_request(self, endpoint: str) -> None:
        self.requests.labels(self._label, endpoint).inc()

    def on_pooling_batch(self, num_seqs: int, num_tokens: int, queue_delays: list[float]) -> None:
        self.batch_size.labels(self._label).observe(num_seqs)
        self.batch_tokens.labels(self._label).observe(num_tokens)
        for d in queue_delays:
            self.queue_delay.labels(self._label).observe(d)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render_models(registries: dict[str, CollectorRegistry]) -> bytes:
    """Several models' registries (one ServerMetrics each, keyed by model name) as one exposition: each family
    once, with every model's samples, each labelled with its model_name (cache_config_info, which has no such
    label in one model's registry, gets it here); a family twice would be an invalid exposition."""
    families: dict[str, Metric] = {}
    for model, registry in registries.items():
        for family in registry.collect():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = s.labels if "model_name" in s.labels else {**s.labels, "model_name": model}
                merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
    return generate_latest(_Families(list(families.values())))  # type: ignore[arg-type]
