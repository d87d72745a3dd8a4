"""The launch counters (`jpaged.aot.launches`) on a handwritten dump of a two-layer step: a thunk
sequence with command buffers, a conditional, a loop and a dynamic-slice fusion nested the way
XLA prints them, its thunk metadata and the step's optimized HLO."""

from __future__ import annotations

import re
from pathlib import Path

from jpaged.aot.launches import (
    COMMAND_BUFFER_OPTIONS,
    LAUNCH_KEYS,
    StepShape,
    instruction_layers,
    kernels_per_layer,
    launch_fields,
    launch_stats,
    parse_thunk_metadata,
    parse_thunk_tree,
    wide_elementwise_passes,
)
from jpaged.aot.target import h200_target_config

_K = "grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes"
# As XLA 0.10.2 prints it: the kWhile's "condition:" label at column 0, a branch's "No thunks."
# beside the next label, command buffers with id 000.
SEQUENCE = f"""\
000: kCommandBuffer      [source       | next=010 (1)] \n\
    001: kCustomKernel [source        | next=002 (1) ] loop_embed_fusion {_K}
    002: kCustomKernel [prev=001 (1)  | next=003 (1) ] fusion_norm {_K}
    003: kCustomKernel [prev=002 (1)  | next=004 (1) ] gemm_fusion_dot {_K}
    004: kCustomKernel [prev=003 (1)  | next=005 (1) ] paged_decode_ppb8_ppp8 {_K}
    005: kCustomKernel [prev=004 (1)  | next=006 (1) ] fusion_norm {_K}
    006: kCustomKernel [prev=005 (1)  | next=007 (1) ] gemm_fusion_dot {_K}
    007: kCustomKernel [prev=006 (1)  | next=008 (1) ] paged_decode_ppb8_ppp8 {_K}
    008: kCopy         [prev=007 (1)  | sink         ] kCopy
010: kConditional        [prev=000 (1) | next=017 (1)]   \n\
  false_branch:
    No thunks.  true_branch:
    011: kCustomKernel [source       | next=013 (1)] input_reduce_fusion {_K}
    013: kWhile        [prev=011 (1) | sink        ]   \n\
condition:
        014: kCustomKernel [source | sink] loop_compare_fusion {_K}
      body:
        000: kCommandBuffer [source | sink] \n\
            015: kCustomKernel [source       | next=016 (1)] loop_exp_fusion {_K}
            016: kCopy         [prev=015 (1) | sink        ] kCopy
017: kGemm               [prev=010 (1) | next=018 (1)] \n\
018: kDynamicSliceFusion [prev=017 (2) | sink        ] params=1, results=1
    019: kCopy [source | sink] kCopy
"""
NAMES = {1: "loop_embed_fusion", 2: "fusion.norm0", 3: "gemm_fusion_dot.q0", 4: "pallas_call.1",
         5: "fusion.norm1", 6: "gemm_fusion_dot.q1", 7: "pallas_call.2", 8: "wrapped_slice",
         10: "conditional.1", 11: "input_reduce_fusion", 13: "while.1", 14: "loop_compare_fusion",
         15: "loop_exp_fusion", 16: "copy.1", 17: "custom-call.1", 18: "loop_dus_fusion",
         19: "copy.2"}
METADATA = "thunk_metadata {\n  thunk_info {\n    profile_annotation: \"command_buffer_1\"\n" \
    "  }\n  thunk_kind: \"kCommandBuffer\"\n}\n" + "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n'
        f'    thunk_id: {i}\n  }}\n  thunk_kind: "kX"\n}}\n' for i, n in NAMES.items())

# Entry parameters as jax names the step's weights: params__model____layers___<i>___...
_N0, _Q0 = "params__layers___0___norm", "params__layers___0___q"
_N1, _Q1 = "params__layers___1___norm", "params__layers___1___q"
_TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
HLO = f"""\
HloModule jit__step, is_scheduled=true

%fused_norm (p.0: bf16[4,8], p.1: bf16[8]) -> bf16[4,8] {{
  %p.0 = bf16[4,8]{{1,0}} parameter(0)
  %p.1 = bf16[8]{{0}} parameter(1)
  %broadcast.0 = bf16[4,8]{{1,0}} broadcast(%p.1), dimensions={{1}}
  ROOT %multiply.0 = bf16[4,8]{{1,0}} multiply(%p.0, %broadcast.0)
}}

%fused_dus (p.0: bf16[64,8], p.1: bf16[4,8], p.2: s32[]) -> bf16[64,8] {{
  %p.0 = bf16[64,8]{{1,0}} parameter(0)
  %p.1 = bf16[4,8]{{1,0}} parameter(1)
  %p.2 = s32[] parameter(2)
  ROOT %dynamic-update-slice.0 = bf16[64,8]{{1,0}} dynamic-update-slice(%p.0, %p.1, %p.2, %p.2)
}}

%fused_exp (p.0: bf16[4,16]) -> bf16[4,16] {{
  %p.0 = bf16[4,16]{{1,0}} parameter(0)
  ROOT %exponential.0 = bf16[4,16]{{1,0}} exponential(%p.0)
}}

%body (arg: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {{
  %arg = (s32[], bf16[4,16]{{1,0}}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  %gte.1 = bf16[4,16]{{1,0}} get-tuple-element(%arg), index=1
  %loop_exp_fusion = bf16[4,16]{{1,0}} fusion(%gte.1), kind=kLoop, calls=%fused_exp
  ROOT %tuple.0 = (s32[], bf16[4,16]{{1,0}}) tuple(%gte.0, %loop_exp_fusion)
}}

%cond (arg: (s32[], bf16[4,16])) -> pred[] {{
  %arg = (s32[], bf16[4,16]{{1,0}}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%arg), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%gte.0), kind=kLoop, calls=%fused_exp
}}

ENTRY %main.1 (a: bf16[8], b: bf16[8,8], c: bf16[8], d: bf16[8,8]) -> bf16[64,8] {{
  %{_N0} = bf16[8]{{0}} parameter(0)
  %{_Q0} = bf16[8,8]{{1,0}} parameter(1)
  %{_N1} = bf16[8]{{0}} parameter(2)
  %{_Q1} = bf16[8,8]{{1,0}} parameter(3)
  %x = bf16[4,8]{{1,0}} parameter(4)
  %pool = bf16[64,8]{{1,0}} parameter(5)
  %loop_embed_fusion = f32[4]{{0}} fusion(%x), kind=kLoop, calls=%fused_exp
  %fusion.norm0 = bf16[4,8]{{1,0}} fusion(%x, %{_N0}), kind=kLoop, calls=%fused_norm
  %bitcast.w0 = bf16[8,8]{{0,1}} bitcast(%{_Q0})
  %gemm_fusion_dot.q0 = bf16[4,8]{{1,0}} fusion(%fusion.norm0, %bitcast.w0), kind=kCustom
  %pallas_call.1 = bf16[4,8]{{1,0}} custom-call(%gemm_fusion_dot.q0, %pool), {_TRITON}
  %fusion.norm1 = (f32[4]{{0}}, bf16[4,8]{{1,0}}) fusion(%pallas_call.1, %{_N1}), kind=kLoop
  %gte.n1 = bf16[4,8]{{1,0}} get-tuple-element(%fusion.norm1), index=1
  %gemm_fusion_dot.q1 = bf16[4,8]{{1,0}} fusion(%gte.n1, %{_Q1}), kind=kCustom
  %pallas_call.2 = bf16[4,8]{{1,0}} custom-call(%gemm_fusion_dot.q1, %pool), {_TRITON}
  %input_reduce_fusion = bf16[4,8]{{1,0}} fusion(%pallas_call.2), kind=kInput
  %init = (s32[], bf16[4,16]{{1,0}}) tuple(%x, %x)
  %while.1 = (s32[], bf16[4,16]{{1,0}}) while(%init), condition=%cond, body=%body
  %c.0 = s32[] parameter(6)
  ROOT %loop_dus_fusion = bf16[64,8]{{1,0}} fusion(%pool, %x, %c.0), kind=kLoop, calls=%fused_dus
}}
"""


def _thunks():
    thunks = parse_thunk_tree(SEQUENCE)
    names = parse_thunk_metadata(METADATA)
    for t in thunks:
        t.name = names.get(t.id, t.name)
    return thunks


def test_thunk_tree_marks_command_buffers_and_control_flow():
    thunks = _thunks()
    by_id = {t.id: t for t in thunks if t.id}
    assert [t.kind for t in thunks].count("kCommandBuffer") == 2
    assert by_id[4].in_command_buffer and not by_id[4].in_control_flow
    assert by_id[4].label.startswith("paged_decode_ppb8_ppp8 grid:")
    assert not by_id[11].in_command_buffer and by_id[11].in_control_flow
    # The loop's condition runs outside a graph; its body's commands inside one.
    assert not by_id[14].in_command_buffer and by_id[14].in_control_flow
    assert by_id[15].in_command_buffer and by_id[15].in_control_flow
    assert not by_id[19].in_command_buffer and not by_id[19].in_control_flow
    assert by_id[17].is_kernel and not by_id[19].is_kernel and by_id[19].is_work
    assert not by_id[10].is_work and not by_id[18].is_work
    assert by_id[4].name == "pallas_call.1" and by_id[8].name == "wrapped_slice"


def test_metadata_reader_skips_thunks_without_an_id():
    names = parse_thunk_metadata(METADATA)
    assert 0 not in names and names[4] == "pallas_call.1" and len(names) == len(NAMES)


def test_layers_are_read_from_the_weights_each_launch_reads():
    layers = instruction_layers(HLO)
    # Read directly or through a bitcast; activations (the pool, x) belong to no layer.
    assert layers == {"fusion.norm0": 0, "gemm_fusion_dot.q0": 0, "fusion.norm1": 1,
                      "gemm_fusion_dot.q1": 1}
    thunks = _thunks()
    assert kernels_per_layer(thunks, layers, 2) == 3  # norm, GEMM, attention
    assert kernels_per_layer(thunks, layers, 3) is None  # a layer never seen
    assert kernels_per_layer(thunks, {"fusion.norm0": 1, "fusion.norm1": 0}, 2) is None


def test_launch_counts_of_the_step():
    s = launch_stats(_thunks(), instruction_layers(HLO), 2)
    # 10 kernel thunks and one cuBLAS GEMM; three copies counted apart.
    assert (s.kernels_per_step, s.copies_per_step, s.kernels_in_control_flow) == (11, 3, 3)
    assert (s.kernels_per_layer, s.kernels_outside_layers) == (3, 5)
    assert s.command_buffers == 2
    # Outside: the branch's reduce, the loop's condition, the GEMM, the dynamic-slice copy;
    # and the conditional and the loop themselves.
    assert s.kernels_outside_command_buffers == 4
    assert s.control_flow_outside_command_buffers == 2
    assert s.outside_command_buffers == [
        "kConditional conditional.1", "kCustomKernel input_reduce_fusion", "kWhile while.1",
        "kCustomKernel loop_compare_fusion", "kGemm custom-call.1", "kCopy copy.2"]
    assert not s.all_in_command_buffers
    # One graph around everything: nothing outside.
    whole = "000: kCommandBuffer [source | sink] \n" + "".join(
        f"    {line}\n" for line in SEQUENCE.splitlines())
    s = launch_stats(parse_thunk_tree(whole))
    assert s.all_in_command_buffers and s.kernels_outside_command_buffers == 0
    assert s.kernels_per_layer is None and s.kernels_per_step == 11


def test_wide_elementwise_passes():
    # tokens x hidden = 4 x 8: the two norms (a multi-output one by its widest array) and the
    # loop body's exponential; not the GEMM fusions, the reduction, the 4-element fusions or
    # the in-place update of the pool.
    assert wide_elementwise_passes(HLO, 4, 8) == [
        "fusion.norm0 bf16[4,8]", "fusion.norm1 bf16[4,8]", "loop_exp_fusion bf16[4,16]"]
    assert wide_elementwise_passes(HLO, 4, 16) == ["loop_exp_fusion bf16[4,16]"]


def test_launch_fields_from_a_dump(tmp_path: Path):
    (tmp_path / "module_0001.jit__step.thunk_sequence.txt").write_text("ignored")
    (tmp_path / "module_0001.jit__step.thunk_sequence_after_thunk_passes.txt").write_text(
        SEQUENCE)
    (tmp_path / "module_0001.jit__step.thunk_metadata.txt").write_text(METADATA)
    got = launch_fields(tmp_path, HLO, StepShape(4, 8, 2))
    assert set(got) == set(LAUNCH_KEYS)
    assert got["kernels_per_step"] == 11 and got["kernels_per_layer"] == 3
    assert got["wide_elementwise_passes"] == 3 and len(got["wide_elementwise_fusions"]) == 3
    assert got["all_in_command_buffers"] is False
    # Without metadata the thunks keep their labels' names; layers cannot be told.
    (tmp_path / "module_0001.jit__step.thunk_metadata.txt").unlink()
    got = launch_fields(tmp_path, HLO, StepShape(4, 8, 2))
    assert got["kernels_per_layer"] is None and got["kernels_per_step"] == 11
    assert "kCustomKernel input_reduce_fusion" in got["outside_command_buffers"]


def test_command_buffers_keep_every_kind_for_the_h200_target():
    types = COMMAND_BUFFER_OPTIONS["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CONDITIONAL", "WHILE"} <= set(types)
    assert COMMAND_BUFFER_OPTIONS["xla_gpu_graph_min_graph_size"] == 1
    # XLA drops every kind but FUSION unless driver and runtime are >= 12.3.
    cfg = h200_target_config()
    for field in ("driver_version", "runtime_version"):
        m = re.search(rf'\b{field}:\s*"(\d+)\.(\d+)', cfg)
        assert m and (int(m.group(1)), int(m.group(2))) >= (12, 3), field
    assert re.search(r"^runtime_version \{ major: 12 minor: 9 \}", cfg, re.M)
