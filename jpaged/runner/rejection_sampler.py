"""Verification of speculative proposals: the standard rejection sampler, on device.

A step scores every proposed token of a row at once: the target's distributions `p_0 .. p_k`
at the row's k draft positions and the one after them. Row by row:

* greedy rows (temperature 0): draft j is accepted while it is the argmax of `p_j`; the first
  mismatch emits the argmax instead, and all k accepted emits the argmax of `p_k` (the bonus);
* sampled rows: draft `d_j` is accepted with probability `min(1, p_j(d_j) / q_j(d_j))`, `q_j` the
  draft's distribution (one-hot for the n-gram and suffix proposers: accepted with probability
  `p_j(d_j)`); the first rejection at j emits a token drawn from `max(0, p_j - q_j)`
  normalised, and all accepted emits one drawn from `p_k`.

Each emitted token is distributed as the target's own sample at its position (Leviathan et
al., 2023; vLLM's RejectionSampler), so speculation changes speed, never the output
distribution. Rows verify `num_draft[b] <= k` drafts (positions past it are padding); a row
with none emits one token from `p_0`, as a plain decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def rejection_sample(
    target_probs: Float[Array, "B K1 V"],
    draft_tokens: Int[Array, "B K"],
    num_draft: Int[Array, " B"],
    greedy: Bool[Array, " B"],
    key: jax.Array,
    draft_probs: Float[Array, "B K V"] | None = None,
) -> tuple[Int[Array, "B K1"], Int[Array, " B"]]:
    """(tokens [B, K + 1], count [B]): row b emits tokens[b, :count[b]] (1 <= count <= its
    drafts + 1: the accepted drafts, then the corrected or bonus token); entries past count
    are -1. `draft_probs` None: one-hot drafts (n-gram, suffix)."""
    b, k1, v = target_probs.shape
    k = k1 - 1
    if k == 0:  # nothing proposed anywhere: a plain decode step's draw
        tok = jnp.where(greedy, jnp.argmax(target_probs[:, 0], -1),
                        jax.random.categorical(key, jnp.log(target_probs[:, 0]), axis=-1))
        return tok[:, None].astype(jnp.int32), jnp.ones((b,), jnp.int32)
    pos = jnp.arange(k)[None, :]
    # A placeholder (-1, vLLM's padding) or out-of-vocabulary draft is never accepted: it is
    # not looked up (a -1 index would wrap to the last token's probability).
    in_vocab = (draft_tokens >= 0) & (draft_tokens < v)
    valid = (pos < num_draft[:, None]) & in_vocab  # [B, K]
    safe = jnp.where(in_vocab, draft_tokens, 0)
    p_draft = jnp.take_along_axis(target_probs[:, :k], safe[..., None], -1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, safe[..., None], -1)[..., 0]
    k_accept, k_resample = jax.random.split(key)
    u = jax.random.uniform(k_accept, (b, k), dtype=jnp.float32)
    # u < p/q, written without a division (q > 0 for a drafted token).
    sampled_ok = u * q_draft < p_draft
    argmax = jnp.argmax(target_probs, axis=-1)  # [B, K + 1]
    greedy_ok = argmax[:, :k] == draft_tokens
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & valid
    # Accepted prefix length: drafts before the first rejection (or every valid one).
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
    # The distribution the last token is drawn from: the residual max(0, p - q) at a rejection,
    # p at the bonus position.
    at = accepted  # position of the last emitted token
    p_at = jnp.take_along_axis(target_probs, at[:, None, None], 1)[:, 0]  # [B, V]
    rejected = accepted < num_draft
    if draft_probs is None:
        q_at = jax.nn.one_hot(jnp.take_along_axis(
            draft_tokens, jnp.minimum(at, k - 1)[:, None], 1)[:, 0], v, dtype=p_at.dtype)
    else:
        q_at = jnp.take_along_axis(draft_probs, jnp.minimum(at, k - 1)[:, None, None], 1)[:, 0]
    # A placeholder rejected at `at` proposed nothing: the token is drawn from p itself.
    drafted_at = jnp.take_along_axis(in_vocab, jnp.minimum(at, k - 1)[:, None], 1)
    q_at = jnp.where(drafted_at, q_at, 0.0)
    residual = jnp.maximum(p_at - q_at, 0.0)
    dist = jnp.where(rejected[:, None], residual, p_at)
    # A residual that is all zero (p == q) cannot be reached (acceptance was then certain);
    # fall back to p so the draw stays defined.
    dist = jnp.where(dist.sum(-1, keepdims=True) > 0, dist, p_at)
    drawn = jax.random.categorical(k_resample, jnp.log(dist), axis=-1)
    last = jnp.where(greedy, jnp.take_along_axis(argmax, at[:, None], 1)[:, 0], drawn)
    slots = jnp.arange(k1)[None, :]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)), constant_values=-1)
    tokens = jnp.where(slots < at[:, None], drafts,
                       jnp.where(slots == at[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), (at + 1).astype(jnp.int32)
