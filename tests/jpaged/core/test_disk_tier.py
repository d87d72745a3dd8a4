"""DiskTier on real files: bit-exact round trips, LRU by bytes, warm restart, every corruption."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time

import ml_dtypes
import numpy as np
import pytest

from jpaged.core.disk_tier import DiskTier, model_fingerprint

SHAPE = (2, 2, 4, 2, 8)  # (num_layers, K/V, block_size, num_kv_heads, head_dim)
FP = model_fingerprint(source="tiny", spec_repr="ModelSpec(...)", kv_dtype="bfloat16",
                       block_size=4, hash_algo="sha256", weights_digest="abc", kv_scales=())


def h(i: int) -> bytes:
    """A sha256 block hash, as the prefix cache makes them."""
    return hashlib.sha256(b"block%d" % i).digest()


def block(seed: int, dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """Random bit patterns of `dtype` (NaNs and infs included: the tier must not care)."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, np.prod(SHAPE) * dt.itemsize, np.uint8)
    return raw.view(dt).reshape(SHAPE)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def tier(tmp_path, blocks: int = 8, dtype=ml_dtypes.bfloat16, fp: str = FP, shape=SHAPE):
    probe = DiskTier(tmp_path / "probe", 1 << 30, fp, shape, np.dtype(dtype))
    size = probe._file_size(32)
    return DiskTier(tmp_path / "kv", blocks * size, fp, shape, np.dtype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_put_get_is_bit_exact(tmp_path, dtype):
    t = tier(tmp_path, dtype=dtype)
    data = [block(i, dtype) for i in range(3)]
    for i, d in enumerate(data):
        assert t.put(h(i), d)
    for i, d in enumerate(data):
        got = t.get(h(i))
        assert got is not None and same_bits(got, d)
        got[0, 0, 0, 0, 0] = got[1, 1, 1, 1, 1]  # a fresh writable array, not a view of a file
    names = sorted(os.listdir(t.directory))
    assert names == sorted(h(i).hex() + ".kvb" for i in range(3))
    # The payload starts 64-byte aligned and the file is exactly header + payload.
    raw = (t.directory / names[0]).read_bytes()
    assert (len(raw) - data[0].nbytes) % 64 == 0


def test_lru_eviction_by_capacity(tmp_path):
    t = tier(tmp_path, blocks=3)
    for i in range(3):
        assert t.put(h(i), block(i))
    assert t.usage == pytest.approx(1.0)
    assert t.get(h(0)) is not None  # 0 becomes most recent; 1 is now the LRU
    assert t.put(h(3), block(3))
    assert h(1) not in t and all(h(i) in t for i in (0, 2, 3))
    assert not (t.directory / (h(1).hex() + ".kvb")).exists()
    assert len(os.listdir(t.directory)) == 3 == len(t)
    assert t.stats["evictions"] == 1
    assert t.put(h(0), block(0))  # already there: refreshes, writes nothing
    assert t.stats["bytes_written"] == 4 * t._file_size(32)
    small = DiskTier(tmp_path / "small", t._file_size(32) - 1, FP, SHAPE, t.dtype)
    assert small.put(h(0), block(0)) is False
    assert os.listdir(small.directory) == [] and len(small) == 0


def test_warm_restart_sees_blocks_in_lru_order(tmp_path):
    t = tier(tmp_path)
    for i in range(4):
        t.put(h(i), block(i))
    size = t._file_size(32)
    again = DiskTier(tmp_path / "kv", 10 * size, FP, SHAPE, t.dtype)
    assert len(again) == 4 and again.stats["bytes_used"] == 4 * size
    assert all(same_bits(again.get(h(i)), block(i)) for i in range(4))
    now = time.time()
    for age, i in enumerate((2, 0, 3, 1)):  # mtime order, oldest first: 1, 3, 0, 2
        os.utime(_path(t, i), (now - age, now - age))
    # A restart with less room keeps the most recently used blocks.
    smaller = DiskTier(tmp_path / "kv", 2 * size, FP, SHAPE, t.dtype)
    assert list(smaller._index) == [h(0), h(2)]
    assert smaller.stats["evictions"] == 2 and len(os.listdir(smaller.directory)) == 2


def _path(t: DiskTier, i: int):
    return t.directory / (h(i).hex() + ".kvb")


def _forge(path, **fields) -> None:
    """Rewrite header fields in place, keeping the layout (and the payload checksum) valid."""
    raw = bytearray(path.read_bytes())
    hlen = int.from_bytes(raw[10:12], "little")
    doc = json.loads(raw[12:12 + hlen])
    doc.update(fields)
    new = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert len(new) <= hlen
    raw[12:12 + hlen] = new + b" " * (hlen - len(new))
    path.write_bytes(bytes(raw))


def _flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _unreadable(path) -> None:
    path.unlink()
    path.mkdir()  # open() now fails with an OSError, even for root


CORRUPTIONS = {
    "payload_bit": lambda p: _flip(p, -5),
    "header_bit": lambda p: _flip(p, 20),
    "magic": lambda p: _flip(p, 0),
    "version": lambda p: _flip(p, 8),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-1]),
    "zero_length": lambda p: p.write_bytes(b""),
    "extended": lambda p: p.write_bytes(p.read_bytes() + b"\0"),
    "foreign_hash": lambda p: _forge(p, block_hash=h(99).hex()),
    "foreign_fingerprint": lambda p: _forge(p, fingerprint="f" * len(FP)),
    "wrong_dtype": lambda p: _forge(p, dtype="float16"),
    "wrong_shape": lambda p: _forge(p, shape=[2, 2, 2, 4, 8]),
    "unreadable": _unreadable,
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_file_is_skipped_deleted_and_counted(tmp_path, caplog, kind):
    t = tier(tmp_path)
    t.put(h(0), block(0))
    t.put(h(1), block(1))
    CORRUPTIONS[kind](_path(t, 0))
    with caplog.at_level(logging.WARNING, logger="jpaged.core.disk_tier"):
        assert t.get(h(0)) is None
    assert h(0).hex() in caplog.text
    assert h(0) not in t and len(t) == 1
    assert not _path(t, 0).is_file()
    assert t.stats["corrupt_skipped"] == 1 and t.stats["misses"] == 1
    assert t.stats["bytes_used"] == t._file_size(32)
    assert same_bits(t.get(h(1)), block(1))  # the neighbour is untouched
    if kind == "unreadable":
        shutil.rmtree(_path(t, 0))
    assert t.put(h(0), block(0)) and same_bits(t.get(h(0)), block(0))  # and it can be rewritten


def test_restart_scan_drops_bad_files_and_stale_partials(tmp_path, caplog):
    t = tier(tmp_path)
    for i in range(4):
        t.put(h(i), block(i))
    _path(t, 0).write_bytes(b"")
    CORRUPTIONS["truncated"](_path(t, 1))
    stale = t.directory / f"{h(7).hex()}.123.abc.tmp"
    fresh = t.directory / f"{h(8).hex()}.456.def.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    (t.directory / "README").write_text("not a block")
    with caplog.at_level(logging.WARNING, logger="jpaged.core.disk_tier"):
        again = DiskTier(tmp_path / "kv", 8 * t._file_size(32), FP, SHAPE, t.dtype)
    assert sorted(again._index) == sorted([h(2), h(3)])
    assert again.stats["corrupt_skipped"] == 2
    assert not stale.exists() and fresh.exists()  # a young *.tmp may belong to a live writer
    assert (t.directory / "README").exists() and "README" in caplog.text
    assert same_bits(again.get(h(3)), block(3))


def test_foreign_fingerprint_directory_is_never_read(tmp_path):
    a = tier(tmp_path)
    a.put(h(0), block(0))
    other_fp = model_fingerprint(source="tiny", spec_repr="ModelSpec(...)", kv_dtype="bfloat16",
                                 block_size=4, hash_algo="sha256", weights_digest="abc",
                                 kv_scales=(0.5,))
    b = tier(tmp_path, fp=other_fp)
    assert b.directory != a.directory and len(b) == 0
    assert h(0) not in b and b.get(h(0)) is None
    assert b.stats["corrupt_skipped"] == 0
    b.put(h(0), block(5))
    b.clear()
    assert same_bits(a.get(h(0)), block(0))  # b's clear left a's files alone


def test_two_processes_share_a_directory(tmp_path):
    old = tier(tmp_path)
    old.put(h(0), block(0))
    old.put(h(1), block(1))
    new = tier(tmp_path)  # the warm restart while the old engine is still exiting
    assert h(0) in new and h(1) in new
    old.discard(h(0))  # the old process evicts a file the new one indexed
    assert new.get(h(0)) is None
    assert new.stats["misses"] == 1 and new.stats["corrupt_skipped"] == 0 and h(0) not in new
    shutil.rmtree(new.directory)  # even the directory may vanish: the next put recreates it
    assert new.put(h(2), block(2)) and same_bits(new.get(h(2)), block(2))
    assert new.get(h(1)) is None and new.stats["corrupt_skipped"] == 0


def test_stats_usage_discard_clear(tmp_path):
    t = tier(tmp_path, blocks=4)
    size = t._file_size(32)
    assert t.stats == {"blocks": 0, "bytes_used": 0, "bytes_written": 0, "bytes_read": 0,
                       "hits": 0, "misses": 0, "evictions": 0, "corrupt_skipped": 0,
                       "write_errors": 0}
    t.put(h(0), block(0))
    t.put(h(1), block(1))
    t.get(h(0))
    t.get(h(5))
    s = t.stats
    assert (s["blocks"], s["bytes_used"], s["bytes_written"], s["bytes_read"]) == (
        2, 2 * size, 2 * size, size)
    assert (s["hits"], s["misses"]) == (1, 1)
    assert t.usage == pytest.approx(0.5)
    t.discard(h(0))
    t.discard(h(0))
    assert len(t) == 1 and t.usage == pytest.approx(0.25) and not _path(t, 0).exists()
    t.clear()
    assert len(t) == 0 and t.usage == 0.0 and os.listdir(t.directory) == []


def test_bad_arguments_raise_value_error(tmp_path):
    t = tier(tmp_path)
    with pytest.raises(ValueError, match="shape"):
        t.put(h(0), np.zeros((2, 2, 4, 2, 4), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        t.put(h(0), np.zeros(SHAPE, np.float16))
    with pytest.raises(ValueError, match="block_hash"):
        t.put("abc", block(0))  # type: ignore[arg-type]
    assert len(t) == 0 and os.listdir(t.directory) == []
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path, -1, FP, SHAPE, np.float32)
    with pytest.raises(ValueError, match="fingerprint"):
        DiskTier(tmp_path, 1, "../escape", SHAPE, np.float32)
    with pytest.raises(ValueError, match="block_shape"):
        DiskTier(tmp_path, 1, FP, (2, 0), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        DiskTier(tmp_path, 1, FP, SHAPE, np.dtype(">f4"))


def test_fingerprint_depends_on_every_field():
    base = dict(source="m", spec_repr="s", kv_dtype="fp8", block_size=16, hash_algo="sha256",
                weights_digest="w", kv_scales=(1.0, 0.5))
    fp = model_fingerprint(**base)
    assert fp == model_fingerprint(**base) and len(fp) == 64
    for key, value in [("source", "n"), ("spec_repr", "t"), ("kv_dtype", "bfloat16"),
                       ("block_size", 32), ("hash_algo", "xxhash"), ("weights_digest", "x"),
                       ("kv_scales", (1.0, 0.5000001))]:
        assert model_fingerprint(**{**base, key: value}) != fp, key


def test_two_tiers_share_one_directory(tmp_path, monkeypatch):
    """Two indexes over one directory (two processes' tiers): a block one writes is adopted
    by the other on lookup; deletions by one are misses for the other; a rescan brings in what
    the other wrote and evicts by the directory's LRU, keeping the byte limit."""
    import jpaged.core.disk_tier as dt

    monkeypatch.setattr(dt, "RESCAN_EVERY", 4)
    a, size = tier(tmp_path, blocks=8), None
    b = DiskTier(a.directory.parent, a.capacity_bytes, FP, SHAPE, np.dtype(ml_dtypes.bfloat16))
    size = a._file_size(32)
    assert a.put(h(0), block(0))
    assert h(0) not in b._index and h(0) in b  # adopted by the lookup (one stat)
    got = b.get(h(0))
    assert got is not None and same_bits(got, block(0))
    b.discard(h(0))  # b deletes it: a's read is an ordinary miss
    assert a.get(h(0)) is None and h(0) not in a
    # Both write many blocks: the directory stays within the limit plus what the other wrote
    # since the last rescan (RESCAN_EVERY writes of one block each).
    for i in range(1, 40):
        assert (a if i % 2 else b).put(h(i), block(i))
        files = [f for f in os.listdir(a.directory) if f.endswith(".kvb")]
        assert len(files) * size <= a.capacity_bytes + 4 * size
    # Every file still listed reads back bit-exact through either index.
    for name in os.listdir(a.directory):
        hh = bytes.fromhex(name[:-4])
        i = next(i for i in range(40) if h(i) == hh)
        for t in (a, b):
            assert hh in t and same_bits(t.get(hh), block(i))


def test_processes_writing_and_reading_one_directory_never_see_a_torn_block(tmp_path):
    """Two processes put and get concurrently on one small directory: every read is the exact
    block of its hash or a miss, and the directory keeps its byte limit (plus rescan slack)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import hashlib, sys, numpy as np, ml_dtypes
        import jpaged.core.disk_tier as dt
        from jpaged.core.disk_tier import DiskTier
        dt.RESCAN_EVERY = 8
        SHAPE = {SHAPE!r}
        def h(i): return hashlib.sha256(b"block%d" % i).digest()
        def block(i):
            raw = np.random.default_rng(i).integers(0, 256, int(np.prod(SHAPE)) * 2, np.uint8)
            return raw.view(ml_dtypes.bfloat16).reshape(SHAPE)
        probe = DiskTier(sys.argv[1] + "/probe" + sys.argv[2], 1 << 30, "fp", SHAPE,
                         np.dtype(ml_dtypes.bfloat16))
        size = probe._file_size(32)
        t = DiskTier(sys.argv[1] + "/kv", 12 * size, "fp", SHAPE, np.dtype(ml_dtypes.bfloat16))
        rng = np.random.default_rng(int(sys.argv[2]))
        hits = 0
        for _ in range(600):
            i = int(rng.integers(0, 40))
            if rng.random() < 0.5:
                t.put(h(i), block(i))
            elif h(i) in t:
                got = t.get(h(i))
                if got is not None:
                    assert np.array_equal(got.view(np.uint8), block(i).view(np.uint8)), i
                    hits += 1
        print(hits, size)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(seed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        assert p.returncode == 0, err
        outs.append(out.split())
    hits, size = sum(int(o[0]) for o in outs), int(outs[0][1])
    assert hits > 0  # the processes did read blocks back
    # 40 distinct blocks were written; the limit is 12 plus what the other process wrote since
    # one's last rescan (every 8 writes here; the two rates differ a little).
    files = [f for f in os.listdir(tmp_path / "kv" / "fp") if f.endswith(".kvb")]
    assert len(files) * size <= (12 + 2 * 8) * size


def test_a_file_written_under_another_hash_seed_is_refused_by_name(tmp_path, caplog):
    """A deployment's seed digest is in every header it writes; a file moved in from another
    seed (or none) is refused, saying so, and nothing else changes."""
    size = DiskTier(tmp_path / "probe", 1 << 30, FP, SHAPE, np.dtype(ml_dtypes.bfloat16),
                    seed_digest="aaaa")._file_size(32)
    for writer, reader, why in (("aaaa", "bbbb", "another prefix-cache hash seed"),
                                (None, "bbbb", "written without a prefix-cache hash seed"),
                                ("aaaa", None, "written under a prefix-cache hash seed")):
        d = tmp_path / f"{writer}-{reader}"
        w = DiskTier(d, 8 * size, FP, SHAPE, np.dtype(ml_dtypes.bfloat16), seed_digest=writer)
        assert w.put(h(0), block(0)) and same_bits(w.get(h(0)), block(0))
        r = DiskTier(d, 8 * size, FP, SHAPE, np.dtype(ml_dtypes.bfloat16), seed_digest=reader)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jpaged.core.disk_tier"):
            assert r.get(h(0)) is None
        assert why in caplog.text, caplog.text
        assert r.stats["corrupt_skipped"] >= 1
    a = model_fingerprint(source="tiny", spec_repr="s", kv_dtype="bfloat16", block_size=4,
                          hash_algo="sha256", weights_digest="abc", kv_scales=())
    assert a != model_fingerprint(source="tiny", spec_repr="s", kv_dtype="bfloat16",
                                  block_size=4, hash_algo="sha256", weights_digest="abc",
                                  kv_scales=(), seed_digest="aaaa")
