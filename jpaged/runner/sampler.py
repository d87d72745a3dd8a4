"""On-device sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step (rows = sequences of the step batch)."""

    temperature: Float[Array, " B"]  # 0 => greedy
    top_k: Int[Array, " B"]  # vocab_size when disabled
    top_p: Float[Array, " B"]
    min_p: Float[Array, " B"]
    seeds: Int[Array, " B"]  # uint32 seed per request
    counters: Int[Array, " B"]  # number of tokens the request has sampled so far
    repetition_penalty: Float[Array, " B"]
    presence_penalty: Float[Array, " B"]
    frequency_penalty: Float[Array, " B"]
    # Token history for penalties, padded with -1: prompt+output and output only.
    history: Int[Array, "B H"]
    history_is_output: Bool[Array, "B H"]
    # Token constraints, per row K entries padded with id -1 (None: no row has any):
    # a finite value is a logit_bias, +inf marks an allowed token (a row with any allows
    # only those).
    bias_ids: Int[Array, "B K"] | None = None
    bias_vals: Float[Array, "B K"] | None = None
    # Structured outputs: packed allowed-token bits per row, ceil(V / 32) int32 words, bit j of
    # word i = token 32 i + j (None: no row is constrained; an unconstrained row is all ones).
    token_mask: Int[Array, "B W"] | None = None


@dataclass(frozen=True)
class SamplingFlags:
    """Static switches (part of the compile key); everything else is decided at run time."""

    use_penalties: bool = False  # the history arrays are non-empty
    # Some row asked for its top candidates' logprobs (SamplingParams.logprobs > 0). Without
    # it the step returns [B, 0] candidates and skips the top-k over the vocabulary.
    top_logprobs: bool = False
    # Every sequence of the step has exactly one new token (BucketPlan's T == B shapes). The
    # Pallas backend then launches only the split-K decode kernel, and a mixed step only the
    # tiled one; other backends ignore it (the runner clears it there, so no extra programs).
    decode_only: bool = False


# Top-N candidates whose logprobs a step with top_logprobs returns (requests read the first
# `logprobs`).
NUM_TOP_LOGPROBS = 20
_BISECT_ITERS = 32


def apply_penalties(logits: Float[Array, "B V"], s: SamplingBatch) -> Float[Array, "B V"]:
    """vLLM's repetition (prompt+output), presence and frequency (output only) penalties."""
    b, v = logits.shape
    hist = s.history
    valid = hist >= 0
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], hist.shape)
    idx = jnp.where(valid, hist, v)  # v is out of range: dropped
    seen = jnp.zeros((b, v), bool).at[rows, idx].set(True, mode="drop")
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, idx].add(
        (valid & s.history_is_output).astype(jnp.float32), mode="drop")
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * out_counts
    logits = logits - s.presence_penalty[:, None] * (out_counts > 0)
    return logits


def apply_token_bias(logits: Float[Array, "B V"], ids: Int[Array, "B K"],
                     vals: Float[Array, "B K"]) -> Float[Array, "B V"]:
    """logit_bias (added) and allowed_token_ids (every other token of such a row to -inf)."""
    b, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    valid = ids >= 0
    idx = jnp.where(valid, ids, v)  # v is out of range: dropped
    allow_mark = valid & jnp.isposinf(vals)
    bias = jnp.zeros((b, v), jnp.float32).at[rows, idx].add(
        jnp.where(valid & jnp.isfinite(vals), vals, 0.0), mode="drop")
    allowed = jnp.zeros((b, v), bool).at[rows, idx].max(allow_mark, mode="drop")
    restrict = jnp.any(allow_mark, axis=-1, keepdims=True)
    return jnp.where(restrict & ~allowed, -jnp.inf, logits + bias)


def apply_token_mask(logits: Float[Array, "B V"], words: Int[Array, "B W"]
                     ) -> Float[Array, "B V"]:
    """Tokens whose bit is 0 in the row's packed mask go to -inf."""
    b, v = logits.shape
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(b, -1)[:, :v] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _threshold_by_count(x: Float[Array, "B V"], k: Int[Array, " B"]) -> Float[Array, " B"]:
    """Largest t (by bisection) with count(x >= t) >= k: the k-th largest value, ties kept."""
    lo, hi = x.min(axis=-1), x.max(axis=-1)

    def body(_, c):
        lo, hi = c
        mid = 0.5 * (lo + hi)
        ok = jnp.sum(x >= mid[:, None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_ITERS, body, (lo, hi))
    return lo


def _threshold_by_mass(p: Float[Array, "B V"], top_p: Float[Array, " B"]) -> Float[Array, " B"]:
    """Largest t (by bisection) with sum(p[p >= t]) >= top_p: the nucleus floor."""
    lo, hi = jnp.zeros_like(top_p), p.max(axis=-1)

    def body(_, c):
        lo, hi = c
        mid = 0.5 * (lo + hi)
        ok = jnp.sum(jnp.where(p >= mid[:, None], p, 0.0), axis=-1) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, _BISECT_ITERS, body, (lo, hi))
    return jnp.where(top_p >= 1.0, 0.0, lo)


def _filter(logits: Float[Array, "B V"], s: SamplingBatch) -> Float[Array, "B V"]:
    """Mask everything outside top-k, the top-p nucleus and the min-p floor to -inf.

    Thresholds come from bisection rather than a full sort of the vocabulary, which costs
    ~100x more on CPU. Order as vLLM: top-k, then top-p on the renormalised survivors, then min-p.
    """
    v = logits.shape[-1]
    k = jnp.clip(s.top_k, 1, v)
    kth = jnp.where(k >= v, -jnp.inf, _threshold_by_count(logits, k))
    logits = jnp.where(logits >= kth[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    pth = _threshold_by_mass(probs, s.top_p)
    keep = (probs >= pth[:, None]) & (probs >= s.min_p[:, None] * probs.max(axis=-1,
                                                                           keepdims=True))
    return jnp.where(keep, logits, -jnp.inf)


def sample(
    logits: Float[Array, "B V"], s: SamplingBatch, flags: SamplingFlags,
    top_k: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] = jax.lax.top_k,
    keep_split: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> tuple[Int[Array, " B"], Float[Array, " B"], Int[Array, "B N"], Float[Array, "B N"]]:
    """Sampled ids, their logprobs (of the penalised distribution), and the top-N candidates
    (N = 0 unless flags.top_logprobs), found by `top_k` (lax.top_k's contract). Tensor
    parallel passes a `top_k` that works on the vocab-split logits and a `keep_split` that pins
    a [B, V] value to that split (else XLA may gather the filtered logits whole).

    Rows with temperature 0 take the argmax. Filtering and random draws run only when some row
    needs them (lax.cond), so one compiled step serves every mix of parameters.
    """
    logits = logits.astype(jnp.float32)
    if flags.use_penalties:
        logits = apply_penalties(logits, s)
    if s.bias_ids is not None:  # structure, so part of the compile key: no cost without it
        logits = apply_token_bias(logits, s.bias_ids, s.bias_vals)
    if s.token_mask is not None:  # likewise: absent unless a row has a grammar
        logits = apply_token_mask(logits, s.token_mask)
    # log_softmax's own terms per row, [B, 1] each; no [B, V] log-probability array is kept:
    # a logprob is (logit - row max) - log(sum(exp(logits - row max))), as log_softmax computes.
    row_max = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[-1]

    def draw(_: None) -> Int[Array, " B"]:
        temp = jnp.where(s.temperature > 0, s.temperature, 1.0)
        scaled = logits / temp[:, None]
        needs_filter = jnp.any((s.top_k < v) | (s.top_p < 1.0) | (s.min_p > 0.0))
        scaled = keep_split(jax.lax.cond(needs_filter, lambda x: _filter(x, s), lambda x: x,
                                         keep_split(scaled)))
        keys = jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.key(seed), c))(
            s.seeds.astype(jnp.uint32), s.counters)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,)))(keys)
        sampled = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(s.temperature > 0, sampled, greedy_ids)

    ids = jax.lax.cond(jnp.all(s.temperature <= 0), lambda _: greedy_ids, draw, None)
    chosen = jnp.take_along_axis(logits, ids[:, None], axis=-1)
    chosen_lp = ((chosen - row_max) - log_norm)[:, 0]
    if not flags.top_logprobs:  # nobody reads candidates: no top-k over the vocabulary
        b = logits.shape[0]
        return ids, chosen_lp, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    # The logprob is monotonic in the logit: the top logits are the top logprobs.
    top_logits, top_ids = top_k(logits, min(NUM_TOP_LOGPROBS, v))
    return ids, chosen_lp, top_ids.astype(jnp.int32), (top_logits - row_max) - log_norm
