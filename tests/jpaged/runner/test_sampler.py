"""On-device sampling: filters, penalties, seeds and logprobs against direct numpy math."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from jpaged.runner.sampler import (
    SamplingBatch,
    SamplingFlags,
    _candidate_draw,
    _threshold_by_count,
    _threshold_by_mass,
    apply_penalties,
    candidate_shape,
    row_chunks,
    row_keys,
    row_stats,
    sample,
)

V = 12


def _batch(b, **kw):
    base = dict(
        temperature=np.ones(b, np.float32), top_k=np.full(b, V, np.int32),
        top_p=np.ones(b, np.float32), min_p=np.zeros(b, np.float32),
        seeds=np.arange(b, dtype=np.uint32), counters=np.zeros(b, np.int32),
        repetition_penalty=np.ones(b, np.float32), presence_penalty=np.zeros(b, np.float32),
        frequency_penalty=np.zeros(b, np.float32), history=np.zeros((b, 0), np.int32),
        history_is_output=np.zeros((b, 0), bool))
    base.update(kw)
    return SamplingBatch(**base)


def _draws(logits, sb, flags, n=400, wide=None):
    """Sample n times with different counters; return the set of ids drawn per row."""
    fn = jax.jit(sample, static_argnames=("flags", "wide_search"))
    seen = [set() for _ in range(logits.shape[0])]
    for c in range(n):
        sb.counters = np.full(logits.shape[0], c, np.int32)
        ids = np.asarray(fn(logits, sb, flags=flags, wide_search=wide)[0])
        for r, t in enumerate(ids):
            seen[r].add(int(t))
    return seen


def test_greedy_is_argmax_and_logprobs():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)).astype(np.float32)
    sb = _batch(3, temperature=np.zeros(3, np.float32))
    ids, lp, top_ids, top_lp, ranks = sample(logits, sb, SamplingFlags(top_logprobs=True))
    np.testing.assert_array_equal(np.asarray(ids), logits.argmax(-1))
    np.testing.assert_array_equal(np.asarray(ranks), 1)  # greedy: the best token
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), ref.max(-1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids)[:, :4], np.argsort(-ref, -1)[:, :4])
    np.testing.assert_allclose(np.asarray(top_lp)[:, :4], -np.sort(-ref, -1)[:, :4], rtol=1e-5)
    # Nobody asking for candidates: the same tokens and logprobs, no candidates computed.
    ids0, lp0, top_ids0, top_lp0, _ = sample(logits, sb, SamplingFlags())
    np.testing.assert_array_equal(np.asarray(ids0), np.asarray(ids))
    np.testing.assert_array_equal(np.asarray(lp0), np.asarray(lp))
    assert top_ids0.shape == (3, 0) and top_lp0.shape == (3, 0)


def test_sampled_tokens_rank_is_counted_over_the_whole_row():
    """A hot draw often lands outside the top candidates: its rank is still exact (one more
    than the logits above its own), with top-k/top-p filters on and off."""
    rng, v = np.random.default_rng(2), 500
    logits = (rng.standard_normal((4, v)) * 2).astype(np.float32)
    flags = SamplingFlags(top_logprobs=True)
    sb = _batch(4, temperature=np.full(4, 3.0, np.float32),
                top_k=np.array([v, 50, v, v], np.int32), top_p=np.array([1, 1, 0.9, 1],
                                                                      np.float32))
    outside = 0
    for c in range(12):
        ids, _, top_ids, _, ranks = sample(logits, dataclasses.replace(
            sb, counters=np.full(4, c, np.int32)), flags)
        ids, ranks = np.asarray(ids), np.asarray(ranks)
        want = 1 + (logits > logits[np.arange(4), ids][:, None]).sum(-1)
        np.testing.assert_array_equal(ranks, want)
        outside += int((ranks > top_ids.shape[1]).sum())
    assert outside > 0  # some draws were ranked past the top candidates


def test_row_stats_one_read_matches_two_pass_log_softmax():
    rng = np.random.default_rng(1)
    for v, shards in ((300, 1), (300, 2), (300, 4), (4099, 1), (8198, 2), (49152, 1)):
        x = (rng.standard_normal((5, v)) * 4).astype(np.float32)
        x[0, [7, 3, v - 1]] = x[0].max() + 2  # ties: the first id wins, as argmax's
        x[1, : v // 2] = -np.inf  # masked logits count for nothing
        x[2, 1:] = -np.inf  # one token left
        m, log_norm, ids = map(np.asarray, jax.jit(row_stats, static_argnums=1)(x, shards))
        top = x.max(-1, keepdims=True)
        with np.errstate(over="ignore"):
            ref = np.log(np.exp((x - top).astype(np.float64)).sum(-1, keepdims=True))
        np.testing.assert_array_equal(ids, x.argmax(-1))
        np.testing.assert_array_equal(m, top)
        np.testing.assert_allclose(log_norm, ref, rtol=0, atol=2e-6)
        assert ids[0] == 3 and log_norm[2, 0] == 0.0
    # A row with nothing allowed: max -inf, log-normaliser -inf, id 0 (as argmax), no nan.
    m, log_norm, ids = jax.jit(row_stats)(np.full((1, 64), -np.inf, np.float32))
    assert float(m[0, 0]) == float(log_norm[0, 0]) == -np.inf and int(ids[0]) == 0


def test_row_chunks_cover_the_row_with_short_chains():
    assert row_chunks(49152) == (192, 256) and row_chunks(262144) == (512, 512)
    assert row_chunks(128256 // 4) == (167, 192)
    assert row_chunks(4099) == (64, 65)  # a prime: padded
    for n in (1, 2, 75, 150, 4099, 50257, 64128, 151936):
        c, length = row_chunks(n)
        assert n <= c * length < n + length and max(c, length) <= 4 * math.isqrt(n) + 1


@pytest.mark.parametrize("wide", [False, True], ids=["bisection", "wide"])
def test_top_k_top_p_min_p_restrict_support(wide):
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)] * 3, np.float32))
    sb = _batch(3, top_k=np.array([2, V, V], np.int32), top_p=np.array([1.0, 0.65, 1.0],
                np.float32), min_p=np.array([0.0, 0.0, 0.6], np.float32))
    seen = _draws(logits, sb, SamplingFlags(), wide=wide)
    assert seen[0] == {0, 1}  # top-2
    assert seen[1] == {0, 1}  # 0.4 + 0.3 >= 0.65
    assert seen[2] == {0, 1}  # p >= 0.6 * 0.4 = 0.24
    # Each filter alone in its batch: the searches the batch does not use are skipped.
    for r in range(3):
        alone = _batch(1, top_k=sb.top_k[r:r + 1], top_p=sb.top_p[r:r + 1],
                       min_p=sb.min_p[r:r + 1])
        assert _draws(logits[r:r + 1], alone, SamplingFlags(), n=150, wide=wide)[0] == {0, 1}


@pytest.mark.parametrize("wide", [False, True], ids=["bisection", "wide"])
def test_thresholds_are_exact_on_a_real_vocabulary(wide):
    """The searches (16-way and bisection) land on the k-th largest logit and the nucleus
    floor that a full sort gives, on 49,152-token rows (ties and masked tokens included)."""
    rng = np.random.default_rng(2)
    b, v = 6, 49152
    x = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    x[1, :100] = x[1].max() + 1  # 100 tied at the top
    x[2, rng.choice(v, v // 2, replace=False)] = -np.inf  # a grammar's mask
    k = np.array([1, 50, 7, 1000, v // 3, 2], np.int32)
    kth = np.asarray(jax.jit(_threshold_by_count, static_argnums=2)(x, k, wide))
    true_kth = -np.sort(-x, -1)[np.arange(b), k - 1]
    # The same tokens kept (a bisection may stop an ulp below the k-th value).
    np.testing.assert_array_equal(x >= kth[:, None], x >= true_kth[:, None])
    p = np.asarray(jax.nn.softmax(x, axis=-1), np.float64)
    top_p = np.array([0.9, 0.5, 0.95, 0.3, 0.999, 0.7], np.float32)
    floor = np.array([-np.inf, -np.inf, -np.inf, kth[3], -np.inf, -np.inf], np.float32)
    least = np.asarray(jax.jit(_threshold_by_mass, static_argnums=(3, 4))(x, floor, top_p, 1,
                                                                          wide))
    for r in range(b):  # the kept tokens reach top_p (of what the floor leaves, row 3 top-k's
        # survivors); without the least of them they do not
        alive = x[r] >= floor[r]
        q = np.where(alive, p[r], 0) / p[r][alive].sum()
        kept = x[r] >= least[r]
        assert kept[alive].all() == (least[r] <= floor[r]) and not kept[~alive].any()
        assert q[kept].sum() >= top_p[r] - 1e-4  # float32 sums of 49,152
        assert q[x[r] > x[r][kept].min()].sum() < top_p[r] + 1e-4


def test_top_k_ignores_masked_tokens():
    """top_k counts among the tokens a mask allows: with half the vocabulary at -inf, top-2
    still keeps two tokens (the search once started at the row's -inf minimum and kept all)."""
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1] + [1e-3] * (V - 4)], np.float32))
    logits[0, 6:] = -np.inf
    sb = _batch(1, top_k=np.array([2], np.int32))
    assert _draws(logits, sb, SamplingFlags(), n=200)[0] == {0, 1}


def test_unfiltered_sampling_covers_support_and_seed_is_reproducible():
    logits = np.log(np.array([[0.25, 0.25, 0.25, 0.25] + [1e-12] * (V - 4)], np.float32))
    flags = SamplingFlags()
    assert _draws(logits, _batch(1), flags, n=200)[0] == {0, 1, 2, 3}
    a = np.asarray(sample(logits, _batch(1), flags)[0])
    b = np.asarray(sample(logits, _batch(1), flags)[0])
    assert (a == b).all()


def test_penalties_match_vllm_formulas():
    logits = np.array([[2.0, -1.0, 0.5, 3.0] + [0.0] * (V - 4)], np.float32)
    hist = np.array([[0, 1, 2, 2, -1]], np.int32)  # prompt: 0, 1; output: 2, 2
    is_out = np.array([[False, False, True, True, False]])
    sb = _batch(1, repetition_penalty=np.array([2.0], np.float32),
                presence_penalty=np.array([0.5], np.float32),
                frequency_penalty=np.array([0.25], np.float32), history=hist,
                history_is_output=is_out)
    out = np.asarray(apply_penalties(logits, sb))[0]
    assert np.isclose(out[0], 1.0)  # 2 / 2 (seen in prompt)
    assert np.isclose(out[1], -2.0)  # -1 * 2
    assert np.isclose(out[2], 0.25 - 0.5 - 0.5)  # 0.5 / 2, minus 2 x 0.25, minus 0.5
    assert np.isclose(out[3], 3.0)  # untouched


def test_logit_bias_before_penalties_and_raw_logprobs():
    """vLLM's order: the token constraints (logit_bias) act before the penalties; the logprobs
    are raw (of the model's logits). Token 0, seen in the prompt, logit 2 and bias -1 under a
    repetition penalty of 2: (2 - 1) / 2 = 0.5 beats token 1's 0.25 (bias after the penalty
    would give 2 / 2 - 1 = 0 and pick token 1)."""
    from jpaged.runner.batch import constraint_rows

    logits = np.array([[2.0, 0.25] + [-5.0] * (V - 2)], np.float32)
    ids, vals = constraint_rows([(np.array([0], np.int32), np.array([-1.0], np.float32))], 1)
    sb = _batch(1, temperature=np.zeros(1, np.float32),
                repetition_penalty=np.array([2.0], np.float32),
                history=np.array([[0]], np.int32), history_is_output=np.array([[False]]),
                bias_ids=ids, bias_vals=vals)
    got, lp, top_ids, top_lp, rank = sample(
        logits, sb, SamplingFlags(use_penalties=True, top_logprobs=True))
    assert int(got[0]) == 0
    raw = logits[0] - np.log(np.exp(logits[0]).sum())
    assert np.isclose(float(lp[0]), raw[0], rtol=1e-5) and int(rank[0]) == 1
    np.testing.assert_allclose(np.asarray(top_lp)[0, :2], raw[:2], rtol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["bisection", "wide"])
def test_min_p_comes_before_the_nucleus(wide):
    """vLLM's order: min-p masks first, top-p then sums the renormalised survivors. With
    probabilities .5 .3 .1 .1, min_p 0.3 keeps 0 and 1 (renormalised .625 and .375) and top_p
    0.6 then keeps token 0 alone (a nucleus over the whole row would keep 0 and 1)."""
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.1] + [1e-12] * (V - 4)], np.float32))
    sb = _batch(1, top_p=np.array([0.6], np.float32), min_p=np.array([0.3], np.float32))
    assert _draws(logits, sb, SamplingFlags(), n=150, wide=wide)[0] == {0}


def test_mixed_greedy_and_sampled_rows():
    logits = np.log(np.array([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)] * 2, np.float32))
    sb = _batch(2, temperature=np.array([0.0, 1.0], np.float32))
    seen = _draws(logits, sb, SamplingFlags(), n=100)
    assert seen[0] == {0}
    assert seen[1] == {0, 1, 2}


def test_top_k_ties_and_top_p_one_keep_everything_needed():
    logits = np.zeros((1, V), np.float32)  # uniform: any k keeps the tied set
    sb = _batch(1, top_p=np.array([1.0], np.float32), min_p=np.array([0.5], np.float32))
    assert _draws(logits, sb, SamplingFlags(), n=300)[0] == set(range(V))


def test_logit_bias_and_allowed_token_ids_by_row():
    """Row 0: +100 on token 5 wins argmax; row 1: only tokens 2 and 7 may be drawn, every
    draw one of them; row 2: no constraint, as without the arrays; row 3: a -100 bias moves
    argmax off the best token."""
    from jpaged.runner.batch import constraint_rows

    b, v, flags = 4, V, SamplingFlags()
    logits = np.array(jax.random.normal(jax.random.key(3), (b, v)) * 3)
    logits[1] = 5.0
    logits[1, [2, 7]] = 0.0  # the two allowed tokens are the least likely ones, and equal
    best = logits.argmax(-1)
    rows = [(np.array([5], np.int32), np.array([100.0], np.float32)),
            (np.array([2, 7], np.int32), np.array([np.inf, np.inf], np.float32)),
            None,
            (np.array([best[3]], np.int32), np.array([-100.0], np.float32))]
    ids, vals = constraint_rows(rows, b)
    assert ids.shape == (4, 8) and (ids[2] == -1).all()
    greedy = _batch(b, temperature=np.zeros(b, np.float32))
    plain = sample(logits, greedy, flags)[0]
    got = sample(logits, _batch(b, temperature=np.zeros(b, np.float32), bias_ids=ids,
                                bias_vals=vals), flags)[0]
    assert int(got[0]) == 5 and int(got[1]) in (2, 7) and int(got[2]) == int(plain[2])
    assert int(got[3]) != best[3]
    hot = _batch(b, temperature=np.full(b, 1.5, np.float32), bias_ids=ids, bias_vals=vals)
    assert _draws(logits, hot, flags, n=100)[1] == {2, 7}


def test_banned_tokens_never_drawn_and_a_ban_beats_an_allow():
    """-inf entries (min_tokens' stop tokens) ban their tokens: row 0 bans its best token and
    boosts another with a logit_bias; row 1 allows 2 and 7 but bans 7, so only 2 is left; row
    2 bans nothing. Greedy and hot draws alike."""
    from jpaged.runner.batch import constraint_rows

    b, v, flags = 3, V, SamplingFlags()
    logits = np.array(jax.random.normal(jax.random.key(5), (b, v)) * 3)
    best = logits.argmax(-1)
    boosted = (int(best[0]) + 1) % v
    rows = [(np.array([best[0], boosted], np.int32), np.array([-np.inf, 0.5], np.float32)),
            (np.array([2, 7, 7], np.int32), np.array([np.inf, np.inf, -np.inf], np.float32)),
            None]
    ids, vals = constraint_rows(rows, b)
    greedy = _batch(b, temperature=np.zeros(b, np.float32), bias_ids=ids, bias_vals=vals)
    got, lps = sample(logits, greedy, flags)[:2]
    row0 = logits[0].copy()
    row0[best[0]] = -np.inf
    row0[boosted] += 0.5
    assert int(got[0]) == int(row0.argmax()) and int(got[1]) == 2 and int(got[2]) == best[2]
    # vLLM's raw_logprobs: of the model's logits, before the bias, allowed ids and bans.
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lps), raw[np.arange(b), np.asarray(got)], rtol=1e-5)
    hot = _batch(b, temperature=np.full(b, 2.0, np.float32), bias_ids=ids, bias_vals=vals)
    seen = _draws(logits, hot, flags, n=100)
    assert best[0] not in seen[0] and len(seen[0]) > 2 and seen[1] == {2}


def test_packed_token_mask_restricts_each_row_to_its_bits():
    """A 40-token vocabulary (two mask words, the second partly past the vocabulary): row 0
    allows tokens 3 and 33 only (33 is bit 1 of word 1), row 1 is all ones (unconstrained:
    as without a mask), row 2 allows only its least likely token. Greedy and sampled draws stay
    inside the bits; logprobs are of the masked distribution."""
    b, v, flags = 3, 40, SamplingFlags()
    logits = np.array(jax.random.normal(jax.random.key(7), (b, v)) * 3, np.float32)
    words = np.full((b, 2), -1, np.int32)
    words[0] = [1 << 3, 1 << 1]
    worst = int(logits[2].argmin())
    words[2] = 0
    words[2, worst // 32] = np.int32(np.uint32(1 << (worst % 32)).view(np.int32))
    greedy = _batch(b, temperature=np.zeros(b, np.float32), top_k=np.full(b, v, np.int32))
    plain = sample(logits, greedy, flags)
    ids, lps = sample(logits, _batch(b, temperature=np.zeros(b, np.float32),
                                     top_k=np.full(b, v, np.int32), token_mask=words), flags)[:2]
    want0 = 3 if logits[0, 3] > logits[0, 33] else 33
    assert int(ids[0]) == want0 and int(ids[1]) == int(plain[0][1]) and int(ids[2]) == worst
    assert float(lps[2]) == 0.0  # the only allowed token holds all the mass
    m = np.logaddexp(logits[0, 3], logits[0, 33])
    np.testing.assert_allclose(float(lps[0]), logits[0, want0] - m, rtol=1e-5)
    hot = _batch(b, temperature=np.full(b, 2.0, np.float32), top_k=np.full(b, v, np.int32),
                 token_mask=words)
    seen = _draws(logits, hot, flags, n=100)
    assert seen[0] == {3, 33} and seen[2] == {worst} and len(seen[1]) > 2


def _row_batch(b, v, **kw):
    """A SamplingBatch for b rows of a v-token vocabulary (filters off unless given)."""
    base = dict(top_k=np.full(b, v, np.int32), seeds=np.arange(b, dtype=np.uint32) + 7)
    base.update(kw)
    return _batch(b, **base)


def test_candidate_shape_only_where_it_pays():
    assert candidate_shape(49152) == (64, 64)
    # A vocab split over devices: each device's share must hold four times the runs kept.
    assert candidate_shape(49152, shards=2) == (64, 64)
    assert candidate_shape(49152, shards=8) is None
    assert candidate_shape(V) is None and candidate_shape(4 * 64 * 64 - 64) is None
    assert candidate_shape(512, candidates=(8, 16)) == (8, 16)
    assert candidate_shape(49152, candidates=(0, 0)) is None


def test_candidates_by_default_only_where_the_search_is_wide():
    """sample() takes the candidate path by default where the search is wide (a GPU), not on
    XLA:CPU's bisection: compiled, only the wide program sorts its candidates."""
    x = np.zeros((2, 49152), np.float32)
    sb = _row_batch(2, 49152, top_k=np.full(2, 64, np.int32))

    def sorts(wide):
        text = jax.jit(sample, static_argnames=("flags", "wide_search")).lower(
            x, sb, flags=SamplingFlags(), wide_search=wide).as_text()
        return "stablehlo.sort" in text

    assert sorts(True) and not sorts(False)


@pytest.mark.parametrize("wide", [False, True], ids=["bisection", "wide"])
def test_candidate_draws_equal_the_whole_rows(wide):
    """Filtering rows drawn from their 4,096 candidates draw exactly the tokens the whole-row
    search draws, row by row, with the same seeds: peaked and flat rows, ties at the top, a
    grammar's mask, a top-k beyond the candidates, every filter mix, greedy rows beside. The
    rows the candidates cannot settle (flat ones, the wide top-k, top-p over a wide nucleus)
    fall back to the whole row inside the same step."""
    rng = np.random.default_rng(0)
    b, v = 10, 49152
    x = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    x[3, :100] = x[3].max() + 1  # 100 tied at the top
    x[4, rng.choice(v, v // 2, replace=False)] = -np.inf  # a grammar's mask
    x[5] = 0.0  # flat: no run is better than another
    x[6] *= 0.1  # a wide nucleus
    x[8] *= 4  # peaked
    sb = _row_batch(b, v, top_k=np.array([64, v, 64, 50, 7, 64, v, 5000, v, 1], np.int32),
                    top_p=np.array([1, .95, .9, 1, .8, 1, .95, 1, .9, 1], np.float32),
                    min_p=np.array([0, 0, .05, 0, 0, 0, 0, 0, .1, 0], np.float32),
                    temperature=np.array([1, 1, .7, 1, 1, 1, 1, 1, 1, 0], np.float32))
    fn = jax.jit(sample, static_argnames=("flags", "wide_search", "candidates"))
    temp = np.where(sb.temperature > 0, sb.temperature, 1).astype(np.float32)
    filters = (sb.temperature > 0) & ((sb.top_k < v) | (sb.top_p < 1) | (sb.min_p > 0))
    for c in range(12):
        sb.counters = np.full(b, c, np.int32)
        got = np.asarray(fn(x, sb, flags=SamplingFlags(), wide_search=wide,
                            candidates=(64, 64))[0])
        whole = np.asarray(fn(x, sb, flags=SamplingFlags(), wide_search=wide,
                              candidates=(0, 0))[0])
        np.testing.assert_array_equal(got, whole)
    keys = row_keys(sb)
    drawn, exact = jax.jit(_candidate_draw, static_argnums=(5, 6))(
        x, temp, sb, filters, keys, 64, 64)
    # Settled by the candidates: the peaked rows' filters; not: the flat rows, the top-k of
    # 5,000 (more than the candidates hold), top-p alone over Gaussian logits of scale 3.
    np.testing.assert_array_equal(np.asarray(exact), [True, False, True, True, True, False,
                                                      False, False, True, False])
    np.testing.assert_array_equal(np.asarray(drawn)[np.asarray(exact)], got[np.asarray(exact)])


def test_candidate_path_on_a_small_vocabulary_with_short_runs():
    """The same equality with runs of 8 and 16 kept (128 candidates of a 512-token row), where
    top-k above the candidates and masked runs are common."""
    rng = np.random.default_rng(1)
    b, v = 6, 512
    x = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    x[1, 40:] = -np.inf  # only 40 tokens allowed: fewer finite than some k below
    x[2, ::2] = -np.inf
    sb = _row_batch(b, v, top_k=np.array([5, 64, 200, v, 16, 3], np.int32),
                    top_p=np.array([0.9, 1, 1, 0.5, 0.99, 1], np.float32),
                    min_p=np.array([0, 0, 0.01, 0, 0, 0.2], np.float32))
    fn = jax.jit(sample, static_argnames=("flags", "wide_search", "candidates"))
    for c in range(20):
        sb.counters = np.full(b, c, np.int32)
        np.testing.assert_array_equal(
            np.asarray(fn(x, sb, flags=SamplingFlags(), candidates=(8, 16))[0]),
            np.asarray(fn(x, sb, flags=SamplingFlags(), candidates=(0, 0))[0]))
    keys = row_keys(sb)
    _, exact = _candidate_draw(x, np.ones(b, np.float32), sb, np.ones(b, bool), keys, 8, 16)
    # The top-k of 200 needs more than 128 candidates; the others settle.
    assert not bool(exact[2]) and bool(exact[0]) and bool(exact[5])
