"""The disk KV tier: one checksummed file per block in ``directory/<fingerprint>/``, LRU by bytes.

File layout (all integers little-endian)::

    magic  b"JPKVBLK\\0"          8 bytes
    format version               u16
    header length H              u16
    header                       H bytes, canonical JSON (sorted keys, no spaces) padded with
                                 spaces so that the payload starts at a multiple of 64 bytes
    payload                      the block's raw bytes, C order

The JSON header holds ``fingerprint``, ``block_hash`` (hex), ``dtype`` (numpy name, e.g.
``bfloat16`` or ``float8_e4m3fn``), ``shape``, ``payload_bytes`` and ``checksum`` (XXH3-128 of
the payload, hex; it detects corruption and is ~25x faster than BLAKE2b). A read verifies every
one of them against what the tier expects; any mismatch (or an OSError) makes the file a miss:
it is deleted, dropped from the index and counted in ``stats["corrupt_skipped"]``. Because the
header layout is deterministic, the exact file size is known in advance, so truncated or
zero-length files are also caught by a cheap size check when the directory is scanned at
start-up.

Several processes may share a directory (data-parallel replicas, or a warm restart while the old
engine exits): files are written to a unique ``*.tmp`` name and moved into place with
``os.replace`` (atomic on POSIX), and a file that another process deleted between our index and
our read is an ordinary miss. Each process keeps its own index, which follows the directory:

* a lookup that misses the index looks for the file (one ``stat``): a block another process
  wrote is adopted, so a prefix one replica wrote is a disk hit for the others;
* every ``RESCAN_EVERY`` writes the index is rebuilt from the directory (files others wrote
  join it, files others deleted leave it), ordered by modification time, which every process
  refreshes on a read: the byte limit and the LRU order are then the directory's, not one
  process's (a rescan lists every file, so it is not done per write). Between rescans the
  directory can exceed ``capacity_bytes`` by what other processes wrote since this one's last
  rescan, and blocks written within the same clock tick tie in the LRU order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from jpaged.kv_events import KVEventCollector

logger = logging.getLogger(__name__)

MAGIC = b"JPKVBLK\0"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
RESCAN_EVERY = 256  # writes between two rebuilds of the index from the shared directory
PAYLOAD_ALIGN = 64
_PREFIX = struct.Struct("<8sHH")  # magic, version, header length
_CHECKSUM_BYTES = 16
_HEADER_KEYS = frozenset(
    {"fingerprint", "block_hash", "dtype", "shape", "payload_bytes", "checksum"})
# A *.tmp file older than this was left by a crashed writer; younger ones may be in flight.
STALE_TMP_SECONDS = 600.0
_SAFE_COMPONENT = re.compile(r"[0-9A-Za-z_-][0-9A-Za-z_.-]*")
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def model_fingerprint(*, source: str, spec_repr: str, kv_dtype: str, block_size: int,
                      hash_algo: str, weights_digest: str, kv_scales: tuple[float, ...],
                      kv_groups: str | None = None, seed_digest: str | None = None) -> str:
    """Hex digest identifying KV content compatibility (model, dtype, block size, scales; the
    KV cache groups of a hybrid layout, whose blocks hold one group's layers)."""
    doc = {
        "format": FORMAT_VERSION,
        "source": source,
        "spec": spec_repr,
        "kv_dtype": kv_dtype,
        "block_size": int(block_size),
        "hash_algo": hash_algo,
        "weights_digest": weights_digest,
        # repr() of a float round-trips exactly, so equal scales give equal fingerprints.
        "kv_scales": [repr(float(s)) for s in kv_scales],
    }
    if kv_groups is not None:  # absent for one group: files written before groups still match
        doc["kv_groups"] = kv_groups
    if seed_digest is not None:  # a seeded deployment's files live apart (absent: unseeded)
        doc["seed"] = seed_digest
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(raw).hexdigest()


def _checksum(payload: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


def _write_replace(tmp: Path, path: Path, parts: tuple[bytes, memoryview]) -> None:
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
    os.replace(tmp, path)  # atomic: readers see the old file, no file, or the whole new one


class _BadFile(Exception):
    """A block file failed verification; the message is the reason."""


class DiskTier:
    """Third KV tier: one checksummed file per block in directory/<fingerprint>/, LRU by bytes."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fingerprint: str,
                 block_shape: tuple[int, ...], dtype: np.dtype,
                 seed_digest: str | None = None) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) \
                or capacity_bytes < 0:
            raise ValueError(f"DiskTier.capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if not isinstance(fingerprint, str) or not _SAFE_COMPONENT.fullmatch(fingerprint):
            raise ValueError("DiskTier.fingerprint must be a non-empty name of [0-9A-Za-z_.-] "
                             f"not starting with '.', got {fingerprint!r}")
        shape = tuple(block_shape)
        if not shape or not all(isinstance(d, int | np.integer) and d >= 1 for d in shape):
            raise ValueError(f"DiskTier.block_shape must be a tuple of ints >= 1, got {shape!r}")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as e:
            raise ValueError(f"DiskTier.dtype is not a numpy dtype: {dtype!r}") from e
        if self.dtype.byteorder == ">" or self.dtype.hasobject or self.dtype.itemsize == 0:
            raise ValueError(f"DiskTier.dtype must be a plain little-endian dtype, got {dtype!r}")
        # One block across all layers, K and V: (num_layers, 2, block_size, kv_heads, head_dim).
        self.block_shape: tuple[int, ...] = tuple(int(d) for d in shape)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        # The prefix-cache hash seed's public digest (block_hash.seed_digest): written in every
        # header of a seeded deployment, and a file under another seed (or none) is refused.
        self.seed_digest = seed_digest
        self.directory = Path(directory) / fingerprint
        self.payload_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self._lock = threading.RLock()
        # block hash -> file size in bytes; order = LRU (first = least recently used).
        # Invariant: self._bytes_used == sum(self._index.values()).
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        self._sizes: dict[int, int] = {}  # hash length -> exact file size (layout is fixed)
        self._counters = dict.fromkeys(
            ("bytes_written", "bytes_read", "hits", "misses", "evictions", "corrupt_skipped",
             "write_errors"), 0)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.events: KVEventCollector | None = None  # entries in and out ("DISK")
        self._puts = 0
        self._scan()

    # ---------------------------------------------------------------- public API

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether the block is in the index, or its file is (another process wrote it: then
        it is adopted). O(1) on a hit; one stat on a miss."""
        if block_hash in self._index:
            return True
        return self._adopt(block_hash)

    def _adopt(self, block_hash: bytes) -> bool:
        try:
            self._check_hash(block_hash)
            size = os.stat(self._path(block_hash)).st_size
        except (OSError, ValueError):
            return False
        if size != self._file_size(len(block_hash)):
            return False  # being replaced, or bad: a read would reject it anyway
        with self._lock:
            if block_hash not in self._index:
                self._index[block_hash] = size
                self._bytes_used += size
                if self.events is not None:
                    self.events.stored([block_hash], "DISK")
        return True

    def __len__(self) -> int:
        """Number of blocks in the index."""
        return len(self._index)

    def hashes(self) -> list[bytes]:
        """The hashes in the index, least recently used first."""
        with self._lock:
            return list(self._index)

    def attach_events(self, events: KVEventCollector) -> None:
        """Report index changes to `events` from now on; the blocks indexed now are stated."""
        with self._lock:
            self.events = events
            events.stored(list(self._index), "DISK")

    def put(self, block_hash: bytes, data: np.ndarray) -> bool:
        """Store one block atomically, evicting LRU files; False if it cannot be stored."""
        self._check_hash(block_hash)
        if not isinstance(data, np.ndarray):
            raise ValueError(f"DiskTier.put: data must be a numpy array, got {type(data).__name__}")
        if data.shape != self.block_shape:
            raise ValueError(f"DiskTier.put: data.shape must be {self.block_shape}, "
                             f"got {data.shape}")
        if data.dtype != self.dtype:
            raise ValueError(f"DiskTier.put: data.dtype must be {self.dtype.name}, "
                             f"got {data.dtype.name}")
        size = self._file_size(len(block_hash))
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if size > self.capacity_bytes:
                return False
            self._puts += 1
            if self._puts % RESCAN_EVERY == 0:
                self._rescan()  # the directory's files and LRU order, not only this process's
            while self._index and self._bytes_used + size > self.capacity_bytes:
                victim, victim_size = self._index.popitem(last=False)
                self._bytes_used -= victim_size
                self._counters["evictions"] += 1
                self._unlink(self._path(victim))
                if self.events is not None:
                    self.events.removed([victim], "DISK")
            payload = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
            blob = self._encode(block_hash, payload)
            if not self._write_atomic(self._path(block_hash), blob):
                return False
            self._index[block_hash] = size
            self._bytes_used += size
            self._counters["bytes_written"] += size
            if self.events is not None:
                self.events.stored([block_hash], "DISK")
            return True

    def get(self, block_hash: bytes) -> np.ndarray | None:
        """The verified block (a fresh writable array) or None; bad files are deleted."""
        self._check_hash(block_hash)
        with self._lock:
            if block_hash not in self._index:
                self._counters["misses"] += 1
                return None
            path = self._path(block_hash)
            expected = self._file_size(len(block_hash))
            try:
                with open(path, "rb") as f:
                    # Never allocate for a file of the wrong size (it may be huge): read at most
                    # one byte more than expected, enough to tell "too long" apart.
                    buf = bytearray(min(os.fstat(f.fileno()).st_size, expected + 1))
                    got = f.readinto(buf)
            except FileNotFoundError:
                # Another process evicted it: a plain miss, not corruption.
                self._forget(block_hash)
                self._counters["misses"] += 1
                return None
            except OSError as e:
                self._reject(block_hash, path, f"unreadable ({e})")
                return None
            try:
                offset = self._verify(block_hash, buf, got)
            except _BadFile as e:
                self._reject(block_hash, path, str(e))
                return None
            self._index.move_to_end(block_hash)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += got
            try:  # best effort: keep the LRU order across restarts (scan sorts by mtime)
                os.utime(path)
            except OSError:
                pass
            arr = np.frombuffer(buf, dtype=self.dtype, count=int(np.prod(self.block_shape)),
                                offset=offset)
            return arr.reshape(self.block_shape)

    def discard(self, block_hash: bytes) -> None:
        """Drop one block from the index and delete its file (no-op if absent)."""
        with self._lock:
            if block_hash in self._index:
                self._forget(block_hash)
                self._unlink(self._path(block_hash))

    def clear(self) -> None:
        """Delete every block file of this fingerprint and empty the index."""
        with self._lock:
            if self.events is not None:
                self.events.removed(list(self._index), "DISK")
            self._index.clear()
            self._bytes_used = 0
            try:
                entries = list(os.scandir(self.directory))
            except OSError:
                return
            for entry in entries:
                if entry.name.endswith(SUFFIX):
                    self._unlink(Path(entry.path))

    @property
    def usage(self) -> float:
        """Bytes used / capacity_bytes (0.0 for a zero capacity)."""
        return self._bytes_used / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def stats(self) -> dict[str, int]:
        """Counters: blocks, bytes_used, bytes_written, bytes_read, hits, misses, evictions,
        corrupt_skipped, write_errors."""
        with self._lock:
            return {"blocks": len(self._index), "bytes_used": self._bytes_used, **self._counters}

    # ---------------------------------------------------------------- encoding

    def _header(self, block_hash: bytes, checksum: str) -> bytes:
        doc = {"fingerprint": self.fingerprint, "block_hash": block_hash.hex(),
               "dtype": self.dtype.name, "shape": list(self.block_shape),
               "payload_bytes": self.payload_bytes, "checksum": checksum}
        if self.seed_digest is not None:  # absent unseeded: older files keep their layout
            doc["seed"] = self.seed_digest
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("ascii")
        pad = -(_PREFIX.size + len(raw)) % PAYLOAD_ALIGN
        return raw + b" " * pad

    def _file_size(self, hash_len: int) -> int:
        if hash_len not in self._sizes:
            header = self._header(b"\0" * hash_len, "0" * (2 * _CHECKSUM_BYTES))
            self._sizes[hash_len] = _PREFIX.size + len(header) + self.payload_bytes
        return self._sizes[hash_len]

    def _encode(self, block_hash: bytes, payload: memoryview) -> tuple[bytes, memoryview]:
        header = self._header(block_hash, _checksum(payload))
        if len(header) > 0xFFFF:
            raise ValueError("DiskTier: header too long (block_shape or fingerprint too large)")
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header, payload

    def _verify(self, block_hash: bytes, buf: bytearray, got: int) -> int:
        """Raise _BadFile unless buf holds exactly this block; return the payload offset."""
        expected = self._file_size(len(block_hash))
        if got != len(buf) or got != expected:
            self._check_seed(buf)  # a seeded header is longer: name the seed, not the size
            raise _BadFile(f"size {got} bytes, expected {expected}")
        magic, version, header_len = _PREFIX.unpack_from(buf)
        if magic != MAGIC:
            raise _BadFile(f"bad magic {magic!r}")
        if version != FORMAT_VERSION:
            raise _BadFile(f"format version {version}, expected {FORMAT_VERSION}")
        offset = _PREFIX.size + header_len
        if offset + self.payload_bytes != got:
            raise _BadFile(f"header length {header_len} inconsistent with the file size")
        try:
            doc = json.loads(bytes(buf[_PREFIX.size:offset]).decode("ascii"))
        except (UnicodeDecodeError, ValueError) as e:
            raise _BadFile(f"unreadable header ({e})") from e
        if isinstance(doc, dict) and doc.get("seed") != self.seed_digest:
            raise _BadFile(self._seed_mismatch(doc.get("seed")))
        if not isinstance(doc, dict) or set(doc) - {"seed"} != _HEADER_KEYS:
            raise _BadFile("header has the wrong keys")
        want = {"fingerprint": self.fingerprint, "block_hash": block_hash.hex(),
                "dtype": self.dtype.name, "shape": list(self.block_shape),
                "payload_bytes": self.payload_bytes}
        for key, value in want.items():
            if doc[key] != value:
                raise _BadFile(f"header {key} is {doc[key]!r}, expected {value!r}")
        if doc["checksum"] != _checksum(memoryview(buf)[offset:]):
            raise _BadFile("payload checksum mismatch")
        return offset

    def _seed_mismatch(self, found: object) -> str:
        if found is None:
            return "written without a prefix-cache hash seed; this deployment has one"
        if self.seed_digest is None:
            return "written under a prefix-cache hash seed; this deployment has none"
        return "written under another prefix-cache hash seed"

    def _check_seed(self, buf: bytearray) -> None:
        """_BadFile naming the seed if buf's header (when readable) has another one."""
        try:
            _, _, header_len = _PREFIX.unpack_from(buf)
            doc = json.loads(bytes(buf[_PREFIX.size:_PREFIX.size + header_len]).decode("ascii"))
        except (struct.error, UnicodeDecodeError, ValueError):
            return
        if isinstance(doc, dict) and doc.get("seed") != self.seed_digest:
            raise _BadFile(self._seed_mismatch(doc.get("seed")))

    # ---------------------------------------------------------------- files

    @staticmethod
    def _check_hash(block_hash: bytes) -> None:
        if not isinstance(block_hash, bytes) or not block_hash:
            raise ValueError(f"DiskTier: block_hash must be non-empty bytes, got {block_hash!r}")

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / (block_hash.hex() + SUFFIX)

    def _write_atomic(self, path: Path, blob: tuple[bytes, memoryview]) -> bool:
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}")
        try:
            try:
                _write_replace(tmp, path, blob)
            except FileNotFoundError:  # the directory was removed under us: recreate it once
                self.directory.mkdir(parents=True, exist_ok=True)
                _write_replace(tmp, path, blob)
            return True
        except OSError as e:
            self._unlink(tmp)
            self._counters["write_errors"] += 1
            logger.warning("disk KV tier: could not write %s (%s); block not stored", path, e)
            return False

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logger.warning("disk KV tier: could not delete %s (%s)", path, e)

    def _forget(self, block_hash: bytes) -> None:
        size = self._index.pop(block_hash)
        self._bytes_used -= size
        if self.events is not None:
            self.events.removed([block_hash], "DISK")

    def _reject(self, block_hash: bytes, path: Path, reason: str) -> None:
        logger.warning("disk KV tier: skipping %s: %s; file deleted", path, reason)
        self._forget(block_hash)
        self._counters["corrupt_skipped"] += 1
        self._counters["misses"] += 1
        self._unlink(path)

    def _rescan(self) -> None:
        """Rebuild the index from the directory (other processes' writes and deletions)."""
        found = self._list_files()
        on_disk = {h for _, h, _ in found}
        gone = [h for h in self._index if h not in on_disk]
        new = [h for _, h, _ in found if h not in self._index]
        self._index = OrderedDict((h, size) for _, h, size in found)
        self._bytes_used = sum(self._index.values())
        if self.events is not None:
            self.events.removed(gone, "DISK")
            self.events.stored(new, "DISK")

    def _scan(self) -> None:
        """Build the index from the files on disk, oldest mtime first (= LRU first)."""
        for _, block_hash, size in self._list_files():
            self._index[block_hash] = size
            self._bytes_used += size
        while self._index and self._bytes_used > self.capacity_bytes:
            victim, size = self._index.popitem(last=False)
            self._bytes_used -= size
            self._counters["evictions"] += 1
            self._unlink(self._path(victim))

    def _list_files(self) -> list[tuple[float, bytes, int]]:
        """(mtime, hash, size) of every well-formed block file, oldest first; stale partial
        files and files of the wrong size are deleted."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for entry in os.scandir(self.directory):
            name = entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished while scanning
            if name.endswith(TMP_SUFFIX):
                if now - st.st_mtime > STALE_TMP_SECONDS:
                    logger.warning("disk KV tier: removing stale partial file %s", entry.path)
                    self._unlink(Path(entry.path))
                continue  # a younger *.tmp may belong to a live writer
            stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
            if stem is None or not _HEX.fullmatch(stem) or not entry.is_file(follow_symlinks=False):
                logger.warning("disk KV tier: ignoring stray entry %s", entry.path)
                continue
            block_hash = bytes.fromhex(stem)
            expected = self._file_size(len(block_hash))
            if st.st_size != expected:
                logger.warning("disk KV tier: skipping %s: size %d bytes, expected %d; "
                               "file deleted", entry.path, st.st_size, expected)
                self._counters["corrupt_skipped"] += 1
                self._unlink(Path(entry.path))
                continue
            found.append((st.st_mtime, block_hash, expected))
        found.sort(key=lambda t: t[0])
        return found
