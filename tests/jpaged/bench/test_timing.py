"""The compile-aware stopwatch, the call timer and the mixed-length workload."""

import jax
import jax.numpy as jnp
import pytest

from jpaged.bench.timing import median_call_s, stopwatch
from jpaged.bench.workloads import mixed_length_requests


def test_stopwatch_counts_compilation_only_when_it_happens():
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = jnp.ones((7, 13))
    with stopwatch() as cold:
        f(x).block_until_ready()
    with stopwatch() as warm:
        f(x).block_until_ready()
    assert 0.0 < cold.compile_s <= cold.wall_s
    assert warm.compile_s == 0.0 and warm.net_s == pytest.approx(warm.wall_s)


def test_mixed_length_requests_are_seeded_and_in_range():
    a = mixed_length_requests(1000, 20, 5, (3, 9), (2, 4))
    assert a == mixed_length_requests(1000, 20, 5, (3, 9), (2, 4))
    assert all(3 <= len(p) <= 9 and 2 <= o <= 4 for p, o in a)
    assert all(500 <= t < 1000 for p, _ in a for t in p)
    with pytest.raises(ValueError, match="output_range"):
        mixed_length_requests(1000, 2, 0, (3, 9), (5, 4))


def test_median_call_s_warms_up_once_then_times_each_repeat():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    s = median_call_s(f, jnp.ones(4), repeats=3)
    assert len(calls) == 4 and s >= 0.0
