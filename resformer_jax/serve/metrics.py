"""The server's Prometheus metrics, in a registry of the app's own, with vLLM's names where vLLM has one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for pages or a row.", labels, registry=r)
        self.cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of the KV cache's pages in use.", labels, registry=r
        )
        self.pages_used = Gauge("resformer:kv_cache_pages_used", "KV cache pages in use.", labels, registry=r)
        self.pages_total = Gauge("resformer:kv_cache_pages_total", "KV cache pages in all.", labels, registry=r)
        self.most_running = Gauge(
            "resformer:max_sequences_cached", "The most sequences the KV cache held at once.", labels, registry=r
        )
        self.tokens_per_s = Gauge(
            "resformer:generation_tokens_per_second", "Tokens a second, last 5 s.", labels, registry=r
        )
        self.compiles_after_start = Gauge(
            "resformer:compiles_after_start",
            "Programs compiled while serving (0 after --compile_at_start for requests without logprobs, penalties or "
            "token masks).",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted for pages.", labels, registry=r)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).", labels, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.model_name = model_name

    def label(self, metric, **extra):
        return metric.labels(model_name=self.model_name, **extra)
