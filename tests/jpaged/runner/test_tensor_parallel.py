"""Tensor parallelism: parameter specs here (the head layout rules: tests/models/test_sharding.py);
engine facts from 4 forced CPU devices in a subprocess (tp_worker.py), so the rest of the suite
keeps its single device."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import xla_flags
from tiny_models import tiny_spec

from jpaged.runner.kv_cache import CPU_DEFAULT_KV_BYTES
from jpaged.runner.parallel import TensorParallel
from models.sharding import plan_layout

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("tp_worker.py")


# ------------------------------------------------------------------ no devices
def test_too_many_devices_is_refused():
    import jax

    n = jax.device_count()
    with pytest.raises(ValueError, match=rf"needs {n + 1} devices but only {n} "):
        TensorParallel(tiny_spec(num_heads=8, num_kv_heads=8), n + 1)


def test_megatron_param_specs():
    from flax import nnx
    from helpers import tiny
    from jax.sharding import PartitionSpec as P

    tp = TensorParallel.__new__(TensorParallel)  # specs only: no mesh needed
    tp.layout, tp.split_vocab = plan_layout(tiny().spec, 2), True
    params = nnx.state(tiny().model)
    import jax

    specs = {jax.tree_util.keystr(path): tp.param_spec(path, x.ndim)
             for path, x in jax.tree_util.tree_leaves_with_path(params)}

    def spec_of(name: str) -> P:
        return next(v for k, v in specs.items() if f"['{name}']['kernel']" in k)

    assert spec_of("q_proj") == spec_of("k_proj") == spec_of("gate_proj") == P(None, "tp")
    assert spec_of("o_proj") == spec_of("down_proj") == P("tp", None)
    assert spec_of("lm_head") == P(None, "tp")  # [hidden, vocab]
    assert next(v for k, v in specs.items() if "embed_tokens" in k) == P("tp", None)
    assert all(v == P() for k, v in specs.items() if "norm" in k)
    tp.layout = plan_layout(tiny().spec, 4)  # KV heads replicated: k/v projections too
    assert tp.param_spec(*next((p, x.ndim) for p, x in jax.tree_util.tree_leaves_with_path(
        params) if "k_proj" in jax.tree_util.keystr(p))) == P()


# ------------------------------------------------------------------ 4 forced CPU devices
@pytest.fixture(scope="module")
def facts() -> dict:
    return worker_facts("engine")


def worker_facts(group: str) -> dict:
    """The facts tp_worker.py's `group` of cases prints, run on 4 forced CPU devices."""
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(WORKER), group], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tiny_greedy_equal_across_tp(facts):
    assert facts["num_devices"] == 4
    base = facts["tiny_tp1"]["tokens"]
    assert all(len(t) == 8 for t in base)
    for tp in (2, 4):
        assert facts[f"tiny_tp{tp}"]["tokens"] == base, tp
        assert facts[f"tiny_tp{tp}"]["tokens_again"] == base, tp
        # Seeded sampling draws the same tokens whatever the split of the logits.
        assert facts[f"tiny_tp{tp}"]["sampled"] == facts["tiny_tp1"]["sampled"], tp
        assert facts[f"tiny_tp{tp}"]["shaped"] == facts["tiny_tp1"]["shaped"], tp
        # The same top-5 candidates from the split logits; their logprobs to float rounding
        # (the log-sum-exp adds the shards' partial sums in another order).
        for got, want in zip(facts[f"tiny_tp{tp}"]["top5"], facts["tiny_tp1"]["top5"],
                             strict=True):
            assert [[k for k, _ in s] for s in got] == [[k for k, _ in s] for s in want], tp
            np.testing.assert_allclose([[lp for _, lp in s] for s in got],
                                       [[lp for _, lp in s] for s in want], atol=1e-5)
        # Prompt logprobs (each prompt token and its top 5), also from the split logits.
        got, want = facts[f"tiny_tp{tp}"]["prompt5"], facts["tiny_tp1"]["prompt5"]
        assert [len(p) for p in want] == [10, 2, 24]  # every prompt token but the first
        for g, w in zip(got, want, strict=True):
            assert [[k for k, _ in pos] for pos in g] == [[k for k, _ in pos] for pos in w], tp
            np.testing.assert_allclose([lp for pos in g for _, lp in pos],
                                       [lp for pos in w for _, lp in pos], atol=1e-5)


def test_candidates_from_vocab_split_logits_draw_the_whole_rows_tokens(facts):
    """Each device's best runs, the best of them overall: at tp 2 and 4 the candidate path
    draws the tokens the whole-row path and one device draw, row by row and seed by seed."""
    base = facts["candidates_tp1"]["whole_row"]
    assert len({tuple(d) for d in base}) > 1  # the seeds draw differently
    for tp in (1, 2, 4):
        assert facts[f"candidates_tp{tp}"]["candidates"] == base, tp
        assert facts[f"candidates_tp{tp}"]["whole_row"] == base, tp
        # Settled by the candidates: the peaked rows; not the flat one, nor the greedy one.
        settled = facts[f"candidates_tp{tp}"]["settled"]
        assert settled[4] is False and settled[5] is False and sum(settled) >= 3, (tp, settled)


def test_each_device_holds_its_share_of_the_pool(facts):
    one = facts["tiny_tp1"]["kv"]
    assert one["global_shape"][2] == 2 and one["tensor_parallel_size"] == 1
    for tp, stored in ((2, 2), (4, 4)):  # tp 4 stores each of the 2 KV heads twice
        kv = facts[f"tiny_tp{tp}"]["kv"]
        assert kv["tensor_parallel_size"] == tp
        assert kv["global_shape"][2] == stored
        assert kv["shard_devices"] == list(range(tp))
        assert all(s[:2] == kv["global_shape"][:2] and s[2] == 1 for s in kv["shard_shapes"])
        assert kv["k_bytes_shard"] * tp == kv["k_bytes_global"]
        # Per device: K and V of one head, half of tp=1's two heads (scales are replicated).
        pages = one["k_bytes_global"] * 2
        scales = one["kv_pool_bytes_per_device"] - pages
        assert kv["kv_pool_bytes_per_device"] == pages // 2 + scales


def test_collectives(facts):
    for tp in (2, 4):
        found = facts[f"tiny_tp{tp}"]["collectives"]
        # [T=16, hidden=64] all-reduces: after o_proj and down_proj in the layer body (XLA:CPU
        # scans the layers: the body is in the program once and runs per layer), and the psum
        # of the vocab-split embedding lookup. The sampler reduces the vocab-split logits on
        # each device and combines per-row partials ([B=4], or [B, tp] argmax candidates): no
        # collective carries the logits [4, 300], the KV pool or a weight.
        assert sorted(found) == ["all-gather", "all-reduce"], found
        shapes = [t.split("{")[0] for kind in found.values() for t in kind]
        assert shapes.count("f32[16,64]") == 3, found
        rest = [t for t in shapes if t != "f32[16,64]"]
        assert rest and all(math.prod(map(int, t[t.index("[") + 1:-1].split(","))) <= 4 * tp
                            for t in rest), found


@pytest.mark.parametrize("case", ["collectives_prompt_logprobs", "collectives_top"])
def test_top_candidates_gather_no_logits(facts, case):
    for tp in (2, 4):
        found = facts[f"tiny_tp{tp}"][case]
        # The step's own collectives plus row-sized combines (the P=8 prompt rows' logprob and
        # rank, the sampler's B=4 rows), and each device's top 20 candidates gathered
        # (`TensorParallel.top_k`, at most [8, 20 * tp]): no [8, 300] or [4, 300] logits.
        shapes = [t.split("{")[0] for kind in found.values() for t in kind]
        assert shapes.count("f32[16,64]") == 3, found
        rest = [math.prod(map(int, t[t.index("[") + 1:-1].split(","))) for t in shapes
                if t != "f32[16,64]"]
        assert rest and max(rest) <= 8 * 20 * tp and not {8 * 300, 4 * 300} & set(rest), found


def test_no_recompiles_after_warmup(facts):
    case = facts["tiny_tp4"]
    assert case["warmup_compiled"] == case["bucket_shapes"]  # one executable per step shape
    assert case["compiled"] == case["warmup_compiled"]
    assert not [w for w in facts["warnings"] if "donat" in w.lower()], facts["warnings"]


def test_embedded_tp3_equals_tp1(facts):
    one, three = facts["embedded_tp1"], facts["embedded_tp3"]
    assert len(one["tokens"]) == 6 and three["tokens"] == one["tokens"], (one, three)
    assert three["kv"]["global_shape"][2] == 3
    assert all(s[2] == 1 for s in three["kv"]["shard_shapes"])
    assert three["kv"]["k_bytes_shard"] * 3 == one["kv"]["k_bytes_global"]


def test_embedded_bad_tp_errors(facts):
    err2 = facts["embedded_tp2_error"]
    assert err2 and "tensor_parallel_size=2" in err2 and "9 query heads" in err2
    assert "values that work: 1, 3" in err2
    err8 = facts["embedded_tp8_error"]
    assert err8 and "needs 8 devices but only 4 cpu device(s)" in err8


def test_cpu_devices_share_the_default_kv_space(facts):
    """Forced CPU devices share one machine's RAM: at tp 2 each device takes half the 2 GiB
    default, so the pool has as many blocks as at tp 1 (it had twice as many before)."""
    one, two = facts["default_pool_tp1"], facts["default_pool_tp2"]
    assert one["num_gpu_blocks"] == two["num_gpu_blocks"]
    assert two["bytes_per_device"] * 2 <= one["bytes_per_device"] * 1.01
    assert one["bytes_per_device"] <= CPU_DEFAULT_KV_BYTES + 1024  # + the fp8 scales


def test_sharded_safetensors_load_straight_into_each_devices_share(facts):
    """tp 3 from a 2-file safetensors checkpoint: every split parameter is a third on each
    device, nothing whole was left on device 0, and the tokens equal tp 1's."""
    case = facts["sharded_load"]
    assert len(case["index_files"]) == 2
    split = [leaf for leaf in case["leaves"] if leaf["split"]]
    assert {leaf["name"].split("'")[-4] for leaf in split} >= {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for leaf in case["leaves"]:
        assert leaf["devices"] == [0, 1, 2], leaf
        share = leaf["bytes"] // 3 if leaf["split"] else leaf["bytes"]
        assert leaf["shard_bytes"] == [share] * 3, leaf
    total = sum(leaf["bytes"] for leaf in case["leaves"])
    mine = sum(leaf["shard_bytes"][0] for leaf in case["leaves"])
    assert mine < total / 2  # the replicated norms are small
    # Device 0 grew by its parameter share and its pool share, plus a few small buffers:
    # no whole copy of the model (which would add `total`).
    assert case["device0_grown"] < mine + case["kv_bytes_per_device"] + total / 10, case
    assert case["runner_uses_loaded_arrays"]
    assert case["tokens_tp3"] == case["tokens_tp1"] and len(case["tokens_tp1"][0]) == 8
