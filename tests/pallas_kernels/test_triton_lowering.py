"""Each kernel lowers to a Triton GPU call (Pallas -> Triton IR, no GPU needed).

This catches what interpret mode cannot: non-power-of-two tiles, primitives the Triton lowering
lacks, unsupported indexing. Compiling that IR to PTX (in XLA) still needs a CUDA machine.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from helpers import lower_for_cuda

from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

S = jax.ShapeDtypeStruct


def _triton_calls(text: str) -> int:
    return text.count("xla.gpu.triton") + text.count("triton_kernel_call")


# merge: the decode kernel's context spans several partitions, so the merge kernel runs too.
@pytest.mark.parametrize("hq,hkv,d,bs,max_blocks,page_dtype,opts,merge", [
    (32, 8, 128, 16, 40, jnp.bfloat16, {}, 1),
    (24, 8, 64, 32, 40, jnp.float8_e4m3fn, {"soft_cap": 30.0, "sliding_window": 100,
                                            "k_scale": 0.5, "v_scale": 0.5}, 1),
    (12, 3, 128, 16, 40, jnp.float32, {}, 1),
    (4, 4, 64, 8, 1, jnp.bfloat16, {}, 0),  # MHA, one 8-token page: steps widen to 16 keys
])
def test_kernels_lower_to_triton(hq, hkv, d, bs, max_blocks, page_dtype, opts, merge):
    b, t, blocks = 4, 48, 128
    pages = S((blocks, bs, hkv, d), page_dtype)
    ints = functools.partial(S, dtype=jnp.int32)
    decode = lower_for_cuda(functools.partial(paged_decode_attention, **opts),
                             S((b, hq, d), jnp.bfloat16), pages, pages, ints((b,)),
                             ints((b, max_blocks)))
    assert _triton_calls(decode) == 1 + merge
    assert ("paged_merge_pk" in decode) == bool(merge)
    ragged = lower_for_cuda(functools.partial(ragged_paged_attention, **opts),
                             S((t, hq, d), jnp.bfloat16), pages, pages, ints((b + 1,)),
                             ints((b,)), ints((b, max_blocks)))
    assert _triton_calls(ragged) == 2 + merge  # the tiled kernel, the decode fast path
    scales = {k: v for k, v in opts.items() if k.endswith("_scale")}
    write = lower_for_cuda(functools.partial(write_kv, **scales), pages, pages,
                            S((t, hkv, d), jnp.bfloat16), S((t, hkv, d), jnp.bfloat16),
                            ints((t,)))
    assert _triton_calls(write) == 1


def test_shapes_the_triton_lowering_cannot_take():
    from pallas_kernels._compat import triton_unsupported

    small = S((64, 16, 8, 128), jnp.bfloat16)
    assert triton_unsupported(small, dims=(128, 16)) is None
    assert "powers of two" in triton_unsupported(small, dims=(96, 16))
    fp8_3gib = S((3 * 2**30 // (16 * 8 * 128), 16, 8, 128), jnp.float8_e4m3fn)
    assert "int32" in triton_unsupported(fp8_3gib, dims=(128, 16))
    bf16_6gib = S((3 * 2**30 // (16 * 8 * 128), 16, 8, 128), jnp.bfloat16)
    assert triton_unsupported(bf16_6gib, dims=(128, 16)) is None  # 64-bit offsets there


@pytest.mark.parametrize("rows,hidden,q,kv,inter,dtype", [
    (1, 4096, 4096, 1024, 14336, jnp.bfloat16),  # Llama-3-8B at batch 1
    (64, 4096, 4096, 1024, 14336, jnp.bfloat16),
    (3, 576, 576, 192, 1536, jnp.float32),  # SmolLM2 (odd multiples of 64), 3 rows
])
def test_decode_matmuls_lower_to_one_triton_call_each(rows, hidden, q, kv, inter, dtype):
    from pallas_kernels import decode_matmul as dm

    x, g = S((rows, hidden), dtype), S((hidden,), dtype)
    qkv = lower_for_cuda(lambda x, g, a, b, c: dm.projections(x, [a, b, c], norm_weight=g),
                          x, g, S((hidden, q), dtype), S((hidden, kv), dtype),
                          S((hidden, kv), dtype))
    assert _triton_calls(qkv) == 1 and "decode_matmul_proj" in qkv
    up = lower_for_cuda(lambda x, g, a, b: dm.gated_up(x, a, b, norm_weight=g), x, g,
                         S((hidden, inter), dtype), S((hidden, inter), dtype))
    assert _triton_calls(up) == 1 and "decode_matmul_gate_up" in up
    down = lower_for_cuda(dm.projection_residual, S((rows, inter), dtype),
                           S((inter, hidden), dtype), x)
    assert _triton_calls(down) == 1 and "decode_matmul_residual" in down
    # [N, K] weights (the layout the device check times beside [K, N]).
    down_t = lower_for_cuda(functools.partial(dm.projection_residual, transposed=True),
                             S((rows, inter), dtype), S((hidden, inter), dtype), x)
    assert _triton_calls(down_t) == 1


@pytest.mark.parametrize("rows,experts,k,n,dtype", [
    (8, 128, 2048, 768, jnp.bfloat16),  # Qwen3-30B-A3B's gate/up at one token (8 experts)
    (300, 8, 96, 48, jnp.float32),  # odd sides: tiles of 32 and 16
    (5, 4, 96, 40, jnp.float32),  # a side without a tile the kernel can take
])
def test_the_moe_grouped_matmul_lowers_to_one_triton_call(rows, experts, k, n, dtype):
    from pallas_kernels import grouped_matmul as gmm

    why = gmm.unsupported(S((experts, k, n), dtype))
    if why is not None:  # n = 40 has no power-of-two tile >= 16: ragged_dot takes it
        assert "no power-of-two tile >= 16" in why
        return
    text = lower_for_cuda(gmm.grouped_matmul, S((rows, k), dtype), S((experts, k, n), dtype),
                          S((experts,), jnp.int32))
    assert _triton_calls(text) == 1 and "moe_grouped_matmul" in text
    # A layer's SwiGLU: gate and up in one launch, then down.
    w, wd = S((experts, k, n), dtype), S((experts, n, k), dtype)
    swiglu = lower_for_cuda(gmm.grouped_swiglu, S((rows, k), dtype), w, w, wd,
                            S((experts,), jnp.int32))
    assert _triton_calls(swiglu) == 2 and "moe_grouped_gate_up" in swiglu


@pytest.mark.parametrize("kind,group,mins", [("int4", 32, True), ("int8", 16, False),
                                             ("int8", 32, True), ("fp8", 2048, False)])
def test_quantized_experts_lower_to_the_same_two_triton_calls(kind, group, mins):
    """A GGUF's experts at its own quantization (Q4_K: int4 groups of 32 with mins; Q6_K: int8
    groups of 16; Q5_K: int8 with mins) and fp8: Qwen3-30B-A3B's shapes at one token."""
    from models.quant import QuantWeight
    from pallas_kernels import grouped_matmul as gmm

    e, h, i = 128, 2048, 768

    def weight(k: int, n: int) -> QuantWeight:
        values = {"int4": (k // 2, jnp.uint8), "int8": (k, jnp.int8),
                  "fp8": (k, jnp.float8_e4m3fn)}[kind]
        g = k if kind == "fp8" else group
        side = S((e, k // g, n), jnp.float32)
        return QuantWeight(kind, S((e, values[0], n), values[1]), side,
                           side if mins else None, 1)

    wg, wd = weight(h, i), weight(i, h)
    assert gmm.unsupported(wg, wg) is None and gmm.unsupported(wd) is None
    text = lower_for_cuda(gmm.grouped_swiglu, S((8, h), jnp.bfloat16), wg, wg, wd,
                          S((e,), jnp.int32))
    assert _triton_calls(text) == 2 and "moe_grouped_gate_up" in text


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (16, 128, 8), (4, 8, 2)])
def test_the_moe_routing_lowers_to_one_triton_call(t, e, k):
    """A decode step's routing and tile layout (`moe_route`): one Triton call, Qwen3-30B-A3B's
    128 experts at one and 16 tokens, Mixtral's 8."""
    from pallas_kernels import grouped_matmul as gmm

    def route(logits, valid):
        w, dst, layout = gmm.route_layout(logits, valid, k, True)
        return w, dst, layout.tile_expert, layout.src

    text = lower_for_cuda(route, S((t, e), jnp.float32), S((t,), jnp.bool_))
    assert _triton_calls(text) == 1 and "moe_route" in text
