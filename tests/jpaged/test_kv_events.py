"""KV cache events from a real engine: replayed from the events alone, every tier's cached
hashes equal the pool's own, in-process and over a real ZMQ socket on 127.0.0.1 (msgpack
batches, gap-free sequence numbers, replay); stored blocks carry their tokens and chain; a
restart states the disk tier's blocks; bad configs are refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from helpers import make_llm, tiny

from jpaged import SamplingParams
from jpaged.config import EngineArgs
from jpaged.core.block_hash import hash_request_blocks
from jpaged.engine import LLMEngine
from jpaged.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheIndex,
    KVEventBatch,
    KVEventsConfig,
    decode_batch,
    encode_batch,
)

BS = 8
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny(): 2 layers, K+V, 2 kv heads x 16, float32
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TIMEOUT_MS = 10_000


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 2**30


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


SYSTEM = _prompt(0, 40)  # 5 full blocks shared by every "tenant" question
QUESTIONS = [SYSTEM + _prompt(100 + i, 20) for i in range(4)]
FILLERS = [_prompt(10 + i, 70) for i in range(6)]  # push the shared blocks down the tiers


def _llm(tmp_path, events: dict, **kw):
    args = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=BS,
                num_gpu_blocks_override=24, kv_offloading_size=gib(8), swap_space=gib(64),
                kv_cache_dir=str(tmp_path), kv_events_config=events)
    args.update(kw)
    return make_llm(tiny(), **args)


def _gen(llm, prompts):
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)


def _check_stored_tokens(batches: list[KVEventBatch], known: dict[bytes, list[int]]) -> int:
    """Every stored block with tokens holds the tokens its hash stands for; returns how many."""
    n = 0
    for b in batches:
        for e in b.events:
            if isinstance(e, BlockStored) and e.token_ids:
                assert e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
                for k, h in enumerate(e.block_hashes):
                    if h in known:
                        assert e.token_ids[k * BS:(k + 1) * BS] == known[h]
                        n += 1
    return n


def _known_blocks(prompts: list[list[int]]) -> dict[bytes, list[int]]:
    out = {}
    for p in prompts:
        for i, h in enumerate(hash_request_blocks(p, BS)):
            out[h] = p[i * BS:(i + 1) * BS]
    return out


def test_in_process_events_replay_every_tier_exactly(tmp_path):
    llm = _llm(tmp_path, {"enable_kv_cache_events": True})
    engine = llm.llm_engine
    index, batches, checked = CacheIndex(), [], []

    def on_batch(batch: KVEventBatch) -> None:
        batches.append(batch)
        index.apply_batch(batch)
        # At the end of every step, the events so far replay the pool's own state.
        checked.append(index.blocks == engine.cached_block_hashes())

    engine.subscribe_kv_events(on_batch)
    _gen(llm, QUESTIONS[:2])
    _gen(llm, FILLERS)  # evicts the shared blocks: device -> host -> disk
    _gen(llm, QUESTIONS[2:])  # hits them again, from a lower tier
    assert checked and all(checked)
    state = engine.cached_block_hashes()
    assert state["GPU"] and state["CPU"] and state["DISK"], state  # every tier was exercised
    kinds = {type(e).__name__ + ":" + getattr(e, "medium", "") for b in batches for e in b.events}
    assert {"BlockStored:GPU", "BlockRemoved:GPU", "BlockStored:CPU", "BlockRemoved:CPU",
            "BlockStored:DISK"} <= kinds, kinds
    known = _known_blocks(QUESTIONS + FILLERS)
    assert _check_stored_tokens(batches, known) > 0
    # The shared system prompt's chain: its first block has no parent, the next ones chain.
    first = hash_request_blocks(SYSTEM, BS)
    stored = [e for b in batches for e in b.events
              if isinstance(e, BlockStored) and e.medium == "GPU" and first[0] in e.block_hashes]
    assert stored and stored[0].parent_block_hash is None
    assert stored[0].block_hashes[:5] == first[:5]
    # A reset clears the device and host tiers; the disk keeps its files and is stated again.
    assert llm.reset_prefix_cache()
    last = batches[-1].events
    assert isinstance(last[0], AllBlocksCleared) or any(
        isinstance(e, AllBlocksCleared) for e in last)
    assert index.blocks == engine.cached_block_hashes()
    assert not index.blocks["GPU"] and not index.blocks["CPU"] and index.blocks["DISK"]
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Ask the replay socket for every batch from `start` on."""
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        dealer.connect(endpoint)
        dealer.send(start.to_bytes(8, "big"))
        got = []
        while True:
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_OF_REPLAY:
                return got
            got.append((seq, decode_batch(payload)))
    finally:
        dealer.close(0)


def test_zmq_subscriber_rebuilds_the_cache_from_live_batches_and_a_replay(tmp_path):
    """A router's protocol: subscribe, read live batches (consecutive sequence numbers), ask
    the replay socket for what it missed before joining, and index the lot."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
           "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}
    llm = _llm(tmp_path, cfg)
    engine = llm.llm_engine
    pub = engine.kv_events.publisher
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint
    local: list[KVEventBatch] = []
    engine.subscribe_kv_events(local.append)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub.endpoint)
        _gen(llm, QUESTIONS[:2])
        _gen(llm, FILLERS[:3])
        live = []
        while sub.poll(2000):  # until the publisher has been quiet for 2 s
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        assert live, "no live batch arrived"
        seqs = [s for s, _ in live]
        # A slow joiner may miss the first batches, never one in the middle or at the end.
        assert seqs == list(range(seqs[0], len(local)))
        missed = _replay(ctx, pub.replay_endpoint, 0)[:seqs[0]]
        assert [s for s, _ in missed] == list(range(seqs[0]))
    finally:
        sub.close(0)
        ctx.term()
        engine.shutdown()
    batches = [b for _, b in missed + live]
    assert [b.events for b in batches] == [b.events for b in local]  # as in-process ones
    index = CacheIndex()
    for batch in batches:
        index.apply_batch(batch)
    assert index.blocks == engine.cached_block_hashes()


def test_zmq_replay_from_a_sequence_number(tmp_path):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
           "buffer_steps": 4}
    llm = _llm(tmp_path, cfg)
    engine = llm.llm_engine
    local: list[KVEventBatch] = []
    engine.subscribe_kv_events(local.append)
    for p in QUESTIONS + FILLERS[:3]:  # nobody listens on the socket yet
        _gen(llm, [p])
    ctx = zmq.Context()
    try:
        got = _replay(ctx, engine.kv_events.publisher.replay_endpoint, 2)
    finally:
        ctx.term()
        engine.shutdown()
    # Only the last buffer_steps batches are kept; from 2 on, those.
    first = max(2, len(local) - 4)
    assert len(local) > 6
    assert [s for s, _ in got] == list(range(first, len(local)))
    assert [b.events for _, b in got] == [b.events for b in local[first:]]


def test_restart_states_the_disk_tier_and_msgpack_round_trips(tmp_path):
    llm = _llm(tmp_path, {"enable_kv_cache_events": True})
    _gen(llm, QUESTIONS[:2] + FILLERS)
    on_disk = llm.llm_engine.cached_block_hashes()["DISK"]
    assert on_disk
    llm.llm_engine.shutdown()
    del llm
    again = _llm(tmp_path, {"enable_kv_cache_events": True})
    batches: list[KVEventBatch] = []
    again.llm_engine.subscribe_kv_events(batches.append)
    _gen(again, [QUESTIONS[0]])  # the disk tier opens on the first step
    disk = [e for b in batches for e in b.events if isinstance(e, BlockStored)
            and e.medium == "DISK"]
    stated = {h for e in disk for h in e.block_hashes}
    assert on_disk <= stated
    # Blocks found on disk carry no tokens (the files hold none); the rest do.
    assert any(not e.token_ids and e.parent_block_hash is None for e in disk)
    for b in batches:  # the wire format keeps every field
        assert decode_batch(encode_batch(b)) == b
    removed = BlockRemoved([b"\x01" * 32], "CPU")
    batch = KVEventBatch(1.5, [removed, AllBlocksCleared()], 3)
    assert decode_batch(encode_batch(batch)) == batch


@pytest.mark.parametrize("cfg,msg", [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "kv_events_config.publisher"),
    ('{"enable_kv_cache_events": true, "endpoint": 5}', "kv_events_config.endpoint"),
    ('{"enable_kv_cache_events": "yes"}', "kv_events_config.enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "bufer_steps": 3}', "unknown field(s) ['bufer_steps']"),
    ('{"enable_kv_cache_events": true,', "not valid JSON"),
    ('[1, 2]', "must be a JSON object"),
    ({"enable_kv_cache_events": True, "hwm": 0}, "kv_events_config.hwm"),
])
def test_bad_kv_events_config_is_named(cfg, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):
        EngineArgs(kv_events_config=cfg).create_engine_config(2048)


def test_events_need_prefix_caching_and_subscribing_needs_events():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLMEngine(EngineArgs(enable_prefix_caching=False, num_gpu_blocks_override=8,
                             max_model_len=64,
                             kv_events_config={"enable_kv_cache_events": True}), loaded=tiny())
    engine = LLMEngine(EngineArgs(num_gpu_blocks_override=8, max_model_len=64), loaded=tiny())
    with pytest.raises(ValueError, match="kv_events_config"):
        engine.subscribe_kv_events(print)
    assert KVEventsConfig.parse(None) is None


def test_a_failing_subscriber_does_not_stop_the_engine(tmp_path, caplog):
    llm = _llm(tmp_path, {"enable_kv_cache_events": True})
    good: list[KVEventBatch] = []

    def bad(batch: KVEventBatch) -> None:
        raise RuntimeError("subscriber bug")

    llm.llm_engine.subscribe_kv_events(bad)
    unsubscribe = llm.llm_engine.subscribe_kv_events(good.append)
    _gen(llm, QUESTIONS[:1])
    assert good and "subscriber bug" in caplog.text
    unsubscribe()
    n = len(good)
    _gen(llm, QUESTIONS[1:2])
    assert len(good) == n


def test_a_dropped_batch_leaves_a_gap_in_the_sequence():
    """Each batch takes its sequence number when published: one dropped from a full send queue
    is a gap a subscriber sees, never a number given to the next batch."""
    from jpaged.kv_events import ZmqEventPublisher

    pub = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*", max_queue_size=1, buffer_steps=100))
    batches = [KVEventBatch(float(i), [BlockRemoved([bytes([i]) * 32], "GPU")])
               for i in range(50)]
    for b in batches:  # faster than the sender thread drains a queue of one
        pub.publish(b)
    ctx = zmq.Context()
    try:
        got = _replay(ctx, pub.replay_endpoint, 0)
    finally:
        ctx.term()
        pub.close()
    seqs = [s for s, _ in got]
    assert seqs == sorted(set(seqs)) and set(seqs) <= set(range(50))
    assert len(seqs) + pub.num_dropped == 50
    for s, b in got:  # each number belongs to the batch published with it
        assert b.events == batches[s].events
