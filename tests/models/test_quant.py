"""Quantized weights on the device: GGUF blocks decoded losslessly, the jnp math, quantized
models that equal their dequantized twins, fp8 at load, checkpoints, planning, bad input."""

from __future__ import annotations

import re

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from tiny_models import jpaged_logits, random_weights, relative_error, tiny_spec, write_gguf

from models import quant
from models.attention import dense_causal_attention
from models.gguf_quant import DECODERS, LAYOUTS, decode, device_bytes, to_weight
from models.llama import stack_layers
from models.loader import load_model
from models.quant import (
    QuantWeight,
    dequantize,
    dequantize_np,
    pack_int4,
    quant_logits,
    quant_matmul,
    quantize_fp8,
    unpack_int4_np,
)
from models.quant_layers import QuantEmbed, QuantLinear, plan_of

Q = gguf.GGMLQuantizationType
# Byte offsets of each block type's float16 fields (d, and m / dmin where it has one).
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_0: (0,), Q.Q4_1: (0, 2),
               Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_blocks(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Random raw blocks of `qtype` (every bit pattern of the integer fields) with finite f16s."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        d = rng.uniform(-2, 2, (rows, k // block, 1)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(DECODERS), ids=lambda t: t.name)
def test_gguf_blocks_decode_exactly(qtype):
    """value * scale + min equals llama.cpp's dequantization bit for bit, in both layouts."""
    raw = _random_blocks(qtype, rows=6, k=512, seed=int(qtype))
    ref = gguf.quants.dequantize(raw, qtype).reshape(6, -1)
    dec = decode(raw, qtype)
    for k_axis in (0, 1):
        w = to_weight(dec, LAYOUTS[qtype], k_axis)
        w.check("w")
        host = dequantize_np(w)
        dev = np.asarray(dequantize(jnp.asarray(w.q), jnp.asarray(w.scales),
                                    None if w.mins is None else jnp.asarray(w.mins), w.kind,
                                    jnp.float32, k_axis))
        want = ref.T if k_axis == 0 else ref
        np.testing.assert_array_equal(host, want)
        np.testing.assert_array_equal(dev, want)
        assert w.nbytes == device_bytes(qtype, (6, 512), 4)


def test_int4_packing_round_trips_and_pairs_group_halves():
    v = np.random.default_rng(0).integers(0, 16, (64, 5), dtype=np.uint8)
    p = pack_int4(v, 32)
    assert p.shape == (32, 5)
    np.testing.assert_array_equal(p[3] & 15, v[3])  # group 0: rows 3 and 19 share a byte
    np.testing.assert_array_equal(p[3] >> 4, v[19])
    np.testing.assert_array_equal(p[16] & 15, v[32])  # group 1 starts at packed row 16
    np.testing.assert_array_equal(unpack_int4_np(p, 32), v)
    np.testing.assert_array_equal(unpack_int4_np(pack_int4(v.T, 16, 1), 16, 1), v.T)


def _random_weight(kind: str, k: int, n: int, group: int, mins: bool, seed: int = 0
                   ) -> QuantWeight:
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float32)
    m = rng.uniform(-0.5, 0.5, scales.shape).astype(np.float32) if mins else None
    if kind == "fp8":
        return quantize_fp8(rng.standard_normal((k, n)).astype(np.float32))
    if kind == "int4":
        q = pack_int4(rng.integers(0, 16, (k, n), dtype=np.uint8), group)
    else:
        q = rng.integers(-128, 128, (k, n)).astype(np.int8)
    return QuantWeight(kind, q, scales, m)


@pytest.mark.parametrize("kind,mins", [("int4", True), ("int8", False), ("int8", True),
                                       ("fp8", False)])
def test_slabbed_matmul_equals_whole(monkeypatch, kind, mins):
    """On XLA:CPU a large weight is dequantized a slab at a time: same product."""
    w = _random_weight(kind, 256, 48, 32, mins)
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    ref = x @ dequantize_np(w)
    monkeypatch.setattr(quant, "CPU_SLAB_ELEMENTS", 64 * 48)  # four slabs of two groups
    assert quant._slabs(8, 256 * 48) == 4
    assert quant._slabs(256, 256 * 48) == 4  # fp8: slabs of K rows
    got = quant_matmul(jnp.asarray(x), jnp.asarray(w.q), jnp.asarray(w.scales),
                       None if w.mins is None else jnp.asarray(w.mins), kind, jnp.float32,
                       jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_cpu_matmul_temporaries_stay_a_slab(kind):
    """A Llama-3-8B-sized down projection [14336, 4096] on XLA:CPU: no float copy of the
    weight (235 MB in float32); compiled only, from abstract arrays. fp8 keeps one copy of its
    bytes (XLA:CPU cannot slice fp8 in place: models/quant.py)."""
    k, n = 14336, 4096
    q = jax.ShapeDtypeStruct((k // 2, n) if kind == "int4" else (k, n),
                             jnp.uint8 if kind == "int4" else jnp.float8_e4m3fn)
    groups = 1 if kind == "fp8" else k // 32
    scales = jax.ShapeDtypeStruct((groups, n), jnp.float16)
    mins = None if kind == "fp8" else scales
    x = jax.ShapeDtypeStruct((4, k), jnp.float32)
    fn = jax.jit(lambda x, q, s, m: quant_matmul(x, q, s, m, kind, jnp.float32))
    temp = fn.lower(x, q, scales, mins).compile().memory_analysis().temp_size_in_bytes
    stored = k * n if kind == "fp8" else 0
    assert temp <= stored + 3 * 4 * quant.CPU_SLAB_ELEMENTS, temp  # a float32 slab, its source


def test_tied_head_logits_in_slabs(monkeypatch):
    table = _random_weight("int4", 64, 96, 32, True)  # built [K, V]: use it as [V, K]
    t = QuantWeight("int4", np.ascontiguousarray(pack_int4(
        unpack_int4_np(table.q, 32).T, 32, 1)), table.scales.T.copy(), table.mins.T.copy(), 1)
    h = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    monkeypatch.setattr(quant, "CPU_SLAB_ELEMENTS", 24 * 64)
    got = quant_logits(jnp.asarray(h), *(jnp.asarray(a) for a in (t.q, t.scales, t.mins)),
                       "int4", jnp.float32, jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), h @ dequantize_np(t).T, rtol=1e-5, atol=1e-4)


def test_fp8_per_channel_error_is_bounded():
    w = np.random.default_rng(3).standard_normal((128, 40)).astype(np.float32)
    w[:, 7] = 0.0  # an all-zero channel keeps a finite scale
    q = quantize_fp8(w)
    assert q.q.dtype == ml_dtypes.float8_e4m3fn and q.scales.shape == (1, 40)
    back = dequantize_np(q)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value (normal range)
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-4 + q.scales * 2.0**-9)
    assert np.all(back[:, 7] == 0)


def test_e4m3_bytes_read_through_float16_exactly():
    """The CPU matmul's e4m3 -> float16 bit move: every finite byte value, exactly (x 256)."""
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(quant._e4m3_over_256(jnp.asarray(b))).astype(np.float32) * 256
    finite = np.isfinite(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])


def test_fp8_scale_search_beats_absmax_channel_by_channel(monkeypatch):
    rng = np.random.default_rng(4)
    # heavy-tailed channels of different magnitudes, as trained weights are
    w = (rng.standard_t(4, (96, 33)) * rng.uniform(0.01, 5, 33)).astype(np.float32)
    w[:, 5] = 0.0
    plain, searched = quantize_fp8(w, candidates=1), quantize_fp8(w)
    amax = np.abs(w).max(0, keepdims=True)
    # one candidate is absmax scaling: the largest value of each channel lands on 448
    want = (w / np.where(amax > 0, amax / 448, 1)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(plain.q.view(np.uint8), want.view(np.uint8))
    np.testing.assert_allclose(plain.scales, np.where(amax > 0, amax / 448, 1), rtol=3e-7)
    # every searched scale lies in the octave above absmax's; no channel's error grows
    live = amax > 0
    assert np.all(searched.scales[live] >= plain.scales[live])
    assert np.all(searched.scales[live] < 2 * plain.scales[live])
    err = [((dequantize_np(x) - w) ** 2).sum(0) for x in (plain, searched)]
    assert np.all(err[1] <= err[0]) and err[1].sum() < 0.95 * err[0].sum()
    assert searched.scales[0, 5] == 1 and np.all(dequantize_np(searched)[:, 5] == 0)
    assert np.isfinite(searched.q.astype(np.float32)).all()
    # an embedding's [V, K] table (k_axis 1) and a search in blocks of channels give the same
    table = quantize_fp8(w.T.copy(), k_axis=1)
    assert table.scales.shape == (33, 1)
    np.testing.assert_array_equal(table.q.T.view(np.uint8), searched.q.view(np.uint8))
    monkeypatch.setattr(quant, "FP8_SEARCH_ELEMENTS", 96 * 4)  # 4 channels a block, 1 padded
    blocked = quantize_fp8(w)
    np.testing.assert_array_equal(blocked.q.view(np.uint8), searched.q.view(np.uint8))
    np.testing.assert_array_equal(blocked.scales, searched.scales)
    with pytest.raises(ValueError, match="candidates must be >= 1"):
        quantize_fp8(w, candidates=0)
    w[3, 9] = np.nan
    w[0, 30] = -np.inf
    with pytest.raises(ValueError, match="NaN or inf values in 2 of its 33 output channels "
                                         r"\(first: channel 9\)"):
        quantize_fp8(w)


def test_bad_weights_are_named():
    w = _random_weight("int4", 64, 8, 32, True)
    with pytest.raises(ValueError, match="layer.x: int4 values must be uint8"):
        QuantWeight("int4", w.q.astype(np.int8), w.scales, w.mins).check("layer.x")
    with pytest.raises(ValueError, match="scales of shape \\(3, 8\\) do not fit"):
        QuantWeight("int4", w.q, np.ones((3, 8), np.float32), None).check("layer.x")
    with pytest.raises(ValueError, match="int4 needs an even group size and mins"):
        QuantWeight("int4", w.q, w.scales, None).check("layer.x")


# ---- whole models ----------------------------------------------------------------------------

SEQS = [[256, 72, 101, 108, 108, 111, 32, 119], [256, 1, 2, 3, 4, 5]]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama GGUF whose linears are Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and embedding Q8_0."""
    spec = tiny_spec()
    types = {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q5_0",
             "gate_proj": "Q5_1", "up_proj": "Q4_1", "down_proj": "Q4_0",
             "embed_tokens": "Q8_0", "lm_head": "Q8_0"}
    path = tmp_path_factory.mktemp("qgguf") / "tiny.gguf"
    return write_gguf(path, spec, random_weights(spec), quantize=types)


def test_gguf_runs_at_its_own_quantization(tiny_gguf):
    ref = load_model(str(tiny_gguf), "float32")
    got = load_model(str(tiny_gguf), "float32", quantization="gguf")
    assert got.quantization == "gguf" and plan_of(got.model)
    assert not plan_of(ref.model)
    plan = plan_of(got.model)
    assert plan["model.layers.0.self_attn.q_proj"].kind == "int4"
    assert plan["model.layers.1.self_attn.v_proj"].kind == "int8"
    assert isinstance(got.model.model.embed_tokens, QuantEmbed)
    assert isinstance(got.model.lm_head, QuantLinear)
    ours, want = jpaged_logits(got.model, SEQS), jpaged_logits(ref.model, SEQS)
    for a, b in zip(ours, want, strict=True):
        assert relative_error(a, b) < 1e-5
    stacked = stack_layers(got.model)  # uniform quantized layers still scan on XLA:CPU
    assert type(stacked.model.layers).__name__ == "ScannedLayers"
    for a, b in zip(jpaged_logits(stacked, SEQS), want, strict=True):
        assert relative_error(a, b) < 1e-5


def test_layers_quantized_differently_are_not_stacked(tmp_path):
    spec = tiny_spec()
    path = write_gguf(tmp_path / "mixed.gguf", spec, random_weights(spec),
                      quantize={"layers.0.mlp.down_proj": "Q4_1", "down_proj": "Q8_0"})
    loaded = load_model(str(path), "float32", quantization="gguf")
    assert stack_layers(loaded.model) is loaded.model


def test_fp8_at_load_keeps_head_and_embedding(tiny_gguf):
    ref = load_model(str(tiny_gguf), "float32")
    got = load_model(str(tiny_gguf), "float32", quantization="fp8")
    plan = plan_of(got.model)
    assert len(plan) == 2 * 7 and {p.kind for p in plan.values()} == {"fp8"}
    assert isinstance(got.model.model.embed_tokens, nnx.Embed)
    assert isinstance(got.model.lm_head, nnx.Linear)
    # The float model with each planned kernel replaced by its fp8 rounding gives the logits.
    for module in plan:
        parent = ref.model
        for part in module.split("."):
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        kernel = np.asarray(parent.kernel[...])
        parent.kernel.set_value(jnp.asarray(dequantize_np(quantize_fp8(kernel))))
    for a, b in zip(jpaged_logits(got.model, SEQS), jpaged_logits(ref.model, SEQS), strict=True):
        assert relative_error(a, b) < 1e-5


@pytest.mark.parametrize("dtype,quantization,bits", [("float32", "fp8", "u8"),
                                                     ("bfloat16", None, "u16")])
def test_narrow_layers_stacked_for_a_scan_are_sliced_as_bits(tiny_gguf, dtype, quantization,
                                                             bits):
    """XLA:CPU widens a whole stacked fp8 / bfloat16 array before slicing a layer out of it
    (every layer's weights converted in each iteration); the scan slices unsigned integers of
    their width instead, and the stacked model gives the per-layer model's logits."""
    got = load_model(str(tiny_gguf), dtype, quantization=quantization)
    stacked = stack_layers(got.model)
    graphdef, state = nnx.split(stacked)

    def logits(state, ids, pos, seg):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, pos, dense_causal_attention(seg, pos, m.spec))
        return m.compute_logits(hidden)

    n = len(SEQS[0])
    args = (jnp.asarray(SEQS[0], jnp.int32), jnp.arange(n, dtype=jnp.int32),
            jnp.zeros(n, jnp.int32))
    hlo = jax.jit(logits).lower(state, *args).compile().as_text()
    layers = got.model.spec.num_layers
    assert re.search(rf"{bits}\[{layers},\d+,\d+\]", hlo)  # the stacked kernels, as bits
    # (never widened whole: no float array of [layers, K, N]; fp8's scales are [layers, 1, N])
    assert not re.search(rf"(?<!b)f(16|32)\[{layers},\d{{2,}},\d+\]", hlo)
    a = jpaged_logits(stacked, [SEQS[0]])[0]
    b = jpaged_logits(got.model, [SEQS[0]])[0]
    assert relative_error(a, b) < 1e-6


def test_embedded_model_keeps_its_quantized_bytes(embedded):
    """The embedded SmolLM2 (Q4_1, its embedding Q8_0) at its own quantization: at most 0.3x
    the float32 bytes, and logits equal to the dequantized model's."""
    got = load_model(None, "float32", quantization="gguf")

    def nbytes(m: nnx.Module) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(nnx.state(m)))

    ratio = nbytes(got.model) / nbytes(embedded.model)
    assert ratio <= 0.3, ratio
    seqs = [embedded.tokenizer.encode("The paged KV cache stores keys and values")]
    a = jpaged_logits(stack_layers(got.model), seqs)[0]  # scanned: one layer to compile
    b = jpaged_logits(stack_layers(embedded.model), seqs)[0]
    assert relative_error(a, b) < 1e-4
    assert (a.argmax(-1) == b.argmax(-1)).all()
    # `jpaged estimate --quantization gguf` counts exactly these bytes; fp8 about half.
    from jpaged.estimate import estimate_capacity

    base = estimate_capacity(None, dtype="float32")
    g = estimate_capacity(None, dtype="float32", quantization="gguf")
    f = estimate_capacity(None, dtype="float32", quantization="fp8")
    assert g.param_bytes == nbytes(got.model) and g.quantization == "gguf"
    assert base.param_bytes == nbytes(embedded.model)
    assert g.num_blocks > f.num_blocks > base.num_blocks
    assert f.param_bytes < 0.5 * base.param_bytes


def test_quantized_checkpoint_round_trips(tiny_gguf, tmp_path):
    from models.checkpoint import save_checkpoint

    got = load_model(str(tiny_gguf), "float32", quantization="gguf")
    out = save_checkpoint(got, tmp_path / "ck")
    back = load_model(str(out), "float32")
    assert back.quantization == "gguf" and plan_of(back.model) == plan_of(got.model)
    for a, b in zip(jax.tree.leaves(nnx.state(back.model)), jax.tree.leaves(nnx.state(got.model)),
                    strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="quantized with 'gguf'; quantization='fp8' names"):
        load_model(str(out), "float32", quantization="fp8")


def test_bad_quantization_requests_are_refused(tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match="quantization 'awq4' is not a method jpaged has"):
        load_model(str(tiny_gguf), "float32", quantization="awq4")
    spec = tiny_spec()
    from tiny_models import write_hf_dir

    hf = write_hf_dir(tmp_path / "hf", spec, random_weights(spec))
    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file"):
        load_model(str(hf), "float32", quantization="gguf")
    # A type that cannot run quantized is named with its tensor.
    raw = write_gguf(tmp_path / "bf16.gguf", spec, random_weights(spec), quantize={})
    assert load_model(str(raw), "float32", quantization="gguf").quantization == "gguf"


def test_unsupported_gguf_type_is_named(tmp_path, monkeypatch):
    from models import gguf_loader

    spec = tiny_spec()
    path = write_gguf(tmp_path / "t.gguf", spec, random_weights(spec), quantize={"up_proj": "Q5_1"})
    monkeypatch.delitem(gguf_loader.LAYOUTS, Q.Q5_1)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' is Q5_1, which cannot "
                                         r"run quantized"):
        load_model(str(path), "float32", quantization="gguf")
