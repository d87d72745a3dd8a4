"""KV cache dtypes end to end on the tiny model: 16-bit pages stay close to float32, fp8 scales
come from the first batch, and fp8 (e4m3 and e5m2) gives the same greedy outputs with prefix
caching on and off (vLLM issue #3880)."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.config import KV_CACHE_DTYPES
from jpaged.runner.kv_cache import kv_dtype, storage_dtype

BS = 8
# Few bucket shapes (T in 16/64, B in 1/4) so the engines below share compiled steps.
ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
            num_gpu_blocks_override=64, block_size=BS)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def _llm(dtype: str, **kw):
    return make_llm(tiny(), **{**ARGS, "kv_cache_dtype": dtype, **kw})


def _run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n).tolist() for n in (21, 37)]


@pytest.fixture(scope="module")
def fp32_outputs(prompts):
    llm = _llm("auto")
    assert llm.llm_engine.runner.kv.dtype == jnp.float32  # auto follows the model
    return _run(llm, prompts)


def test_dtype_names():
    model = jnp.float32
    want = {"auto": model, "float32": jnp.float32, "bfloat16": jnp.bfloat16,
            "float16": jnp.float16, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
            "fp8_e5m2": jnp.float8_e5m2}
    assert set(want) == set(KV_CACHE_DTYPES)
    for name, dt in want.items():
        assert kv_dtype(name, model) == jnp.dtype(dt)
    assert kv_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_dtype("int8", model)


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 1e-2), ("bfloat16", 6e-2)])
def test_16_bit_pages_stay_close_to_float32(prompts, fp32_outputs, dtype, tol):
    llm = _llm(dtype)
    assert llm.llm_engine.runner.kv.dtype == jnp.dtype(dtype)
    assert llm.llm_engine.runner.kv.k.dtype == storage_dtype(dtype)  # bf16 as uint16 bits
    outs = _run(llm, prompts)
    for got, ref in zip(outs, fp32_outputs, strict=True):
        assert got.token_ids == ref.token_ids
        diff = [abs(a[t].logprob - b[t].logprob)
                for t, a, b in zip(ref.token_ids, got.logprobs, ref.logprobs, strict=True)]
        assert max(diff) <= tol, diff


def _pages_absmax(kv, layer: int) -> tuple[float, float]:
    rows = slice(layer * kv.num_blocks, (layer + 1) * kv.num_blocks)
    k = np.abs(np.asarray(kv.k_pages()[rows]).astype(np.float32)).max()
    v = np.abs(np.asarray(kv.v_pages()[rows]).astype(np.float32)).max()
    return float(k), float(v)


def test_calculate_kv_scales_is_ignored_without_fp8(prompts, fp32_outputs, caplog):
    with caplog.at_level(logging.INFO, logger="jpaged"):
        llm = _llm("float32", calculate_kv_scales=True)
    assert "calculate_kv_scales is ignored" in caplog.text
    assert not llm.llm_engine.runner.scales_pending
    assert [o.token_ids for o in _run(llm, prompts)] == [o.token_ids for o in fp32_outputs]
    assert (np.asarray(llm.llm_engine.runner.kv.k_scale) == 1.0).all()


def _first_batch_sets_the_scales(llm, prompts: list[list[int]]) -> None:
    """Step once by hand: the scales change from 1.0 and the first batch's largest |K| and |V|
    are stored as exactly the fp8 maximum (it was quantized with its own scales); then finish."""
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    assert runner.scales_pending and (np.asarray(runner.kv.k_scale) == 1.0).all()
    for i, p in enumerate(prompts):
        eng.add_request(f"warm-{i}", {"prompt_token_ids": p}, GREEDY)
    eng.step()
    assert not runner.scales_pending
    for x in (runner.kv.k_scale, runner.kv.v_scale):
        assert (np.asarray(x) > 0).all() and (np.asarray(x) != 1.0).all()
    fmax = float(jnp.finfo(runner.kv.dtype).max)
    for layer in range(tiny().spec.num_layers):
        assert _pages_absmax(runner.kv, layer) == (fmax, fmax)
    scales = np.asarray(runner.kv.k_scale)
    while eng.has_unfinished_requests():
        eng.step()
    np.testing.assert_array_equal(np.asarray(runner.kv.k_scale), scales)  # fixed afterwards


def _shared_prefix_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 256, 5 * BS).tolist()  # 5 shared full blocks
    return [prefix + rng.integers(0, 256, n).tolist() for n in (7, 13, 6, 15)]


@pytest.mark.parametrize("dtype,calc", [("fp8_e4m3", False), ("fp8_e5m2", False),
                                        ("fp8", True)])
def test_fp8_with_prefix_caching_matches_without(dtype, calc):
    prompts = _shared_prefix_prompts()
    on = _llm(dtype, enable_prefix_caching=True, calculate_kv_scales=calc)
    off = _llm(dtype, enable_prefix_caching=False, calculate_kv_scales=calc)
    assert on.llm_engine.runner.kv.dtype == kv_dtype(dtype, jnp.float32)
    assert on.llm_engine.runner.kv.k.dtype == jnp.uint8  # fp8 pages stored as bit patterns
    if calc:
        _first_batch_sets_the_scales(on, prompts)
    a = [o.token_ids for o in _run(on, prompts)]  # later prompts reuse the first's blocks
    assert on.get_metrics()["prefix_cache_hits"] > 0
    again = [o.token_ids for o in _run(on, prompts)]  # every full prompt block from the cache
    b = [o.token_ids for o in _run(off, prompts)]
    assert a == b == again
    assert off.get_metrics()["prefix_cache_hits"] == 0
    if calc:
        # Both first batches hold p0 (plus, without caching, 17 more tokens of the shared
        # prefix), so both engines computed the same scales.
        for x, y in ((on.llm_engine.runner.kv.k_scale, off.llm_engine.runner.kv.k_scale),
                     (on.llm_engine.runner.kv.v_scale, off.llm_engine.runner.kv.v_scale)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            assert (np.asarray(x) != 1.0).all()
