"""Tensor parallelism on the kernels' side, in a subprocess of its own (tp_worker.py's
"kernels" group, beside test_tensor_parallel.py's "engine" group, so the two test workers run
them at once): the fused decode projections per device, and quantized weights split as the
float kernels are."""

from __future__ import annotations

import pytest
from test_tensor_parallel import worker_facts


@pytest.fixture(scope="module")
def facts() -> dict:
    return worker_facts("kernels")


def test_fused_decode_projections_under_tp_give_the_xla_tokens(facts):
    """q/k/v (RoPE in the epilogue, biases), gate/up and o/down on the streaming kernels, per
    device under shard_map: the same greedy tokens as XLA's GEMMs at tp 1, at tp 2 and 4."""
    case = facts["fused_linears"]
    assert any(len(t) == 8 for t in case["xla"])  # (a prompt may draw EOS early)
    for tp in (2, 4):
        assert case[f"linears_tp{tp}"] == f"pallas+tp{tp}"
        assert case[f"tp{tp}"] == case["xla"], tp


def test_quantized_weights_split_like_float_kernels(facts):
    case = facts["quantized"]
    assert case["tp2"] == case["tp1"] and any(len(t) == 8 for t in case["tp1"])
    assert case["fp8_tp2"] == case["fp8_tp1"] and any(len(t) == 8 for t in case["fp8_tp1"])
    # Scanned layers [L, K/2, N]: q_proj splits its columns, down_proj its packed rows.
    assert case["q_proj_tp2"] == [[2, 32, 64], [[2, 32, 32]] * 2]
    assert case["down_proj_tp2"] == [[2, 64, 64], [[2, 32, 64]] * 2]
    assert "down_proj: tensor_parallel_size=2 splits its 96 input rows into 48, which cuts " \
           "its groups of 32" in case["cut_error"]


def test_lora_under_tp_gives_the_single_device_tokens(facts):
    case = facts["lora"]
    assert case["tp2"] == case["tp1"]
    half = len(case["tp1"]) // 2
    assert case["tp1"][half:] != case["tp1"][:half]  # the adapter changed the answers
    assert case["slot_sharding"] == ["P()", "P()"]  # replicated on the mesh


def test_experts_split_their_width_and_give_the_single_device_tokens(facts):
    case = facts["moe"]
    assert case["tp2"] == case["tp1"] and any(len(t) == 8 for t in case["tp1"])
    # Stacked experts [E, hidden, width] / [E, width, hidden]: each device holds width / 2 of
    # all 6 experts (layers are never scanned: a scan would copy all experts); the router
    # [hidden, E] is whole.
    shapes = case["shard_shapes"]
    assert shapes["gate_proj"] == [6, 64, 16] and shapes["down_proj"] == [6, 16, 64]
    assert shapes["router"] == [64, 6]
    # The kernel per device under shard_map (a GPU's way) gives one device's logits.
    assert case["kernel_tp2_max_err"] < 1e-4
    # fp8 experts split as the float ones (values [E, 64, 64] by columns, down's rows; down's
    # per-column scales whole), the kernel per device exact.
    assert case["fp8_shards"] == [[6, 64, 32], [6, 1, 32], [6, 32, 64], [6, 1, 64]]
    assert case["fp8_kernel_tp2_max_err"] < 1e-4
    # A GGUF's experts at its own quantization: gate / up int4 (Q4_1: [E, 64 / 2, 64] packed,
    # groups of 32) split by columns, down int8 (Q8_0) by rows with its groups.
    assert case["gguf_tp2"] == case["gguf_tp1"] and any(len(t) == 8 for t in case["gguf_tp1"])
    assert case["gguf_shards"] == [[6, 32, 32], [6, 2, 32], [6, 32, 64], [6, 1, 64]]
    assert case["gguf_kernel_tp2_max_err"] < 1e-4


def test_pooling_under_tp_gives_the_single_device_vectors(facts):
    import numpy as np

    case = facts["pooling"]
    assert len(case["tp1"]) == 3 and len(case["tp1"][0]) == 64
    np.testing.assert_allclose(case["tp2"], case["tp1"], atol=1e-5)
    # A classifier's probabilities (its head on the replicated pooled state).
    assert np.shape(case["classify_tp1"]) == (3, 3)
    np.testing.assert_allclose(np.sum(case["classify_tp1"], axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(case["classify_tp2"], case["classify_tp1"], atol=1e-5)
