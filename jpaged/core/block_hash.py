"""Prefix hash chain for automatic prefix caching.

The hash of FULL block i of a token sequence is

    h_i = H(h_{i-1} (or ROOT for i == 0) || tokens of block i || encode(extra keys of block i))

where the extra keys of block i are ``(cache_salt if i == 0 else None, *extra_keys)``: the salt
enters the first block only (and through the chain every later block), the request-level
``extra_keys`` tuple (LoRA name, multimodal hashes, ...) enters every block. Partial blocks are
never hashed. Hashes are ``bytes`` computed from a canonical byte serialisation (never Python's
``hash()``), so they are identical across processes and runs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

BlockHash = bytes
HASH_ALGOS = ("sha256", "xxhash")

# Parent of the first block of every sequence; fixed so hashes agree across processes.
ROOT_HASH: BlockHash = hashlib.sha256(b"jpaged/prefix-cache/root/v1").digest()


def root_hash(seed: str | None = None) -> BlockHash:
    """The chain's root for a deployment's hash seed (None: ROOT_HASH, the unseeded chain).

    A seed is a per-deployment secret: without it nobody can compute which prompts collide
    (the xxhash chain is not collision-resistant), and deployments with different seeds share
    no block hash. Every process of a deployment must use the same one.
    """
    if seed is None:
        return ROOT_HASH
    return hashlib.sha256(b"jpaged/prefix-cache/root/v1/seed:" + seed.encode("utf-8")).digest()


def seed_digest(seed: str | None) -> str | None:
    """A short public digest of a hash seed (what files and logs may carry; None: unseeded)."""
    if seed is None:
        return None
    return hashlib.sha256(b"jpaged/prefix-cache/seed-digest:" + seed.encode("utf-8")).hexdigest(
    )[:16]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional dependency, imported on first use

    return xxhash.xxh3_128_digest(data)


def get_hash_fn(algo: str) -> Callable[[bytes], bytes]:
    """The byte-digest function for `prefix_caching_hash_algo` ("sha256" or "xxhash")."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        return _xxh3_128
    raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")


def encode_key(obj: object) -> bytes:
    """Canonical, bytes of an extra key (None/bool/int/float/str/bytes/tuple)."""
    if obj is None:
        return b"N"
    if obj is True:
        return b"T"
    if obj is False:
        return b"F"
    if isinstance(obj, int):
        return b"i%d;" % obj
    if isinstance(obj, float):
        return b"f" + struct.pack("<d", obj)
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return b"s%d:" % len(raw) + raw
    if isinstance(obj, bytes | bytearray):
        return b"b%d:" % len(obj) + bytes(obj)
    if isinstance(obj, tuple | list):
        return b"(" + b"".join(encode_key(x) for x in obj) + b")"
    raise TypeError(f"extra key of type {type(obj).__name__} cannot be hashed canonically; "
                    "use None, bool, int, float, str, bytes or tuples of them")


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra: tuple = (),
                      algo: str = "sha256") -> BlockHash:
    """Hash of one full block given its parent's hash (None: the first block)."""
    payload = _payload(parent, token_ids, encode_key(tuple(extra)))
    return get_hash_fn(algo)(payload)


def _payload(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes) -> bytes:
    # parent has a fixed length per algo and the token part has a fixed length per block size,
    # so the concatenation is unambiguous.
    return (parent if parent is not None else ROOT_HASH) + struct.pack(
        f"<{len(token_ids)}q", *token_ids) + extra


class BlockHasher:
    """Incremental hasher of a request's full blocks for one (block_size, algo); O(block) each."""

    __slots__ = ("block_size", "algo", "root", "_fn", "_pack")

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.root = root_hash(seed)  # the parent of every first block
        self._fn = get_hash_fn(algo)
        self._pack = struct.Struct(f"<{block_size}q").pack

    def extra_bytes(self, cache_salt: str | None, extra_keys: tuple) -> tuple[bytes, bytes]:
        """Encoded extra keys of (the first block, every later block) of one request."""
        rest = tuple(extra_keys)
        return encode_key((cache_salt, *rest)), encode_key((None, *rest))

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int],
               extra: tuple[bytes, bytes]) -> None:
        """Append to `hashes` the hashes of every full block of `token_ids` not yet hashed."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        i = len(hashes)
        parent = hashes[-1] if hashes else self.root
        while i < n_full:
            tokens = token_ids[i * bs:(i + 1) * bs]
            parent = self._fn(parent + self._pack(*tokens) + extra[0 if i == 0 else 1])
            hashes.append(parent)
            i += 1


def hash_request_blocks(token_ids: Sequence[int], block_size: int, algo: str = "sha256",
                        cache_salt: str | None = None, extra_keys: tuple = (),
                        seed: str | None = None) -> list[BlockHash]:
    """Hashes of all full blocks of `token_ids` (the chain a Request maintains incrementally)."""
    hasher = BlockHasher(block_size, algo, seed)
    out: list[BlockHash] = []
    hasher.extend(out, token_ids, hasher.extra_bytes(cache_salt, extra_keys))
    return out
