"""Random paged-attention inputs for the kernel tests (shared by the test modules here)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.intmath import cdiv
from pallas_kernels._compat import compute_dtype
from pallas_kernels.reference import write_kv


@dataclass
class PagedCase:
    """One step's inputs; arrays follow `reference.ragged_paged_attention`'s argument order."""

    q: jax.Array  # [T, hq, d]
    k_pages: jax.Array  # [blocks, bs, hkv, d]
    v_pages: jax.Array
    qsl: jax.Array  # [B + 1]
    seq_lens: jax.Array  # [B]
    tables: jax.Array  # [B, max_blocks]

    def ragged_args(self) -> tuple[jax.Array, ...]:
        """Positional arguments of ragged_paged_attention."""
        return self.q, self.k_pages, self.v_pages, self.qsl, self.seq_lens, self.tables


def make_case(rng: np.random.Generator, seqs: list[tuple[int, int]], *, bs: int, hq: int,
              hkv: int, d: int, page_dtype=jnp.float32, q_dtype=jnp.float32,
              max_blocks: int | None = None, pad_seqs: int = 1, pad_tokens: int = 2,
              k_scale: float = 1.0, v_scale: float = 1.0) -> PagedCase:
    """seqs: (seq_len, q_len) per real sequence; pages hold random data everywhere else too.

    Block tables are a random permutation of blocks 1..; entries past a sequence's blocks are 0
    (the null block), and every unused slot holds random finite data, so a masking mistake shows.
    """
    need = [cdiv(s, bs) for s, _ in seqs]
    max_blocks = max_blocks or max(max(need), 1)
    num_blocks = sum(need) + 3
    perm = rng.permutation(np.arange(1, num_blocks))
    garbage = rng.standard_normal((2, num_blocks, bs, hkv, d)).astype(np.float32)
    k_pages = jnp.asarray(garbage[0]).astype(page_dtype)
    v_pages = jnp.asarray(garbage[1]).astype(page_dtype)
    tables = np.zeros((len(seqs) + pad_seqs, max_blocks), np.int32)
    qsl, qs, ks, vs, slots, used = [0], [], [], [], [], 0
    for b, (seq_len, q_len) in enumerate(seqs):
        tables[b, :need[b]] = perm[used:used + need[b]]
        used += need[b]
        ks.append(rng.standard_normal((seq_len, hkv, d)).astype(np.float32))
        vs.append(rng.standard_normal((seq_len, hkv, d)).astype(np.float32))
        qs.append(rng.standard_normal((q_len, hq, d)).astype(np.float32))
        slots.append(np.array([tables[b, p // bs] * bs + p % bs for p in range(seq_len)],
                              np.int32))
        qsl.append(qsl[-1] + q_len)
    k_pages, v_pages = write_kv(k_pages, v_pages, jnp.asarray(np.concatenate(ks)),
                                jnp.asarray(np.concatenate(vs)),
                                jnp.asarray(np.concatenate(slots)), k_scale, v_scale)
    qsl += [qsl[-1]] * pad_seqs
    q = np.concatenate(qs + [rng.standard_normal((pad_tokens, hq, d)).astype(np.float32)])
    seq_lens = np.array([s for s, _ in seqs] + [0] * pad_seqs, np.int32)
    return PagedCase(jnp.asarray(q, q_dtype), k_pages, v_pages,
                     jnp.asarray(np.array(qsl, np.int32)), jnp.asarray(seq_lens),
                     jnp.asarray(tables))


def rel_err(got: jax.Array, want: jax.Array) -> float:
    """||got - want|| / ||want|| in float64; NaN never passes a `<` check."""
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def tolerance(q_dtype, page_dtype) -> float:
    """Relative-error budget by the kernels' operand dtype (`_compat.compute_dtype`).

    float32 operands: float32 arithmetic. bf16 operands (bf16 q with bf16 or fp8 pages; fp8
    widens to bf16 exactly): probabilities are rounded to bf16 before the PV product and the
    output is bf16, so about 2**-8 relative.
    """
    return 2e-5 if compute_dtype(q_dtype, page_dtype) == jnp.float32 else 1.5e-2
