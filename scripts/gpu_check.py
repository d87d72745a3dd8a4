"""Device check of the Pallas paged-attention kernels: correctness, timings, achieved bandwidth.

    python scripts/gpu_check.py [--quick] [--out results.json]   # on a CUDA machine (< 6 min)
    python scripts/gpu_check.py --cpu-smoke                      # tiny shapes, interpret mode

1. every kernel against the reference on fresh random inputs (relative error by dtype);
2. timings (one jitted loop of many calls, median of repeats) of the Pallas decode kernel, the
   XLA reference path, jax's own Pallas paged_attention and dense attention over a contiguous
   cache; the ragged kernel on a mixed prefill+decode batch; the KV write;
3. a device-to-device copy, so each kernel's K/V bytes read per second is reported as a
   fraction of copy bandwidth: jax's bf16 `x + 1` (`copy_GBps`, `copy_GBps_jax_bf16`: XLA moves
   8 bytes a thread there) and the best copy with 16-byte accesses (`copy_GBps_16byte`, named
   by `copy_16byte_method`: a Pallas copy kernel or jax's float32 `x + 1`,
   jpaged/bench/copy_ceiling.py), the honest ceiling; 4. a table on stdout and JSON with --out.
Each case catches its own failure, prints it and goes on. The decode matmul kernels have their
own stage (python -m jpaged.bench.matmul_check), which reads this JSON's copy_GBps_16byte.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged  # noqa: E402

from jpaged.bench.copy_ceiling import copy_rates  # noqa: E402
from pallas_kernels import bench_inputs as bi  # noqa: E402
from pallas_kernels import reference  # noqa: E402
from pallas_kernels.kv_write import write_kv  # noqa: E402
from pallas_kernels.paged_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

RESULTS: dict = {"checks": [], "timings": [], "tuning": [], "failures": []}


def _rel_err(got: jax.Array, want: jax.Array) -> float:
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _guard(name: str, fn, *args, **kw) -> None:
    """Run one case; on failure print and record it, then go on."""
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - every case must be isolated
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"  FAILED {name}: {msg}", flush=True)
        traceback.print_exc(limit=3)
        RESULTS["failures"].append({"case": name, "error": msg})


# ----------------------------------------------------------------------------------- checks
def check_attention(cfg, kind: str, page_dtype, q_dtype, bs: int, hq: int, hkv: int, **opts):
    """Decode or mixed ragged batch against the reference (float32 math, highest precision)."""
    lens = [1, bs - 1, bs, bs + 1, *cfg["long"]]
    q_lens = [1] * len(lens) if kind == "decode" else [1, 1, bs, 1, *cfg["chunks"]]
    scale = 0.5 if reference.is_fp8(page_dtype) else 1.0
    b = bi.paged_batch(jax.random.key(len(RESULTS["checks"])), lens, q_lens, hq=hq, hkv=hkv,
                       d=cfg["d"], bs=bs, page_dtype=page_dtype, q_dtype=q_dtype, scale=scale)
    sc = dict(k_scale=scale, v_scale=scale, **opts)
    tables = b.tables[0]
    if kind == "decode":
        args = (b.q, b.k_pages, b.v_pages, b.seq_lens, tables)
        got = jax.jit(functools.partial(paged_decode_attention, interpret=cfg["interpret"],
                                        **sc))(*args)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(functools.partial(reference.paged_decode_attention, **sc))(*args)
    else:
        args = (b.q, b.k_pages, b.v_pages, b.qsl, b.seq_lens, tables)
        got = jax.jit(functools.partial(ragged_paged_attention, interpret=cfg["interpret"],
                                        **sc))(*args)
        with jax.default_matmul_precision("highest"):
            want = jax.jit(functools.partial(reference.ragged_paged_attention, **sc))(*args)
    err = _rel_err(got, want)
    f32 = jnp.dtype(q_dtype) == jnp.float32
    # Float32 operands: the kernels' products run in TF32 on GPU tensor cores (Triton's reading
    # of DEFAULT precision, as XLA's own float32 dots on GPU), near 3e-4 against the
    # highest-precision reference (2.5e-4 / 3.3e-4 measured on an H200); the interpreter on CPU
    # computes in full float32.
    tol = (1e-4 if cfg["interpret"] else 1e-3) if f32 else 2e-2
    name = f"{kind} {jnp.dtype(page_dtype).name} q={jnp.dtype(q_dtype).name} bs={bs} G={hq//hkv}"
    name += "".join(f" {k}={v}" for k, v in opts.items())
    ok = bool(np.isfinite(err) and err < tol)
    RESULTS["checks"].append({"case": name, "rel_err": err, "tol": tol, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {name:60s} rel_err={err:.2e} (tol {tol:.0e})", flush=True)


def check_write(cfg, page_dtype) -> None:
    """KV write against the reference scatter: bf16 bit-exact; fp8 within one fp8 step.

    (Triton's float32 division may differ from XLA's in the last bit, which can move a value
    to the neighbouring fp8 code; slots not written must be untouched either way.)
    """
    hkv = cfg["hkv"]
    b = bi.paged_batch(jax.random.key(99), [cfg["long"][0]], [1], hq=cfg["hq"], hkv=hkv,
                       d=cfg["d"], bs=16, page_dtype=page_dtype)
    total = b.k_pages.shape[0] * 16
    t = 64 if not cfg["interpret"] else 6
    slots = jax.random.permutation(jax.random.key(5), total)[:t].astype(jnp.int32)
    slots = slots.at[::3].set(-1)  # padding
    k = jax.random.normal(jax.random.key(6), (t, hkv, cfg["d"]), jnp.bfloat16) * 4
    args = (b.k_pages, b.v_pages, k, k * 2, slots, 0.5, 0.25)
    want = jax.jit(reference.write_kv)(*args)
    got = jax.jit(functools.partial(write_kv, interpret=cfg["interpret"]))(*args)
    mismatch, step_err = 0.0, 0.0
    for g, w in zip(got, want, strict=True):
        differ = np.asarray(g).view(np.uint8) != np.asarray(w).view(np.uint8)
        mismatch = max(mismatch, float(differ.mean()))
        gf, wf = np.asarray(g, np.float32), np.asarray(w, np.float32)
        step_err = max(step_err, float(np.max(np.abs(gf - wf) / np.maximum(np.abs(wf), 1e-3))))
    step = 0.0 if not reference.is_fp8(page_dtype) else 0.13 if "e4m3" in str(page_dtype) else 0.26
    ok = mismatch == 0.0 or (mismatch < 1e-3 and step_err <= step)
    name = f"kv_write {jnp.dtype(page_dtype).name}"
    RESULTS["checks"].append({"case": name, "rel_err": step_err, "mismatch": mismatch, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {name:60s} bytes differing={mismatch:.1e} "
          f"max rel step={step_err:.2e}", flush=True)


# ---------------------------------------------------------------------------------- timings
def _record(case: str, impl: str, sec: float, nbytes: int, copy_bw: float, base: float | None):
    bw = nbytes / sec
    row = {"case": case, "impl": impl, "us": sec * 1e6, "GBps": bw / 1e9,
           "frac_copy": bw / copy_bw, "speedup_vs_ref": (base / sec) if base else None}
    c16 = RESULTS.get("copy_GBps_16byte")
    if c16:  # of the honest ceiling too (frac_copy stays of jax's bf16 copy, as before)
        row["frac_copy_16byte"] = bw / 1e9 / c16
    RESULTS["timings"].append(row)
    spd = f"{row['speedup_vs_ref']:6.2f}x" if base else "     -"
    print(f"  {case:34s} {impl:22s} {sec * 1e6:10.1f} us {bw / 1e9:8.0f} GB/s "
          f"{bw / copy_bw:6.1%} {spd}", flush=True)


def bench_decode(cfg, batch: int, ctx: int, bs: int, copy_bw: float, ragged_lens=False):
    """Decode step of `batch` sequences of `ctx` tokens: four implementations."""
    lens = [ctx] * batch
    if ragged_lens:
        lens = [int(x) for x in np.random.default_rng(0).integers(1, ctx + 1, batch)]
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    rot = bi.rotations_for(2 * sum(lens) * hkv * d * 2) if not cfg["interpret"] else 2
    b = bi.paged_batch(jax.random.key(batch * ctx + bs), lens, [1] * batch, hq=hq, hkv=hkv,
                       d=d, bs=bs, page_dtype=jnp.bfloat16, rotations=rot)
    case = f"decode B={batch} ctx={ctx}{'(ragged)' if ragged_lens else ''} bs={bs}"
    t = functools.partial(bi.time_in_loop, **cfg["timing"])
    interp = cfg["interpret"]
    ref = t(lambda tb, q, kp, vp, sl: reference.paged_decode_attention(q, kp, vp, sl, tb),
            b.tables, b.q, b.k_pages, b.v_pages, b.seq_lens)
    _record(case, "xla-reference", ref, b.kv_bytes, copy_bw, None)
    ours = t(lambda tb, q, kp, vp, sl: paged_decode_attention(q, kp, vp, sl, tb,
                                                              interpret=interp),
             b.tables, b.q, b.k_pages, b.v_pages, b.seq_lens)
    _record(case, "pallas-decode", ours, b.kv_bytes, copy_bw, ref)
    if not ragged_lens:
        _guard(case + " jax-paged", _bench_jax_kernel, cfg, case, b, copy_bw, ref)
        _guard(case + " dense", _bench_dense, cfg, case, b, batch, ctx, copy_bw, ref)


def _bench_jax_kernel(cfg, case, b, copy_bw, ref):
    kp, vp = b.k_pages.transpose(2, 0, 1, 3), b.v_pages.transpose(2, 0, 1, 3)
    pages = b.tables.shape[2]
    k_splits = max(s for s in (1, 2, 4, 8, 16) if pages % s == 0)
    ppcb = max(s for s in (1, 2, 4, 8) if (pages // k_splits) % s == 0)
    sec = bi.time_in_loop(
        lambda tb, q, kp, vp, sl: jax_paged.paged_attention(
            q, kp, vp, tb, sl, k_splits=k_splits, pages_per_compute_block=ppcb,
            interpret=cfg["interpret"]),
        b.tables, _prescaled(b.q, cfg["d"]), kp, vp, b.seq_lens, **cfg["timing"])
    _record(case, "jax-paged_attention", sec, b.kv_bytes, copy_bw, ref)


def _bench_dense(cfg, case, b, batch, ctx, copy_bw, ref):
    shape = (batch, ctx, cfg["hkv"], cfg["d"])
    k = jax.random.normal(jax.random.key(3), shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.key(4), shape, jnp.bfloat16)
    # No block tables to rotate: the loop indexes two copies of seq_lens instead, so that the
    # attention depends on the iteration and XLA cannot hoist it out of the timing loop.
    lens2 = jnp.stack([b.seq_lens, b.seq_lens])
    sec = bi.time_in_loop(
        lambda sl, q, k, v: reference.dense_attention_contiguous(
            q[:, None], k, v, (sl - 1)[:, None], sl)[:, 0],
        lens2, b.q, k, v, **cfg["timing"])
    _record(case, "xla-dense-contiguous", sec, b.kv_bytes, copy_bw, ref)


def bench_mixed(cfg, copy_bw: float) -> None:
    """A mixed step: a few prefill chunks over cached prefixes plus many decodes."""
    n_pre, chunk, cached, n_dec, ctx = cfg["mixed"]
    lens = [cached + chunk] * n_pre + [ctx] * n_dec
    q_lens = [chunk] * n_pre + [1] * n_dec
    b = bi.paged_batch(jax.random.key(7), lens, q_lens, hq=cfg["hq"], hkv=cfg["hkv"],
                       d=cfg["d"], bs=16, page_dtype=jnp.bfloat16, rotations=2, pad_tokens=5)
    case = f"mixed {n_pre}x{chunk}@{cached}+{n_dec}dec@{ctx}"
    t = functools.partial(bi.time_in_loop, **cfg["timing"])
    args = (b.q, b.k_pages, b.v_pages, b.qsl, b.seq_lens)
    ref = t(lambda tb, q, kp, vp, qsl, sl: reference.ragged_paged_attention(
        q, kp, vp, qsl, sl, tb), b.tables, *args)
    _record(case, "xla-reference", ref, b.kv_bytes, copy_bw, None)
    ours = t(lambda tb, q, kp, vp, qsl, sl: ragged_paged_attention(
        q, kp, vp, qsl, sl, tb, interpret=cfg["interpret"]), b.tables, *args)
    _record(case, "pallas-ragged", ours, b.kv_bytes, copy_bw, ref)


def bench_write(cfg, copy_bw: float) -> None:
    """KV write of one step's tokens into a pool carried through the loop (so in place)."""
    t_tok, hkv, d = cfg["write_tokens"], cfg["hkv"], cfg["d"]
    nb = max(4 * t_tok // 16, 64)
    pool = jax.random.normal(jax.random.key(8), (nb, 16, hkv, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(9), (t_tok, hkv, d), jnp.bfloat16)
    slots = jnp.stack([jax.random.permutation(jax.random.key(i), nb * 16)[:t_tok]
                       for i in range(2)]).astype(jnp.int32)
    nbytes = 2 * 2 * k.nbytes  # read the new k and v, write them
    case = f"kv_write T={t_tok}"
    for impl, fn in (("xla-reference", reference.write_kv),
                     ("pallas-kv_write", functools.partial(write_kv,
                                                           interpret=cfg["interpret"]))):
        sec = bi.time_carry_loop(lambda sl, c, k, fn=fn: fn(c[0], c[1], k, k, sl),
                                 (pool, pool + 1), slots, k, **cfg["timing"])
        _record(case, impl, sec, nbytes, copy_bw, None)


def _prescaled(q: jax.Array, d: int) -> jax.Array:
    """q * d**-0.5 in q's own dtype (jax's kernel does not scale). A numpy scalar is not weakly
    typed: `bf16 * np.float64` is float32, which jax's Triton kernel refuses against bf16 pages
    (seen on the first H200 run)."""
    return (q * float(1 / np.sqrt(d))).astype(q.dtype)


def check_vs_jax_kernel(cfg) -> None:
    """Decode kernel against jax's own Pallas paged_attention on the same bf16 inputs."""
    lens = [1, 15, 16, 17, *cfg["long"]]
    b = bi.paged_batch(jax.random.key(21), lens, [1] * len(lens), hq=cfg["hq"], hkv=cfg["hkv"],
                       d=cfg["d"], bs=16, page_dtype=jnp.bfloat16)
    pages = b.tables.shape[2]
    tables = jnp.pad(b.tables[0], ((0, 0), (0, -pages % 8)))
    ours = jax.jit(functools.partial(paged_decode_attention, interpret=cfg["interpret"]))(
        b.q, b.k_pages, b.v_pages, b.seq_lens, tables)
    theirs = jax_paged.paged_attention(
        _prescaled(b.q, cfg["d"]), b.k_pages.transpose(2, 0, 1, 3),
        b.v_pages.transpose(2, 0, 1, 3), tables, b.seq_lens, k_splits=8,
        pages_per_compute_block=1, interpret=cfg["interpret"])
    err = _rel_err(ours, theirs)
    ok = bool(np.isfinite(err) and err < 2e-2)
    RESULTS["checks"].append({"case": "decode vs jax paged_attention", "rel_err": err,
                              "tol": 2e-2, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {'decode vs jax paged_attention':60s} "
          f"rel_err={err:.2e}", flush=True)


def tune_decode(cfg, copy_bw: float) -> None:
    """A small sweep of the decode kernel's static knobs at the headline shape."""
    batch, ctx = cfg["tune_shape"]
    rot = 1 if cfg["interpret"] else 2
    b = bi.paged_batch(jax.random.key(11), [ctx] * batch, [1] * batch, hq=cfg["hq"],
                       hkv=cfg["hkv"],
                       d=cfg["d"], bs=16, page_dtype=jnp.bfloat16, rotations=rot)
    for ppb, warps, stages, ppp in cfg["tune_grid"]:
        knobs = dict(pages_per_block=ppb, num_warps=warps, num_stages=stages,
                     pages_per_partition=ppp)

        def run(knobs=knobs):
            sec = bi.time_in_loop(
                lambda tb, q, kp, vp, sl: paged_decode_attention(
                    q, kp, vp, sl, tb, interpret=cfg["interpret"], **knobs),
                b.tables, b.q, b.k_pages, b.v_pages, b.seq_lens, **cfg["timing"])
            frac = b.kv_bytes / sec / copy_bw
            RESULTS["tuning"].append({**knobs, "us": sec * 1e6, "frac_copy": frac})
            print(f"  tune B={batch} ctx={ctx} {knobs}: {sec * 1e6:9.1f} us {frac:6.1%}",
                  flush=True)
        _guard(f"tune {knobs}", run)


def _copy_16byte(cfg, repeats: int) -> None:
    """copy_GBps_16byte (and the method that reached it), copy_GBps_jax_bf16, every rate."""
    c = copy_rates(cfg["copy16_bytes"], interpret=cfg["interpret"], repeats=repeats,
                   target_s=0.02 if not cfg["interpret"] else 1e-4)
    RESULTS.update(copy_GBps_16byte=c["copy_GBps_16byte"],
                   copy_16byte_method=c["copy_16byte_method"],
                   copy_GBps_jax_bf16=c["copy_GBps_jax_bf16"], copy_rates=c["rates"],
                   copy16_bytes=c["copy_bytes"])
    if c["errors"]:
        RESULTS["copy_errors"] = c["errors"]
    print(f"  copy with 16-byte accesses: {c['copy_GBps_16byte']} GB/s "
          f"({c['copy_16byte_method']}); jax bf16 x + 1: {c['copy_GBps_jax_bf16']} GB/s",
          flush=True)


# ------------------------------------------------------------------------------------ main
def configure(args) -> dict:
    """Shapes and repetitions for --cpu-smoke, --quick or the full run."""
    variants = [(jnp.float8_e4m3fn, jnp.bfloat16, {}),
                (jnp.float8_e5m2, jnp.bfloat16, {"soft_cap": 30.0}),
                (jnp.float32, jnp.float32, {"soft_cap": 20.0, "sliding_window": 500}),
                (jnp.bfloat16, jnp.bfloat16, {"sliding_window": 700})]
    if args.cpu_smoke:
        # A rehearsal of every step of the script: one check per code path (the kernels'
        # interpret-mode tests cover the GQA ratios and dtypes at length).
        return dict(interpret=True, hq=8, hkv=2, d=64, long=[21], chunks=[7],
                    timing=dict(max_reps=1, repeats=1), copy_bytes=2**22, copy16_bytes=2**20,
                    variants=[variants[0], variants[2]], gqa=[], decode=[(2, 16, 4)],
                    ragged_lens=[(3, 24, 4)], mixed=(1, 5, 8, 2, 20), write_tokens=8,
                    tune_shape=(2, 32), tune_grid=[(4, 4, 2, 8)])
    # Llama-3-8B attention: 32 query heads, 8 kv heads, head_dim 128, bf16.
    decode = [(64, 4096, 16), (1, 4096, 16), (64, 4096, 32), (128, 16384, 16)]
    tune = [(p, w, s, None) for p in (4, 8, 16) for w in (4, 8) for s in (2, 3)]
    tune += [(8, 4, 2, 32), (8, 4, 2, 256)]
    if args.quick:
        tune = [(8, 4, 2, None), (16, 4, 3, None), (8, 8, 2, None), (8, 4, 2, 256)]
    else:
        decode += [(1, 512, 16), (1, 16384, 16), (8, 4096, 16), (32, 4096, 16),
                   (64, 512, 16), (64, 16384, 16), (128, 4096, 16), (1, 16384, 32),
                   (128, 2048, 32)]
    return dict(interpret=False, hq=32, hkv=8, d=128, long=[1000, 3001], chunks=[300, 77],
                variants=variants,
                timing=dict(max_reps=200, repeats=5), copy_bytes=2**31, copy16_bytes=2**30,
                gqa=[(8, 8), (24, 3)], decode=decode, ragged_lens=[(64, 4096, 16)],
                mixed=(4, 512, 1536, 60, 4096), write_tokens=2048, tune_shape=(64, 4096),
                tune_grid=tune)


def main() -> int:
    """Run the checks and timings; exit 1 if a correctness check failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="headline shapes only")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in interpret mode")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip timings after this")
    args = p.parse_args()
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    cfg = configure(args)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    RESULTS.update(device=str(getattr(dev, "device_kind", dev.platform)), jax=jax.__version__,
                   mode="cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full")
    print(f"device: {RESULTS['device']}  jax {jax.__version__}  mode {RESULTS['mode']}")

    print("== correctness (relative error vs the float32 reference)")
    hq0, hkv0 = cfg["hq"], cfg["hkv"]
    for hq, hkv in [(hq0, hkv0), *cfg["gqa"]]:  # the model's GQA ratio, then 1 and 8
        for kind in ("decode", "mixed"):
            _guard(f"check {kind} G={hq // hkv}", check_attention, cfg, kind, jnp.bfloat16,
                   jnp.bfloat16, 16, hq, hkv)
    for pd, qd, opts in cfg["variants"]:
        for kind in ("decode", "mixed"):
            _guard(f"check {kind}", check_attention, cfg, kind, pd, qd, 32, hq0, hkv0, **opts)
    for pd in (jnp.bfloat16, jnp.float8_e4m3fn):
        _guard("check kv_write", check_write, cfg, pd)
    _guard("check vs jax kernel", check_vs_jax_kernel, cfg)

    print("== bandwidth ceiling")
    copy_reps = 5 if not args.cpu_smoke else 1
    copy_bw = bi.copy_bandwidth(cfg["copy_bytes"], repeats=copy_reps)
    RESULTS["copy_GBps"] = copy_bw / 1e9
    print(f"  device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    # The same in float32: XLA's elementwise kernels then access 16 bytes a thread, not 8.
    copy_f32 = bi.copy_bandwidth(cfg["copy_bytes"], repeats=copy_reps, dtype=jnp.float32)
    RESULTS["copy_GBps_f32"] = copy_f32 / 1e9
    print(f"  device-to-device copy, float32: {copy_f32 / 1e9:.0f} GB/s (read + write)")
    # The honest ceiling: 16-byte accesses a thread (a Pallas copy kernel, jax's float32 x + 1)
    # beside jax's bf16 x + 1 (8-byte), each timed back to back over one buffer.
    _guard("copy 16-byte", _copy_16byte, cfg, copy_reps)
    if args.out:  # the checks and the ceilings so far, should the stage's limit cut in
        args.out.write_text(json.dumps({**RESULTS, "partial": True}, indent=1))

    print("== timings" + " " * 26 + "impl" + " " * 20 + "time       K/V read  %copy  vs ref"
          "  (%copy: of jax's bf16 copy; frac_copy_16byte in the JSON)")
    jobs = [(f"decode {c}", bench_decode, (cfg, *c, copy_bw)) for c in cfg["decode"][:1]]
    jobs += [("tune", tune_decode, (cfg, copy_bw))]
    jobs += [(f"decode {c}", bench_decode, (cfg, *c, copy_bw)) for c in cfg["decode"][1:]]
    jobs += [(f"decode ragged {c}", bench_decode, (cfg, *c, copy_bw, True))
             for c in cfg["ragged_lens"]]
    jobs += [("mixed", bench_mixed, (cfg, copy_bw)), ("kv_write", bench_write, (cfg, copy_bw))]
    for name, fn, fargs in jobs:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"  skipped {name}: time budget {args.budget_s:.0f} s spent")
            RESULTS["failures"].append({"case": name, "error": "skipped: time budget"})
            continue
        _guard(name, fn, *fargs)
    RESULTS["wall_s"] = time.perf_counter() - t_start
    if args.out:
        args.out.write_text(json.dumps(RESULTS, indent=1))
    bad = [c["case"] for c in RESULTS["checks"] if not c["ok"]]
    print(f"== done in {RESULTS['wall_s']:.0f} s; {len(RESULTS['checks'])} checks, "
          f"{len(bad)} wrong, {len(RESULTS['failures'])} failed cases")
    return 1 if bad or any(f["case"].startswith("check") for f in RESULTS["failures"]) else 0


if __name__ == "__main__":
    sys.exit(main())
