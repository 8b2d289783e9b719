"""The server's Prometheus metrics, all named ``hf_paged_cache_*``, on a registry of the app's own.

Request counters and latency histograms are updated as requests end (`ServerMetrics.request_finished`, called
from the thread that reads each request's handle). What the pool and the queue hold now is read from the
batcher when Prometheus scrapes (`BatcherCollector`), so it is never stale and costs nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ...engine.batcher import BatcherStats

LabelledStats = tuple[dict[str, str], BatcherStats]
"""One batcher's stats with the labels its samples carry (``{}`` for a lone batcher, ``{"replica": id}``)."""

PREFIX = "hf_paged_cache_"
FINISH_REASONS = ("stop", "length", "cancelled", "error")

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    """Counters and histograms of the requests a server ran, registered on `registry` (safe from any thread).

    A request here is one choice (one `RequestHandle`): a completion with ``n=3`` counts three.
    """

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            PREFIX + "requests", "Requests (choices) ended, by finish reason", ["finish_reason"], registry=registry,
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # every reason is exported from the start, at 0
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests ended", registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "From submission to the first token", buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Between two tokens of one request", buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "From submission to the end of a request", buckets=E2E_BUCKETS,
            registry=registry,
        )

        self.structured_requests = Counter(
            PREFIX + "structured_requests", "Requests whose answer is held to a schema, pattern or grammar, by kind",
            ["kind"], registry=registry,
        )
        self.grammar_mask_seconds = Histogram(
            PREFIX + "grammar_mask_seconds", "Computing and applying one constrained row's token mask",
            buckets=MASK_BUCKETS, registry=registry,
        )

    def request_finished(
        self, finish_reason: str, *, prompt_tokens: int, generated_tokens: int, time_to_first_token: float | None,
        latency: float,
    ) -> None:
        """Count one request (choice) that ended; `prompt_tokens` is 0 for every choice of a prompt but one."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        if time_to_first_token is not None:
            self.time_to_first_token.observe(time_to_first_token)
        self.e2e_request_latency.observe(latency)


class BatcherCollector(Collector):
    """The pool's blocks and the batcher's queue, read when Prometheus scrapes (each batcher's, with its labels).

    Per layer group (labelled ``group`` when the model has several): ``blocks_total`` (the most blocks that can
    be held), ``blocks_used``, ``blocks_free``, ``blocks_cached`` (findable by prefix, held or free) and
    ``kv_utilization`` (tokens stored / token slots of the blocks in use, 0 when none is). Then
    ``requests_running`` (prefilling or decoding), ``requests_waiting``, the batcher's counters
    ``prefix_cache_hit_tokens_total`` and ``preemptions_total``, and its steps by ``kind`` (``decode``: running
    rows only; ``prompt``: prompt chunks, with the running rows when packed): ``steps_total``,
    ``step_seconds_total`` (their wall time) and ``step_tokens_total`` (decode: the tokens picked; prompt: the
    prompt tokens computed).

    Args:
        stats: returns each batcher's stats and labels: none while the model is loading (nothing is exported),
            one for a lone batcher, one per replica (labelled ``replica``) for replicas of one.
    """

    def __init__(self, stats: Callable[[], Sequence[LabelledStats]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        batchers = list(self._stats())
        if not batchers:
            return
        names = sorted({name for labels, _ in batchers for name in labels})  # the same keys for every batcher
        grouped = any(len(stats.groups) > 1 for _, stats in batchers)
        group_labels = [*names, "group"] if grouped else names
        gauges = {
            name: GaugeMetricFamily(PREFIX + name, help_text, labels=group_labels)
            for name, help_text in (
                ("blocks_total", "KV blocks the pool can hold at once (its capacity)"),
                ("blocks_used", "KV blocks held by requests"),
                ("blocks_free", "KV blocks free (including those cached for their prefix)"),
                ("blocks_cached", "KV blocks findable by their prefix (held or free)"),
                ("kv_utilization", "Tokens stored / token slots of the KV blocks requests hold"),
            )
        }
        running = GaugeMetricFamily(PREFIX + "requests_running", "Requests prefilling or decoding", labels=names)
        waiting = GaugeMetricFamily(PREFIX + "requests_waiting", "Requests submitted and not started", labels=names)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache",
                                   labels=names)
        preemptions = CounterMetricFamily(PREFIX + "preemptions", "Running requests preempted (computed again later)",
                                          labels=names)
        step_labels = [*names, "kind"]
        steps = CounterMetricFamily(PREFIX + "steps", "Batcher steps run", labels=step_labels)
        step_seconds = CounterMetricFamily(PREFIX + "step_seconds", "Wall time of the batcher's steps",
                                           labels=step_labels)
        step_tokens = CounterMetricFamily(PREFIX + "step_tokens", "Tokens of the batcher's steps (decode: picked; "
                                          "prompt: prompt tokens computed)", labels=step_labels)
        drafts = CounterMetricFamily(PREFIX + "spec_draft_tokens", "Draft tokens speculative decoding proposed",
                                     labels=names)
        accepted = CounterMetricFamily(PREFIX + "spec_accepted_tokens", "Draft tokens the model verified and kept",
                                       labels=names)
        for labels, stats in batchers:
            values = [labels.get(name, "") for name in names]
            drafts.add_metric(values, stats.speculation.draft_tokens)
            accepted.add_metric(values, stats.speculation.accepted_tokens)
            for usage in stats.groups:
                for name, value in (("blocks_total", usage.capacity), ("blocks_used", usage.blocks_used),
                                    ("blocks_free", usage.blocks_free), ("blocks_cached", usage.blocks_cached),
                                    ("kv_utilization", usage.kv_utilization)):
                    gauges[name].add_metric([*values, usage.name] if grouped else values, value)
            running.add_metric(values, stats.running + stats.prefilling)
            waiting.add_metric(values, stats.waiting)
            hits.add_metric(values, stats.prefix_hit_tokens)
            preemptions.add_metric(values, stats.preemptions)
            times = stats.steps
            for kind, count, seconds, tokens in (
                ("decode", times.decode_steps, times.decode_seconds, times.decode_rows),
                ("prompt", times.prompt_steps, times.prompt_seconds, times.prompt_tokens),
            ):
                steps.add_metric([*values, kind], count)
                step_seconds.add_metric([*values, kind], seconds)
                step_tokens.add_metric([*values, kind], tokens)
        yield from gauges.values()
        yield from (running, waiting, hits, preemptions, steps, step_seconds, step_tokens, drafts, accepted)
