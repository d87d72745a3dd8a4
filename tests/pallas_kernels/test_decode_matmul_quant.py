"""The weight-streaming decode matmuls on quantized weights (models/quant.py's device layout:
int4 with its group-local nibble pairing, int8 with and without mins, fp8 per output channel),
in interpret mode, against the jnp reference (`quant_matmul`, QuantLinear's order: float32
sum, bias in float32, one rounding; then the float kernels' reference for the norm, RoPE, the
activation and the residual); the formats the kernels refuse; the runner's choice for
quantized models, tensor parallel over two CPU devices; and the embedded GGUF model run at its
own quantization on the Pallas path giving the XLA path's greedy tokens."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_on_cpu_devices

from models.quant import QuantWeight, dequantize, pack_int4, quant_matmul, quantize_fp8
from models.quant_layers import QuantLayout
from pallas_kernels import decode_matmul as dm
from pallas_kernels import reference as ref

ROOT = Path(__file__).resolve().parents[2]


def _tol(dtype: jnp.dtype) -> dict:
    # bf16: the kernel and XLA sum in another order and may round an output one ulp apart.
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == jnp.float32 else {"atol": 0.06, "rtol": 0.02}


def _close(got: jax.Array, want: jax.Array, dtype: jnp.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **_tol(dtype))


def qweight(kind: str, k: int, n: int, group: int, mins: bool, seed: int,
            scale_dtype: str = "float16") -> QuantWeight:
    """A random [k, n] weight of `kind` on the device, outputs O(1) for O(1) inputs."""
    rng = np.random.default_rng(seed)
    if kind == "fp8":
        return jax.tree.map(jnp.asarray, quantize_fp8(
            (rng.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32)))
    groups = k // group
    step = 1 / np.sqrt(k) / (4 if kind == "int4" else 64)
    scales = (rng.uniform(0.5, 1.5, (groups, n)) * step).astype(scale_dtype)
    if kind == "int4":  # values 0..15 around their mean: min = -7.5 * scale (+ a shift)
        vals = rng.integers(0, 16, (k, n), dtype=np.uint8)
        low = (-7.5 * scales.astype(np.float32) + rng.normal(size=(groups, n)) * step)
        w = QuantWeight("int4", pack_int4(vals, group), scales, low.astype(scale_dtype))
    else:
        vals = rng.integers(-128, 128, (k, n), dtype=np.int8)
        low = (rng.normal(size=(groups, n)) * step).astype(scale_dtype) if mins else None
        w = QuantWeight("int8", vals, scales, low)
    w.check("test weight")
    return jax.tree.map(jnp.asarray, w)


def _arrays(seed: int, dtype: jnp.dtype, *shapes: tuple[int, ...]) -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(key, s).astype(dtype) for key, s in zip(keys, shapes, strict=True)]


def q_linear(x: jax.Array, w: QuantWeight | jax.Array, b: jax.Array | None = None
             ) -> jax.Array:
    """QuantLinear's x @ W (+ b): float32 sum (fp8: times the channel scale), bias added in
    float32, rounded once; a float weight: the float kernels' reference."""
    if not isinstance(w, QuantWeight):
        return ref.linear(x, w, b)
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    y = quant_matmul(x, w.q, w.scales, w.mins, w.kind, x.dtype, prec)
    return (y if b is None else y + b.astype(jnp.float32)).astype(x.dtype)


def ref_projections(x, weights, biases=None, *, norm_weight=None, norm_eps=1e-6,
                    norm_offset=0.0, rope=None, rope_outputs=0, head_dim=None):  # noqa: ANN001, ANN201
    """pallas_kernels.reference.projections with `q_linear`."""
    h = x if norm_weight is None else ref.rms_norm(x, norm_weight, norm_eps, norm_offset)
    biases = biases or [None] * len(weights)
    outs = [q_linear(h, w, b) for w, b in zip(weights, biases, strict=True)]
    return [ref.rope_rows(y, *rope, head_dim) if n < rope_outputs else y
            for n, y in enumerate(outs)]


def _rope(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    ang = (jnp.arange(rows) * 37 + 5)[:, None] * (
        1.0 / 10000.0 ** (jnp.arange(0, head_dim, 2) / head_dim))
    return jnp.cos(ang), jnp.sin(ang)


def test_the_references_agree():
    """quant_matmul (the models' path) and dequantize-then-matmul are the same product."""
    x = _arrays(0, jnp.float32, (5, 128))[0]
    for kind, gs, mins in (("int4", 32, True), ("int8", 16, False), ("fp8", 128, False)):
        w = qweight(kind, 128, 48, gs, mins, seed=1)
        want = ref.linear(x, dequantize(w.q, w.scales, w.mins, w.kind, jnp.float32))
        _close(q_linear(x, w), want, jnp.float32)


# (kind, group, mins, k, rows, n_q, dtype): every group size the sources use (16: Q6_K, 32:
# most, 64, K: a scale per channel), rows 1 / 3 / 17 / 64, outputs of odd multiples of 16.
PROJ_CASES = [
    ("int4", 32, True, 256, 1, 144, jnp.bfloat16),
    ("int4", 16, True, 128, 17, 48, jnp.float32),
    ("int4", 64, True, 192, 3, 80, jnp.bfloat16),
    ("int4", 256, True, 256, 64, 48, jnp.float32),  # per channel: tiles inside the group
    ("int8", 16, False, 128, 3, 48, jnp.bfloat16),
    ("int8", 32, True, 384, 64, 80, jnp.bfloat16),
    ("int8", 64, False, 192, 17, 48, jnp.float32),
    ("int8", 512, True, 512, 1, 48, jnp.float32),  # per channel, K of two tiles
    ("fp8", 0, False, 256, 17, 144, jnp.bfloat16),
    ("fp8", 0, False, 96, 1, 48, jnp.float32),
]


def _ids(case: tuple) -> str:
    kind, gs, mins, k, rows, n, dtype = case
    return f"{kind}-g{gs or k}{'-min' if mins else ''}-k{k}-r{rows}-n{n}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", PROJ_CASES, ids=_ids)
def test_projections_on_quantized_weights(case):
    """q, k, v in one launch (norm prologue; q/k biases on every other case; RoPE of q and k
    where half a head is >= 16 columns), against the reference."""
    kind, gs, mins, k, rows, nq, dtype = case
    gs = gs or k
    nk = 48 if nq != 48 else 32
    ws = [qweight(kind, k, n, gs, mins, seed=s) for s, n in enumerate((nq, nk, nk))]
    x, g, bq, bk = _arrays(rows + k, dtype, (rows, k), (k,), (nq,), (nk,))
    biases = [bq, bk, None] if rows % 2 else None
    kw = {"norm_weight": g, "norm_eps": 1e-5}
    if nq % 32 == 0 and nk % 32 == 0:  # heads of 32: half-slabs of 16
        kw.update(rope=_rope(rows, 32), rope_outputs=2, head_dim=32)
    got = dm.projections(x, ws, biases, interpret=True, **kw)
    want = ref_projections(x, ws, biases, **kw)
    for a, b in zip(got, want, strict=True):
        _close(a, b, dtype)


def test_a_launch_mixes_formats_and_float_weights():
    """q int4, k float, v int8 with Q6_K's groups of 16 and float32 scales: one launch."""
    k, rows, dtype = 128, 5, jnp.bfloat16
    x, g, wk = _arrays(3, dtype, (rows, k), (k,), (k, 32))
    wk = wk / np.sqrt(k)
    ws = [qweight("int4", k, 64, 32, True, 1), wk,
          qweight("int8", k, 32, 16, False, 2, scale_dtype="float32")]
    kw = {"norm_weight": g, "rope": _rope(rows, 32), "rope_outputs": 2, "head_dim": 32}
    for a, b in zip(dm.projections(x, ws, interpret=True, **kw), ref_projections(x, ws, **kw),
                    strict=True):
        _close(a, b, dtype)


@pytest.mark.parametrize("kind,gs,mins,rows,dtype,act,bias", [
    ("int4", 32, True, 3, jnp.bfloat16, "silu", False),
    ("int8", 16, False, 64, jnp.float32, "gelu_tanh", True),
    ("int8", 128, True, 1, jnp.bfloat16, "silu", True),
    ("fp8", 0, False, 17, jnp.float32, "silu", False),
])
def test_gated_up_on_quantized_weights(kind, gs, mins, rows, dtype, act, bias):
    k, n = 128, 80
    wg, wu = (qweight(kind, k, n, gs or k, mins, seed=s) for s in (3, 4))
    x, g, bg, bu = _arrays(rows, dtype, (rows, k), (k,), (n,), (n,))
    b = (bg, bu) if bias else (None, None)
    offset = 1.0 if act == "gelu_tanh" else 0.0
    kw = {"norm_weight": g, "norm_eps": 1e-6, "norm_offset": offset}
    got = dm.gated_up(x, wg, wu, *b, act=act, interpret=True, **kw)
    gv, uv = ref_projections(x, [wg, wu], list(b), **kw)
    f = jax.nn.silu if act == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    _close(got, f(gv) * uv, dtype)


@pytest.mark.parametrize("kind,gs,mins,k,rows,dtype", [
    ("int4", 32, True, 384, 17, jnp.bfloat16),
    ("int4", 64, True, 128, 1, jnp.float32),
    ("int8", 16, True, 192, 64, jnp.bfloat16),
    ("int8", 32, False, 128, 3, jnp.float32),
    ("fp8", 0, False, 576, 3, jnp.bfloat16),  # SmolLM2's o: K = 9 x 64
])
def test_projection_residual_on_quantized_weights(kind, gs, mins, k, rows, dtype):
    n = 48
    w = qweight(kind, k, n, gs or k, mins, seed=5)
    x, r, b = _arrays(rows * 3, dtype, (rows, k), (rows, n), (n,))
    bias = b if rows % 2 else None
    _close(dm.projection_residual(x, w, r, bias, interpret=True), r + q_linear(x, w, bias),
           dtype)


@pytest.mark.parametrize("kind,gs,page_dtype,rows", [
    ("int4", 32, jnp.bfloat16, 3),
    ("fp8", 0, jnp.float8_e4m3fn, 17),
    ("int8", 16, jnp.float32, 1),
])
def test_fused_qkv_and_kv_write_on_quantized_weights(kind, gs, page_dtype, rows):
    """The q/k/v launch that also writes k (after RoPE) and v into the pages, as kv_write's
    reference stores them."""
    k, hd, hkv, nb, bs = 128, 32, 2, 12, 4
    dtype = jnp.float32 if page_dtype == jnp.float32 else jnp.bfloat16
    ws = [qweight(kind, k, n, gs or k, True, seed=s) for s, n in enumerate((2 * hkv * hd,
                                                                            hkv * hd, hkv * hd))]
    x, g = _arrays(rows, dtype, (rows, k), (k,))
    pages = tuple(p.astype(page_dtype)
                  for p in _arrays(9, jnp.float32, *[(nb, bs, hkv, hd)] * 2))
    slots = np.random.default_rng(rows).choice(np.arange(bs, nb * bs), rows, replace=False)
    slots[::2] = -1
    at = jnp.asarray(slots.astype(np.int32))
    kw = {"norm_weight": g, "rope": _rope(rows, hd), "rope_outputs": 2, "head_dim": hd}
    q, kk, v, kp, vp = dm.projections(x, ws, kv_pages=pages, kv_slots=at, kv_scales=(0.5, 2.0),
                                      interpret=True, **kw)
    for a, b in zip((q, kk, v), ref_projections(x, ws, **kw), strict=True):
        _close(a, b, dtype)
    kr, vr = ref.write_kv(*pages, kk.reshape(rows, hkv, hd), v.reshape(rows, hkv, hd), at,
                          0.5, 2.0)
    for a, b in ((kp, kr), (vp, vr)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("fmt,k,why", [
    (dm.QuantFormat("fp8", 32, False), 128, "fp8 weights with group scales"),
    (dm.QuantFormat("int4", 48, True), 96, "no power-of-two K tile >= 32"),
    (dm.QuantFormat("int8", 24, False), 96, "no power-of-two K tile >= 16"),
    (dm.QuantFormat("int8", 36, False), 96, "does not divide the input size 96"),
    (dm.QuantFormat("int4", 32, False), 128, "no mins"),
    (dm.QuantFormat("nf4", 32, False), 128, "quantized kind 'nf4'"),
])
def test_formats_the_kernels_cannot_stream_are_refused(fmt, k, why):
    """`unsupported` names the format (the runner then keeps XLA's GEMMs); the launch itself
    raises rather than compute a wrong answer."""
    assert why in dm.unsupported(1, k, [48], jnp.bfloat16, [fmt])
    if fmt.kind in ("int4", "int8") and fmt.group_size == 48 and k == 96:
        w = qweight("int4", 96, 48, 48, True, seed=0)
        with pytest.raises(ValueError, match="cannot take the streaming kernels"):
            dm.projections(jnp.ones((1, 96), jnp.bfloat16), [w], interpret=True)


def test_formats_the_kernels_take_and_bad_calls():
    for fmt, k in ((dm.QuantFormat("int8", 48, False), 96),  # a 16-row tile inside a group
                   (dm.QuantFormat("int4", 576, True), 576),  # per channel, K = 9 x 64
                   (dm.QuantFormat("int8", 8, True), 128),
                   (dm.QuantFormat("fp8", 4096, False), 4096)):
        assert dm.unsupported(1, k, [48], jnp.float32, [fmt]) is None
    assert "activation dtype int8" in dm.unsupported(1, 128, [48], jnp.int8,
                                                     [dm.QuantFormat("int8", 32, False)])
    w = qweight("int4", 64, 32, 32, True, seed=0)
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="float weights only"):
        dm.projections(x, [w], transposed=True, interpret=True)
    with pytest.raises(ValueError, match="does not suit"):  # int4 halves of 8 rows
        dm.projections(x, [w], plan=dm.StreamPlan(16, 32, 16), interpret=True)


def test_plans_for_llama3_8b_quantized_weights():
    """K tiles hold whole groups (or lie in one), the values' slab is >= 16 bytes a row, and
    a RoPE half-slab of int4 still loads 2 KiB a step at one row (16 bytes a thread)."""
    q = dm.QuantFormat("int4", 32, True)
    p = dm.plan_stream(1, 4096, [4096, 1024, 1024], 2, head_dim=128, formats=[q] * 6)
    assert (p.block_n, p.block_k, p.num_stages) == (32, 256, 4)
    assert p.block_k // 2 * p.block_n // 2 >= 2048
    p = dm.plan_stream(64, 4096, [14336], 2, weights_per_program=2, formats=[q, q])
    assert p.block_k % 32 == 0 and p.block_n >= 16
    f = dm.QuantFormat("fp8", 14336, False)
    p = dm.plan_stream(1, 14336, [4096], 2, formats=[f])
    assert 14336 % p.block_k == 0 and p.block_k >= 16
    q6 = dm.QuantFormat("int8", 16, False)
    assert dm.plan_stream(16, 4096, [1024], 2, formats=[q6, q]).block_k % 32 == 0
    # float launches: the plan they always had
    assert dm.plan_stream(1, 4096, [4096], 2) == dm.StreamPlan(16, 32, 256)


def _plan(spec, kind: str, group: int | None, has_min: bool,  # noqa: ANN001
          modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj")) -> dict[str, QuantLayout]:
    """A quantization plan of every layer's `modules` (group None: one per channel)."""
    inputs = {"o_proj": spec.num_heads * spec.head_dim, "down_proj": spec.intermediate_size}
    out = {}
    for i in range(spec.num_layers):
        for m in modules:
            where = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            gs = group or inputs.get(m, spec.hidden_size)
            out[f"model.layers.{i}.{where}.{m}"] = QuantLayout(kind, gs, has_min, "float16")
    return out


def test_the_runner_runs_quantized_models_on_the_kernels_it_can(caplog):
    from tiny_models import tiny_spec

    from jpaged.runner.linears import select_linears, unsupported_reason

    spec = tiny_spec(head_dim=32, intermediate_size=128)  # hidden 64, q 128, kv 64
    # Integer weights keep the kernels up to 256 rows (XLA's path would dequantize each weight
    # into a bf16 copy); fp8 (XLA's GEMM reads its bytes) and float weights up to 64.
    for tp, plan, rows in ((1, _plan(spec, "int4", 32, True), 256),
                           (1, _plan(spec, "fp8", None, False), 64),
                           (2, _plan(spec, "int8", 16, False), 256), (1, {}, 64)):
        assert select_linears("pallas", "gpu", spec, jnp.bfloat16, tp, plan).max_rows == rows
    with caplog.at_level(logging.WARNING, logger="jpaged.runner"):
        assert select_linears("pallas", "gpu", spec, jnp.bfloat16, 1,
                              _plan(spec, "fp8", 32, False, ("down_proj",))) is None
    assert "model.layers.0.down: fp8 weights with group scales" in caplog.text
    # One scale per channel over row-split rows: each device's rows, one scale each.
    assert unsupported_reason(spec, jnp.bfloat16, 2, _plan(spec, "int8", None, True)) is None
    assert "model.layers.0.qkv: int8 group size 24 does not divide the input size 64" in (
        unsupported_reason(spec, jnp.bfloat16, 1, _plan(spec, "int8", 24, True, ("q_proj",))))


def test_gpu_aot_quantized_cases_are_abstract_and_selectable():
    """`make gpu-aot`'s llama3-8b-fp8 / -int4 configurations: every decoder linear (and for
    int4 the untied head) quantized on an abstract model (nothing allocated), the runner's
    plan of it, and --only's key. (The tiny model's 64 inputs take groups of 32, not the 8B's
    128.)"""
    from tiny_models import tiny_spec

    from jpaged.aot.cases import quantize_abstract
    from jpaged.aot.report import Config, plan_configs
    from jpaged.runner.linears import select_linears
    from models.build import abstract_model
    from models.quant_layers import plan_of

    spec = tiny_spec(head_dim=32, intermediate_size=128)
    for weights, kind, group in (("int4", "int4", 32), ("fp8", "fp8", None)):
        model = quantize_abstract(abstract_model(spec, jnp.bfloat16), weights, int4_group=32)
        plan = plan_of(model)
        assert len(plan) == 7 * spec.num_layers + (weights == "int4")
        assert ("lm_head" in plan) == (weights == "int4")
        assert {(lay.kind, lay.group_size if group else None) for lay in plan.values()} == {
            (kind, group)}
        assert select_linears("pallas", "cuda", spec, jnp.bfloat16, 1, plan) is not None
    keys = [c.key for c, _ in plan_configs(quick=True) if c.weights]
    assert keys == ["llama3-8b-fp8/bfloat16/pallas/tp1", "llama3-8b-int4/bfloat16/pallas/tp1",
                    "qwen3-30b-a3b-fp8/bfloat16/pallas/tp1",  # (fp8 and int4 experts)
                    "qwen3-30b-a3b-int4/bfloat16/pallas/tp1"]
    assert Config("llama3-8b", "bfloat16", "pallas", 2).key == "llama3-8b/bfloat16/pallas/tp2"


def test_quantized_projections_under_tensor_parallel():
    """TensorParallel.wrap_linears over two CPU devices (a subprocess) gives the one-device
    kernels' outputs: q/gate/up by columns, o/down by rows with their groups (int4 groups of
    32, an fp8 per-channel scale replicated)."""
    run_on_cpu_devices(_TP_SCRIPT, 2, ROOT)


_TP_SCRIPT = """
import sys
sys.path[:0] = ["tests/pallas_kernels", "tests/models", "tests", "."]
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding
from tiny_models import tiny_spec
from test_decode_matmul_quant import qweight, _rope
from jpaged.runner.linears import kernel_linears
from jpaged.runner.parallel import TensorParallel
from models.sharding import param_spec

spec = tiny_spec(head_dim=32, intermediate_size=128)
tp = TensorParallel(spec, 2)
one = kernel_linears(interpret=True)
both = tp.wrap_linears(one)
h, d = spec.hidden_size, spec.head_dim
q, kv, inter = spec.num_heads * d, spec.num_kv_heads * d, spec.intermediate_size
rows = 3
x = jax.random.normal(jax.random.PRNGKey(0), (rows, h), jnp.float32)
g = jnp.ones((h,), jnp.float32)
norm = {"norm_weight": g, "norm_eps": 1e-5, "norm_offset": 0.0}

def place(w, module):
    def put(path, a):
        names = ("self_attn", module, getattr(path[0], "name", "q"))
        p = param_spec(names, a.ndim, tp.layout, tp.split_vocab, a.shape)
        return jax.device_put(a, NamedSharding(tp.mesh, p))
    return jax.tree_util.tree_map_with_path(put, w)

for kind, gs in (("int4", 32), ("fp8", 0)):
    w = {m: qweight(kind, kk, n, gs or kk, True, seed=i) for i, (m, kk, n) in enumerate(
        (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("gate_proj", h, inter),
         ("up_proj", h, inter), ("o_proj", q, h), ("down_proj", inter, h)))}
    sharded = {m: place(v, m) for m, v in w.items()}
    args = (x, w["q_proj"], w["k_proj"], w["v_proj"], None, None, None)
    sargs = (x, sharded["q_proj"], sharded["k_proj"], sharded["v_proj"], None, None, None)
    for a, b in zip(one.qkv(*args, **norm, rope=_rope(rows, d), head_dim=d),
                    both.qkv(*sargs, **norm, rope=_rope(rows, d), head_dim=d)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    a = one.gate_up(x, w["gate_proj"], w["up_proj"], None, None, act="silu", **norm)
    b = both.gate_up(x, sharded["gate_proj"], sharded["up_proj"], None, None, act="silu", **norm)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)
    xo = jax.random.normal(jax.random.PRNGKey(1), (rows, q), jnp.float32)
    xd = jax.random.normal(jax.random.PRNGKey(2), (rows, inter), jnp.float32)
    for xi, m in ((xo, "o_proj"), (xd, "down_proj")):
        a = one.out(xi, w[m], None, x)
        b = both.out(xi, sharded[m], None, x)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5)
    print(kind, "ok")
print("tp ok")
"""


def test_embedded_gguf_at_its_own_quantization_pallas_equals_xla():
    """SmolLM2 (Q4_1 layers: int4, groups of 32 with mins) kept quantized: the Pallas path,
    whose decode steps run the quantized kernels (interpreted here), its tied Q8_0 head (int8
    [49152, 576]) on the head kernel as it lies, gives XLA's greedy tokens (whose head
    multiplies the table a slab at a time)."""
    from jpaged import LLM
    from jpaged.sampling_params import SamplingParams

    prompts = ["The capital of France is", "1, 2, 3,"]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("xla", "pallas"):
        llm = LLM(quantization="gguf", attention_backend=backend, num_gpu_blocks_override=16,
                  max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64)
        if backend == "pallas":
            lin = llm.llm_engine.runner.linears
            assert lin is not None  # the kernels took the model, and the integer head
            assert lin.logits is not None and lin.logits_max_rows == 256
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp,
                                                                        use_tqdm=False)]
        del llm
    assert tokens["pallas"] == tokens["xla"]
    assert all(len(t) == 4 for t in tokens["xla"])
