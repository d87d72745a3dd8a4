"""Preemption and KV-pressure warnings: fields, advice, and rate limiting under a fake clock."""

from __future__ import annotations

import logging

import pytest
from core_sim import Sim, make_request, make_scheduler

from jpaged.config import CacheConfig
from jpaged.core.pressure import (
    PressureMonitor,
    PressureThresholds,
    RateLimitedLog,
    advice,
)

LOGGER = "jpaged.pressure"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_rate_limit_one_per_interval_per_kind_with_suppressed_count(caplog):
    clock = FakeClock()
    lim = RateLimitedLog(logging.getLogger(LOGGER), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert lim.warn("a", "first")
        clock.t += 3
        assert not lim.warn("a", "second") and not lim.warn("a", "third")
        assert lim.warn("b", "other kind")  # kinds are limited separately
        clock.t += 6.9
        assert not lim.warn("a", "fourth")  # 9.9 s after the first
        clock.t += 0.1
        assert lim.warn("a", "fifth")
        clock.t += 10
        assert lim.warn("a", "sixth")
    assert messages(caplog) == [
        "first", "other kind", "fifth (3 similar warnings suppressed in the last 10s)", "sixth"]
    assert lim.emitted == {"a": 3, "b": 1} and lim.suppressed == {}
    with pytest.raises(ValueError, match="interval"):
        RateLimitedLog(interval=-1)


def test_advice_names_the_knob_the_user_set():
    assert "raise num_gpu_blocks_override" in advice(CacheConfig(num_gpu_blocks_override=10))
    assert "raise kv_cache_memory_bytes" in advice(CacheConfig(kv_cache_memory_bytes=2**20))
    text = advice(CacheConfig())
    assert "gpu_memory_utilization" in text and "lower max_num_seqs" in text
    assert "kv_offloading_size > 0" in text and "fp8" in text
    text = advice(CacheConfig(kv_offloading_size=1.0, kv_cache_dtype="fp8"))
    assert "preemption_mode=swap" in text and "kv_offloading_size >" not in text
    assert "fp8" not in text
    assert "preemption_mode" not in advice(CacheConfig(kv_offloading_size=1.0,
                                                       preemption_mode="swap"))


def test_tiny_pool_workload_warns_with_request_mode_total_and_advice(caplog):
    # 11 usable blocks of 4 tokens; four 12-token prompts growing to 32 tokens must preempt.
    s = make_scheduler(12, max_num_batched_tokens=32)
    reqs = [make_request(f"r{i}", [i * 50 + j for j in range(12)], 20, arrival=float(i))
            for i in range(4)]
    for r in reqs:
        s.add_request(r)
    sim = Sim(s)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sim.run()
    assert s.num_preemptions >= 2
    got = messages(caplog)
    # Real time: the whole run takes far less than 10 s, so exactly one preemption warning.
    pre = [m for m in got if "was preempted" in m]
    assert len(pre) == 1, got
    first = sim.events[0][1]
    assert f"Request {first!r} was preempted by RECOMPUTE mode" in pre[0]
    assert "total_num_cumulative_preemption=1" in pre[0]
    assert "lower max_num_seqs" in pre[0] and "gpu_memory_utilization" in pre[0]
    assert s.pressure.limiter.suppressed["preemption"] == s.num_preemptions - 1


def _monitor(clock, **th) -> PressureMonitor:
    return PressureMonitor(CacheConfig(), 101, interval=10.0, clock=clock,
                           thresholds=PressureThresholds(**th))


def test_sustained_usage_with_waiting_requests_warns_once_per_window(caplog):
    clock = FakeClock()
    m = _monitor(clock, window_steps=5, usage=0.9)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(4):
            m.on_step(0.95, 0, num_waiting=3)
        m.on_step(0.5, 0, num_waiting=3)  # a dip resets the window
        for _ in range(4):
            m.on_step(0.95, 0, num_waiting=3)
        m.on_step(0.99, 0, num_waiting=0)  # nobody waits: full is fine
        assert messages(caplog) == []
        for _ in range(5):
            m.on_step(0.97, 0, num_waiting=2)
        for _ in range(10):  # two more windows inside 10 s: both muted
            m.on_step(0.97, 0, num_waiting=2)
        clock.t += 11
        for _ in range(5):
            m.on_step(0.97, 0, num_waiting=2)
    got = messages(caplog)
    assert len(got) == 2, got
    assert "usage has stayed >= 90% for 5 steps with 2 request(s) waiting" in got[0]
    assert "(100 blocks)" in got[0] and "2 similar warnings suppressed" in got[1]


def test_eviction_turnover_warns(caplog):
    clock = FakeClock()
    m = _monitor(clock, window_steps=4, turnover=1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        total = 0
        m.on_step(0.2, total, 0)
        for step in range(8):  # 30 evictions per step: the 100-block pool turns over in 4
            total += 30
            m.on_step(0.2, total, 0)
            if step == 2:
                assert messages(caplog) == []
    got = messages(caplog)
    assert len(got) == 1 and "120 cached blocks evicted in the last 4 steps (1.2x" in got[0]
    assert m.limiter.suppressed["kv_pressure"] == 1
