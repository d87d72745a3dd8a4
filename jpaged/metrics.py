"""Engine metrics: per-step request timings, the periodic stats log line, Prometheus export.

`StatLogger` is fed once per engine step (`LLMEngine.step` calls `on_step`); it keeps the
time-to-first-token, inter-token and end-to-end latency histograms and logs vLLM's stats line
every `interval` seconds. `build_registry` exposes every numeric `get_metrics()` key plus those
histograms under `jpaged:` names in a fresh `CollectorRegistry` (one per server app).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from typing import Any

from jpaged.config import DEFAULT_LOG_STATS_INTERVAL

logger = logging.getLogger("jpaged.metrics")

MetricsFn = Callable[[], Mapping[str, Any]]

PREFIX = "jpaged:"
_LAST_TOKEN_TIME = attrgetter("last_token_time")
# vLLM's bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Request phase times: vLLM's request_*_time_seconds edges.
REQUEST_TIME_BUCKETS = E2E_BUCKETS
# iteration_tokens_total: vLLM's edges for an engine without CUDA graphs (with them, vLLM uses
# its capture sizes), doubled on up to the engine's token budget per step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def iteration_buckets(max_num_batched_tokens: int) -> tuple[float, ...]:
    """iteration_tokens_total's edges: vLLM's, and powers of two up to the step budget."""
    out = [float(b) for b in ITERATION_TOKEN_BUCKETS]
    while out[-1] < max_num_batched_tokens:
        out.append(out[-1] * 2)
    return tuple(out)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count histogram edges)."""
    out: list[float] = []
    mag = 1
    while True:
        for m in (1, 2, 5):
            if m * mag > limit:
                return tuple(out)
            out.append(float(m * mag))
        mag *= 10

# A finished sequence's finish_reason values (request_success's label values).
FINISH_REASONS = ("stop", "length", "abort", "error")

# get_metrics() key -> (exported name without prefix, "counter" | "gauge", help).
# Counters are exposed with a `_total` suffix (prometheus_client adds it).
KNOWN_METRICS: dict[str, tuple[str, str, str]] = {
    "num_preemptions": ("num_preemptions", "counter", "Cumulative number of preemptions."),
    "kv_cache_usage": ("kv_cache_usage_perc", "gauge",
                       "KV-cache usage: fraction of usable blocks held by requests (1 = 100%)."),
    "prefix_cache_queries": ("prefix_cache_queries", "counter",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "counter",
                          "Prompt tokens found in the prefix cache."),
    "num_requests_running": ("num_requests_running", "gauge", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    "request_prompt_tokens_total": ("prompt_tokens", "counter",
                                    "Prompt tokens of sequences that got a first token, "
                                    "prefix-cache hits included (vLLM's prompt_tokens)."),
    "prompt_tokens_total": ("prompt_tokens_computed", "counter",
                            "Prompt tokens computed (prefill work: prefix-cache hits and "
                            "loaded KV excluded)."),
    "generation_tokens_total": ("generation_tokens", "counter", "Generation tokens produced."),
    "num_evictions": ("num_evictions", "counter", "Cached blocks evicted for reuse."),
    "num_steps": ("num_steps", "counter", "Engine steps run."),
    "num_requests_finished": ("num_requests_finished", "counter", "Requests finished."),
    "num_requests_aborted": ("num_requests_aborted", "counter", "Requests aborted."),
    "cache_access_total": ("cache_access", "counter", "Prefix-cache lookups (requests)."),
    "num_blocks_total": ("num_blocks_usable", "gauge", "KV blocks in the pool (null excluded)."),
    "num_blocks_free": ("num_blocks_free", "gauge", "KV blocks free (cached ones included)."),
    "num_kv_cache_groups": ("kv_cache_groups", "gauge",
                            "KV cache groups (more than 1: a hybrid sliding-window model)."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "counter",
                               "Speculative decoding: requests' proposals verified (per step)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "counter",
                                     "Speculative decoding: tokens proposed."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "counter",
                                        "Speculative decoding: proposed tokens accepted."),
    "num_blocks_freed_out_of_window": (
        "kv_blocks_freed_out_of_window", "counter",
        "Blocks sliding-window groups returned to the pool while their requests ran."),
}


# Cumulative get_metrics() keys of the KV tiers (jpaged/core/offload.py): exported as counters.
TIER_COUNTERS = frozenset({
    "offload_hits_blocks", "offload_hits_tokens", "offload_bytes_to_host",
    "offload_bytes_to_device", "offload_dropped", "num_swapped_out", "num_swapped_in",
    "num_swap_fallbacks", "disk_hits_blocks", "disk_bytes_written", "disk_bytes_read",
    "disk_corrupt_skipped"})


# A get_metrics() list exported as one counter with a `position` label.
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"
# A get_metrics() (max_lora, running adapters, waiting adapters) tuple, exported as vLLM's
# lora_requests_info: one gauge whose labels name the adapters (comma-separated), valued at
# the scrape's time.
LORA_INFO = "lora_requests_info"
# A get_metrics() sleep-mode state, exported as vLLM's engine_sleep_state: 1 for the state the
# engine is in, 0 for the others.
SLEEP_STATE = "engine_sleep_state"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def _sanitize(name: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return name if not name[:1].isdigit() else f"_{name}"


def _numeric(value: Any) -> float | None:
    """A finite float for ints, floats and bools (and numpy scalars); None otherwise."""
    if isinstance(value, bool):
        return float(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    if isinstance(value, str) or not math.isfinite(f):
        return None
    return f


def flatten_numeric(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(key, value) for every numeric entry; nested mappings become `outer_inner` keys."""
    for key, value in metrics.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_numeric(value, f"{full}_")
            continue
        f = _numeric(value)
        if f is not None:
            yield full, f


def describe_metric(key: str) -> tuple[str, str, str]:
    """(exported name without prefix, kind, help) of a get_metrics() key; unknown ones generic."""
    if key in KNOWN_METRICS:
        return KNOWN_METRICS[key]
    name = _sanitize(key)
    if key in TIER_COUNTERS:
        return name, "counter", f"KV tier counter {key}."
    if name.endswith("_total"):  # a cumulative count by naming convention
        return name[: -len("_total")], "counter", f"Engine counter {key}."
    return name, "gauge", f"Engine metric {key}."


def _observe_many(hist: Any, value: float, count: int) -> None:
    """`hist.observe(value)` `count` times, as one update where prometheus_client allows."""
    bounds, buckets, total = (getattr(hist, a, None) for a in ("_upper_bounds", "_buckets",
                                                                 "_sum"))
    if bounds is None or buckets is None or total is None or count == 1:
        for _ in range(count):
            hist.observe(value)
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break


class StatLogger:
    """Request timing histograms and the periodic "Avg prompt throughput ..." log line."""

    def __init__(self, metrics_fn: MetricsFn, interval: float = DEFAULT_LOG_STATS_INTERVAL,
                 log: bool = True, start: float | None = None, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        if not interval > 0:
            raise ValueError(f"StatLogger.interval must be > 0 seconds, got {interval!r}")
        self.metrics_fn = metrics_fn
        self.interval = float(interval)
        self.log_enabled = log
        # Unregistered metrics (registry=None): each server app's registry collects them.
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token per sequence.",
            buckets=TTFT_BUCKETS, registry=None)
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between consecutive output tokens.",
            buckets=ITL_BUCKETS, registry=None)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token per sequence.",
            buckets=E2E_BUCKETS, registry=None)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Finished sequences by finish reason.",
            ["finished_reason"], registry=None)
        for reason in FINISH_REASONS:  # every series from the start, at 0 (as vLLM)
            self.request_success.labels(reason)
        # vLLM's request phase and size families: a finished sequence each; n and the most
        # tokens any of its sequences generated, a finished request each.
        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(f"{PREFIX}{name}", doc, buckets=buckets, registry=None)
        self.request_queue_time = hist("request_queue_time_seconds",
                                       "Arrival to first scheduled, per sequence.",
                                       REQUEST_TIME_BUCKETS)
        self.request_prefill_time = hist("request_prefill_time_seconds",
                                         "First scheduled to first token, per sequence.",
                                         REQUEST_TIME_BUCKETS)
        self.request_decode_time = hist("request_decode_time_seconds",
                                        "First token to last token, per sequence.",
                                        REQUEST_TIME_BUCKETS)
        self.request_inference_time = hist("request_inference_time_seconds",
                                           "First scheduled to last token, per sequence.",
                                           REQUEST_TIME_BUCKETS)
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens",
                                          "Prompt tokens per finished sequence.", tokens)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Generated tokens per finished sequence.", tokens)
        self.request_params_n = hist("request_params_n", "The n of each finished request.",
                                     (1, 2, 5, 10, 20))
        self.request_params_max_tokens = hist("request_params_max_tokens",
                                              "The max_tokens of each finished sequence.",
                                              tokens)
        self.request_max_num_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "The most tokens a sequence of each finished request generated.", tokens)
        self.iteration_tokens = hist("iteration_tokens_total",
                                     "Prompt and generated tokens per engine step (vLLM's "
                                     "count).", iteration_buckets(max_num_batched_tokens))
        self.cache_config_info = Gauge(f"{PREFIX}cache_config_info",
                                       "Information of the KV cache config (value 1).",
                                       ["block_size", "cache_dtype", "num_gpu_blocks",
                                        "enable_prefix_caching", "prefix_caching_hash_algo"],
                                       registry=None)
        self._last_log = time.monotonic() if start is None else start
        self._last_prompt = 0.0
        self._last_gen = 0.0
        # vLLM's prompt_tokens: the whole prompt of each sequence once it has its first token
        # (prefix-cache hits included), so n identical requests count n prompts.
        self.prompt_tokens = 0

    def prometheus_metrics(self) -> tuple[Any, ...]:
        """The prometheus_client metric objects this logger fills."""
        return (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                self.request_success, self.request_queue_time, self.request_prefill_time,
                self.request_decode_time, self.request_inference_time,
                self.request_prompt_tokens, self.request_generation_tokens,
                self.request_params_n, self.request_params_max_tokens,
                self.request_max_num_generation_tokens, self.iteration_tokens,
                self.cache_config_info)

    def set_cache_config(self, **labels: Any) -> None:
        """The cache_config_info labels (vLLM's), value 1."""
        self.cache_config_info.labels(**{k: str(v) for k, v in labels.items()}).set(1)

    def on_request_finished(self, n: int, max_tokens: int, generated: Sequence[int]) -> None:
        """A user request finished: its n, its max_tokens (once per sequence, as vLLM's) and
        each sequence's generated token count. (An aborted request is not observed here, nor
        in request_success: as vLLM, only num_requests_aborted counts it.)"""
        self.request_params_n.observe(n)
        _observe_many(self.request_params_max_tokens, max_tokens, len(generated))
        self.request_max_num_generation_tokens.observe(max(generated, default=0))

    def on_step(self, updated: Sequence[Any], now: float,
                finished: Iterable[Any] | None = None) -> None:
        """Record one engine step: `updated` requests each got one token at time `now`.

        `finished`: those of them that finished this step (found with `is_finished()` when
        not given; the engine's output loop knows them already).
        """
        # Requests of one step mostly share the time of their previous token: one histogram
        # update per distinct gap rather than per request, counted in C (this runs per request
        # per step).
        gaps = Counter(map(_LAST_TOKEN_TIME, updated))
        # vLLM's iteration_tokens_total: each token this step gave (a sequence's first one
        # included) plus the whole prompt of each sequence it gave its first token, so a
        # sequence counts prompt + output tokens in all, however its prefill was chunked.
        iteration = len(updated)
        if gaps.pop(None, 0):
            for req in updated:
                if req.last_token_time is None:
                    req.first_token_time = now  # a Request field this logger owns too
                    self.time_to_first_token.observe(max(0.0, now - req.arrival_time))
                    iteration += req.num_prompt_tokens
                    self.prompt_tokens += req.num_prompt_tokens
        if iteration:
            self.iteration_tokens.observe(iteration)
        for req in updated:
            req.last_token_time = now  # a Request field this logger owns
        for req in (finished if finished is not None
                    else [r for r in updated if r.is_finished()]):
            self.e2e_request_latency.observe(max(0.0, now - req.arrival_time))
            self.request_success.labels(req.finish_reason or "unknown").inc()
            self._on_finished(req, now)
        for prev, count in gaps.items():
            _observe_many(self.inter_token_latency, max(0.0, now - prev), count)
        if self.log_enabled and now - self._last_log >= self.interval:
            self.log(now)

    def _on_finished(self, req: Any, now: float) -> None:
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(req.num_output_tokens)
        first, sched = req.first_token_time, req.first_scheduled_time
        if first is not None:
            self.request_decode_time.observe(max(0.0, now - first))
        if sched is not None:  # set by the scheduler (not in an engine-core front end)
            self.request_queue_time.observe(max(0.0, sched - req.arrival_time))
            self.request_inference_time.observe(max(0.0, now - sched))
            if first is not None:
                self.request_prefill_time.observe(max(0.0, first - sched))

    def log(self, now: float | None = None) -> str:
        """Log (INFO) and return the stats line for the time since the previous one."""
        now = time.monotonic() if now is None else now
        m = self.metrics_fn()
        elapsed = max(now - self._last_log, 1e-9)
        prompt = float(m.get("request_prompt_tokens_total", 0))
        gen = float(m.get("generation_tokens_total", 0))
        hit_rate = m.get("prefix_cache_hit_rate_recent", m.get("prefix_cache_hit_rate", 0.0))
        line = (f"Avg prompt throughput: {(prompt - self._last_prompt) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(gen - self._last_gen) / elapsed:.1f} tokens/s, "
                f"Running: {int(m.get('num_requests_running', 0))} reqs, "
                f"Waiting: {int(m.get('num_requests_waiting', 0))} reqs, "
                f"KV cache usage: {100.0 * float(m.get('kv_cache_usage', 0.0)):.1f}%, "
                f"Prefix cache hit rate: {100.0 * float(hit_rate or 0.0):.1f}%")
        self._last_log, self._last_prompt, self._last_gen = now, prompt, gen
        logger.info(line)
        return line


class _EngineCollector:
    """Collects engine gauges/counters at scrape time, plus the StatLogger's histograms."""

    def __init__(self, metrics_fn: MetricsFn, stat_logger: StatLogger | None) -> None:
        self.metrics_fn = metrics_fn
        self.stat_logger = stat_logger

    def collect(self) -> Iterator[Any]:
        """Yield one metric family per numeric engine metric, then the timing metrics."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        seen: set[str] = set()
        metrics = self.metrics_fn()
        for key, value in flatten_numeric(metrics):
            name, kind, doc = describe_metric(key)
            if name in seen:
                continue
            seen.add(name)
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{PREFIX}{name}", doc, value=value)
        per_pos = metrics.get(PER_POSITION)
        if per_pos:  # vLLM's counter, labelled by the proposal's position
            family = CounterMetricFamily(f"{PREFIX}{PER_POSITION}",
                                         "Speculative decoding: accepted tokens by position.",
                                         labels=["position"])
            for j, n in enumerate(per_pos):
                family.add_metric([str(j)], float(n))
            yield family
        state = metrics.get(SLEEP_STATE)
        if state is not None:
            family = GaugeMetricFamily(f"{PREFIX}{SLEEP_STATE}", "Sleep mode: 1 for the state "
                                       "the engine is in.", labels=["sleep_state"])
            for name in SLEEP_STATES:
                family.add_metric([name], float(name == state))
            yield family
        lora = metrics.get(LORA_INFO)
        if lora is not None:  # vLLM's info gauge of the adapters in use
            family = GaugeMetricFamily(f"{PREFIX}{LORA_INFO}", "LoRA adapters of the running and "
                                       "waiting requests (labels), and the device's slots.",
                                       labels=["max_lora", "running_lora_adapters",
                                               "waiting_lora_adapters"])
            family.add_metric([str(lora[0]), ",".join(lora[1]), ",".join(lora[2])], time.time())
            yield family
        if self.stat_logger is not None:
            for metric in self.stat_logger.prometheus_metrics():
                yield from metric.collect()


def build_registry(metrics_fn: MetricsFn, stat_logger: StatLogger | None = None) -> Any:
    """A new prometheus CollectorRegistry exposing the engine's metrics under `jpaged:` names."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(metrics_fn, stat_logger))
    return registry


class _ConstantLabels:
    """Every sample of a registry with labels added (vLLM's model_name on each series)."""

    def __init__(self, registry: Any, labels: Mapping[str, str]) -> None:
        self.registry, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Any]:
        """The registry's families, each sample labelled."""
        from prometheus_client import Metric

        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                out.add_sample(smp.name, {**self.labels, **smp.labels}, smp.value,
                               smp.timestamp, smp.exemplar)
            yield out


def with_labels(registry: Any, labels: Mapping[str, str]) -> Any:
    """A registry exposing `registry`'s metrics with `labels` on every series (the server
    adds model_name, the served name, as vLLM's metrics carry it)."""
    from prometheus_client import CollectorRegistry

    out = CollectorRegistry(auto_describe=False)
    out.register(_ConstantLabels(registry, labels))
    return out


def render(registry: Any) -> tuple[bytes, str]:
    """(Prometheus text exposition, its content type) of a registry."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST
