"""Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE) as Flax NNX modules.

A sparse layer's router scores every token against `num_experts` experts; each token goes to
its `num_experts_per_tok` best (their softmax weights, renormalized to sum 1 where the model
says so) and its output is the weighted sum of those experts' SwiGLU MLPs. The experts of a
layer are three stacked Params, `[E, hidden, width]` (gate, up) and `[E, width, hidden]`
(down), so tensor parallel splits every expert's width as it splits a dense MLP's
(models/sharding.py's rules are rank-relative).

The work grows with the tokens, not the experts: the (token, expert) pairs are sorted by
expert and each expert multiplies only its own rows (`grouped_matmul`). On XLA:CPU that is a
loop over (row tile, expert) pieces whose count is known only at run time, so a decode step
reads the weights of the experts its tokens chose and no others; on a GPU the Pallas kernels
of pallas_kernels/grouped_matmul.py (a small step's routing and layout in one launch); on a
TPU `jax.lax.ragged_dot`. Experts may stay quantized (`QuantExperts`: fp8, or the int4 / int8
groups of a GGUF or a GPTQ / AWQ checkpoint).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels import grouped_matmul as gmm_kernel

from .config import ModelSpec
from .linear_ops import matmul_precision, one_row_as_two
from .quant import QuantWeight, dequantize

logger = logging.getLogger("jpaged")

__all__ = ["EXPERT_IMPLS", "EXPERT_PARAMS", "ExpertWeight", "Experts", "SparseMoeBlock",
           "QuantExperts", "expert_impl", "expert_matrices", "expert_tensor_names",
           "experts_run_as", "grouped_matmul", "route"]

# The stacked Params of a layer's experts and, per architecture family, the name each
# expert's tensor has in HF checkpoints (`...experts.{e}.{name}.weight`, [out, in]).
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

# How grouped_matmul runs when the caller says (the runner: for the platform its step compiles
# for, which a deviceless GPU compile traces on the CPU backend): one of EXPERT_IMPLS, or None
# for jax's default backend's.
_IMPL: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_impl", default=None)
# "loop": the while loop (XLA:CPU); "pallas": the Pallas kernel (a GPU, one device);
# "interpret": that kernel in the Pallas interpreter (tests); "xla": jax.lax.ragged_dot.
EXPERT_IMPLS = ("loop", "pallas", "interpret", "xla")
# The tensor-parallel mesh the kernel runs per device on, under shard_map (None: one device,
# or GSPMD partitions the step: the loop and ragged_dot are plain XLA ops).
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("moe_mesh", default=None)
# Which of the step's tokens are real ([T] bool; None: all): a bucket's padding tokens are
# routed to no expert, so they make no expert read its weights.
_VALID: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("moe_valid",
                                                                         default=None)
_logged: set[str] = set()

# One matrix of a layer's experts: [E, K, N] in the model's dtype, or quantized (a stacked
# QuantWeight, k_axis 1: fp8 values [E, K, N] with scales [E, 1, N]; int8 / int4 groups with
# scales and mins [E, K / group, N]).
ExpertWeight = jax.Array | QuantWeight

# Rows of the sorted (token, expert) pairs one piece of the CPU loop multiplies.
LOOP_TILE_ROWS = 64


def _expert_hf_names(architecture: str) -> dict[str, str]:
    """Stacked Param name -> the per-expert tensor's name in an HF checkpoint."""
    if architecture == "MixtralForCausalLM":
        return dict(_MIXTRAL_NAMES)
    return {p: p for p in EXPERT_PARAMS}


def expert_impl(platform: str) -> str:
    """How the experts' matmuls run on `platform`: the loop on XLA:CPU, the Pallas kernel on a
    GPU (per device under tensor parallel), else XLA's ragged_dot (TPU)."""
    if platform == "cpu":
        return "loop"
    if platform in ("gpu", "cuda", "rocm"):
        return "pallas"
    return "xla"


def expert_tensor_names(param_path: str, num_experts: int) -> list[str] | None:
    """An HF checkpoint's per-expert tensors (`...experts.{e}.{w1|gate_proj}.weight`, [out, in]
    each) of a stacked experts Param at `param_path` (`<layer>.<mlp|block_sparse_moe>.experts.
    <gate_proj|up_proj|down_proj>`), in expert order; None for other paths."""
    prefix, _, param = param_path.rpartition(".")
    if not prefix.endswith(".experts") or param not in EXPERT_PARAMS:
        return None
    arch = "MixtralForCausalLM" if ".block_sparse_moe." in param_path else ""
    hf = _expert_hf_names(arch)[param]
    return [f"{prefix}.{e}.{hf}.weight" for e in range(num_experts)]


def expert_matrices(model: nnx.Module) -> dict[str, tuple[int, int, int]]:
    """HF path of each layer's stacked expert matrix (`<layer>.<mlp>.experts.gate_proj`, ...)
    -> its (experts, in, out)."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Experts):
            for leaf in EXPERT_PARAMS:
                out[".".join([*map(str, path), leaf])] = tuple(
                    getattr(node, leaf).get_value().shape[-3:])
    return out


@contextlib.contextmanager
def experts_run_as(impl: str | None, mesh: Mesh | None = None,
                   valid: jax.Array | None = None) -> Iterator[None]:
    """Within the block, sparse layers trace their grouped matmuls as `impl` (EXPERT_IMPLS);
    `mesh`: the tensor-parallel mesh whose devices each run the kernel on their own width;
    `valid`: [T] bool, the step's real tokens (padding goes to no expert; its output is
    finite and meaningless)."""
    if impl is not None and impl not in EXPERT_IMPLS:
        raise ValueError(f"expert impl must be one of {', '.join(EXPERT_IMPLS)}, got {impl!r}")
    tokens = _IMPL.set(impl), _MESH.set(mesh), _VALID.set(valid)
    try:
        yield
    finally:
        _IMPL.reset(tokens[0])
        _MESH.reset(tokens[1])
        _VALID.reset(tokens[2])


def _loop_grouped_matmul(x: jax.Array, w: ExpertWeight, group_sizes: jax.Array,
                         precision: Any) -> jax.Array:
    """grouped_matmul as a while loop over (row tile, expert) pieces: only the pieces that
    hold rows run, each reading its expert's weights once (XLA:CPU, and integer experts on a
    backend with no kernel for them); a quantized expert is dequantized one expert at a time
    (fp8: widened, its product scaled per column)."""
    m, k = x.shape
    e, n = (w.q if isinstance(w, QuantWeight) else w).shape[::2]
    tm = min(LOOP_TILE_ROWS, 1 << max(0, (m - 1).bit_length()))
    mp = -(-m // tm) * tm
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    first = starts // tm
    count = jnp.where(gs > 0, (ends - 1) // tm - first + 1, 0)  # tiles expert e touches
    item_end = jnp.cumsum(count)
    item_start = item_end - count
    total = item_end[-1]
    rows = jnp.arange(tm, dtype=jnp.int32)

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        j, out = carry
        ex = jnp.searchsorted(item_end, j, side="right").astype(jnp.int32)  # piece j's expert
        tile = first[ex] + j - item_start[ex]
        lo = tile * tm
        lhs = jax.lax.dynamic_slice(xp, (lo, 0), (tm, k))
        prod = jnp.dot(lhs, _one_expert(w, ex, x.dtype), precision=precision,
                       preferred_element_type=jnp.float32)
        if isinstance(w, QuantWeight) and w.kind == "fp8":  # x @ (q * s) == (x @ q) * s
            prod = prod * jax.lax.dynamic_index_in_dim(w.scales, ex, keepdims=False)
        mine = ((lo + rows >= starts[ex]) & (lo + rows < ends[ex]))[:, None]
        cur = jax.lax.dynamic_slice(out, (lo, 0), (tm, n))
        return j + 1, jax.lax.dynamic_update_slice(out, cur + jnp.where(mine, prod, 0.0),
                                                   (lo, 0))

    # Invariant: the groups cover rows 0 .. sum(group_sizes) - 1 in order, so each of those
    # rows is summed into by exactly one piece, and the rows past them by none.
    _, out = jax.lax.while_loop(lambda c: c[0] < total, body,
                                (jnp.int32(0), jnp.zeros((mp, n), jnp.float32)))
    return out[:m]


def _one_expert(w: ExpertWeight, ex: jax.Array, dtype: Any) -> jax.Array:
    """Expert `ex`'s [K, N] matrix in `dtype` (fp8: its values only; integer groups:
    dequantized)."""
    def pick(a: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(a, ex, keepdims=False)

    if not isinstance(w, QuantWeight):
        return pick(w).astype(dtype)
    if w.kind == "fp8":
        return pick(w.q).astype(dtype)
    return dequantize(pick(w.q), pick(w.scales), None if w.mins is None else pick(w.mins),
                      w.kind, dtype)


def grouped_matmul(x: Float[Array, "M K"], w: ExpertWeight,
                   group_sizes: Int[Array, " E"], *, precision: Any = None,
                   impl: str | None = None) -> Float[Array, "M N"]:
    """Rows [start_e, start_e + group_sizes[e]) of `x` times w[e], for each expert e in order;
    float32 out; rows past the groups (sum(group_sizes) < M: tokens routed to no expert) zero.
    `impl`: one of EXPERT_IMPLS (default: the caller's `experts_run_as`, else the backend's)."""
    impl = impl or _IMPL.get() or expert_impl(jax.default_backend())
    if impl == "loop":
        return _loop_grouped_matmul(x, w, group_sizes, precision)
    if impl in ("pallas", "interpret") and _kernel_takes(w):
        return gmm_kernel.grouped_matmul(x, w, group_sizes, interpret=impl == "interpret")
    if isinstance(w, QuantWeight) and w.kind != "fp8":  # integer groups: dequantized per
        return _loop_grouped_matmul(x, w, group_sizes, precision)  # expert, never whole
    if isinstance(w, QuantWeight):  # fp8: widened whole for ragged_dot, each row scaled
        q, scales = w.q, w.scales
        y = jax.lax.ragged_dot(x, q.astype(x.dtype), group_sizes.astype(jnp.int32),
                               precision=precision, preferred_element_type=jnp.float32)
        row_expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]),
                                      side="right")
        return y * scales[jnp.minimum(row_expert, q.shape[0] - 1), 0]
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=precision,
                              preferred_element_type=jnp.float32)


def _kernel_takes(*ws: ExpertWeight) -> bool:
    """Whether the Pallas kernel takes these [E, K, N] weights (gate and up: together); else
    one log line names why."""
    why = gmm_kernel.unsupported(*ws)
    if why is not None and why not in _logged:  # once per reason, at trace time
        _logged.add(why)
        logger.warning("experts run on XLA's ragged_dot: %s", why)
    return why is None


def route(logits: Float[Array, "T E"], top_k: int, renormalize: bool
          ) -> tuple[Float[Array, "T k"], Int[Array, "T k"]]:
    """Each token's top_k experts and their weights: softmax over all experts (float32),
    the top_k kept, rescaled to sum 1 when `renormalize` (HF's order and rule)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1)(
        rngs.params(), shape, dtype))


_VALUE_DTYPES = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


class QuantExperts(nnx.Module):
    """A layer's experts' matrix kept quantized (models/quant.py's forms, stacked): values
    [E, K or K / 2, N]; scales (and mins) [E, K / group_size, N]. fp8: one float32 scale per
    expert and output channel (`--quantization fp8`, fp8 checkpoints); int8 / int4 groups: a
    GGUF's experts at its own quantization, a GPTQ / AWQ checkpoint's."""

    def __init__(self, kind: str, num_experts: int, k: int, n: int, group_size: int,
                 has_min: bool = False, scale_dtype: str = "float32"):
        if k % group_size or (kind == "int4" and group_size % 2):
            raise ValueError(f"{kind} experts: group size {group_size} does not fit {k} "
                             "input rows")
        groups = k // group_size
        self.kind = kind
        self.qweight = nnx.Param(jnp.zeros(
            (num_experts, k // 2 if kind == "int4" else k, n), _VALUE_DTYPES[kind]))
        self.scales = nnx.Param(jnp.zeros((num_experts, groups, n), scale_dtype))
        self.mins = nnx.Param(jnp.zeros((num_experts, groups, n), scale_dtype)) \
            if has_min else None

    @property
    def in_features(self) -> int:
        """K, each expert's input rows (int4: two a stored byte)."""
        return self.qweight.get_value().shape[-2] * (2 if self.kind == "int4" else 1)

    @property
    def group_size(self) -> int:
        """Input rows a scale covers (K for fp8's one scale per channel); the shapes may have
        a leading stacked-layer axis."""
        return self.in_features // self.scales.get_value().shape[-2]

    def weight(self) -> QuantWeight:
        """The arrays as they lie (a stacked QuantWeight, k_axis 1)."""
        mins = None if self.mins is None else self.mins[...]
        return QuantWeight(self.kind, self.qweight[...], self.scales[...], mins, 1)


class Experts(nnx.Module):
    """A layer's experts' SwiGLU weights, stacked: gate/up [E, hidden, width], down
    [E, width, hidden] (each expert's HF [out, in] tensors transposed); each a Param in the
    model's dtype or, quantized, a QuantExperts."""

    def __init__(self, num_experts: int, hidden: int, width: int, *, dtype: Any,
                 rngs: nnx.Rngs):
        self.gate_proj = _init(rngs, (num_experts, hidden, width), dtype)
        self.up_proj = _init(rngs, (num_experts, hidden, width), dtype)
        self.down_proj = _init(rngs, (num_experts, width, hidden), dtype)
        self.dtype = jnp.dtype(dtype)

    def weights(self) -> tuple[ExpertWeight, ExpertWeight, ExpertWeight]:
        """gate, up and down as they lie: arrays, or (fp8 values, scales)."""
        return tuple(w.weight() if isinstance(w, QuantExperts) else w[...]
                     for w in (self.gate_proj, self.up_proj, self.down_proj))

    def __call__(self, xs: Float[Array, "M hidden"], group_sizes: Int[Array, " E"]
                 ) -> Float[Array, "M hidden"]:
        """Each row through its own expert's SwiGLU MLP (rows sorted by expert); float32."""
        weights = self.weights()
        xs = xs.astype(self.dtype)
        mesh, impl = _MESH.get(), _IMPL.get()
        if mesh is None or mesh.size == 1 or impl not in ("pallas", "interpret"):
            return _swiglu(xs, group_sizes, *weights)
        # A kernel is one opaque call to GSPMD: each device runs it on its own width of every
        # expert (gate/up columns, down rows, models/sharding.py's split; an fp8 down's
        # per-column scales whole) and the partial down products are summed, as a row-split
        # dense projection's.
        axis = mesh.axis_names[0]
        specs = [_split_spec(w, P(None, None, axis)) for w in weights[:2]]
        specs.append(_split_spec(weights[2], P(None, axis, None)))

        def local(xs: jax.Array, gs: jax.Array, wg: ExpertWeight, wu: ExpertWeight,
                  wd: ExpertWeight) -> jax.Array:
            return jax.lax.psum(_swiglu(xs, gs, wg, wu, wd), axis)

        f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *specs), out_specs=P(),
                          check_vma=False)
        return f(xs, group_sizes, *weights)


def _split_spec(w: ExpertWeight, spec: P) -> Any:
    """`spec` for every array of an expert weight, but a per-column scale row (fp8's [E, 1, N])
    whole when the split is along K (the row-split down projection: groups split with K)."""
    if not isinstance(w, QuantWeight):
        return spec
    along_k = spec[1] is not None
    side = P() if along_k and w.scales.shape[1] == 1 else spec
    return QuantWeight(w.kind, spec, side, None if w.mins is None else side, w.k_axis)


def _swiglu(xs: jax.Array, group_sizes: jax.Array, wg: ExpertWeight, wu: ExpertWeight,
            wd: ExpertWeight) -> jax.Array:
    """down(silu(gate(x)) * up(x)) of each row by its own expert's weights; float32. The
    activations are in xs's dtype (the model's)."""
    dtype, precision = xs.dtype, matmul_precision(xs.dtype)
    impl = _IMPL.get() or expert_impl(jax.default_backend())
    if impl in ("pallas", "interpret") and _kernel_takes(wg, wu) and _kernel_takes(wd):
        return gmm_kernel.grouped_swiglu(xs, wg, wu, wd, group_sizes,
                                         interpret=impl == "interpret")

    def mm(a: jax.Array, w: ExpertWeight) -> jax.Array:
        return grouped_matmul(a, w, group_sizes, precision=precision)

    g = mm(xs, wg).astype(dtype)
    u = mm(xs, wu).astype(dtype)
    return mm(jax.nn.silu(g) * u, wd)


class SparseMoeBlock(nnx.Module):
    """Router, experts and (Qwen2-MoE) a gated shared expert; HF's `mlp` / `block_sparse_moe`."""

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs,
                 mlp_cls: Any = None):
        h = spec.hidden_size
        self.top_k, self.renormalize = spec.num_experts_per_tok, spec.norm_topk_prob
        self.gate = nnx.Linear(h, spec.num_experts, use_bias=False, dtype=dtype,
                               param_dtype=dtype, precision=matmul_precision(dtype), rngs=rngs)
        self.experts = Experts(spec.num_experts, h, spec.moe_intermediate_size, dtype=dtype,
                               rngs=rngs)
        if spec.shared_expert_intermediate_size:
            shared = spec.replace(intermediate_size=spec.shared_expert_intermediate_size)
            self.shared_expert = mlp_cls(shared, dtype=dtype, rngs=rngs)
            self.shared_expert_gate = nnx.Linear(
                h, 1, use_bias=False, dtype=dtype, param_dtype=dtype,
                precision=matmul_precision(dtype), rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: Float[Array, "T hidden"], lora: Any = None,
                 layer_idx: int | jax.Array = 0) -> Float[Array, "T hidden"]:
        """Each token's chosen experts' outputs weighted by the router (plus the shared
        expert's, gated). `lora` is never for a sparse layer (models/lora.py refuses adapters
        on its projections); the arguments match the dense MLP's."""
        t = x.shape[0]
        if hasattr(self.gate, "product"):  # a router its checkpoint stored in fp8 (QuantLinear)
            logits = self.gate.product(x)
        else:
            kernel = self.gate.kernel[...]
            logits = one_row_as_two(  # no f32 copy of the router's weight at batch 1
                lambda v: jnp.dot(v.astype(kernel.dtype), kernel,
                                  precision=matmul_precision(x.dtype),
                                  preferred_element_type=jnp.float32), x)
        valid = _VALID.get()
        if valid is not None and valid.shape[0] != t:
            valid = None
        y = self._fused_route(x, logits, valid)
        if y is None:
            y = self._sorted_route(x, logits, valid)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(
                one_row_as_two(self.shared_expert_gate, x).astype(jnp.float32))
            y = y + gate * self.shared_expert(x).astype(jnp.float32)
        return y.astype(x.dtype)

    def _fused_route(self, x: jax.Array, logits: jax.Array, valid: jax.Array | None
                     ) -> jax.Array | None:
        """A small step on the kernels (one device): the routing and the tile layout in one
        launch (`moe_route`), the rows gathered from the tokens into their tiles, the two
        expert launches, and each token's weighted sum of its pairs' rows; float32 [T, H].
        None where the kernels do not take the step (the sorted path runs it)."""
        impl, mesh = _IMPL.get() or expert_impl(jax.default_backend()), _MESH.get()
        t, e = logits.shape
        if (impl not in ("pallas", "interpret") or (mesh is not None and mesh.size > 1)
                or not gmm_kernel.routing_fits(t, e, self.top_k)):
            return None
        wg, wu, wd = self.experts.weights()
        if not (_kernel_takes(wg, wu) and _kernel_takes(wd)):
            return None
        interpret = impl == "interpret"
        weights, dst, layout = gmm_kernel.route_layout(logits, valid, self.top_k,
                                                       self.renormalize, interpret=interpret)
        xs = x.astype(self.experts.dtype)
        h = gmm_kernel.tiled_matmul(
            gmm_kernel.pad_rows(xs, layout), (wg, wu), layout,
            out_dtype=xs.dtype if isinstance(wg, QuantWeight) else wg.dtype,
            interpret=interpret)
        rows = gmm_kernel.tiled_matmul(h, (wd,), layout, interpret=interpret)  # [Q, H]
        # Pair (t, j)'s row, weighted (a pair in no group: weight 0).
        picked = rows[jnp.maximum(dst, 0)]  # [T, KP, H]
        return jnp.einsum("tkh,tk->th", picked, jnp.where(dst >= 0, weights, 0.0))

    def _sorted_route(self, x: jax.Array, logits: jax.Array, valid: jax.Array | None
                      ) -> jax.Array:
        """The pairs sorted by expert, each expert's rows through its SwiGLU
        (`grouped_matmul`'s ways), gathered back and summed per token; float32 [T, H]."""
        t, h = x.shape
        weights, experts = route(logits, self.top_k, self.renormalize)
        e = logits.shape[1]
        flat = experts.reshape(-1)  # pair p = (token p // k, its (p % k)-th expert)
        if valid is not None:  # padding: "expert" E, sorted last
            flat = jnp.where(jnp.repeat(valid, self.top_k), flat, e)
        order = jnp.argsort(flat, stable=True)  # pairs sorted by expert
        # (a pair of expert E is in no group: sum(group_sizes) <= T * k, and the rows past
        # the groups read no weight and come out zero)
        group_sizes = jnp.bincount(flat, length=e)
        out = self.experts(x[order // self.top_k], group_sizes)  # float32, sorted pairs
        # Back to pair order by a gather (the inverse permutation is one small scatter of
        # indices, not a second sort), then each token's weighted sum.
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        pairs = out[rank].reshape(t, self.top_k, h)  # rank[p]: pair p's row in sorted order
        return jnp.einsum("tkh,tk->th", pairs, weights)
