"""Prefix hash chain: prefix sharing, salt isolation, algorithms, cross-process determinism."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jpaged.core.block_hash import (
    BlockHasher,
    encode_key,
    get_hash_fn,
    hash_block_tokens,
    hash_request_blocks,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_same_prefix_same_hashes(algo):
    a = hash_request_blocks(list(range(40)), 16, algo)
    b = hash_request_blocks(list(range(32)) + [99] * 20, 16, algo)
    assert len(a) == 2 and len(b) == 3  # partial blocks are not hashed
    assert a == b[:2] and b[2] not in a
    # The chain: changing block 0 changes every later hash.
    c = hash_request_blocks([5] + list(range(1, 40)), 16, algo)
    assert c[0] != a[0] and c[1] != a[1]
    assert all(isinstance(h, bytes) for h in a + b + c)


def test_chain_formula_matches_incremental_hasher():
    toks = list(range(50))
    hs = hash_request_blocks(toks, 16, cache_salt="s", extra_keys=("lora-a",))
    h0 = hash_block_tokens(None, toks[:16], ("s", "lora-a"))
    h1 = hash_block_tokens(h0, toks[16:32], (None, "lora-a"))
    assert hs[:2] == [h0, h1]


def test_salt_isolates_and_extra_keys_isolate():
    toks = list(range(64))
    plain = hash_request_blocks(toks, 16)
    salted = hash_request_blocks(toks, 16, cache_salt="tenant-1")
    salted2 = hash_request_blocks(toks, 16, cache_salt="tenant-2")
    lora = hash_request_blocks(toks, 16, extra_keys=("adapter", 3))
    assert not set(plain) & set(salted) and not set(salted) & set(salted2)
    assert not set(plain) & set(lora)
    assert salted == hash_request_blocks(toks, 16, cache_salt="tenant-1")


def test_algorithms_give_the_same_hit_pattern():
    prompts = [list(range(48)) + [i] * 16 for i in range(3)] + [[7] * 64]
    for algo in ("sha256", "xxhash"):
        assert len(get_hash_fn(algo)(b"x")) in (16, 32)
    pat = []
    for algo in ("sha256", "xxhash"):
        seen, hits = set(), []
        for p in prompts:
            hs = hash_request_blocks(p, 16, algo)
            hits.append([h in seen for h in hs])
            seen.update(hs)
        pat.append(hits)
    assert pat[0] == pat[1]
    assert pat[0][1] == [True, True, True, False]


def test_incremental_extension_equals_batch():
    hasher = BlockHasher(4)
    extra = hasher.extra_bytes(None, ())
    out: list[bytes] = []
    toks: list[int] = []
    for t in range(23):
        toks.append(t)
        hasher.extend(out, toks, extra)
    assert out == hash_request_blocks(toks, 4)


def test_bad_inputs():
    with pytest.raises(ValueError):
        get_hash_fn("md5")
    with pytest.raises(TypeError):
        encode_key({1, 2})
    assert encode_key(("a", 1)) != encode_key(("a1",))
    assert encode_key(1) != encode_key(True) and encode_key(1.0) != encode_key(1)


def test_sha256_is_deterministic_across_processes():
    code = ("from jpaged.core.block_hash import hash_request_blocks as h;"
            "print(','.join(x.hex() for x in h(list(range(70)), 16, 'sha256', 'salt', ('k', 2))))")
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           cwd=REPO, check=True)
        outs.add(r.stdout.strip())
    here = ",".join(x.hex() for x in hash_request_blocks(list(range(70)), 16, "sha256", "salt",
                                                          ("k", 2)))
    assert outs == {here}


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_a_hash_seed_gives_a_deployment_its_own_chain(algo):
    """Two deployments with different seeds share no block hash; one seed agrees with itself
    (and the router's hashes with the engine's); no seed is the public chain."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, int(rng.integers(16, 200))).tolist() for _ in range(40)]
    prompts += [prompts[0][:64] + p for p in prompts[1:5]]  # shared prefixes too

    def chain(seed):
        return {h for p in prompts for h in hash_request_blocks(p, 16, algo, seed=seed)}
    a, b, none = chain("deployment-a"), chain("deployment-b"), chain(None)
    assert a and not a & b and not a & none and not b & none
    assert a == chain("deployment-a")
    assert none == {h for p in prompts for h in hash_request_blocks(p, 16, algo)}
    hasher = BlockHasher(16, algo, "deployment-a")
    got: list[bytes] = []
    hasher.extend(got, prompts[0], hasher.extra_bytes(None, ()))
    assert got == hash_request_blocks(prompts[0], 16, algo, seed="deployment-a")


def test_the_seed_reaches_the_scheduler_and_comes_from_the_environment(monkeypatch):
    from jpaged.config import HASH_SEED_ENV, EngineArgs
    from jpaged.core.scheduler import Scheduler
    from jpaged.request import Request
    from jpaged.sampling_params import SamplingParams

    monkeypatch.setenv(HASH_SEED_ENV, "from-env")
    cfg = EngineArgs(block_size=16).create_engine_config(4096)
    assert cfg.cache.prefix_caching_hash_seed == "from-env"
    flag = EngineArgs(block_size=16, prefix_caching_hash_seed="flag").create_engine_config(4096)
    assert flag.cache.prefix_caching_hash_seed == "flag"
    with pytest.raises(ValueError, match="prefix_caching_hash_seed must be a non-empty"):
        EngineArgs(prefix_caching_hash_seed=3).create_engine_config(4096)
    sched = Scheduler(cfg.scheduler, cfg.cache, 64)
    req = Request("r", list(range(40)), SamplingParams())
    sched.add_request(req)
    assert req.block_hashes == hash_request_blocks(list(range(40)), 16, seed="from-env")
    assert req.block_hashes != hash_request_blocks(list(range(40)), 16)
