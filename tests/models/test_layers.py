"""Decoder layers with their own Params, run by a Python loop: per-layer HF names for weights,
no scan and no stacked array in the traced step, and attention-backend state threaded through
the layers; the stacked twin XLA:CPU runs instead (one scan) computes the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxtyping import Array, Float, Int
from tiny_models import flatten, make_logits_fn, random_weights, tiny_spec

from models import AttnFn, dense_causal_attention
from models.attention import repeat_kv
from models.llama import ScannedLayers, stack_layers
from models.loader import build_model
from models.registry import get_model_class
from models.weights import hf_param_table

NUM_LAYERS = 3


@pytest.fixture(scope="module")
def spec():
    return tiny_spec(num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def model(spec):
    return build_model(spec, random_weights(spec, seed=5), np.float32)


def test_each_layer_owns_its_params_and_table_names_each_layer(spec):
    abstract = nnx.eval_shape(lambda: get_model_class(spec.architecture)(spec, rngs=nnx.Rngs(0)))
    assert len(abstract.model.layers) == NUM_LAYERS
    table = hf_param_table(abstract)
    assert set(table) == set(random_weights(spec))
    q = [table[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(NUM_LAYERS)]
    assert len({id(e.param) for e in q}) == NUM_LAYERS and all(e.transpose for e in q)
    want = (spec.num_heads * spec.head_dim, spec.hidden_size)
    assert all(e.hf_shape() == want for e in q)
    # No Param carries a layer axis: every one has its HF tensor's rank.
    params = [n for _, n in nnx.iter_graph(abstract) if isinstance(n, nnx.Param)]
    assert len(params) == len(table)


def test_assign_sets_each_param_once(spec, monkeypatch):
    calls: dict[int, int] = {}
    original = nnx.Param.set_value

    def counting(self, value, *args, **kwargs):
        calls[id(self)] = calls.get(id(self), 0) + 1
        return original(self, value, *args, **kwargs)

    monkeypatch.setattr(nnx.Param, "set_value", counting)
    build_model(spec, random_weights(spec), np.float32)
    assert len(calls) == len(random_weights(spec)) and set(calls.values()) == {1}


def test_missing_layer_tensor_is_named(spec):
    weights = random_weights(spec)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        build_model(spec, weights, np.float32)


def test_layers_are_unrolled_with_static_indices_and_no_scan(model):
    seen: list[object] = []
    ids, pos, seg = (jnp.asarray(a) for a in flatten([[5, 6, 7]]))
    dense = dense_causal_attention(seg, pos)

    def spy(layer_idx, q, k, v, state):
        seen.append(layer_idx)
        return dense(layer_idx, q, k, v, state)

    jaxpr = jax.make_jaxpr(lambda i, p: model(i, p, spy, jnp.zeros(2))[0])(ids, pos)
    assert seen == list(range(NUM_LAYERS))  # Python ints: static per-layer indexing
    prims = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert "scan" not in prims and "while" not in prims and "dynamic_slice" not in prims


def test_embed_fn_replaces_the_lookup(model):
    ids, pos, seg = (jnp.asarray(a) for a in flatten([[5, 6, 7, 8], [9, 10]]))
    attn = dense_causal_attention(seg, pos)
    base, _ = model(ids, pos, attn)
    state = {"untouched": jnp.arange(4.0)}
    tables: list[tuple[int, ...]] = []

    def lookup(table, token_ids):
        tables.append(table.shape)
        return jnp.take(table, token_ids, axis=0)

    got, state_out = model(ids, pos, attn, state, embed_fn=lookup)
    assert tables == [(model.spec.vocab_size, model.spec.hidden_size)]
    assert np.array_equal(state_out["untouched"], state["untouched"])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(base))


def contiguous_cache_attention(positions: Int[Array, " T"]) -> AttnFn:
    """One sequence's causal attention through a [layers, S, kv_heads, D] (k, v) cache."""

    def attn(
        layer_idx: int,
        q: Float[Array, "T H D"],
        k: Float[Array, "T KV D"],
        v: Float[Array, "T KV D"],
        state: tuple[Float[Array, "L S KV D"], Float[Array, "L S KV D"]],
    ) -> tuple[Float[Array, "T H D"], tuple[Array, Array]]:
        kc, vc = state
        kc = kc.at[layer_idx, positions].set(k)  # write first: new tokens see themselves
        vc = vc.at[layer_idx, positions].set(v)
        keys = repeat_kv(kc[layer_idx], q.shape[1])  # [S, H, D]
        vals = repeat_kv(vc[layer_idx], q.shape[1])
        scores = jnp.einsum("thd,shd->hts", q, keys) / np.sqrt(q.shape[-1])
        visible = jnp.arange(kc.shape[1])[None, :] <= positions[:, None]  # [T, S]
        probs = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("hts,shd->thd", probs, vals), (kc, vc)

    return attn


def test_attn_state_threads_through_layers_and_calls(spec, model):
    seq = [11, 42, 7, 99, 3, 250, 18, 64, 5]
    prompt = 6
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, ids, pos, cache):
        m = nnx.merge(graphdef, params)
        hidden, cache = m(ids, pos, contiguous_cache_attention(pos), cache)
        return m.compute_logits(hidden), cache

    shape = (NUM_LAYERS, 16, spec.num_kv_heads, spec.head_dim)
    cache = (jnp.zeros(shape), jnp.zeros(shape))
    logits, cache = step(params, jnp.asarray(seq[:prompt]), jnp.arange(prompt), cache)
    got = [np.asarray(logits)]
    for p in range(prompt, len(seq)):  # decode one token at a time from the threaded cache
        logits, cache = step(params, jnp.asarray(seq[p:p + 1]), jnp.asarray([p]), cache)
        got.append(np.asarray(logits))
    ids, pos, seg = flatten([seq])
    want = np.asarray(make_logits_fn(model)(ids, pos, seg))
    np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-4)
    # Every layer wrote its own K for every token, and layers differ.
    k = np.asarray(cache[0])
    assert np.all(np.abs(k[:, : len(seq)]).sum(axis=(2, 3)) > 0)
    assert np.all(k[:, len(seq):] == 0)
    assert not np.allclose(k[0, : len(seq)], k[1, : len(seq)])


def test_stacked_twin_scans_and_computes_the_same(spec, model):
    """stack_layers (XLA:CPU's layout): one scan over [layers, ...] Params with a traced layer
    index, the same logits and threaded cache, the original model left per-layer."""
    twin = stack_layers(model)
    assert isinstance(twin.model.layers, ScannedLayers) and stack_layers(twin) is twin
    assert len(model.model.layers) == NUM_LAYERS  # untouched
    q = twin.model.layers.layer.self_attn.q_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(q[1]),
                                  np.asarray(model.model.layers[1].self_attn.q_proj.kernel[...]))
    assert twin.model.embed_tokens.embedding[...] is model.model.embed_tokens.embedding[...]
    seq = [11, 42, 7, 99, 3, 250, 18, 64, 5]
    pos = jnp.arange(len(seq))
    shape = (NUM_LAYERS, 16, spec.num_kv_heads, spec.head_dim)
    outs = []
    for m in (model, twin):
        hidden, cache = m(jnp.asarray(seq), pos, contiguous_cache_attention(pos),
                          (jnp.zeros(shape), jnp.zeros(shape)))
        outs.append((np.asarray(m.compute_logits(hidden)), np.asarray(cache[0])))
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(outs[1][1], outs[0][1], rtol=0, atol=1e-5)  # layer i wrote row i
    ids, pos, seg = (jnp.asarray(a) for a in flatten([[5, 6, 7]]))
    prims = {e.primitive.name for e in jax.make_jaxpr(
        lambda i, p: twin(i, p, dense_causal_attention(seg, pos))[0])(ids, pos).jaxpr.eqns}
    assert "scan" in prims

