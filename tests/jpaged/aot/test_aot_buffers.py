"""The buffer-assignment reader: it finds the pool's parameters and flags a pool-sized copy.

The planted case is the bug it was written for: a scatter into fp8 pages, which XLA:CPU does by
widening the whole pool to f16 and back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jpaged.aot.buffers import (
    aliased_parameters,
    dump_dir,
    dump_options,
    find_dump,
    no_persistent_cache,
    parse_buffer_assignment,
    pool_report,
)
from jpaged.runner.kv_cache import storage_dtype
from pallas_kernels import reference

POOL = (4099, 16, 2, 16)  # an element count no activation here has


def _report(fn, *avals, pool_shape: str, donate=(0,)):
    with dump_dir() as d, no_persistent_cache():
        compiled = jax.jit(fn, donate_argnums=donate).lower(*avals).compile(
            dump_options(d, gpu=False))
        text = find_dump(d, "after_optimizations-buffer-assignment.txt").read_text()
    return pool_report(text, compiled.as_text(), pool_shape)


def _write_args(dtype):
    s = jax.ShapeDtypeStruct
    return (s(POOL, dtype), s(POOL, dtype), s((8, 2, 16), jnp.float32),
            s((8, 2, 16), jnp.float32), s((8,), jnp.int32))


def test_fp8_scatter_on_fp8_pages_is_flagged():
    def naive(kp, vp, k, v, slots):  # the old write: scatter straight into fp8 pages
        return (kp.reshape(-1, 2, 16).at[slots].set(k.astype(kp.dtype)).reshape(POOL),
                vp.reshape(-1, 2, 16).at[slots].set(v.astype(vp.dtype)).reshape(POOL))

    rep = _report(naive, *_write_args(jnp.float8_e4m3fn), pool_shape="f8e4m3fn[4099,16,2,16]",
                  donate=(0, 1))
    assert not rep.pool_aliased
    assert any(v.shape.startswith("f16[") for v in rep.copies), rep.copies  # widened pool


@pytest.mark.parametrize("dtype,xla", [(jnp.float32, "f32"), (jnp.float8_e4m3fn, "u8")])
def test_reference_write_on_stored_pages_is_in_place(dtype, xla):
    """As the engine calls it: fp8 pages live as uint8 and the op sees a bitcast view."""
    def write(kp, vp, k, v, slots):
        kp, vp = reference.write_kv(reference.from_bits(kp, dtype),
                                    reference.from_bits(vp, dtype), k, v, slots)
        return reference.to_bits(kp), reference.to_bits(vp)

    s = jax.ShapeDtypeStruct
    pages = s(POOL, storage_dtype(dtype))
    rep = _report(write, pages, pages, *_write_args(dtype)[2:], pool_shape=f"{xla}[4099,16,2,16]",
                  donate=(0, 1))
    assert rep.pool_aliased and rep.copies == [] and len(rep.pool_params) == 2


def test_undonated_pool_is_not_aliased():
    rep = _report(lambda kp, vp, k, v, s: reference.write_kv(kp, vp, k, v, s),
                  *_write_args(jnp.float32), pool_shape="f32[4099,16,2,16]", donate=())
    assert not rep.pool_aliased  # the result needs a new buffer: a full copy
    assert rep.copies


def test_wrong_pool_shape_is_named():
    with pytest.raises(ValueError, match=r"no parameter of shape f32\[1,2\]"):
        _report(reference.write_kv, *_write_args(jnp.float32), pool_shape="f32[1,2]",
                donate=(0, 1))


def test_parsers_on_text():
    text = (
        "BufferAssignment:\n"
        "allocation 0: size 64, parameter 3, shape |f32[4,4]| at ShapeIndex {}, maybe-live-out:\n"
        " value: <7 kv_k.1 @0> (size=64,offset=0): f32[4,4]{1,0}\n"
        "allocation 1: size 128, preallocated-temp:\n"
        " value: <9 copy.1 @0> (size=64,offset=0): f32[4,4]{1,0}\n"
        " value: <10 small @0> (size=16,offset=64): f32[4]{0}\n")
    allocs = parse_buffer_assignment(text)
    assert [(a.parameter, a.kind, len(a.values)) for a in allocs] == [
        (3, "parameter", 1), (None, "preallocated-temp", 2)]
    hlo = ("HloModule m, input_output_alias={ {0}: (3, {}, may-alias), {1}: (5, {}, may-alias) "
           "}, entry_computation_layout={(f32[4,4])->f32[4,4]}\n")
    assert aliased_parameters(hlo) == {3, 5}
    rep = pool_report(text, hlo, "f32[4,4]")
    assert rep.pool_params == [3] and [v.name for v in rep.copies] == ["copy.1"]
    assert not rep.pool_aliased
