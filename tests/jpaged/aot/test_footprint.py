"""`footprint.param_read_elements` on handwritten fused computations whose read elements are
counted by hand, and the estimator counting a split-K consumer's columns only."""

from __future__ import annotations

from jpaged.aot.footprint import _reshape_box, param_read_elements
from jpaged.aot.hbm import estimate_traffic
from jpaged.aot.hlo import parse_module

# Split-K partials f32[4, 8, 12] reduced, then the consumer keeps columns 8..11 (the "v" of a
# fused qkv): 4 x 8 x 4 elements of the partials are read. Rows 2..5 of a [6, 4] rope table.
CONSUMER = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_v (p0: f32[4,8,12], p1: f32[6,4]) -> bf16[8,4] {
  %p0 = f32[4,8,12]{2,1,0} parameter(0)
  %z = f32[] constant(0)
  %r = f32[8,12]{1,0} reduce(%p0, %z), dimensions={0}, to_apply=%add
  %c = bf16[8,12]{1,0} convert(%r)
  %s = bf16[8,4]{1,0} slice(%c), slice={[0:8], [8:12]}
  %p1 = f32[6,4]{1,0} parameter(1)
  %t = f32[2,4]{1,0} slice(%p1), slice={[2:4], [0:4]}
  %cols = f32[4]{0} reduce(%t, %z), dimensions={0}, to_apply=%add
  %b = f32[8,4]{1,0} broadcast(%cols), dimensions={1}
  %sf = f32[8,4]{1,0} convert(%s)
  %m = f32[8,4]{1,0} multiply(%sf, %b)
  ROOT %o = bf16[8,4]{1,0} convert(%m)
}

ENTRY %main (x: f32[4,8,12], tab: f32[6,4]) -> bf16[8,4] {
  %x = f32[4,8,12]{2,1,0} parameter(0)
  %tab = f32[6,4]{1,0} parameter(1)
  ROOT %f = bf16[8,4]{1,0} fusion(%x, %tab), kind=kLoop, calls=%fused_v
}
"""

# Rotate-half on a bitcast view: both halves of every head are read, so all of columns 0..5.
ROPE = """HloModule m

%fused_rope (p0: f32[8,12]) -> f32[8,2,3] {
  %p0 = f32[8,12]{1,0} parameter(0)
  %q = f32[8,6]{1,0} slice(%p0), slice={[0:8], [0:6]}
  %v = f32[8,2,3]{2,1,0} bitcast(%q)
  %lo = f32[8,2,1]{2,1,0} slice(%v), slice={[0:8], [0:2], [0:1]}
  %hi = f32[8,2,2]{2,1,0} slice(%v), slice={[0:8], [0:2], [1:3]}
  %n = f32[8,2,2]{2,1,0} negate(%hi)
  ROOT %cat = f32[8,2,3]{2,1,0} concatenate(%n, %lo), dimensions={2}
}

ENTRY %main (x: f32[8,12]) -> f32[8,2,3] {
  %x = f32[8,12]{1,0} parameter(0)
  ROOT %f = f32[8,2,3]{2,1,0} fusion(%x), kind=kLoop, calls=%fused_rope
}
"""

# Rows picked by a gather (4 of 16), a dynamic-slice of 3 rows, a padded view of which only
# the pad and two source rows are kept, and a sort (unknown to the walk: read whole).
PICKS = """HloModule m

%lt (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%fused_picks (...) -> (f32[4,6], f32[3,6], f32[4,4], f32[5]) {
  %p0 = f32[16,6]{1,0} parameter(0)
  %p1 = s32[4,1]{1,0} parameter(1)
  GATHER
  %gr = f32[4,6]{1,0} bitcast(%g)
  %p2 = f32[16,6]{1,0} parameter(2)
  %p3 = s32[] parameter(3)
  %z = s32[] constant(0)
  %ds = f32[3,6]{1,0} dynamic-slice(%p2, %p3, %z), dynamic_slice_sizes={3,6}
  %p4 = f32[6,4]{1,0} parameter(4)
  %zf = f32[] constant(0)
  %pd = f32[10,4]{1,0} pad(%p4, %zf), padding=2_2x0_0
  %keep = f32[4,4]{1,0} slice(%pd), slice={[0:4], [0:4]}
  %p5 = f32[5]{0} parameter(5)
  %srt = f32[5]{0} sort(%p5), dimensions={0}, to_apply=%lt
  ROOT %t = (f32[4,6]{1,0}, f32[3,6]{1,0}, f32[4,4]{1,0}, f32[5]{0}) tuple(%gr, %ds, %keep, %srt)
}

ENTRY %main () -> f32[] {
  ROOT %c = f32[] constant(0)
}
""".replace("GATHER", "%g = f32[4,1,6]{2,1,0} gather(%p0, %p1), offset_dims={1,2}, "
            "collapsed_slice_dims={}, start_index_map={0}, index_vector_dim=1, "
            "slice_sizes={1,6}")


def test_split_k_consumer_reads_its_columns_of_the_partials():
    comps, _ = parse_module(CONSUMER)
    assert param_read_elements(comps["fused_v"]) == {0: 4 * 8 * 4, 1: 2 * 4}
    # The estimator counts those bytes (f32), the write whole: no longer all the partials.
    t = estimate_traffic(CONSUMER)
    assert t.hbm_bytes == 4 * 8 * 4 * 4 + 2 * 4 * 4 + 8 * 4 * 2


def test_rotate_half_on_a_view_reads_the_sliced_columns_once():
    comps, _ = parse_module(ROPE)
    assert param_read_elements(comps["fused_rope"]) == {0: 8 * 6}


def test_picked_rows_pads_and_unknown_ops():
    comps, _ = parse_module(PICKS)
    got = param_read_elements(comps["fused_picks"])
    assert got[0] == 4 * 6  # four gathered rows of six
    assert got[1] == 4  # the indices, whole
    assert got[2] == 3 * 6 and got[3] == 1  # the dynamic-slice's extent, and its offset
    assert got[4] == 2 * 4  # rows 0..1 of the source under two rows of padding
    assert got[5] == 5  # sort: whole


def test_reshape_maps_boxes_by_groups_of_dimensions():
    # A head's columns of a [T, heads * D] view, whole minor dims: a range of the merged dim.
    assert _reshape_box(((0, 8), (1, 2), (0, 4)), (8, 3, 4), (8, 12)) == ((0, 8), (4, 8))
    # Size-1 dims lead nothing.
    assert _reshape_box(((0, 1), (0, 8), (2, 5)), (1, 8, 12), (8, 12)) == ((0, 8), (2, 5))
    # Part of a minor dim: the whole group.
    assert _reshape_box(((0, 4), (3, 5)), (4, 6), (24,)) == ((0, 24),)
    # Rows of a merged dim split back: rows of the major source dim, minor dims whole.
    assert _reshape_box(((4, 9), (0, 6)), (12, 6), (4, 3, 6)) == ((1, 3), (0, 3), (0, 6))
