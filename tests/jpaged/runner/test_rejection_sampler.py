"""The rejection sampler keeps the target's distribution exactly (chi-square on a small
vocabulary, one-hot and general drafts) and accepts greedy drafts while they are the argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from jpaged.runner.rejection_sampler import rejection_sample

V = 6


def _probs(rng: np.random.Generator, *shape: int) -> np.ndarray:
    x = rng.gamma(1.0, size=(*shape, V))
    return x / x.sum(-1, keepdims=True)


def _chi2_p(tokens: np.ndarray, p: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=V)
    return stats.chisquare(counts, p * counts.sum()).pvalue


def test_greedy_accepts_while_the_drafts_are_the_argmax():
    rng = np.random.default_rng(0)
    p = _probs(rng, 3, 4)  # 3 rows, 3 drafts + bonus
    top = p.argmax(-1)
    drafts = top[:, :3].copy()
    drafts[0, 1] = (drafts[0, 1] + 1) % V  # row 0: the second draft is wrong
    drafts[2] = (drafts[2] + 1) % V  # row 2: the first is wrong
    tokens, count = rejection_sample(jnp.asarray(p, jnp.float32), jnp.asarray(drafts),
                                     jnp.asarray([3, 3, 3]), jnp.ones(3, bool),
                                     jax.random.key(0))
    tokens, count = np.asarray(tokens), np.asarray(count)
    assert count.tolist() == [2, 4, 1]
    assert tokens[0].tolist() == [top[0, 0], top[0, 1], -1, -1]  # the argmax corrects it
    assert tokens[1].tolist() == top[1].tolist()  # all accepted, then the bonus
    assert tokens[2].tolist() == [top[2, 0], -1, -1, -1]


def test_rows_verify_only_their_drafts():
    rng = np.random.default_rng(1)
    p = _probs(rng, 2, 3)
    top = p.argmax(-1)
    tokens, count = rejection_sample(jnp.asarray(p, jnp.float32), jnp.asarray(top[:, :2]),
                                     jnp.asarray([0, 1]), jnp.ones(2, bool), jax.random.key(0))
    assert np.asarray(count).tolist() == [1, 2]
    assert np.asarray(tokens)[0].tolist() == [top[0, 0], -1, -1]
    assert np.asarray(tokens)[1].tolist() == [top[1, 0], top[1, 1], -1]


def test_sampled_tokens_follow_the_target_distribution():
    """20,000 rows, two drafts each, p fixed: the first emitted token is distributed as p_0
    whatever the drafts (one-hot drafts of a fixed token; drafts drawn from a q of their
    own), and so is the second, among rows that accepted the first draft, as p_1."""
    rng = np.random.default_rng(2)
    n = 20_000
    p = _probs(rng, 3)  # positions 0, 1 and the bonus
    q = _probs(rng, 2)
    target = jnp.asarray(np.broadcast_to(p, (n, 3, V)), jnp.float32)
    fixed = jnp.full((n, 2), 2, jnp.int32)  # an n-gram-style proposal: always token 2
    drawn = jnp.asarray(np.stack([rng.choice(V, n, p=q[j]) for j in range(2)], 1), jnp.int32)
    qs = jnp.asarray(np.broadcast_to(q, (n, 2, V)), jnp.float32)
    for name, drafts, dprobs in (("one-hot", fixed, None), ("q", drawn, qs)):
        tokens, count = rejection_sample(target, drafts, jnp.full((n,), 2), jnp.zeros(n, bool),
                                         jax.random.key(7), draft_probs=dprobs)
        tokens, count = np.asarray(tokens), np.asarray(count)
        assert (count >= 1).all() and (count <= 3).all()
        assert _chi2_p(tokens[:, 0], p[0]) > 1e-3, name
        # The second token, where the first draft was accepted: p_1 again.
        second = tokens[:, 1][(tokens[:, 0] == np.asarray(drafts)[:, 0]) & (count >= 2)]
        assert second.size > 1000 and _chi2_p(second, p[1]) > 1e-3, name
    # The check can fail: the drafts' own distribution is far from p.
    assert _chi2_p(np.asarray(drawn)[:, 0], p[0]) < 1e-6


def test_no_drafts_at_all_is_a_plain_draw():
    p = jnp.asarray([[[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]], jnp.float32)
    tokens, count = rejection_sample(p, jnp.zeros((1, 0), jnp.int32), jnp.zeros(1, jnp.int32),
                                     jnp.zeros(1, bool), jax.random.key(0))
    assert np.asarray(tokens).tolist() == [[1]] and np.asarray(count).tolist() == [1]


def test_placeholder_and_out_of_vocab_drafts_are_rejected_never_emitted():
    """vLLM's test_placeholder_draft_token_rejected_*: a -1 draft (vLLM's padding) or one past
    the vocabulary is rejected in greedy and sampled rows alike and the token there is drawn
    from the target (a -1 index used to wrap to the last token's probability)."""
    p = np.zeros((2, 2, V), np.float32)
    p[:, 0, V - 1] = 1.0  # the target is sure of the last token, which -1 would wrap to
    p[:, 1, 3] = 1.0
    for drafts in ([[-1], [-1]], [[V], [V + 3]]):
        for greedy in (True, False):
            for q in (None, jnp.full((2, 1, V), 1.0 / V)):
                tokens, count = rejection_sample(jnp.asarray(p), jnp.asarray(drafts, jnp.int32),
                                                 jnp.ones(2, jnp.int32),
                                                 jnp.full(2, greedy), jax.random.key(1), q)
                assert np.asarray(count).tolist() == [1, 1]
                assert np.asarray(tokens)[:, 0].tolist() == [V - 1, V - 1]
