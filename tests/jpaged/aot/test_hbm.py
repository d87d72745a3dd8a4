"""The HBM traffic estimator (`jpaged.aot.hbm`) on programs whose bytes are counted by hand: tiny
jitted CPU programs (an elementwise op, a scan over stacked weights against a Python loop over
separate ones) and a handwritten optimized-HLO module with the GPU-only constructs (known trip
count, Pallas custom-calls, sliced pool reads, in-place updates, an all-gather of a weight)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jpaged.aot.hbm import HbmModel, KernelRule, estimate_traffic
from jpaged.aot.hlo import parse_module, shape_bytes
from jpaged.aot.traffic import StepTraffic
from jpaged.intmath import cdiv

K, LAYERS, ROWS = 128, 8, 4
WEIGHT = K * K * 4  # one f32 [K, K] layer


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_shape_bytes():
    assert shape_bytes("bf16[32,4096]{1,0}") == 32 * 4096 * 2
    assert shape_bytes("(s32[], f32[4]{0}, /*index=2*/u8[2,3]{1,0})") == 4 + 16 + 6
    assert shape_bytes("f8e4m3fn[10]{0}") == 10 and shape_bytes("pred[]") == 1


def test_elementwise_reads_and_writes_once():
    n = 1000
    t = estimate_traffic(_hlo(lambda a: a * 2 + 1, jnp.zeros(n, jnp.float32)))
    assert t.hbm_bytes == 8 * n  # read 4n, write 4n: one fused kernel
    assert t.param_copy_bytes == 0 and t.notes == []


def _scan(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def _loop(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return x


def test_scan_counts_its_body_per_trip_and_the_weight_slice_copies():
    ws, x = jnp.zeros((LAYERS, K, K)), jnp.zeros((ROWS, K))
    text = _hlo(_scan, ws, x)
    t = estimate_traffic(text, HbmModel(num_weights=1))
    # XLA:CPU materializes each layer's slice: read it, write it, read it again in the matmul.
    assert t.param_copy_bytes == LAYERS * WEIGHT
    # Plus per trip h in and out of the matmul and of the tanh, and a few scalars (exactly that
    # under jax 0.10.2; the bound leaves XLA:CPU room to fuse differently).
    activations = (LAYERS + 1) * 4 * ROWS * K * 4 + 1024
    assert 3 * LAYERS * WEIGHT <= t.hbm_bytes <= 3 * LAYERS * WEIGHT + activations
    assert t.notes == []
    # Without XLA's known_trip_count the condition's constant gives the same count.
    bare = re.sub(r'"known_trip_count":\{"n":"\d+"\}', '"x":1', text)
    t2 = estimate_traffic(bare, HbmModel(num_weights=1))
    assert t2.hbm_bytes == t.hbm_bytes and "from its condition's constant" in t2.notes[0]


def test_python_loop_over_separate_weights_copies_nothing():
    ws, x = [jnp.zeros((K, K)) for _ in range(LAYERS)], jnp.zeros((ROWS, K))
    t = estimate_traffic(_hlo(_loop, ws, x), HbmModel(num_weights=LAYERS))
    assert t.param_copy_bytes == 0
    assert LAYERS * WEIGHT <= t.hbm_bytes <= LAYERS * WEIGHT + (LAYERS + 1) * 4 * ROWS * K * 4


# A GPU-style optimized module (hbm_module.hlo.txt). Per loop trip (4, from known_trip_count):
#   %wslice  reads the weight's slice 131072 + index 4, writes 131072     = 262148 (a weight copy)
#   %h2      (gemm) reads 512 + 131072, writes 512                         = 132096
#   %pages   reads 4 gathered pages 16384 (not the 262144-byte pool) + 16,
#            writes 16384                                                  =  32784
#   %attn    Pallas decode: 2 pool operands x rule 1000 + 512, writes 1024 =   3536
#   %kw      Pallas kv_write: 512 + pools 0, writes 2 x rule 300           =   1112
#   %pool2   in-place update: reads update 4096 + 4, writes 4096           =   8196
#   %i2      4 + 4 + 4 = 12; condition compare 4 + 4 + 1 = 9
# Entry: all-gather of the embedding reads 128000, writes 256000; the lookup reads one row 128
# (+ 4 of its index), writes 128 (a slice of a weight); compare 9; the larger branch 2048.
GPU_HLO = (Path(__file__).parent / "hbm_module.hlo.txt").read_text()
BODY = 262148 + 132096 + 32784 + 3536 + 1112 + 8196 + 12
ENTRY = 384000 + 260 + 9 + 2048


def _rules(name: str) -> KernelRule | None:
    return {"paged_decode_ppb8_ppp8": KernelRule(1000, 0), "kv_write": KernelRule(0, 300)
            }.get(name)


def test_handwritten_gpu_module_counted_by_hand():
    comps, entry = parse_module(GPU_HLO)
    assert entry == "main" and comps["body"].root.operands[-1] == "upd"
    model = HbmModel(num_weights=2, pool_shape="u16[64,16,2,64]", kernel_rule=_rules)
    t = estimate_traffic(GPU_HLO, model)
    assert t.hbm_bytes == 4 * (BODY + 9) + ENTRY
    assert t.param_copy_bytes == 4 * 131072 + 128  # the layer slices and the embedding row
    assert t.param_collective_bytes == 256000  # the gathered embedding
    assert t.kernel_bytes == {"paged_decode_ppb8_ppp8": 4 * 3536, "kv_write": 4 * 1112}
    assert t.notes == ["cnd: largest of 2 branches counted"]
    # By kind of op (name less its number; a Pallas call by its kernel), every trip summed.
    assert sum(t.by_op.values()) == t.hbm_bytes
    assert t.by_op["wslice: bf16[1,256,256]{2,1,0}"] == 4 * 262148
    assert t.by_op["paged_decode_ppb8_ppp8: f32[1,256]{1,0}"] == 4 * 3536
    assert t.largest(1) == [f"wslice: bf16[1,256,256]{{2,1,0}} = {4 * 262148} B"]
    # Unknown trip count: the condition's constant; no constant: once, and said so.
    t2 = estimate_traffic(GPU_HLO.replace('"known_trip_count":{"n":"4"}', '"x":1'), model)
    assert t2.hbm_bytes == t.hbm_bytes
    t3 = estimate_traffic(GPU_HLO.replace('"known_trip_count":{"n":"4"}', '"x":1')
                          .replace("s32[] constant(4)", "s32[] parameter(1)"), model)
    assert t3.hbm_bytes == BODY + 9 + ENTRY and "unknown trip count" in t3.notes[0]
    # Named as the lookup table, the embedding's one-row read is the activation, not a copy;
    # its gather by the all-gather stays a weight collective.
    emb = estimate_traffic(GPU_HLO, replace(model, lookup_weights=(1,)))
    assert emb.param_copy_bytes == 4 * 131072 and emb.param_collective_bytes == 256000
    assert emb.hbm_bytes == t.hbm_bytes
    # The smaller branch (one negate: 512 + 512) when the model says a greedy batch runs it.
    small = estimate_traffic(GPU_HLO, replace(model, branch="smallest"))
    assert small.hbm_bytes == t.hbm_bytes - 2048 + 1024
    assert small.notes == ["cnd: smallest of 2 branches counted"]
    # An idle launch (every program skips its work) moves nothing, its operands included.
    idle = estimate_traffic(GPU_HLO, replace(model, kernel_rule=lambda n: KernelRule(
        0, 0, idle=True) if n.startswith("paged_decode") else _rules(n)))
    assert idle.kernel_bytes["paged_decode_ppb8_ppp8"] == 0
    assert idle.hbm_bytes == t.hbm_bytes - 4 * 3536
    # A rule that says what the kernel stores of its other results (here 100 of its 1024
    # bytes) counts that instead of the whole result.
    part = estimate_traffic(GPU_HLO, replace(model, kernel_rule=lambda n: KernelRule(
        1000, 0, write=100) if n.startswith("paged_decode") else _rules(n)))
    assert part.hbm_bytes == t.hbm_bytes - 4 * (1024 - 100)
    # A rule that says what the kernel loads of its other operands (here 200 of the 512
    # bytes of q) counts that instead of each whole.
    read = estimate_traffic(GPU_HLO, replace(model, kernel_rule=lambda n: KernelRule(
        1000, 0, read=200) if n.startswith("paged_decode") else _rules(n)))
    assert read.hbm_bytes == t.hbm_bytes - 4 * (512 - 200)
    # No weights named: nothing is a weight copy or a weight collective.
    t4 = estimate_traffic(GPU_HLO, HbmModel(pool_shape="u16[64,16,2,64]", kernel_rule=_rules))
    assert (t4.param_copy_bytes, t4.param_collective_bytes) == (0, 0)


def test_step_rules_decode_and_prefill():
    dec = StepTraffic(tokens=4, seqs=4, context_len=100, num_layers=2, block_size=16, kv_heads=2,
                      head_dim=64, page_bytes=2, vocab_size=1000, param_bytes=10**6,
                      num_blocks=64, q_per_kv=3)
    assert dec.row_bytes == 256
    # 100 keys in steps of 2 pages (32 keys): 128 keys per sequence. Partials: the two 64-key
    # partitions holding keys, 3 query rows of 64 + 2 floats each, per sequence and kv head.
    assert dec.kernel_rule("paged_decode_ppb2_ppp4") == KernelRule(
        4 * 128 * 256, 0, write=4 * 2 * 2 * 3 * 66 * 4)
    # Launched inactive: every tile skips its loads and stores.
    assert dec.kernel_rule("ragged_paged_qt4_ppb4") == KernelRule(0, 0, idle=True)
    assert dec.kernel_rule("kv_write") == KernelRule(0, 4 * 256)
    assert dec.kernel_rule("something_else") is None
    assert dec.min_hbm_bytes() == 10**6 + 2 * 2 * 256 * (4 * 100 + 4) + 4 * 1000 * 4
    assert dec.fits_pool() and not StepTraffic(**{**dec.__dict__, "seqs": 64}).fits_pool()
    pre = StepTraffic(**{**dec.__dict__, "tokens": 64, "seqs": 2, "context_len": 32})
    # Two 16-token tiles per sequence, keys in 16-key steps: 16 + 32 keys. It stores the real
    # rows of its tiles: 64 tokens x 2 kv heads x 3 query heads x 64 dims in bf16.
    out = 64 * 2 * 3 * 64 * 2
    assert pre.kernel_rule("ragged_paged_qt16_ppb1") == KernelRule(2 * 48 * 256, 0, write=out)
    # fp8 pages: the output stays f32 (v_scale is applied after the kernel).
    fp8 = StepTraffic(**{**pre.__dict__, "page_bytes": 1})
    assert fp8.kernel_rule("ragged_paged_qt16_ppb1") == KernelRule(2 * 48 * 128, 0,
                                                                   write=2 * out)
    assert pre.kernel_rule("paged_decode_ppb8_ppp8") == KernelRule(0, 0)
    # The merge of a decode step's 64-key partitions: it loads the partials of the two that
    # hold keys (3 real rows of 64 + 2 floats each, per sequence and kv head) and the lengths,
    # and stores the 3 merged rows of 64 in bf16 (the model's dtype, fp8 pages or not).
    merged = 4 * 2 * 3 * 64 * 2
    assert dec.kernel_rule("paged_merge_pk64") == KernelRule(
        0, 0, write=merged, read=4 * 2 * 3 * 2 * 66 * 4 + 4 * 4)
    assert StepTraffic(**{**dec.__dict__, "page_bytes": 1}).kernel_rule(
        "paged_merge_pk64").write == merged
    # A 40-key window ending at key 100 (keys 60..99) touches both partitions; 30 keys only
    # the second.
    assert dec.kernel_rule("paged_merge_pk64_w40").read == 4 * 2 * 3 * 2 * 66 * 4 + 4 * 4
    assert dec.kernel_rule("paged_merge_pk64_w30").read == 4 * 2 * 3 * 1 * 66 * 4 + 4 * 4
    assert pre.kernel_rule("paged_merge_pk64") == KernelRule(0, 0)
    with pytest.raises(ValueError):
        pre.kernel_rule("ragged_paged_noparams")


def test_sliding_window_kernels_read_their_window_and_the_minimum_counts_it():
    """A `_w<N>` kernel reads the steps its window touches, not the whole context; a sliding
    layer's share of the minimum is its window (layer 0 slides over 40 keys, layer 1 is full)."""
    dec = StepTraffic(tokens=4, seqs=4, context_len=1000, num_layers=2, block_size=16,
                      kv_heads=2, head_dim=64, page_bytes=2, vocab_size=1000, param_bytes=10**6,
                      num_blocks=512, layer_windows=(40, None))
    # Keys 960..999 in 32-key steps: steps 30 and 31, 64 keys, not 1024; one 64-key partition
    # of partials (keys 960..1023), not 16.
    partials = 4 * 2 * 66 * 4
    assert dec.kernel_rule("paged_decode_ppb2_ppp4_w40") == KernelRule(4 * 64 * 256, 0,
                                                                       write=partials)
    assert dec.kernel_rule("paged_decode_ppb2_ppp4") == KernelRule(4 * 1024 * 256, 0,
                                                                   write=16 * partials)
    assert dec.kernel_rule("paged_decode_ppb2_ppp4_w4096") == KernelRule(
        4 * 1024 * 256, 0, write=16 * partials)
    assert dec.min_hbm_bytes() == 10**6 + 2 * 256 * (4 * (40 + 1000) + 2 * 4) + 4 * 1000 * 4
    pre = StepTraffic(**{**dec.__dict__, "tokens": 256, "seqs": 2, "context_len": 128})
    # Tiles of 16 rows, window 8: tile j's first row sees keys from 16j - 7, so it reads its
    # own step and the one before (the first tile only its own), against j + 1 steps.
    out = 256 * 2 * 1 * 64 * 2  # 256 tokens x 2 kv heads x 1 query head x 64 dims, bf16
    assert pre.kernel_rule("ragged_paged_qt16_ppb1_w8") == KernelRule(
        2 * (16 + 7 * 32) * 256, 0, write=out)
    full = sum(16 * (j + 1) for j in range(8))
    assert pre.kernel_rule("ragged_paged_qt16_ppb1") == KernelRule(2 * full * 256, 0, write=out)


def test_a_data_dependent_loop_counts_the_trips_the_case_gives():
    def f(x, n):  # the trip count is an argument: XLA knows none
        with jax.named_scope("xla_chunks_t1_g2_ck4_n8"):
            return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y) * 2, x)

    text = _hlo(f, jnp.zeros(1000), 3)
    once = estimate_traffic(text)
    assert "unknown trip count, body counted once" in once.notes[0]
    seen = []
    five = estimate_traffic(text, HbmModel(loop_trips=lambda name: seen.append(name) or 5))
    assert seen == ["jit(f)/xla_chunks_t1_g2_ck4_n8/while"] and five.notes == []
    # The body (read and write 4000 bytes, plus the counter) runs 5 times instead of once.
    assert five.hbm_bytes - once.hbm_bytes >= 4 * 8000


def test_xla_chunk_loop_trips_follow_its_schedule():
    dec = StepTraffic(tokens=64, seqs=64, context_len=1000, num_layers=2, block_size=16,
                      kv_heads=2, head_dim=64, page_bytes=2, vocab_size=1000, param_bytes=10**6,
                      num_blocks=4096)
    # Decode: 64 one-token tiles, each needing chunks 0..7 of 128 keys; 16 tiles a trip.
    assert dec.loop_trips("jit(_step)/xla_chunks_t1_g16_ck128_n32/while") == 8 * 4
    # A 100-token window from position 999: chunks 7 only (keys 900.. start in chunk 7).
    assert dec.loop_trips("jit(_step)/xla_chunks_t1_g16_ck128_n32_w100/while") == 1 * 4
    assert dec.loop_trips("jit(_step)/while") is None
    # Mixed: 4 sequences prefilling 300 tokens each in 32-token tiles (10 tiles, the last of
    # 12 tokens); tile k ends at 32k + 31 (299 for the last): chunks 0..(last // 128).
    pre = StepTraffic(**{**dec.__dict__, "tokens": 1200, "seqs": 4, "context_len": 300})
    need = [min(32 * k + 31, 299) // 128 + 1 for k in range(10)] * 4  # 1 x 16, 2 x 16, 3 x 8
    want = sum(cdiv(sum(1 for x in need if x > j), 8) for j in range(32))
    assert want == 5 + 3 + 1
    assert pre.loop_trips("jit(_step)/xla_chunks_t32_g8_ck128_n32/while") == want


SPLIT_K = """HloModule m

%gemm (a: f32[4,32], w: f32[32,16]) -> f32[8,4,16] {
  %a = f32[4,32]{1,0} parameter(0)
  %w = f32[32,16]{1,0} parameter(1)
  %d = f32[4,16]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %b = f32[8,4,16]{2,1,0} broadcast(%d), dimensions={1,2}
}

ENTRY %main (w0: f32[32,16], x: f32[4,32]) -> f32[8,4,16] {
  %w0 = f32[32,16]{1,0} parameter(0)
  %x = f32[4,32]{1,0} parameter(1)
  ROOT %g = f32[8,4,16]{2,1,0} fusion(%x, %w0), kind=kCustom, calls=%gemm
}
"""


def test_a_contraction_is_no_weight_copy_however_large_its_output():
    # Split-K partials (8 x [4, 16] f32 = 2 KiB) as large as the 2 KiB weight read beside a
    # 512-byte activation: the size rule alone would call it a copy; it is a product.
    t = estimate_traffic(SPLIT_K, HbmModel(num_weights=1))
    assert t.param_copy_bytes == 0
    assert t.hbm_bytes == 4 * 32 * 4 + 32 * 16 * 4 + 8 * 4 * 16 * 4


def test_skip_scopes_count_their_conditionals_smallest_branch():
    """A conditional under a named scope in `skip_scopes` counts its smallest branch while the
    others keep `branch` (the sampler's whole-row work, skipped when the candidates settle)."""
    n = 4096

    def f(x, y, p):  # each larger branch reads y beside x
        a = jax.lax.cond(p, lambda x, y: jnp.sin(x) * y, lambda x, y: x + 1, x, y)
        with jax.named_scope("whole_row"):
            b = jax.lax.cond(p, lambda x, y: jnp.cos(x) * y, lambda x, y: -x, x, y)
        return a + b

    text = _hlo(f, jnp.zeros(n, jnp.float32), jnp.ones(n, jnp.float32), True)
    largest = estimate_traffic(text, HbmModel(branch="largest"))
    smallest = estimate_traffic(text, HbmModel(branch="smallest"))
    skipped = estimate_traffic(text, HbmModel(branch="largest", skip_scopes=("whole_row",)))
    assert smallest.hbm_bytes < skipped.hbm_bytes < largest.hbm_bytes
    assert sorted(x.split(": ")[1] for x in skipped.notes) == [
        "largest of 2 branches counted", "smallest of 2 branches counted"]
