"""KV tiers through the engine on the tiny model: host-tier prefix hits, swap preemption equal to
recompute, device -> host -> disk -> device bit-exact, warm restart from disk, a corrupt block
file skipped; every block free after each workload."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.config import EngineArgs
from jpaged.core.block_hash import hash_request_blocks
from jpaged.engine import LLMEngine
from jpaged.runner.tier_transfer import TierTransfer

BS = 8
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny(): 2 layers, K+V, 2 kv heads x 16, float32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30


def _llm(blocks=24, **kw):
    args = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=BS,
                num_gpu_blocks_override=blocks)
    args.update(kw)
    return make_llm(tiny(), **args)


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


LONG = _prompt(0, 100)  # 12 full blocks + 4
FILLERS = [_prompt(10 + i, 60) for i in range(3)]
MORE_FILLERS = [_prompt(20 + i, 60) for i in range(3)]


def _gen(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]


def _drained(llm):
    m = llm.get_metrics()
    assert m["kv_cache_usage"] == 0.0
    llm.llm_engine.scheduler.kv_cache_manager.check_invariants()
    return m


def _device_blocks(llm, hashes):
    """Host copies of the device blocks now caching `hashes`."""
    eng = llm.llm_engine
    cached = eng.scheduler.kv_cache_manager.block_pool.cached_blocks
    return TierTransfer().gather(eng.runner.kv, [cached[h].block_id for h in hashes])


@pytest.fixture(scope="module")
def baseline():
    llm = _llm(blocks=200)
    return _gen(llm, [LONG]), _gen(llm, FILLERS)


def test_reasked_prompt_is_served_from_the_host_tier(baseline):
    llm = _llm(kv_offloading_size=gib(64))
    first = _gen(llm, [LONG])
    _gen(llm, FILLERS)  # evicts LONG's cached blocks: they move to the host tier
    m0 = _drained(llm)
    assert m0["host_tier_blocks"] > 0 and m0["offload_bytes_to_host"] > 0
    again = _gen(llm, [LONG])
    m = _drained(llm)
    assert first == again == baseline[0]
    assert m["offload_hits_blocks"] - m0["offload_hits_blocks"] >= 8
    assert m["offload_hits_tokens"] == BS * m["offload_hits_blocks"]
    assert m["offload_bytes_to_device"] == BLOCK_BYTES * m["offload_hits_blocks"]
    assert m["host_tier_usage"] > 0 and m["disk_tier_blocks"] == 0


def test_swap_equals_recompute():
    prompts = [_prompt(20 + i, 30 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = {}
    for mode in ("recompute", "swap"):
        llm = _llm(blocks=22, preemption_mode=mode, kv_offloading_size=gib(64))
        out[mode] = _gen(llm, prompts, params)
        m = _drained(llm)
        assert m["num_preemptions"] > 0
        if mode == "swap":
            assert m["num_swapped_out"] > 0 and m["num_swapped_in"] == m["num_swapped_out"]
    assert out["swap"] == out["recompute"]


def test_disk_tier_round_trip_warm_restart_and_corrupt_file(tmp_path, baseline):
    args = dict(kv_offloading_size=gib(16), swap_space=gib(200), kv_cache_dir=str(tmp_path))
    llm = _llm(**args)
    hashes = hash_request_blocks(LONG, BS)[:12]  # the blocks a lookup of LONG may hit
    first = _gen(llm, [LONG])
    on_device = _device_blocks(llm, hashes)
    for p in FILLERS + MORE_FILLERS:  # one by one: LONG's blocks go device -> host -> disk
        _gen(llm, [p])
    disk = llm.llm_engine.tiers.disk
    assert all(h in disk for h in hashes)
    again = _gen(llm, [LONG])  # (disk ->) host -> device
    m = _drained(llm)
    assert first == again == baseline[0]
    assert m["disk_hits_blocks"] > 0 and m["offload_hits_blocks"] == 12
    back = _device_blocks(llm, hashes)
    assert np.array_equal(back.view(np.uint8), on_device.view(np.uint8))
    assert m["disk_bytes_written"] > 0 and m["disk_bytes_read"] > 0 and m["disk_tier_usage"] > 0

    # Warm restart: a new engine over the same directory, with block 5's file corrupted.
    target = disk.directory / (hashes[5].hex() + ".kvb")
    raw = bytearray(target.read_bytes())
    raw[-3] ^= 0x55
    target.write_bytes(bytes(raw))
    fresh = _llm(**args)
    assert _gen(fresh, [LONG]) == baseline[0]
    m2 = _drained(fresh)
    assert m2["disk_hits_blocks"] == 5 and m2["offload_hits_blocks"] == 5  # blocks 0..4
    assert m2["disk_corrupt_skipped"] == 1


@pytest.mark.parametrize("kw,field", [
    (dict(preemption_mode="swap"), "kv_offloading_size"),
    (dict(swap_space=1.0), "kv_offloading_size"),
    (dict(kv_offloading_size=1e-9), "kv_offloading_size"),
    # More host RAM than the machine has (a MemoryError from numpy before).
    (dict(kv_offloading_size=2.0**20), "kv_offloading_size=.*host memory available"),
    # A disk tier whose folder cannot be made: refused at start, not at the first step.
    (dict(kv_offloading_size=gib(16), swap_space=gib(200), kv_cache_dir="/proc/no/such"),
     "kv_cache_dir='/proc/no/such'"),
])
def test_bad_tier_settings_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        LLMEngine(EngineArgs(max_model_len=64, num_gpu_blocks_override=16, **kw), loaded=tiny())


def test_a_kv_cache_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ValueError, match="kv_cache_dir="):
        LLMEngine(EngineArgs(max_model_len=64, num_gpu_blocks_override=16,
                             kv_offloading_size=gib(16), swap_space=gib(200),
                             kv_cache_dir=str(f)), loaded=tiny())


def test_other_disk_tiers_beyond_swap_space_are_reported(tmp_path, caplog):
    """swap_space caps each fingerprint's folder; the folders of other models or scales left
    in kv_cache_dir are never deleted, so when they outgrow the cap a warning says so."""
    old = tmp_path / "an-old-fingerprint"
    old.mkdir()
    (old / "x.kvb").write_bytes(b"\0" * (200 * BLOCK_BYTES + 1))
    llm = _llm(kv_offloading_size=gib(16), swap_space=gib(200), kv_cache_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="jpaged"):
        _gen(llm, [LONG])  # the disk tier opens after the first step
    assert any("other disk KV tiers" in r.getMessage() for r in caplog.records)
    assert (old / "x.kvb").exists()


def test_two_engines_share_one_disk_tier(tmp_path, baseline):
    """Two engines (as two replicas) over one kv_cache_dir: a prefix one of them spilled to
    disk is a disk hit for the other, which was running before the files existed."""
    args = dict(kv_offloading_size=gib(16), swap_space=gib(200), kv_cache_dir=str(tmp_path))
    writer, reader = _llm(**args), _llm(**args)
    _gen(reader, [FILLERS[0]])  # the reader's disk tier is open and indexed (empty) first
    assert _gen(writer, [LONG]) == baseline[0]
    for p in FILLERS + MORE_FILLERS:  # LONG's blocks: writer's device -> host -> disk
        _gen(writer, [p])
    hashes = hash_request_blocks(LONG, BS)[:12]
    assert all(h in writer.llm_engine.tiers.disk._index for h in hashes)
    assert not any(h in reader.llm_engine.tiers.disk._index for h in hashes)
    assert _gen(reader, [LONG]) == baseline[0]  # found on disk, written by the other
    m = _drained(reader)
    assert m["disk_hits_blocks"] == 12 and m["offload_hits_blocks"] == 12
