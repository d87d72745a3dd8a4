"""The zero-overhead bound: prefill is matmul-bound, decode steps weight-read-bound."""

import math

import jax
from flax import nnx
from helpers import tiny

from jpaged.bench.bound import machine_rates, workload_bound


def _layer_params(loaded) -> int:
    """Parameters outside the embedding, counted from the model itself (not the spec)."""
    state = nnx.state(loaded.model.model.layers)
    return sum(x.size for x in jax.tree.leaves(state)) + loaded.spec.hidden_size  # + final norm


def test_prefill_only_is_matmul_work_over_the_rate():
    loaded = tiny()
    spec = loaded.spec
    n = 40
    rates = {"matmul_flops_per_s": 1e9, "read_bytes_per_s": 1e9}
    got = workload_bound(spec, [n], 1, rates)
    embed = spec.vocab_size * spec.hidden_size
    attn = 4 * spec.num_layers * spec.num_heads * spec.head_dim * n * n / 2
    want = (2 * _layer_params(loaded) * n + attn + 2 * embed) / 1e9
    assert math.isclose(got["bound_s"], want, rel_tol=1e-9)
    assert math.isclose(got["bound_tokens_per_s"], 1 / want, rel_tol=1e-9)


def test_decode_steps_read_every_weight_once():
    loaded = tiny()
    spec = loaded.spec
    fast = {"matmul_flops_per_s": 1e30, "read_bytes_per_s": 1e6}  # decode purely read-bound
    got = workload_bound(spec, [8, 9], 5, fast)
    weights = (_layer_params(loaded) + spec.vocab_size * spec.hidden_size) * 4
    assert math.isclose(got["bound_s"], 4 * weights / 1e6, rel_tol=1e-6)
    assert math.isclose(got["bound_tokens_per_s"], 10 / got["bound_s"], rel_tol=1e-9)


def test_machine_rates_are_positive():
    r = machine_rates(hidden=64, inter=64, tokens=64, stream_bytes=1 << 20)
    assert r["matmul_flops_per_s"] > 0 and r["read_bytes_per_s"] > 0
