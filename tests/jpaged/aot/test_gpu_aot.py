"""Deviceless H200 compiles: the log and dump readers on text, and one real case when a CUDA
plugin is installed (`make gpu-aot` makes such an environment; CI's has none and skips it)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jpaged.aot.kernels import (
    capture_stderr,
    is_pallas_kernel,
    kernel_resources,
    parse_ptxas,
    parse_thunks,
)
from jpaged.aot.markdown import hbm_table, prediction_table, programs
from jpaged.aot.report import check_rows, per_context, plan_configs, shapes_for
from jpaged.aot.target import cuda_plugin_error, h200_target_config, target_field
from jpaged.aot.traffic import HBM_KEYS

THUNKS = """\
021: kCustomKernel [prev=020 (1)  | next=022 (1)] kv_write grid: [16, 3, 1] threads: [32, 1, 1]  \
shared_memory: 0 bytes
040: kCustomKernel [prev=039 (1)  | next=042 (2)] ragged_paged_qt16_ppb4 grid: [17, 3, 1] \
threads: [128, 1, 1]  shared_memory: 40960 bytes
041: kCustomKernel [source       | next=005 (4)] loop_cosine_sine_fusion grid: [4, 1, 1] \
threads: [128, 1, 1]  shared_memory: 0 bytes
"""
PTXAS = """\
I1201 subprocess_compilation.cc:356] ptxas info    : 960 bytes gmem
ptxas info    : Compiling entry function 'paged_decode_ppb8_ppp8' for 'sm_90a'
ptxas info    : Function properties for paged_decode_ppb8_ppp8
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes smem
ptxas info    : Compiling entry function 'kv_write' for 'sm_90a'
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
"""


def test_thunk_and_ptxas_readers():
    launches = parse_thunks(THUNKS)
    assert [(x.name, x.grid, x.threads, x.dyn_smem) for x in launches] == [
        ("kv_write", (16, 3, 1), 32, 0), ("ragged_paged_qt16_ppb4", (17, 3, 1), 128, 40960),
        ("loop_cosine_sine_fusion", (4, 1, 1), 128, 0)]
    assert [is_pallas_kernel(x.name) for x in launches] == [True, True, False]
    got = parse_ptxas(PTXAS)
    assert got["paged_decode_ppb8_ppp8"] == {"smem": 16, "stack": 0, "spill": 12,
                                             "registers": 255}
    assert got["kv_write"]["registers"] == 16 and got["kv_write"]["spill"] == 0


def test_kernel_resources_of_a_dump(tmp_path):
    seq = THUNKS + ("042: kCustomKernel [prev=041 (1)  | next=043 (1)] decode_matmul_proj "
                    "grid: [96, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes\n")
    (tmp_path / "module_0001.jit__step.thunk_sequence.txt").write_text(seq)
    (tmp_path / "module_0001.jit__step.3.ptx").write_text(
        ".version 8.8\n.target sm_90a\n"
        ".visible .entry ragged_paged_qt16_ppb4(\n)\n{\n"
        "cp.async.cg.shared.global [ %r2 + 0 ], [ %rd2 + 0 ], 0x10, %r3;\n}\n"
        ".visible .entry decode_matmul_proj(\n)\n{\n"
        "@%p1 ld.global.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];\n}\n")
    got = {k.name: k for k in kernel_resources(tmp_path, None, PTXAS)}
    # The weight-streaming kernels are ours too; loop fusions are not.
    assert set(got) == {"kv_write", "ragged_paged_qt16_ppb4", "decode_matmul_proj"}
    assert got["ragged_paged_qt16_ppb4"].max_global_load_bytes == 16
    assert got["decode_matmul_proj"].max_global_load_bytes == 8
    assert got["kv_write"].max_global_load_bytes is None  # no PTX entry in the dump
    assert got["kv_write"].as_dict()["max_global_load_bytes"] is None


def test_check_rows_names_every_failure():
    ok = {"model": "m", "kv_cache_dtype": "bfloat16", "backend": "pallas",
          "tensor_parallel_size": 1, "program": "step", "tokens": 64, "seqs": 64,
          "compiled": True, "pool_aliased": True, "pool_copies": [],
          "kernels": [{"name": "kv_write", "registers": 16, "spill_bytes": 0,
                       "shared_memory_bytes": 0}]}
    assert check_rows([ok]) == []
    bad = {**ok, "pool_aliased": False, "kernels": [
        {"name": "paged_decode_x", "registers": 256, "spill_bytes": 8,
         "shared_memory_bytes": 300000, "max_global_load_bytes": 16}]}
    problems = check_rows([bad, {**ok, "compiled": False, "error": "boom"}])
    assert len(problems) == 5 and "did not compile: boom" in problems[-1]
    # Every weight byte once: a weight copy or a weight in a collective fails the run.
    moved = check_rows([{**ok, "param_copy_bytes": 512, "param_collective_bytes": 0},
                        {**ok, "param_copy_bytes": 0, "param_collective_bytes": 2048}])
    assert moved == ["m/bfloat16/pallas/tp1/step T=64 B=64: 512 bytes of weight copies",
                     "m/bfloat16/pallas/tp1/step T=64 B=64: collectives carry 2048 weight bytes"]
    # Streaming kernels (weights, K/V) must load 16 bytes per instruction; others may not.
    def kernel(name, width):
        return {"name": name, "registers": 64, "spill_bytes": 0, "shared_memory_bytes": 0,
                "max_global_load_bytes": width}

    narrow = check_rows([{**ok, "kernels": [
        kernel("kv_write", 4), kernel("paged_merge_pk128", 8), kernel("ragged_paged_qt16", 16),
        kernel("decode_matmul_gate_up", 8), kernel("paged_decode_ppb8", None),
        {**kernel("decode_matmul_proj", 16), "spill_bytes": 16}]}])
    tag = "m/bfloat16/pallas/tp1/step T=64 B=64"
    assert narrow == [f"{tag}: decode_matmul_gate_up widest global load 8 B (< 16)",
                      f"{tag}: paged_decode_ppb8 load width unknown (no PTX entry)",
                      f"{tag}: decode_matmul_proj spills 16 bytes"]


def test_plan_covers_both_models_dtypes_backends_and_tp2():
    cfgs = [c for c, _ in plan_configs(quick=True)]
    assert {(c.model, c.kv_cache_dtype, c.backend) for c in cfgs if c.tensor_parallel_size == 1
            } == {(m, d, b) for m in ("smollm2-135m", "llama3-8b")
                  for d in ("bfloat16", "fp8_e4m3") for b in ("pallas", "xla")
                  } | {("gemma3-270m", "bfloat16", "pallas"),  # sliding windows, head_dim 256
                       ("qwen3-30b-a3b", "bfloat16", "pallas")}  # a mixture of experts
    assert any(c.tensor_parallel_size == 2 for c in cfgs)
    # An engine serving LoRA adapters: the 8B's decode steps with 4 slots of rank 16.
    assert "llama3-8b-lora4x16/bfloat16/pallas/tp1" in {c.key for c in cfgs}

    class Plan:
        def all_shapes(self):
            return [(1, 1), (4, 4), (16, 16), (64, 16), (64, 64), (2048, 256)]

    # The decode shapes of DECODE_BATCHES the plan has, then the largest mixed shape.
    assert shapes_for(Plan(), "quick") == [(1, 1), (16, 16), (64, 64), (2048, 256)]
    assert shapes_for(Plan(), "decode") == [(1, 1), (16, 16), (64, 64)]
    assert shapes_for(Plan(), "all") == Plan().all_shapes()


def test_decode_case_gives_one_row_per_context_and_a_summary():
    row = {"model": "m", "kv_cache_dtype": "bfloat16", "backend": "pallas",
           "tensor_parallel_size": 1, "program": "step", "tokens": 1, "seqs": 1,
           "compiled": True, "pool_aliased": True, "pool_copies": [], "temp_bytes": 2**20,
           "hbm": [{"context_len": c, "hbm_bytes": 3 * 10**9, "min_hbm_bytes": 10**9,
                    "traffic_ratio": 3.0, "param_copy_bytes": 0, "param_collective_bytes": 0,
                    "predicted_step_ms": 0.625, "predicted_step_ms_at_80pct": 0.781}
                   for c in (1024, 4096)]}
    rows = per_context(row, (1024, 4096))
    assert [r["context_len"] for r in rows] == [1024, 4096]
    assert [bool(r.get("reuses_compile")) for r in rows] == [False, True]
    assert all(k in rows[0] for k in HBM_KEYS)
    doc = {"cases": rows, "hbm_bytes_per_s": 4.8e12}
    table = hbm_table(doc)
    assert "| m | bfloat16 | pallas | 1 | 1 | 4096 | 3.00 | 1.00 | 3.00 |" in table
    assert programs(doc) == 1
    # The predicted throughput: 1 token per 0.781 ms at 80% of peak; ideal = min bytes at peak.
    pred = prediction_table({"cases": [{**r, "model": "llama3-8b"} for r in rows],
                             "hbm_bytes_per_s": 4.8e12})
    assert "| bfloat16 | 1 | 1 | 1024 | 0.62 / 0.78 | 1,280 | 0.21 | 4,800 | ~4.3 ms" in pred
    failed = per_context({**row, "hbm": None, "compiled": False}, (1024, 4096))
    assert [r["context_len"] for r in failed] == [1024, 4096] and failed[0]["hbm_bytes"] is None


def test_target_config_is_an_h200():
    cfg = h200_target_config()
    assert 'device_description_str: "NVIDIA H200"' in cfg
    assert target_field("core_count") == 132
    assert target_field("shared_memory_per_block_optin") == 232448
    assert target_field("device_memory_size") == 143771 * 2**20


def test_capture_stderr_reads_file_descriptor_2():
    import os

    with capture_stderr() as out:
        os.write(2, b"ptxas info    : Used 7 registers\n")
    assert "Used 7 registers" in out[0]


@pytest.mark.skipif(cuda_plugin_error() is not None, reason="no CUDA plugin for jax here")
def test_one_step_compiles_for_an_h200():
    from jpaged.aot.cases import DECODE_FLAGS, StepBuilder, model_spec
    from jpaged.aot.launches import COMMAND_BUFFER_OPTIONS, StepShape
    from jpaged.aot.report import compile_lowered
    from jpaged.aot.target import h200_target

    target = h200_target(1)
    b = StepBuilder(model_spec("smollm2-135m"), jnp.bfloat16, "fp8_e4m3", "pallas", 4099,
                    target.devices)
    from jpaged.aot.traffic import hbm_fields

    def analyze(text: str) -> list[dict]:
        return [hbm_fields(text, b.traffic_case(16, 16, 512), b.num_weights, b.pool_shape())]

    # A pure decode step (the engine's flags for T == B): the split-K decode kernel alone.
    row = compile_lowered(lambda: b.lower_step(16, 16, DECODE_FLAGS), True, None, b.pool_shape(),
                          target=target, analyze=analyze, options=COMMAND_BUFFER_OPTIONS,
                          step=StepShape(16, b.spec.hidden_size, b.spec.num_layers))
    assert row["compiled"], row.get("error")
    # The whole step is one CUDA graph; every layer launches the same kernels.
    assert row["all_in_command_buffers"] and row["command_buffers"] == 1, row
    assert row["kernels_outside_command_buffers"] == 0 and row["outside_command_buffers"] == []
    assert row["kernels_per_layer"] and row["kernels_outside_layers"] >= 0
    assert row["kernels_per_step"] == (row["kernels_per_layer"] * b.spec.num_layers
                                       + row["kernels_outside_layers"])
    assert len(row["wide_elementwise_fusions"]) == min(20, row["wide_elementwise_passes"])
    # The decode kernel streams K/V 16 bytes per thread per load (cp.async or ld.v4).
    assert all(k["max_global_load_bytes"] == 16 for k in row["kernels"]
               if k["name"].startswith("paged_decode_"))
    hbm = row["hbm"][0]
    # Every weight is read at least once and the decode kernel reads the 512-token contexts.
    assert hbm["hbm_bytes"] >= hbm["min_hbm_bytes"] > b.param_bytes
    # A random batch its candidates settle moves more than a greedy one and less than one the
    # whole row must settle (its searches read the 49,152-token row again and again).
    assert hbm["hbm_bytes"] < hbm["hbm_bytes_sampling_candidates"] < hbm["hbm_bytes_sampling"]
    case = b.traffic_case(16, 16, 512)
    decode = [k for k in hbm["kernel_hbm_bytes"] if k.startswith("paged_decode_")]
    assert len(decode) == 1
    layers = b.spec.num_layers
    assert hbm["kernel_hbm_bytes"][decode[0]] >= layers * 2 * 16 * 512 * case.row_bytes
    assert row["pool_aliased"] and row["pool_copies"] == []
    # Batch 16 splits each context into partitions: their merge is a kernel too, counted by
    # its rule (the partitions holding keys), not by its whole operands.
    assert [k for k in hbm["kernel_hbm_bytes"] if k.startswith("paged_merge_pk")]
    assert not any("no read rule" in n for n in hbm["hbm_notes"])
    names = {k["name"].split("_ppb")[0].split("_qt")[0].split("_pk")[0].split("__")[0]
             for k in row["kernels"]}
    # The decode matmuls take every projection and the tied output head (its [49152, 576]
    # table, transposed), and the q/k/v launch writes K/V (no kv_write), the pool still updated
    # in place; they stream their weights 16 bytes per load.
    assert names == {"decode_matmul_proj", "decode_matmul_residual", "decode_matmul_gate_up",
                     "decode_matmul_logits", "paged_decode", "paged_merge"}, names
    assert all(k["max_global_load_bytes"] == 16 for k in row["kernels"]
               if k["name"].startswith("decode_matmul"))
    assert all(k["shared_memory_bytes"] <= 232448 for k in row["kernels"])


def test_markdown_tables_of_a_run():
    from jpaged.aot.markdown import render

    case = {"model": "m", "kv_cache_dtype": "fp8_e4m3", "backend": "pallas",
            "tensor_parallel_size": 1, "program": "step", "tokens": 64, "seqs": 64,
            "compiled": True, "compile_s": 6.0, "temp_bytes": 2**20, "pool_bytes": 2**30,
            "pool_aliased": True, "kernels": [{"name": "kv_write", "registers": 16,
                                               "spill_bytes": 0, "shared_memory_bytes": 0,
                                               "threads": 32, "max_global_load_bytes": 4}],
            "kernels_per_step": 343, "kernels_per_layer": 9, "kernels_outside_layers": 73,
            "copies_per_step": 23, "command_buffers": 1, "kernels_outside_command_buffers": 0,
            "control_flow_outside_command_buffers": 0, "wide_elementwise_passes": 38}
    sizing = {"model": "m", "kv_cache_dtype": "fp8_e4m3", "backend": "pallas",
              "tensor_parallel_size": 1, "param_bytes": 2**30, "activation_bytes_gpu": 2**20,
              "estimate_activation_bytes": 2**21, "kv_budget_bytes": 2**33, "num_blocks": 1000,
              "estimate_num_blocks": 990, "max_concurrent_seqs": 7, "max_model_len": 2048}
    text = render({"jax_version": "0", "target": "t", "mode": "quick", "cases": [case],
                   "sizing": [sizing], "problems": []})
    assert "| m | fp8_e4m3 | pallas | 1 | 1 | 1/1 | 1/1 | 1.00 GiB |" in text
    assert "| `kv_write` | 16 | 0 | 0 | 32 | 64x64 | 4 |" in text
    assert "| m | fp8_e4m3 | pallas | 1 | 64 | 64 | 343 | 9 | 73 | 23 | 1 | 0 + 0 | 38 |" in text
    assert "1,000 (990)" in text


def test_xla_options_of_the_command_line():
    from jpaged.aot.cli import _option, main

    assert _option("xla_gpu_experimental_force_split_k=1") == (
        "xla_gpu_experimental_force_split_k", 1)
    assert _option("xla_gpu_enable_triton_gemm=False") == ("xla_gpu_enable_triton_gemm", False)
    assert _option("xla_gpu_some_path=/tmp/x") == ("xla_gpu_some_path", "/tmp/x")
    for bad in ("force_split_k=1", "xla_gpu_experimental_force_split_k"):
        with pytest.raises(SystemExit) as e:
            main(["--xla-option", bad])
        assert e.value.code == 2


def test_lora_step_lowers_with_its_slots_counted_as_weights():
    """A LoRA engine's step (every slot's arrays, each token's slot) lowers on the local
    backend as the engine runs it; its slot bytes count among the weights every step reads."""
    from tiny_models import tiny_spec

    from jpaged.aot.cases import StepBuilder
    from models.lora import lora_slot_bytes

    spec = tiny_spec()
    plain = StepBuilder(spec, jnp.float32, "auto", "xla", 16)
    lora = StepBuilder(spec, jnp.float32, "auto", "xla", 16, lora=(2, 4))
    assert lora.param_bytes - plain.param_bytes == lora_slot_bytes(spec, 2, 4, 4)
    text = lora.lower_step(16, 4).as_text()
    assert "dot_general" in text and lora.runner.lora.weights["q_proj"][0].shape == (
        spec.num_layers, spec.hidden_size, 8)


def test_a_mixture_of_experts_step_counts_the_experts_its_tokens_choose():
    """Qwen3-30B-A3B (128 experts, 8 a token): one token reads 8 experts of each layer, the
    grouped-matmul kernel's weight operand is capped at them, and the minimum leaves the rest
    out; a dense model's figures are unchanged."""
    from jpaged.aot.cases import model_spec
    from jpaged.aot.traffic import StepTraffic

    spec = model_spec("qwen3-30b-a3b")
    assert spec.is_moe and spec.num_experts == 128 and spec.num_experts_per_tok == 8
    matrix = 2048 * 768 * 2
    base = dict(context_len=1024, num_layers=48, block_size=16, kv_heads=4, head_dim=128,
                page_bytes=2, vocab_size=151936, param_bytes=61_000_000_000, num_blocks=9000)
    moe = dict(sparse_layers=48, num_experts=128, top_k=8, expert_matrix_bytes=matrix,
               expert_width=768, expert_hidden=2048)
    one = StepTraffic(1, 1, **base, **moe)
    assert one.experts_read == pytest.approx(8.0)
    assert one.unread_expert_bytes == 48 * 3 * 120 * matrix
    assert StepTraffic(1, 1, **base).min_hbm_bytes() - one.min_hbm_bytes() == \
        one.unread_expert_bytes
    rule = one.kernel_rule("moe_grouped_matmul__1")
    tiles = 1 + 8  # ceil(8 rows / 16) + min(128 experts, 8 rows)
    assert rule.read == 4 * tiles + tiles * 16 * 2048 * 2 + 8 * matrix
    # Many tokens choose nearly every expert; never more than all of them.
    assert 125 < StepTraffic(64, 64, **base, **moe).experts_read <= 128
    assert StepTraffic(1, 1, **base).kernel_rule("moe_grouped_matmul") is not None
    both = one.kernel_rule("moe_grouped_gate_up")  # gate and up: two weights' experts
    assert both.read - rule.read == 8 * matrix
