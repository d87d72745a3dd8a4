"""The Llama family of decoder-only transformers as Flax NNX modules.

Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) reuse these layers through `ModelSpec` flags.
Module attribute paths mirror HF parameter names (model.layers.N.self_attn.q_proj, ...) so
models/weights.py can map checkpoints generically. Each decoder layer owns its own Params
(`model.layers` is an nnx.List of DecoderLayers) and the forward pass loops over them in
Python: a GEMM then reads its weight where it lies. A `lax.scan` over weights stacked on a
layer axis makes XLA:GPU copy each layer's slices out of the stack before the GEMMs read them,
so every weight byte would cross HBM three times instead of once (docs/kernels.md). Inputs are
a flattened ragged token batch: token t has id input_ids[t] and absolute position
positions[t]; which tokens see which is decided solely by the AttnFn, whose state (e.g. the KV
pool) is threaded from layer to layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_kernels.reference import from_bits, to_bits

from .attention import AttnFn
from .config import ModelSpec
from .linear_ops import DecodeLinears, activation_name, matmul_precision, one_row_as_two
from .lora import LoraBatch, add_delta
from .moe import SparseMoeBlock
from .quant import QuantWeight
from .quant_layers import QuantEmbed, QuantLinear
from .rope import apply_rope, inverse_frequencies, rope_cos_sin


def _linear(
    n_in: int, n_out: int, bias: bool, dtype: Any, rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(
        n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
        precision=matmul_precision(dtype), rngs=rngs,
    )


def residual_sum(x: Float[Array, "T hidden"], y: Float[Array, "T hidden"]) -> jax.Array:
    """x + y, computed once into its own buffer (an optimization barrier).

    The residual stream has two consumers per layer: the next norm and the next residual add.
    When y comes out of a GEMM that XLA:GPU splits along K (its SplitkRewriter does at decode
    shapes), y is f32 partials [splits, T, hidden] and XLA folds their reduction into every
    consumer, so each consumer read all of the partials again (SmolLM2's o_proj and down_proj
    at batch 64: 1.2 MB each, twice a layer, against a 74 KB residual). Held behind a barrier,
    the sum is written once in the model's dtype and the partials are read once.
    """
    return jax.lax.optimization_barrier(x + y)


class RMSNorm(nnx.Module):
    """weight * x / rms(x), normalised in float32 then cast back (HF LlamaRMSNorm order)."""

    offset = 0.0  # the fused kernels' name for the form: weight (Llama) or 1 + weight (Gemma)

    def __init__(self, dim: int, eps: float, *, dtype: Any = jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... dim"]) -> Float[Array, "... dim"]:
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def _weight(linear: nnx.Module) -> jax.Array | QuantWeight:
    """A linear's [in, out] kernel as it lies (a QuantWeight when quantized)."""
    if isinstance(linear, QuantLinear):
        return linear.weight()
    return linear.kernel[...]


def _bias(linear: nnx.Linear) -> jax.Array | None:
    """A linear's bias, or None."""
    b = getattr(linear, "bias", None)
    return None if b is None else b[...]


def _norm_args(norm: nnx.Module) -> dict[str, Any]:
    """The fused kernels' prologue arguments for one of the models' RMSNorms."""
    return {"norm_weight": norm.weight[...], "norm_eps": norm.eps, "norm_offset": norm.offset}


def _activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The gate activation: silu (SwiGLU) or tanh-approximated gelu (Gemma's GeGLU)."""
    return jax.nn.silu if name == "silu" else lambda x: jax.nn.gelu(x, approximate=True)


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); act is silu (SwiGLU) or gelu (GeGLU)."""

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs):
        h, i, b = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = _linear(h, i, b, dtype, rngs)
        self.up_proj = _linear(h, i, b, dtype, rngs)
        self.down_proj = _linear(i, h, b, dtype, rngs)
        self.act = spec.hidden_act

    def __call__(self, x: Float[Array, "T hidden"], lora: LoraBatch | None = None,
                 layer_idx: int | jax.Array = 0) -> Float[Array, "T hidden"]:
        """down(act(gate(x)) * up(x)), each projection plus its LoRA delta when `lora`."""
        g = add_delta(lora, layer_idx, "gate_proj", x, one_row_as_two(self.gate_proj, x))
        u = add_delta(lora, layer_idx, "up_proj", x, one_row_as_two(self.up_proj, x))
        h = _activation(self.act)(g) * u
        return add_delta(lora, layer_idx, "down_proj", h, one_row_as_two(self.down_proj, h))

    def fused(self, x: jax.Array, norm: nnx.Module, linears: DecodeLinears,
              residual: jax.Array | None) -> jax.Array:
        """down(act(gate(norm(x))) * up(norm(x))) (+ residual) by the fused kernels."""
        g, u = self.gate_proj, self.up_proj
        h = linears.gate_up(x, _weight(g), _weight(u), _bias(g), _bias(u),
                            act=activation_name(self.act), **_norm_args(norm))
        return linears.out(h, _weight(self.down_proj), _bias(self.down_proj), residual)


class Attention(nnx.Module):
    """Projections, optional q/k norm and RoPE around an external attention backend."""

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs,
                 norm_cls: Callable[..., nnx.Module] | None = None):
        h, d = spec.hidden_size, spec.head_dim
        norm_cls = norm_cls or RMSNorm
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = _linear(h, spec.num_heads * d, spec.attention_bias, dtype, rngs)
        self.k_proj = _linear(h, spec.num_kv_heads * d, spec.attention_bias, dtype, rngs)
        self.v_proj = _linear(h, spec.num_kv_heads * d, spec.attention_bias, dtype, rngs)
        self.o_proj = _linear(spec.num_heads * d, h, spec.o_proj_bias, dtype, rngs)
        if spec.qk_norm:
            self.q_norm = norm_cls(d, spec.rms_norm_eps, dtype=dtype)
            self.k_norm = norm_cls(d, spec.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x: Float[Array, "T hidden"],
        cos: Float[Array, "T half"],
        sin: Float[Array, "T half"],
        layer_idx: int,
        attn_fn: AttnFn,
        attn_state: Any,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """Attention output projected back to hidden size, and the backend's updated state
        (`lora`: each projection plus its adapters' delta)."""
        q, k, v = (add_delta(lora, layer_idx, name, x, one_row_as_two(p, x)) for name, p in
                   (("q_proj", self.q_proj), ("k_proj", self.k_proj), ("v_proj", self.v_proj)))
        out, attn_state = self.attend(q, k, v, cos, sin, layer_idx, attn_fn, attn_state)
        return add_delta(lora, layer_idx, "o_proj", out,
                         one_row_as_two(self.o_proj, out)), attn_state

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, cos: jax.Array,
               sin: jax.Array, layer_idx: int, attn_fn: AttnFn, attn_state: Any,
               roped: bool = False, kv_written: bool = False
               ) -> tuple[Float[Array, "T q_features"], Any]:
        """Attention of projected [T, heads * head_dim] q, k, v (q/k norm, RoPE unless `roped`
        says q and k come rotated, the backend), before the output projection; and the
        backend's updated state. `kv_written`: k and v are in the backend's cache already
        (`DecodeLinears.qkv_write`); the AttnFn is told so."""
        t = q.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if not roped:
            if self.q_norm is not None:  # Qwen3, Gemma 3: per-head norm, before RoPE
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_written:
            out, attn_state = attn_fn(layer_idx, q, k, v, attn_state, kv_written=True)
        else:
            out, attn_state = attn_fn(layer_idx, q, k, v, attn_state)  # [T, heads, head_dim]
        return out.reshape(t, self.num_heads * self.head_dim), attn_state

    def fused_attention(self, x: jax.Array, norm: nnx.Module, cos: jax.Array, sin: jax.Array,
                        layer_idx: int, attn_fn: AttnFn, attn_state: Any,
                        linears: DecodeLinears) -> tuple[jax.Array, Any]:
        """`attend` of norm(x)'s q, k, v from the fused kernel: the norm in its prologue, and
        RoPE in its epilogue unless q/k norms must come between (Qwen3, Gemma 3)."""
        ps = (self.q_proj, self.k_proj, self.v_proj)
        args = (x, *map(_weight, ps), *map(_bias, ps))
        roped = self.q_norm is None
        if roped and linears.qkv_write is not None:  # K/V into the cache by the same launch
            q, k, v, attn_state = linears.qkv_write(
                *args, layer_idx=layer_idx, attn_state=attn_state, **_norm_args(norm),
                rope=(cos, sin), head_dim=self.head_dim)
            return self.attend(q, k, v, cos, sin, layer_idx, attn_fn, attn_state, roped=True,
                               kv_written=True)
        q, k, v = linears.qkv(*args, **_norm_args(norm), rope=(cos, sin) if roped else None,
                              head_dim=self.head_dim)
        return self.attend(q, k, v, cos, sin, layer_idx, attn_fn, attn_state, roped=roped)


def feed_forward(spec: ModelSpec, layer_idx: int, *, dtype: Any, rngs: nnx.Rngs
                 ) -> tuple[str, nnx.Module]:
    """A layer's feed-forward module and its HF attribute name: the experts of a sparse layer
    (Mixtral's `block_sparse_moe`, Qwen's `mlp`), else the dense MLP (`mlp`)."""
    if not spec.layer_is_sparse(layer_idx):
        return "mlp", MLP(spec, dtype=dtype, rngs=rngs)
    name = "block_sparse_moe" if spec.architecture == "MixtralForCausalLM" else "mlp"
    return name, SparseMoeBlock(spec, dtype=dtype, rngs=rngs, mlp_cls=MLP)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (the MLP a mixture of
    experts in a sparse layer)."""

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs, layer_idx: int = 0):
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(spec, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)
        self.ffn_name, ffn = feed_forward(spec, layer_idx, dtype=dtype, rngs=rngs)
        setattr(self, self.ffn_name, ffn)

    @property
    def ffn(self) -> nnx.Module:
        """The layer's feed-forward module (MLP or SparseMoeBlock)."""
        return getattr(self, self.ffn_name)

    def __call__(
        self,
        x: Float[Array, "T hidden"],
        cos: Float[Array, "T half"],
        sin: Float[Array, "T half"],
        layer_idx: int,
        attn_fn: AttnFn,
        attn_state: Any,
        linears: DecodeLinears | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """One layer; returns (x, attn_state after this layer). `linears`: fused kernels for
        the projections (norms and residual adds folded in), else XLA's GEMMs; `lora`: LoRA
        adapters' deltas added to the projections (XLA's GEMMs only)."""
        attn = self.self_attn
        if linears is not None:
            assert lora is None, "LoRA runs on XLA's GEMMs (the runner passes no linears)"
            out, attn_state = attn.fused_attention(x, self.input_layernorm, cos, sin,
                                                   layer_idx, attn_fn, attn_state, linears)
            x = linears.out(out, _weight(attn.o_proj), _bias(attn.o_proj), x)
            if isinstance(self.ffn, SparseMoeBlock):  # experts: XLA's grouped GEMMs
                return residual_sum(x, self.ffn(self.post_attention_layernorm(x))), attn_state
            return self.ffn.fused(x, self.post_attention_layernorm, linears, x), attn_state
        attn_out, attn_state = attn(
            self.input_layernorm(x), cos, sin, layer_idx, attn_fn, attn_state, lora
        )
        x = residual_sum(x, attn_out)
        return residual_sum(x, self.ffn(self.post_attention_layernorm(x), lora, layer_idx)
                            ), attn_state


# embed_fn(table, input_ids) -> rows: the token lookup, for callers whose table is laid out in
# a way a plain take would gather whole (e.g. split by vocabulary over devices).
#   table: Float[Array, "vocab hidden"], input_ids: Int[Array, " T"] -> Float[Array, "T hidden"]
EmbedFn = Callable[[jax.Array, jax.Array], jax.Array]


class LlamaModel(nnx.Module):
    """Embedding, decoder layers and final norm (HF `model.*`)."""

    layer_class: Callable[..., nnx.Module] = DecoderLayer
    norm_class: Callable[..., nnx.Module] = RMSNorm

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs):
        self.spec = spec
        self.embed_tokens = nnx.Embed(
            spec.vocab_size, spec.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        # Invariant: len(layers) == num_layers, and layer i's Params are its own arrays.
        self.layers = nnx.List(
            [self.layer_class(spec, dtype=dtype, rngs=rngs, layer_idx=i)
             for i in range(spec.num_layers)]
        )
        self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, dtype=dtype)

    def scale_embeddings(self, x: Float[Array, "T hidden"]) -> Float[Array, "T hidden"]:
        """The looked-up embeddings as the first layer takes them (Llama: unchanged)."""
        return x

    def rope_tables(self, positions: Int[Array, " T"]) -> list[tuple[jax.Array, jax.Array]]:
        """(cos, sin) for each layer: one table, or (Gemma 3) a second for sliding layers."""
        spec = self.spec
        # inv_freq is a trace-time constant derived from the (static) spec.
        main = rope_cos_sin(jnp.asarray(inverse_frequencies(spec)), positions)
        if spec.rope_local_base_freq is None:
            return [main] * spec.num_layers
        local_spec = spec.replace(rope_theta=spec.rope_local_base_freq, rope_scaling=None)
        local = rope_cos_sin(jnp.asarray(inverse_frequencies(local_spec)), positions)
        return [main if w is None else local for w in spec.layer_windows]

    def __call__(
        self,
        input_ids: Int[Array, " T"],
        positions: Int[Array, " T"],
        attn_fn: AttnFn,
        attn_state: Any = None,
        *,
        embed_fn: EmbedFn | None = None,
        linears: DecodeLinears | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """(final-norm hidden states, attn_state after the last layer)."""
        tables = self.rope_tables(positions)
        if embed_fn is None or isinstance(self.embed_tokens, QuantEmbed):
            x = self.embed_tokens(input_ids)  # a quantized table is whole on every device
        else:
            x = embed_fn(self.embed_tokens.embedding[...], input_ids)
        x = self.scale_embeddings(x)
        if isinstance(self.layers, ScannedLayers):  # XLA:CPU (stack_layers): uniform layers
            x, attn_state = self.layers(x, *tables[0], attn_fn, attn_state, linears, lora)
        else:
            # Unrolled at trace time: layer i's GEMMs read layer i's own weight arrays in place.
            for i, layer in enumerate(self.layers):
                x, attn_state = layer(x, *tables[i], i, attn_fn, attn_state, linears, lora)
        return self.norm(x), attn_state


class ScannedLayers(nnx.Module):
    """Every decoder layer as one DecoderLayer whose Params carry a leading layer axis, run by
    `lax.scan` with a traced layer index: the layout for XLA:CPU (see `stack_layers`)."""

    def __init__(self, layer: DecoderLayer, num_layers: int):
        self.layer = layer  # invariant: every Param has shape [num_layers, *one layer's shape]
        self.num_layers = num_layers

    def __call__(
        self,
        x: Float[Array, "T hidden"],
        cos: Float[Array, "T half"],
        sin: Float[Array, "T half"],
        attn_fn: AttnFn,
        attn_state: Any,
        linears: DecodeLinears | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """All layers in order; returns (x, attn_state after the last layer)."""
        layer_def, stacked = nnx.split(self.layer)
        # XLA:CPU widens a whole stacked fp8 / bfloat16 array (to float16 / float32) before it
        # slices one layer out: every layer's weights converted in every iteration (a 30-layer
        # scan of 576 x 1536 projections: fp8 5x, bfloat16 2.5x the time). The scan slices
        # their bits (`to_bits`, as the KV pages move) and each layer reads its slice back in
        # its own dtype. float16 is sliced as it is (as uint16 the same scan took 2.7x longer).
        dtypes = jax.tree.map(lambda a: a.dtype, stacked)
        stacked = jax.tree.map(to_bits, stacked)

        def body(carry: tuple[Any, Any, jax.Array], layer_state: Any) -> tuple[Any, None]:
            h, state, i = carry
            layer_state = jax.tree.map(from_bits, layer_state, dtypes)
            h, state = nnx.merge(layer_def, layer_state)(h, cos, sin, i, attn_fn, state,
                                                         linears, lora)
            return (h, state, i + 1), None

        (x, attn_state, _), _ = jax.lax.scan(body, (x, attn_state, jnp.int32(0)), stacked)
        return x, attn_state


def _stack(*xs: jax.Array) -> jax.Array:
    """One array of `xs` stacked on a new leading axis, keeping a mesh split of the layers'."""
    sharding = getattr(xs[0], "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        # The rank-relative plan of models/sharding.py: P() stays P(), a split gains a None.
        spec = jax.sharding.PartitionSpec(*((None, *sharding.spec) if sharding.spec else ()))
        out = jax.sharding.NamedSharding(sharding.mesh, spec)
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*xs)
    return jnp.stack(xs)


def stack_layers(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A twin of `model` whose decoder layers run as one `lax.scan` over stacked weights.

    For XLA:CPU only. There a scan compiles one layer instead of num_layers (the embedded
    model's step compiles ~5x faster) and runs as fast; on a GPU it would copy each layer's
    weights out of the stack every step, which is why models are built per layer. The twin
    shares every non-layer array with `model` and holds a stacked copy of the layers' arrays;
    `model` is unchanged (drop it to free its layer arrays). Already stacked, layers of
    different kinds (sliding and global), or a mixture of experts: `model` itself.
    """
    layers = model.model.layers
    if isinstance(layers, ScannedLayers) or not model.spec.uniform_layers:
        return model  # stacked already, or layers that attend differently (one scan body each)
    if model.spec.is_moe:
        # A scan slices each layer's weights out of the stack every step: for a mixture of
        # experts that is every expert's weights, where a step reads only the ones its tokens
        # chose (a 64-expert layer at 8 rows: 17x the time, a temporary of all its experts).
        return model
    layer_def = nnx.graphdef(layers[0])
    first = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(layers[0]))
    for layer in layers[1:]:  # a GGUF may quantize one projection differently per layer
        if (nnx.graphdef(layer) != layer_def
                or jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(layer)) != first):
            return model
    stacked = jax.tree.map(_stack, *[nnx.state(layer) for layer in layers])
    twin = nnx.clone(model)
    twin.model.layers = ScannedLayers(nnx.merge(layer_def, stacked), len(layers))
    return twin


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with LM head; `__call__` gives final hidden states, `compute_logits` logits."""

    model_class: Callable[..., LlamaModel] = LlamaModel

    def __init__(self, spec: ModelSpec, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.spec = spec
        self.dtype = jnp.dtype(dtype)
        self.model = self.model_class(spec, dtype=dtype, rngs=rngs)
        # Tied models have no lm_head: logits use the embedding matrix.
        self.lm_head = (
            None if spec.tie_word_embeddings
            else _linear(spec.hidden_size, spec.vocab_size, False, dtype, rngs)
        )
        # A sequence classifier's head (HF `score`, [num_labels, hidden]): the pooled final
        # hidden state's class logits (ModelSpec.labels; None for a language model).
        self.score = (_linear(spec.hidden_size, spec.num_labels, False, dtype, rngs)
                      if spec.labels else None)

    def __call__(
        self,
        input_ids: Int[Array, " T"],
        positions: Int[Array, " T"],
        attn_fn: AttnFn,
        attn_state: Any = None,
        *,
        embed_fn: EmbedFn | None = None,
        linears: DecodeLinears | None = None,
        lora: LoraBatch | None = None,
    ) -> tuple[Float[Array, "T hidden"], Any]:
        """(final-norm hidden states of a flattened token batch, attn_state after all layers).

        `linears`: fused kernels for every decoder layer's projections (models/linear_ops.py);
        `lora`: LoRA adapters' deltas on the projections (models/lora.py), without linears.
        """
        return self.model(input_ids, positions, attn_fn, attn_state, embed_fn=embed_fn,
                          linears=linears, lora=lora)

    def classify(self, pooled: Float[Array, "N hidden"]) -> Float[Array, "N labels"]:
        """A classifier's float32 class logits of pooled final hidden states (its score
        head, linear and without bias: a sum of pooled rows maps to the sum of logits)."""
        assert self.score is not None, "classify needs a sequence classifier (spec.labels)"
        weight = self.score.kernel[...]  # [hidden, num_labels]
        return jnp.einsum("nh,hl->nl", pooled.astype(jnp.float32), weight.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    def head_weight(self) -> tuple[jax.Array | QuantWeight, bool]:
        """The output head's weight as it lies, and whether it is transposed: lm_head's
        [hidden, vocab] kernel (False), or the tied embedding's [vocab, hidden] table (True);
        a QuantWeight when quantized."""
        if self.lm_head is not None:
            return _weight(self.lm_head), False
        embed = self.model.embed_tokens
        if isinstance(embed, QuantEmbed):
            return embed.weight(), True
        return embed.embedding[...], True

    def compute_logits(self, hidden: Float[Array, "N hidden"],
                       linears: DecodeLinears | None = None) -> Float[Array, "N vocab"]:
        """float32 logits; accumulation in float32 whatever the parameter dtype. `linears`
        with a `logits` kernel (the runner's, for small steps): the head runs on it, else on
        XLA's GEMM; a final soft-cap (Gemma 2) applies after either."""
        embed = self.model.embed_tokens
        if linears is not None and linears.logits is not None:
            weight, transposed = self.head_weight()
            out = linears.logits(hidden, weight, transposed=transposed)
        elif self.lm_head is None and isinstance(embed, QuantEmbed):
            out = one_row_as_two(embed.attend, hidden)
        elif isinstance(self.lm_head, QuantLinear):
            out = self.lm_head.product(hidden)  # float32, as the float head's
        else:
            out = self._float_logits(hidden)
        cap = self.spec.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)  # Gemma 2

    def _float_logits(self, hidden: jax.Array) -> jax.Array:
        """Logits of an unquantized head: the tied embedding or lm_head."""
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...]  # [vocab, hidden]
            spec = "nh,vh->nv"
        else:
            weight = self.lm_head.kernel[...]  # [hidden, vocab]
            spec = "nh,hv->nv"

        def logits(h: jax.Array) -> jax.Array:
            return jnp.einsum(spec, h.astype(weight.dtype), weight,
                              preferred_element_type=jnp.float32,
                              precision=matmul_precision(self.dtype))

        return one_row_as_two(logits, hidden)  # no weight-sized temporary at batch 1


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layers without biases; a sliding window (ModelSpec) on every layer."""


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention, a mixture of experts (`block_sparse_moe`) in every layer."""


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2's attention; experts plus a gated shared expert (models/moe.py)."""


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms); experts without a shared one."""
