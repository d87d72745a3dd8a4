"""StatLogger (timing histograms, the periodic stats line) and the Prometheus export."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jpaged.metrics import StatLogger, build_registry, render
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import SamplingParams


def _scrape(registry) -> dict[str, tuple[str, dict]]:
    """family name -> (type, {(sample name, labels): value})."""
    body, content_type = render(registry)
    assert content_type.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        out[fam.name] = (fam.type, {(s.name, tuple(sorted(s.labels.items()))): s.value
                                    for s in fam.samples})
    return out


def test_timings_feed_the_histograms():
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=3), arrival_time=100.0)
    other = Request("b", [4], SamplingParams(max_tokens=1), arrival_time=100.2)
    sl = StatLogger(dict, log=False, start=100.0)
    sl.on_step([req], 100.5)  # first token: TTFT 0.5
    sl.on_step([req], 100.75)  # ITL 0.25
    req.status = RequestStatus.FINISHED_LENGTH
    other.status = RequestStatus.FINISHED_STOPPED
    sl.on_step([req, other], 101.0)  # ITL 0.25, e2e 1.0; other: TTFT 0.8, e2e 0.8
    sl.on_step([], 102.0)
    fams = _scrape(build_registry(dict, sl))
    kind, ttft = fams["jpaged:time_to_first_token_seconds"]
    assert kind == "histogram"
    assert ttft[("jpaged:time_to_first_token_seconds_count", ())] == 2
    assert ttft[("jpaged:time_to_first_token_seconds_sum", ())] == pytest.approx(1.3)
    assert ttft[("jpaged:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    _, itl = fams["jpaged:inter_token_latency_seconds"]
    assert itl[("jpaged:inter_token_latency_seconds_count", ())] == 2
    assert itl[("jpaged:inter_token_latency_seconds_sum", ())] == pytest.approx(0.5)
    _, e2e = fams["jpaged:e2e_request_latency_seconds"]
    assert e2e[("jpaged:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.8)
    _, ok = fams["jpaged:request_success"]
    assert ok[("jpaged:request_success_total", (("finished_reason", "length"),))] == 1
    assert ok[("jpaged:request_success_total", (("finished_reason", "stop"),))] == 1


def test_stats_line_every_interval(caplog):
    m = {"request_prompt_tokens_total": 300, "generation_tokens_total": 50,
         "num_requests_running": 2,
         "num_requests_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_hit_rate": 0.1,
         "prefix_cache_hit_rate_recent": 0.5}
    sl = StatLogger(lambda: m, interval=10.0, start=100.0)
    with caplog.at_level(logging.INFO, logger="jpaged.metrics"):
        sl.on_step([], 105.0)  # not yet
        sl.on_step([], 110.0)
        m.update(request_prompt_tokens_total=400, generation_tokens_total=250,
                 num_requests_running=0)
        sl.on_step([], 115.0)  # not yet: 5 s since the last line
        sl.on_step([], 120.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "jpaged.metrics"]
    assert lines == [
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%",
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 0 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 50.0%",
    ]
    quiet = StatLogger(lambda: m, interval=10.0, log=False, start=0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jpaged.metrics"):
        quiet.on_step([], 1000.0)
    assert not caplog.records
    with pytest.raises(ValueError, match="interval"):
        StatLogger(dict, interval=0)


def test_every_numeric_engine_metric_is_exported():
    m = {"num_preemptions": 3, "kv_cache_usage": 0.5, "request_prompt_tokens_total": 7,
         "prompt_tokens_total": 5,
         "offload_hits_blocks": 4, "host_tier": {"usage": 0.25, "name": "ram"}, "disk_usage": 0.5,
         "swap_enabled": True, "model": "tiny", "nothing": None, "bytes_moved_total": 9,
         "weird key-1": 2.5}
    fams = _scrape(build_registry(lambda: m))
    assert fams["jpaged:num_preemptions"] == ("counter",
                                              {("jpaged:num_preemptions_total", ()): 3})
    assert fams["jpaged:kv_cache_usage_perc"][0] == "gauge"
    assert fams["jpaged:prompt_tokens"][1] == {("jpaged:prompt_tokens_total", ()): 7}
    assert fams["jpaged:prompt_tokens_computed"][1] == {
        ("jpaged:prompt_tokens_computed_total", ()): 5}
    assert fams["jpaged:offload_hits_blocks"] == ("counter",
                                                  {("jpaged:offload_hits_blocks_total", ()): 4})
    assert fams["jpaged:host_tier_usage"][1] == {("jpaged:host_tier_usage", ()): 0.25}
    assert fams["jpaged:disk_usage"] == ("gauge", {("jpaged:disk_usage", ()): 0.5})  # unknown
    assert fams["jpaged:swap_enabled"][1] == {("jpaged:swap_enabled", ()): 1.0}
    assert fams["jpaged:bytes_moved"][0] == "counter"
    assert fams["jpaged:weird_key_1"][1] == {("jpaged:weird_key_1", ()): 2.5}
    assert not any("model" in k or "nothing" in k or "name" in k for k in fams)


def test_gaps_shared_by_a_batch_count_once_per_token():
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=9), arrival_time=0.0)
            for i in range(3)]
    sl = StatLogger(dict, log=False, start=0.0)
    sl.on_step(reqs, 1.0)  # three first tokens
    sl.on_step(reqs, 1.03)  # three gaps of 0.03 (one bucket update for the three)
    sl.on_step(reqs[:1], 1.2)  # one gap of 0.17
    fams = _scrape(build_registry(dict, sl))
    _, itl = fams["jpaged:inter_token_latency_seconds"]
    name = "jpaged:inter_token_latency_seconds"
    assert itl[(f"{name}_count", ())] == 4
    assert itl[(f"{name}_sum", ())] == pytest.approx(3 * 0.03 + 0.17)
    assert itl[(f"{name}_bucket", (("le", "0.025"),))] == 0
    assert itl[(f"{name}_bucket", (("le", "0.05"),))] == 3
    assert itl[(f"{name}_bucket", (("le", "0.2"),))] == 4


def test_finished_given_by_the_caller_are_the_ones_counted():
    """on_step(updated, now, finished): the output loop names the finished sequences; without
    it the logger finds them by status. Both count the same e2e latencies and successes."""
    def run(pass_finished: bool) -> dict:
        reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=9), arrival_time=0.0)
                for i in range(3)]
        sl = StatLogger(dict, log=False, start=0.0)
        sl.on_step(reqs, 1.0)
        reqs[0].status = RequestStatus.FINISHED_STOPPED
        reqs[2].status = RequestStatus.FINISHED_LENGTH
        sl.on_step(reqs, 2.0, [reqs[0], reqs[2]] if pass_finished else None)
        return _scrape(build_registry(dict, sl))

    for fams in (run(True), run(False)):
        _, e2e = fams["jpaged:e2e_request_latency_seconds"]
        assert e2e[("jpaged:e2e_request_latency_seconds_count", ())] == 2
        assert e2e[("jpaged:e2e_request_latency_seconds_sum", ())] == pytest.approx(4.0)
        _, ok = fams["jpaged:request_success"]
        assert ok[("jpaged:request_success_total", (("finished_reason", "stop"),))] == 1
        assert ok[("jpaged:request_success_total", (("finished_reason", "length"),))] == 1
        _, ttft = fams["jpaged:time_to_first_token_seconds"]
        assert ttft[("jpaged:time_to_first_token_seconds_count", ())] == 3


def test_iteration_token_edges_are_vllms_up_to_the_step_budget():
    """vLLM's iteration_tokens_total edges (no CUDA graphs: 1, 8, 16, ... 16384), doubled on
    to cover a larger per-step token budget."""
    from jpaged.metrics import ITERATION_TOKEN_BUCKETS, iteration_buckets

    assert iteration_buckets(2048) == tuple(float(b) for b in ITERATION_TOKEN_BUCKETS)
    assert iteration_buckets(40000)[-2:] == (32768.0, 65536.0)
    sl = StatLogger(dict, log=False, start=0.0, max_num_batched_tokens=512)
    sl.on_step([Request("a", [1] * 9, SamplingParams(max_tokens=4), arrival_time=0.0)], 1.0)
    _, it = _scrape(build_registry(dict, sl))["jpaged:iteration_tokens_total"]
    name = "jpaged:iteration_tokens_total_bucket"
    assert it[(name, (("le", "8.0"),))] == 0 and it[(name, (("le", "16.0"),))] == 1  # 9 + 1
