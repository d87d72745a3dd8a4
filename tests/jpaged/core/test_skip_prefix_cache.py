"""One rule for requests that take no prefix hit (``Request.skip_reading_prefix_cache``: prompt
logprobs need every position's logits), applied by the KV manager with one group or several, on
every tier: the device prefix cache, the host/disk tiers, and the in-flight hold-back (nothing
to wait for)."""

from __future__ import annotations

import numpy as np
import pytest
from core_sim import make_request

from jpaged.core.kv_cache_groups import kv_cache_layout
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.offload import HostTier, KVTiers
from jpaged.kv_events import group_key

BS = 4


def manager(hybrid: bool, tiers: KVTiers) -> KVCacheManager:
    # hybrid: a full-attention group and a sliding window of 4 tokens
    return KVCacheManager(BS, 40, 64, True, "sha256", tiers,
                          layout=kv_cache_layout([None, 4]) if hybrid else None)


def request(kvm: KVCacheManager, rid: str, prompt: list[int], **sp):
    r = make_request(rid, prompt, **sp)
    r.set_block_hasher(kvm.block_hasher)
    return r


def num_hit_tokens(kvm: KVCacheManager, req) -> int:
    return kvm.get_computed_blocks(req)[1]


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_prompt_logprobs_take_no_hit_from_device_host_or_in_flight_blocks(hybrid):
    tiers = KVTiers(HostTier(32, (BS,), np.int64))
    kvm = manager(hybrid, tiers)
    prompt = list(range(100, 117))  # 4 full blocks and one token
    done = request(kvm, "done", prompt)
    assert kvm.allocate_slots(done, len(prompt)) is not None
    done.num_computed_tokens = len(prompt)
    kvm.commit(done)
    kvm.free(done)  # its 4 full blocks stay cached on the device

    plain = request(kvm, "plain", prompt)
    scoring = request(kvm, "scoring", prompt, prompt_logprobs=1)
    assert scoring.skip_reading_prefix_cache and not plain.skip_reading_prefix_cache
    assert num_hit_tokens(kvm, plain) == 16
    assert num_hit_tokens(kvm, scoring) == 0

    # The same blocks on the host tier only (under each group's key): a tier hit for the
    # plain request, none for the scoring one.
    for i, h in enumerate(plain.block_hashes):
        for g in range(kvm.num_groups):
            tiers.on_device_evict(i + 1, group_key(h, g))
    hit = kvm.get_offloaded_blocks(plain, 0)
    assert hit is not None and hit.extra_blocks > 0
    assert kvm.get_offloaded_blocks(scoring, 0) is None

    # A running request computing this prefix now holds back the plain one (it will share
    # the blocks next step), not the scoring one (it takes no hit, so it waits for nothing).
    kvm.reset_prefix_cache()
    computing = request(kvm, "computing", prompt + [1, 2])
    assert kvm.allocate_slots(computing, len(prompt) + 2) is not None
    assert kvm.is_prefix_in_flight(plain, 0)
    assert not kvm.is_prefix_in_flight(scoring, 0)
