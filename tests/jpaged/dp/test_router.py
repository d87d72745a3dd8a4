"""The router on real engines' KV cache events (no Ray): prefix matches found under the
engine's own hashes, cache_salt kept apart, load weighed against the cached prefix, the other
two policies, and a replica's entries dropped when it goes down."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny

from jpaged import SamplingParams
from jpaged.config import EngineArgs
from jpaged.dp.router import PrefixIndex, Route, Router
from jpaged.engine import LLMEngine
from jpaged.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


SYS_A, SYS_B = _prompt(1, 48), _prompt(2, 48)  # two tenants' system prompts: 6 blocks each


@pytest.fixture(scope="module")
def replicas():
    """Two engines whose events feed one router's index, as replicas 0 and 1."""
    router = Router(2, "kv_aware", BS)
    engines, stored = [], {0: [], 1: []}
    for r in range(2):
        e = LLMEngine(EngineArgs(max_model_len=128, block_size=BS, num_gpu_blocks_override=64,
                                 kv_events_config={"enable_kv_cache_events": True},
                                 data_parallel_rank=r), loaded=tiny())

        def on_batch(batch: KVEventBatch, r: int = r) -> None:
            assert batch.data_parallel_rank == r
            for ev in batch.events:
                router.index.apply(r, ev)
                if isinstance(ev, BlockStored):
                    stored[r].extend(ev.block_hashes)

        e.subscribe_kv_events(on_batch)
        engines.append(e)
    return router, engines, stored


def _run(engine: LLMEngine, prompt: list[int], salt: str | None = None) -> None:
    p = {"prompt_token_ids": prompt}
    if salt is not None:
        p["cache_salt"] = salt
    engine.add_request(f"r{np.random.default_rng().integers(1 << 30)}", p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()


def test_kv_aware_finds_the_replica_holding_the_prefix(replicas):
    router, engines, stored = replicas
    _run(engines[0], SYS_A + _prompt(10, 5))
    _run(engines[1], SYS_B + _prompt(11, 5))
    # The router hashes a prompt exactly as the engine did (the blocks it stored).
    assert router.prompt_hashes(SYS_A)[:6] == stored[0][:6]
    a = router.choose(SYS_A + _prompt(12, 9))
    b = router.choose(SYS_B + _prompt(13, 9))
    assert (a.replica, a.cached_tokens) == (0, 48) and (b.replica, b.cached_tokens) == (1, 48)
    assert router.index.match(router.prompt_hashes(SYS_A)) == {0: 6}
    # A salted tenant's blocks match only that tenant's salt.
    _run(engines[1], SYS_A + _prompt(14, 3), salt="tenant-x")
    assert router.choose(SYS_A + _prompt(15, 9), "tenant-x").replica == 1
    assert router.choose(SYS_A + _prompt(15, 9), "tenant-x").cached_tokens == 48
    assert router.choose(SYS_A + _prompt(15, 9), "tenant-y").cached_tokens == 0
    # A prompt that is all cached still computes its last token: the match stops before it.
    assert router.choose(SYS_A).cached_tokens == 40


def test_load_is_weighed_against_the_cached_prefix(replicas):
    router, _, _ = replicas
    hot = SYS_A + _prompt(20, 9)
    # Replica 0 holds the 48-token prefix: it wins until its load outweighs recomputing it.
    routes = []
    for i in range(12):
        route = router.choose(hot)
        router.started(f"hot-{i}", route)
        routes.append(route.replica)
    assert routes[0] == 0 and 1 in routes and routes.count(0) >= routes.count(1)
    for i, r in enumerate(routes):
        router.finished(f"hot-{i}", r)
    assert [load.tokens(router.decode_cost) for load in router.loads] == [0, 0]


def test_round_robin_least_load_and_a_replica_going_down():
    idx_router = Router(3, "round_robin", BS)
    assert [idx_router.choose([1, 2, 3]).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    idx_router.set_healthy(1, False)
    assert {idx_router.choose([1]).replica for _ in range(6)} == {0, 2}
    least = Router(3, "least_load", BS)
    least.started("x", Route(0, 0, 100))
    least.started("y", Route(2, 0, 10))
    assert least.choose(None).replica == 1
    least.started("z", Route(1, 0, 50))
    assert least.choose(None).replica == 2
    least.first_output("x", 0)  # replica 0's prompt is computed: only its decode loads it
    assert least.choose(None).replica == 0
    for r in range(3):
        least.set_healthy(r, False)
    with pytest.raises(RuntimeError, match="no replica is healthy"):
        least.choose(None)


def test_index_tracks_tiers_and_drops_a_replica():
    idx = PrefixIndex()
    h = [bytes([i]) * 32 for i in range(4)]
    idx.apply(0, BlockStored(h[:3], None, [], BS, None, "GPU"))
    idx.apply(1, BlockStored(h[:2], None, [], BS, None, "CPU"))
    assert idx.match(h) == {0: 3, 1: 2}
    idx.apply(0, BlockStored([h[1]], h[0], [], BS, None, "DISK"))
    idx.apply(0, BlockRemoved([h[1]], "GPU"))
    assert idx.match(h) == {0: 3, 1: 2}  # still on replica 0's disk
    idx.apply(0, BlockRemoved([h[1]], "DISK"))
    assert idx.match(h) == {0: 1, 1: 2}
    idx.apply(1, AllBlocksCleared())
    assert idx.match(h) == {0: 1} and not idx.hashes_of(1)
    idx.drop_replica(0)
    assert idx.match(h) == {} and not idx.hashes_of(0)
    with pytest.raises(ValueError, match="routing_policy"):
        Router(2, "random", BS)


def test_a_burst_of_one_prefix_follows_the_first_request_before_its_events():
    """Requests routed but not yet cached count for their replica, so a burst of one tenant
    is not spread over replicas while the first copy of its prefix is being computed."""
    router = Router(2, "kv_aware", BS)
    busy = Route(0, 0, 0)
    router.started("other", busy)  # replica 0 is busier: a new prefix goes to replica 1
    router.loads[0].prefill_tokens += 20
    first = router.choose(SYS_B + _prompt(30, 5))
    assert first.replica == 1 and first.cached_tokens == 0
    router.started("b0", first)
    follow = router.choose(SYS_B + _prompt(31, 5))  # no event yet: the pending blocks count
    assert follow.replica == 1 and follow.cached_tokens == 48
    router.finished("b0", 1)  # ended: its blocks are in the events by now, or not cached at all
    assert router.index.match(first.hashes) == {}
