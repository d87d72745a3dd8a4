"""On-device sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jpaged.intmath import cdiv


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
    # only those), -inf a banned one (min_tokens' stop tokens; a ban beats an allow).
    bias_ids: Int[Array, "B K"] | None = None
    bias_vals: Float[Array, "B K"] | None = None
    # Structured outputs: packed allowed-token bits per row, ceil(V / 32) int32 words, bit j of
    # word i = token 32 i + j (None: no row is constrained; an unconstrained row is all ones).
    token_mask: Int[Array, "B W"] | None = None


@dataclass(frozen=True)
class SamplingFlags:
    """Static switches (part of the compile key); everything else is decided at run time."""

    use_penalties: bool = False  # the history arrays are non-empty
    # Some row asked for logprobs (SamplingParams.logprobs >= 0): its top candidates and the
    # sampled token's rank. Without it the step returns [B, 0] candidates and skips the top-k
    # over the vocabulary.
    top_logprobs: bool = False
    # Every sequence of the step has exactly one new token (BucketPlan's T == B shapes). The
    # Pallas backend then launches only the split-K decode kernel, and a mixed step only the
    # tiled one; other backends ignore it (the runner clears it there, so no extra programs).
    decode_only: bool = False


# Top-N candidates whose logprobs a step with top_logprobs returns by default (requests read the
# first `logprobs`): vLLM's default max_logprobs. An engine returns its own max_logprobs (the
# whole vocabulary when that is -1): `sample`'s num_top.
NUM_TOP_LOGPROBS = 20
# The top-k/top-p thresholds' search, (ways a pass, passes), both resolving the range to 2^-32:
# wide (16 ways, 15 thresholds a read of the row) where the bytes a pass moves cost most (a
# GPU); a bisection on XLA:CPU, whose row sits in cache and whose many-operand float reduces
# run element by element, so that 15 thresholds a pass cost more than 15 passes.
_WIDE_SEARCH = (16, 8)
_BISECTION = (2, 32)


def searches_wide(platform: str | None = None) -> bool:
    """Whether the filters' threshold search on `platform` (default: jax's backend) reads the
    row as few times as it can (_WIDE_SEARCH) rather than bisecting: everywhere but XLA:CPU."""
    return (platform or jax.default_backend()) != "cpu"


def row_keys(s: SamplingBatch) -> jax.Array:
    """Each row's random key for this step: its seed folded with the tokens it has sampled,
    so a seeded request draws the same tokens whatever batch it shares."""
    return jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.key(seed), c))(
        s.seeds.astype(jnp.uint32), s.counters)


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
    """logit_bias (added), allowed_token_ids (every other token of such a row to -inf) and
    banned tokens (-inf entries) to -inf."""
    b, v = logits.shape
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    valid = ids >= 0
    idx = jnp.where(valid, ids, v)  # v is out of range: dropped
    allow_mark = valid & jnp.isposinf(vals)
    # A banned token's bias is -inf: the sum below sends it to -inf whatever else holds.
    bias = jnp.zeros((b, v), jnp.float32).at[rows, idx].add(
        jnp.where(valid & ~jnp.isposinf(vals), vals, 0.0), mode="drop")
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


def _sums(terms: Callable[[int], jax.Array], n: int, zero: jax.Array) -> jax.Array:
    """[B, n]: row sums of terms(0..n-1), each [B, V], as one variadic reduce, so that the n
    sums read the row once (n separate sums would read it n times)."""
    ops = tuple(terms(j) for j in range(n))
    sums = jax.lax.reduce(ops, (zero,) * n,
                          lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (1,))
    return jnp.stack(sums, axis=-1)


def _search(lo: jax.Array, hi: jax.Array, measure: Callable[[jax.Array], jax.Array],
            need: jax.Array, wide: bool) -> jax.Array:
    """Largest t in [lo, hi] with measure(t) >= need, to 2^-32 of the range, for a measure
    that falls as t rises (a prefix of the thresholds passes). `measure` takes [B, W - 1]
    thresholds and makes one pass over the row for all of them: a W-way search (`wide`, W = 16)
    needs a quarter of the passes of a bisection (8 for 16^8 = 2^32)."""
    ways, passes = _WIDE_SEARCH if wide else _BISECTION
    frac = jnp.arange(1, ways, dtype=jnp.float32) / ways

    def body(_, c):
        lo, hi = c
        t = lo[:, None] + (hi - lo)[:, None] * frac  # rises with its index
        passed = jnp.sum(measure(t) >= need[:, None], axis=-1)
        grid = jnp.concatenate([lo[:, None], t, hi[:, None]], axis=-1)
        pick = jnp.take_along_axis(grid, jnp.stack([passed, passed + 1], axis=-1), axis=-1)
        return pick[:, 0], pick[:, 1]

    lo, _ = jax.lax.fori_loop(0, passes, body, (lo, hi))
    return lo


def _finite_min(x: Float[Array, "B V"]) -> Float[Array, " B"]:
    """Each row's smallest finite value (-inf for a row masked whole)."""
    lo = jnp.min(jnp.where(x > -jnp.inf, x, jnp.inf), axis=-1)
    return jnp.minimum(lo, x.max(axis=-1))


def _threshold_by_count(x: Float[Array, "B V"], k: Int[Array, " B"], wide: bool = True
                        ) -> Float[Array, " B"]:
    """Largest t with count(x >= t) >= k: the k-th largest value, ties kept (the smallest
    finite value where fewer than k are finite: masked tokens stay out)."""

    def count(t: jax.Array) -> jax.Array:
        return _sums(lambda j: (x >= t[:, j:j + 1]).astype(jnp.int32), t.shape[1],
                     jnp.int32(0))

    return _search(_finite_min(x), x.max(axis=-1), count, k, wide)


def _threshold_by_mass(x: Float[Array, "B V"], floor: Float[Array, " B"],
                       top_p: Float[Array, " B"], shards: int = 1, wide: bool = True
                       ) -> Float[Array, " B"]:
    """Largest t such that the tokens with x >= t (and x >= floor: what top-k and min-p keep)
    hold top_p of the probability of those with x >= floor: the nucleus's least logit, found
    on the logits (softmax is monotonic).

    The search starts 128 below the row's max (and not below `floor`, so every threshold tried
    leaves the top-k's losers out): a token further down has a probability under e^-128 of the
    max's, which float32 sums as 0 and which never wins the Gumbel draw. `wide`: each pass
    recomputes the probabilities it sums, so no [B, V] probability array is written or read;
    else they are stored once and each pass reads them beside the logits.
    """
    m, log_z, _ = row_stats(jnp.where(x >= floor[:, None], x, -jnp.inf), shards)
    if wide:
        def probs(t: jax.Array) -> tuple[jax.Array, jax.Array]:
            # The barrier ties the row to the loop's state, so XLA computes p inside each pass
            # instead of hoisting a [B, V] probability array out of the loop.
            xs, _ = jax.lax.optimization_barrier((x, t))
            return xs, jnp.exp(xs - m - log_z)
    else:
        stored = jax.lax.optimization_barrier(jnp.exp(x - m - log_z))  # once, not per pass

        def probs(t: jax.Array) -> tuple[jax.Array, jax.Array]:
            return x, stored

    def mass(t: jax.Array) -> jax.Array:
        xs, p = probs(t)
        return _sums(lambda j: jnp.where(xs >= t[:, j:j + 1], p, 0.0), t.shape[1],
                     jnp.float32(0.0))

    return _search(jnp.maximum(m[:, 0] - 128.0, floor), m[:, 0], mass, top_p, wide)


def _filter_floor(x: Float[Array, "B V"], s: SamplingBatch, shards: int = 1,
                  wide: bool = True) -> Float[Array, " B"]:
    """[B]: the least (temperature-scaled) logit each row keeps under its top-k, top-p and
    min-p; -inf keeps every token. Order as vLLM: min-p (relative to the most probable token)
    and top-k, then top-p on the renormalised survivors of both.

    Thresholds come from a search (16-way where `wide`, else a bisection) rather than a full
    sort of the vocabulary, which costs ~100x more on CPU; each search (about 10 reads of the
    row when wide) runs only when some row of the batch uses its filter. Only [B] thresholds
    leave: the caller masks the row inside the pass that draws, so no filtered [B, V] array
    is written.
    """
    b, v = x.shape
    k = jnp.clip(s.top_k, 1, v)
    minus_inf = jnp.full((b,), -jnp.inf, jnp.float32)
    kth = jax.lax.cond(jnp.any(k < v),
                       lambda x: jnp.where(k >= v, -jnp.inf, _threshold_by_count(x, k, wide)),
                       lambda x: minus_inf, x)
    # p >= min_p * p_max  <=>  x >= max + log(min_p) (-inf where min_p = 0)
    least = jax.lax.cond(jnp.any(s.min_p > 0.0),
                         lambda x: x.max(axis=-1) + jnp.log(s.min_p), lambda x: minus_inf, x)
    base = jnp.maximum(kth, least)  # what top-k and min-p keep: the nucleus renormalises it
    top = jax.lax.cond(
        jnp.any(s.top_p < 1.0),
        lambda x: jnp.where(s.top_p >= 1.0, -jnp.inf, _threshold_by_mass(x, base, s.top_p,
                                                                         shards, wide)),
        lambda x: minus_inf, x)
    return jnp.maximum(base, top)


# The draw's candidates on a GPU: (tokens a run, runs kept), 4,096 candidates a row. A top-k
# of at most 64 and a nucleus or min-p floor above the best run left out are found on the
# candidates alone (_candidate_draw); other rows are searched on the whole row.
_CANDIDATES = (64, 64)
# The name scope of the draw's whole-row work (the rows the candidates did not settle): the
# deviceless HBM estimate counts those conditionals skipped for a batch the candidates settle.
WHOLE_ROW_SCOPE = "sampler_whole_row"
# The name scope of the candidate path (absent from a program that has none: a vocabulary
# too small for one, or XLA:CPU's bisection).
CANDIDATES_SCOPE = "sampler_candidates"


def candidate_shape(v: int, shards: int = 1,
                    candidates: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """(run length, runs kept) of the candidate path for a `v`-token row split in `shards`
    equal parts, or None where it does not pay (a part of fewer than four times the kept
    runs) or is turned off ((0, 0))."""
    chunk, keep = _CANDIDATES if candidates is None else candidates
    if chunk <= 0 or keep <= 0:
        return None
    return (chunk, keep) if cdiv(v // shards, chunk) >= 4 * keep else None


def best_runs(x: Float[Array, "B V"], chunk: int, keep: int
              ) -> tuple[Float[Array, "B C"], Int[Array, "B C"], Float[Array, "B K1"]]:
    """The `keep` runs of `chunk` consecutive tokens with the largest maxima, as values and ids
    [B, keep * chunk] (padding past the row: -inf, ids past it), and the maxima of the best
    keep + 1 runs, largest first: the last is the best run left out."""
    b, v = x.shape
    n = cdiv(v, chunk)
    if n * chunk > v:
        x = jnp.pad(x, ((0, 0), (0, n * chunk - v)), constant_values=-jnp.inf)
    runs = x.reshape(b, n, chunk)
    top, which = jax.lax.top_k(runs.max(axis=-1), keep + 1)  # one read of the row
    vals = jnp.take_along_axis(runs, which[:, :keep, None], axis=1).reshape(b, keep * chunk)
    ids = (which[:, :keep, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)).reshape(
        b, keep * chunk)
    return vals, ids.astype(jnp.int32), top


def row_candidates(x: Float[Array, "B V"], chunk: int, keep: int
                   ) -> tuple[Float[Array, "B C"], Int[Array, "B C"], Float[Array, " B"]]:
    """The candidates of a whole row (`best_runs`) and the largest maximum of a run left out
    [B]: no token outside the candidates is above it."""
    vals, ids, top = best_runs(x, chunk, keep)
    return vals, ids, top[:, keep]


def _candidate_draw(logits: Float[Array, "B V"], temp: Float[Array, " B"], s: SamplingBatch,
                    active: Bool[Array, " B"], keys: jax.Array, chunk: int, keep: int,
                    pick: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] = row_candidates,
                    shards: int = 1, keep_split: Callable[[jax.Array], jax.Array] = lambda x: x
                    ) -> tuple[Int[Array, " B"], Bool[Array, " B"]]:
    """Each filtering (`active`) row's draw from its candidates (the kept runs of
    `row_candidates`, scaled by the row's temperature) and whether it is exact: every token at or
    above the row's floor is a candidate, and each threshold the floor is made of is the one
    the whole row gives. Rows where this does not hold are drawn on the whole row by the
    caller.

    The candidates are sorted (4,096 a row, not the vocabulary): the top-k threshold is the
    k-th of them, the nucleus's the first whose running sum of probabilities reaches top_p,
    min-p's the max plus log(min_p). A top-k or nucleus threshold above the best run left out
    (`bound`) is the whole row's: every token above it is a candidate, and k <= keep runs
    always hold the top k (each token above the k-th best run's maximum lies in one of the
    top k runs). The nucleus sums the top-k's survivors, or with no top-k the whole row's
    probabilities, whose normaliser one read of the row gives. Searched on the whole row
    (`_filter_floor`), the same thresholds keep the same tokens, and the Gumbel draw over the
    kept candidates, each with the noise of its own id, is the whole row's draw. `pick` finds
    the candidates (`row_candidates`; under tensor parallel `TensorParallel.candidates`, from the
    vocab-split row, with its `shards` and `keep_split` for the whole row's normaliser).
    """
    b, v = logits.shape
    raw, cid, raw_bound = pick(logits, chunk, keep)
    # Scaling by a positive temperature keeps the order: the same runs as scaling first.
    cv, bound = raw / temp[:, None], raw_bound / temp
    n = cv.shape[1]
    desc = -jnp.sort(-cv, axis=-1)  # masked (-inf) candidates last
    k_on, p_on, m_on = active & (s.top_k < v), active & (s.top_p < 1.0), active & (s.min_p > 0)
    at_k = jnp.take_along_axis(desc, jnp.clip(s.top_k, 1, n)[:, None] - 1, axis=1)[:, 0]
    # As _threshold_by_count: the smallest finite value where fewer than k are finite.
    kth = jnp.where(k_on, jnp.where(at_k > -jnp.inf, at_k, _finite_min(desc)), -jnp.inf)
    top_m = desc[:, 0]  # the row's max: the best run is a candidate
    least = jnp.where(m_on, top_m + jnp.log(s.min_p), -jnp.inf)
    # What top-k and min-p keep (vLLM applies both before the nucleus): all candidates where
    # either threshold is above the best run left out.
    base = jnp.maximum(kth, least)
    kept_k = desc >= base[:, None]
    held = (k_on | m_on) & (base > bound)
    # The nucleus's normaliser: of those survivors (candidates all), else of the whole row,
    # read once only when some row has top-p with neither filter.
    z_k = jnp.log(jnp.sum(jnp.where(kept_k, jnp.exp(desc - top_m[:, None]), 0.0), axis=-1))
    z_w = jax.lax.cond(jnp.any(p_on & ~k_on & ~m_on),
                       lambda x: row_stats(keep_split(x / temp[:, None]), shards)[1][:, 0],
                       lambda x: z_k, logits)
    log_z = jnp.where(k_on | m_on, z_k, z_w)
    cum = jnp.cumsum(jnp.where(kept_k, jnp.exp(desc - top_m[:, None] - log_z[:, None]), 0.0),
                     axis=-1)
    reach = cum >= s.top_p[:, None]
    at_p = jnp.take_along_axis(desc, jnp.argmax(reach, axis=-1)[:, None], axis=1)[:, 0]
    # As _threshold_by_mass's search, never below 128 under the max or below the survivors'.
    lo = jnp.maximum(top_m - 128.0, base)
    top = jnp.where(p_on, jnp.where(jnp.any(reach, axis=-1), jnp.maximum(at_p, lo), lo),
                    -jnp.inf)
    floor = jnp.maximum(base, top)
    # A nucleus over survivors some of which are not candidates cannot be summed here.
    exact = ((~k_on | ((s.top_k <= n) & (kth > bound))) & (~p_on | (top > bound))
             & (~p_on | ~(k_on | m_on) | held) & (floor > bound))
    noise = jax.vmap(lambda key, ids: jnp.take(jax.random.gumbel(key, (v,)), ids,
                                               mode="clip"))(keys, cid)
    z = jnp.where(cv >= floor[:, None], cv, -jnp.inf) + noise
    best = z.max(axis=-1, keepdims=True)
    # The first id among equal maxima, as the whole row's argmax picks.
    drawn = jnp.min(jnp.where(z == best, cid, v), axis=-1).astype(jnp.int32)
    return drawn, exact


def row_chunks(n: int) -> tuple[int, int]:
    """(chunks, chunk length) that `row_stats` cuts n logits into: the largest divisor of n
    not above sqrt(n) when it leaves chunks of at most 4 sqrt(n), else about sqrt(n) chunks of
    ceil(sqrt(n)) with the last one padded."""
    root = math.isqrt(n)
    c = max(d for d in range(1, root + 1) if n % d == 0)
    if n // c <= 4 * max(root, 1):
        return c, n // c
    length = math.isqrt(n - 1) + 1
    return cdiv(n, length), length


def _combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Merge two (max, sum of exp(x - max), index of the first max) triples."""
    m1, s1, i1 = a
    m2, s2, i2 = b
    # The side with the larger max keeps its sum; the other's is scaled by exp(-|m1 - m2|)
    # (one exp per merge). Equal maxima scale by 1, so two -inf maxima (a row masked so far)
    # give 0 + 0 rather than exp(-inf - -inf) = nan.
    scale = jnp.where(m1 == m2, 1.0, jnp.exp(-jnp.abs(m1 - m2)))
    first = m1 >= m2
    s = jnp.where(first, s1 + s2 * scale, s1 * scale + s2)
    i = jnp.where(m1 > m2, i1, jnp.where(m2 > m1, i2, jnp.minimum(i1, i2)))
    return jnp.maximum(m1, m2), s, i


def row_stats(logits: Float[Array, "B V"], shards: int = 1
              ) -> tuple[Float[Array, "B 1"], Float[Array, "B 1"], Int[Array, " B"]]:
    """Each row's max, log(sum(exp(logits - max))) and argmax (first on ties), from one read
    of the logits: an online log-sum-exp carried beside the argmax in one variadic reduce.

    Two-pass log_softmax reads the row twice (the max, then the sum that needs it); at a
    262,144-token vocabulary and 256 rows that is 268 MB more per step. Each of the `shards`
    equal parts of the row (the vocab split under tensor parallel: each device reduces its
    own, and only [B]-sized partials move) is reduced in `row_chunks` chunks and then across
    them, so no serial chain runs longer than a few sqrt(V) (XLA:CPU reduces a custom reducer
    element by element) and the sum keeps the two-pass precision.
    """
    b, v = logits.shape
    n = v // shards
    c, length = row_chunks(n)
    x = logits.reshape(b, shards, n)
    ids = jax.lax.broadcasted_iota(jnp.int32, (b, shards, n), 1) * n + \
        jax.lax.broadcasted_iota(jnp.int32, (b, shards, n), 2)
    if c * length > n:  # pad with masked logits, whose ids are past every real one
        pad = ((0, 0), (0, 0), (0, c * length - n))
        x = jnp.pad(x, pad, constant_values=-jnp.inf)
        ids = jnp.pad(ids, pad, constant_values=v)
    x = x.reshape(b, shards, c, length)
    ids = ids.reshape(b, shards, c, length)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(v))
    # Each logit enters as (x, exp(x - x) = 1, its id); a -inf one (masked) as a sum of 0.
    ones = (x > -jnp.inf).astype(jnp.float32)
    part = jax.lax.reduce((x, ones, ids), init, _combine, (3,))
    m, total, first = jax.lax.reduce(part, init, _combine, (1, 2))
    return m[:, None], jnp.log(total)[:, None], first


def sample(
    logits: Float[Array, "B V"], s: SamplingBatch, flags: SamplingFlags,
    top_k: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] = jax.lax.top_k,
    keep_split: Callable[[jax.Array], jax.Array] = lambda x: x,
    vocab_shards: int = 1, wide_search: bool | None = None,
    candidates: tuple[int, int] | None = None,
    pick_candidates: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None,
    num_top: int = NUM_TOP_LOGPROBS,
) -> tuple[Int[Array, " B"], Float[Array, " B"], Int[Array, "B N"], Float[Array, "B N"],
           Int[Array, " B"]]:
    """Sampled ids, their logprobs (vLLM's raw_logprobs: of the model's logits under the token
    mask, before token constraints, penalties and temperature), the top-N candidates
    (N = min(num_top, V); 0 unless flags.top_logprobs), found by `top_k` (lax.top_k's
    contract), and each sampled id's rank in its row (1 = the most likely; 0 unless
    flags.top_logprobs). Tensor
    parallel passes a `top_k` that works on the vocab-split logits, a `keep_split` that pins
    a [B, V] value to that split (else XLA may gather the filtered logits whole), and the
    number of vocab shards. `wide_search`: the filters' threshold search reads the row as
    few times as it can (a GPU; the default off XLA:CPU) or bisects (XLA:CPU). `candidates`:
    (tokens a run, runs kept) of the filtering rows' candidate path (default: `_CANDIDATES`
    where the search is wide, else none; (0, 0) draws every row on the whole row), found by
    `pick_candidates` (`row_candidates`' contract; tensor parallel passes its own, and without
    one a vocab-split row has no candidate path).

    Rows with temperature 0 take the argmax. Filtering and random draws run only when some row
    needs them (lax.cond), so one compiled step serves every mix of parameters.
    """
    logits = logits.astype(jnp.float32)
    if s.token_mask is not None:  # structure, so part of the compile key: absent unless a
        logits = apply_token_mask(logits, s.token_mask)  # row has a grammar or bad words
    # vLLM's raw_logprobs: of the model's logits under the output's token mask (vLLM masks a
    # grammar before its sampler), before logit_bias, allowed ids, min_tokens and penalties.
    raw = logits
    # Then vLLM's order: the token constraints (its logits processors), then the penalties.
    if s.bias_ids is not None:  # likewise: no cost without it
        logits = apply_token_bias(logits, s.bias_ids, s.bias_vals)
    if flags.use_penalties:
        logits = apply_penalties(logits, s)
    # log_softmax's own terms per row, [B, 1] each; no [B, V] log-probability array is kept:
    # a logprob is (logit - row max) - log(sum(exp(logits - row max))), as log_softmax computes.
    row_max, log_norm, greedy_ids = row_stats(logits, vocab_shards)
    if raw is not logits:  # a second read of the row, only where constraints or penalties ran
        raw_max, raw_norm, _ = row_stats(raw, vocab_shards)
    else:
        raw_max, raw_norm = row_max, log_norm
    wide = searches_wide() if wide_search is None else wide_search
    v = logits.shape[-1]

    def draw(_: None) -> Int[Array, " B"]:
        active = s.temperature > 0
        temp = jnp.where(active, s.temperature, 1.0)
        filters = active & ((s.top_k < v) | (s.top_p < 1.0) | (s.min_p > 0.0))
        keys = row_keys(s)
        b = logits.shape[0]
        # By default only where the search is wide (a GPU): on XLA:CPU the row sits in cache,
        # the whole-row bisection costs about what the candidates do, and a row they cannot
        # settle pays for both (docs/benchmarks.md).
        shape = candidate_shape(v, vocab_shards, candidates if candidates is not None else
                                _CANDIDATES if wide else (0, 0))
        if vocab_shards > 1 and pick_candidates is None:
            shape = None
        pick = pick_candidates or row_candidates
        if shape is None:
            picked, exact = jnp.zeros(b, jnp.int32), jnp.zeros(b, bool)
        else:  # filtering rows first from their candidates: no search reads the whole row
            with jax.named_scope(CANDIDATES_SCOPE):
                picked, exact = jax.lax.cond(
                    jnp.any(filters),
                    lambda x: _candidate_draw(x, temp, s, filters, keys, *shape, pick,
                                              vocab_shards, keep_split),
                    lambda x: (jnp.zeros(b, jnp.int32), jnp.zeros(b, bool)), logits)
        # Rows left to the whole row: no filter, or one the candidates could not settle. Only
        # those rows' filters are searched there (the others' count as off).
        rest = filters & ~exact
        whole = active & ~(filters & exact)
        off = dataclasses.replace(s, top_k=jnp.where(rest, s.top_k, v),
                                  top_p=jnp.where(rest, s.top_p, 1.0),
                                  min_p=jnp.where(rest, s.min_p, 0.0))
        with jax.named_scope(WHOLE_ROW_SCOPE):  # named for the HBM estimate (jpaged/aot)
            floor = jax.lax.cond(jnp.any(rest),
                                 lambda x: _filter_floor(keep_split(x / temp[:, None]), off,
                                                         vocab_shards, wide),
                                 lambda x: jnp.full(x.shape[:1], -jnp.inf, jnp.float32), logits)

        def whole_row(x: jax.Array) -> jax.Array:
            gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,)))(keys)
            x = keep_split(x / temp[:, None])
            kept = jnp.where(x >= floor[:, None], x, -jnp.inf)
            return jnp.argmax(keep_split(kept + gumbel), axis=-1).astype(jnp.int32)

        with jax.named_scope(WHOLE_ROW_SCOPE):
            drawn = jax.lax.cond(jnp.any(whole), whole_row,
                                 lambda x: jnp.zeros(b, jnp.int32), logits)
        sampled = jnp.where(filters & exact, picked, drawn)
        return jnp.where(active, sampled, greedy_ids)

    ids = jax.lax.cond(jnp.all(s.temperature <= 0), lambda _: greedy_ids, draw, None)
    chosen = jnp.take_along_axis(raw, ids[:, None], axis=-1)
    chosen_lp = ((chosen - raw_max) - raw_norm)[:, 0]
    b = logits.shape[0]
    if not flags.top_logprobs:  # nobody reads candidates: no top-k over the vocabulary
        return (ids, chosen_lp, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32),
                jnp.zeros(b, jnp.int32))
    # The logprob is monotonic in the logit: the top logits are the top logprobs, and a
    # token's rank is one more than the logits above its own (ties share the better rank).
    top_logits, top_ids = top_k(raw, min(num_top, v))
    ranks = 1 + jnp.sum(keep_split(raw) > chosen, axis=-1).astype(jnp.int32)
    return (ids, chosen_lp, top_ids.astype(jnp.int32), (top_logits - raw_max) - raw_norm,
            ranks)
