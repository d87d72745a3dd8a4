"""Tensor parallelism over a 1-D JAX device mesh (axis 'tp'), Megatron style.

Parameters are placed with NamedSharding and the step is left to GSPMD, except attention: the
backend's ops run per device inside `shard_map` over the head axes, so each device writes and
reads only its own KV heads' pages (the pool is never gathered).

Layout for tensor_parallel_size N (decoder layer i's Params are model.layers.i.*):
  q_proj, gate_proj, up_proj   split by output columns  -> each device owns heads / N, ffn / N
  k_proj, v_proj               split by columns when N <= kv_heads, else replicated
  o_proj, down_proj            split by input rows      -> partial sums, one all-reduce each
  embed_tokens, lm_head        split by vocabulary when N divides it (else replicated); the
                               token lookup is local and masked, then one psum of [T, hidden]
                               (the table never moves); the logits are all-gathered before
                               sampling, which runs replicated
  norms, o/down biases         replicated
  KV pool [L*nb, bs, H, D]     split on H; when N > kv_heads each KV head is stored N/kv_heads
                               times (H = N) so every device holds the one head its queries use
  fp8 scales, step batch       replicated

The parameter rules, the head layout and the mesh are models/sharding.py's (the loaders place
parameters with them too); this module adds the KV pool and the attention ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.runner.kv_cache import KVCache, storage_dtype
from jpaged.runner.sampler import best_runs, row_candidates
from models.config import ModelSpec
from models.linear_ops import DecodeLinears
from models.quant import QuantWeight
from models.sharding import AXIS, make_mesh, param_shardings, param_spec, plan_layout, vocab_splits
from pallas_kernels.backend import AttentionOps

# Pages [blocks, bs, kv_heads, head_dim] and per-token heads [T, heads, head_dim]: split on heads.
# No trailing None: jit returns the donated pool as P(None, None, 'tp'), and an input sharding
# spelled differently is a different cache key (one extra compile per shape).
PAGES = P(None, None, AXIS)
HEADS = P(None, AXIS)

def _place(tree: Any, shardings: Any) -> Any:
    """device_put, or for abstract trees (ShapeDtypeStructs) the same structs with shardings."""
    leaves = jax.tree_util.tree_leaves(tree)
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            tree, shardings)
    return jax.device_put(tree, shardings)


class TensorParallel:
    """A mesh plus the head layout: places parameters and the KV pool, wraps attention ops."""

    def __init__(self, spec: ModelSpec, tensor_parallel_size: int,
                 devices: Sequence[Any] | None = None) -> None:
        self.layout = plan_layout(spec, tensor_parallel_size)
        # `devices`: explicit (e.g. abstract GPUs of a deviceless compile); default jax.devices().
        self.mesh = make_mesh(tensor_parallel_size, devices)
        self.spec = spec
        # Embedding and lm_head rows split by vocabulary when it divides evenly.
        self.split_vocab = vocab_splits(spec, tensor_parallel_size)

    @property
    def size(self) -> int:
        """tensor_parallel_size."""
        return self.layout.size

    # ------------------------------------------------------------------ parameters
    def param_spec(self, path: tuple[Any, ...], ndim: int,
                   shape: tuple[int, ...] | None = None) -> P:
        """PartitionSpec of one parameter leaf, from its module path and rank (and shape)."""
        return param_spec(path, ndim, self.layout, self.split_vocab, shape)

    def param_shardings(self, params: Any) -> Any:
        """A NamedSharding for every leaf of an nnx parameter State."""
        return param_shardings(params, self.mesh, self.layout, self.split_vocab)

    def shard_params(self, params: Any) -> Any:
        """Place parameters on the mesh (a copy; the input stays where it was)."""
        return _place(params, self.param_shardings(params))

    def param_bytes_per_device(self, params: Any) -> int:
        """Bytes of parameters each device holds once sharded."""
        total = 0
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            spec = self.param_spec(path, x.ndim, x.shape)
            ways = self.size if AXIS in tuple(spec) else 1
            total += math.ceil(x.size / ways) * x.dtype.itemsize
        return total

    def embed_lookup(self, table: jax.Array, input_ids: jax.Array) -> jax.Array:
        """Rows of `input_ids` from the embedding table, moving activations only.

        table: [vocab, hidden], split by vocabulary over the mesh; input_ids: [T]; returns
        [T, hidden] replicated. Each device looks up the ids in its own vocabulary range (zeros
        elsewhere) and one psum adds the devices' rows: exactly one device contributes each
        row, so the sum is exact in any dtype. A plain take would all-gather the whole table.
        """
        if not self.split_vocab:
            return jnp.take(table, input_ids, axis=0)

        def local(part: jax.Array, ids: jax.Array) -> jax.Array:
            rows = part.shape[0]  # this device's vocabulary: [index * rows, (index + 1) * rows)
            j = ids - jax.lax.axis_index(AXIS) * rows
            mine = (j >= 0) & (j < rows)
            found = jnp.take(part, jnp.where(mine, j, 0), axis=0)
            return jax.lax.psum(jnp.where(mine[:, None], found, jnp.zeros_like(found)), AXIS)

        f = jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS, None), P()), out_specs=P(),
                          check_vma=False)
        return f(table, input_ids)

    def split_logits(self, logits: jax.Array) -> jax.Array:
        """Logits as the lm_head computes them, vocab-split (whole on each device when the
        vocabulary is not split): the sampler's reductions over the vocabulary then run on each
        device's share and combine [B]-sized partials, instead of gathering [B, V] first."""
        if not self.split_vocab:
            return self.replicated(logits)
        return jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, P(None, AXIS)))

    def top_k(self, logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """`lax.top_k` of vocab-split logits [N, V] (values, global ids; replicated), moving
        [N, k x tp] candidates: each device takes the top k of its own vocabulary range, and
        the top k of the devices' candidates, laid out in device (= id) order, are the top k
        overall with the same ties as one top_k (lower id first). XLA's partitioner gathers
        all [N, V] for a plain top_k (XLA:CPU does)."""
        if not self.split_vocab:
            return jax.lax.top_k(logits, k)

        def local(part: jax.Array) -> tuple[jax.Array, jax.Array]:
            vals, ids = jax.lax.top_k(part, min(k, part.shape[-1]))
            ids = ids + jax.lax.axis_index(AXIS) * part.shape[-1]
            vals = jax.lax.all_gather(vals, AXIS, axis=1, tiled=True)
            ids = jax.lax.all_gather(ids, AXIS, axis=1, tiled=True)
            best, pos = jax.lax.top_k(vals, k)
            return best, jnp.take_along_axis(ids, pos, axis=1)

        f = jax.shard_map(local, mesh=self.mesh, in_specs=P(None, AXIS), out_specs=(P(), P()),
                          check_vma=False)
        return f(logits)

    def candidates(self, logits: jax.Array, chunk: int, keep: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The sampler's candidates (`sampler.row_candidates`' contract: the `keep` runs of `chunk`
        tokens with the best maxima, as values and global ids, and the best run left out's
        maximum; replicated) of vocab-split logits, moving [B, tp x keep x chunk] values: each
        device takes its own best runs, and the best `keep` of the devices' are the best
        overall (a run among the best overall is among its device's best). The best run left
        out is the best of the devices' runs not taken and of each device's first run not
        sent."""
        if not self.split_vocab or self.size == 1:
            return row_candidates(logits, chunk, keep)

        def local(part: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            b = part.shape[0]
            vals, ids, top = best_runs(part, chunk, keep)
            ids = ids + jax.lax.axis_index(AXIS) * part.shape[-1]
            vals, ids, top = (jax.lax.all_gather(a, AXIS, axis=1, tiled=True)
                              for a in (vals, ids, top))
            top = top.reshape(b, -1, keep + 1)  # [B, devices, keep + 1], best first
            best, pos = jax.lax.top_k(top[:, :, :keep].reshape(b, -1), keep + 1)
            vals = jnp.take_along_axis(vals.reshape(b, -1, chunk), pos[:, :keep, None], axis=1)
            ids = jnp.take_along_axis(ids.reshape(b, -1, chunk), pos[:, :keep, None], axis=1)
            bound = jnp.maximum(best[:, keep], top[:, :, keep].max(axis=-1))
            return vals.reshape(b, -1), ids.reshape(b, -1), bound

        f = jax.shard_map(local, mesh=self.mesh, in_specs=P(None, AXIS),
                          out_specs=(P(), P(), P()), check_vma=False)
        return f(logits)

    def replicated(self, x: jax.Array) -> jax.Array:
        """`x` whole on every device (inside a jitted program)."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P()))

    def replicate(self, x: jax.Array) -> jax.Array:
        """`x` whole on every device of the mesh."""
        return jax.device_put(x, NamedSharding(self.mesh, P()))

    # ------------------------------------------------------------------ KV pool
    def kv_shardings(self, num_blocks: int, dtype: jnp.dtype) -> KVCache:
        """Shardings of the KVCache pytree: pages split on heads, scales replicated."""
        pages, rep = NamedSharding(self.mesh, PAGES), NamedSharding(self.mesh, P())
        return KVCache(pages, pages, rep, rep, num_blocks, jnp.dtype(dtype))

    def place_kv(self, kv: KVCache) -> KVCache:
        """Put an existing pool on the mesh; its head axis must already hold stored_kv_heads."""
        if kv.k.shape[2] != self.layout.stored_kv_heads:
            raise ValueError(
                f"the KV pool has {kv.k.shape[2]} heads but tensor_parallel_size={self.size} "
                f"needs {self.layout.stored_kv_heads} (use TensorParallel.allocate_kv)")
        return _place(kv, self.kv_shardings(kv.num_blocks, kv.dtype))

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: jnp.dtype,
                    kv_layers: int | None = None) -> KVCache:
        """Zeroed pool made directly in its sharded layout (no device holds the whole pool);
        `kv_layers` slots per block (KV cache groups) instead of one per layer."""
        s = self.spec
        layers = s.num_layers if kv_layers is None else kv_layers
        shape = (layers * num_blocks, block_size, self.layout.stored_kv_heads, s.head_dim)

        stored = storage_dtype(dtype)

        def make() -> KVCache:
            return KVCache(jnp.zeros(shape, stored), jnp.zeros(shape, stored),
                           jnp.ones((s.num_layers,), jnp.float32),
                           jnp.ones((s.num_layers,), jnp.float32), num_blocks, jnp.dtype(dtype))

        return jax.jit(make, out_shardings=self.kv_shardings(num_blocks, dtype))()

    # ------------------------------------------------------------------ attention
    def wrap_ops(self, ops: AttentionOps) -> AttentionOps:
        """The backend's ops run per device on its own heads under shard_map."""
        mesh, rep = self.mesh, self.layout.kv_replicas

        def expand(x: jax.Array) -> jax.Array:
            # [T, kv_heads, D] -> [T, stored_kv_heads, D]; stored head j is KV head j // rep.
            return x if rep == 1 else jnp.repeat(x, rep, axis=1)

        def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                     slot_mapping: jax.Array, k_scale: Any = 1.0, v_scale: Any = 1.0
                     ) -> tuple[jax.Array, jax.Array]:
            f = jax.shard_map(ops.write_kv, mesh=mesh,
                              in_specs=(PAGES, PAGES, HEADS, HEADS, P(), P(), P()),
                              out_specs=(PAGES, PAGES), check_vma=False)
            return f(k_pages, v_pages, expand(k), expand(v), slot_mapping,
                     jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))

        def attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                      query_start_loc: jax.Array, seq_lens: jax.Array, block_tables: jax.Array,
                      *, k_scale: Any = 1.0, v_scale: Any = 1.0, **static: Any) -> jax.Array:
            # Device i holds query heads [i*hq/N, (i+1)*hq/N) and exactly the KV heads they read.
            def local(q, kp, vp, qsl, lens, tables, ks, vs):  # noqa: ANN001, ANN202
                return ops.ragged_paged_attention(q, kp, vp, qsl, lens, tables, k_scale=ks,
                                                  v_scale=vs, **static)

            f = jax.shard_map(local, mesh=mesh,
                              in_specs=(HEADS, PAGES, PAGES, P(), P(), P(), P(), P()),
                              out_specs=HEADS, check_vma=False)
            return f(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables,
                     jnp.asarray(k_scale, jnp.float32), jnp.asarray(v_scale, jnp.float32))

        return AttentionOps(f"{ops.name}+tp{self.size}", write_kv, attention)


    # ------------------------------------------------------------------ projections
    def wrap_linears(self, lin: DecodeLinears) -> DecodeLinears:
        """The fused projections per device on its own columns or rows, under shard_map.

        q, gate and up are split by output columns (k and v too unless their heads are
        replicated), so each device runs the kernel on its slabs with the whole (replicated)
        input; o and down are split by input rows: each device's partial product is summed
        across devices, then the bias and the residual are added (by XLA: the kernel's residual
        epilogue would add it once per device). A quantized weight (QuantWeight) splits as
        its float kernel would, leaf by leaf (models/sharding.py's rule): values, scales and
        mins by columns alike; by rows the values and the scales and mins of its groups, a
        single scale row (one group per channel) replicated. The output head (`logits`, a
        float head split by vocabulary: lm_head's columns or the tied table's rows) runs per
        device on its own vocabulary and gives the logits vocab-split, as `split_logits` lays
        them out; the runner offers no head kernel for a head the loaders replicate
        (linears.head_unsupported)."""
        mesh = self.mesh
        col, rep = P(None, AXIS), P()
        kv = col if self.layout.kv_replicas == 1 else rep
        kvb = P(AXIS) if self.layout.kv_replicas == 1 else P()

        def by_rows(w: Any) -> Any:
            """in_specs of a row-split weight (o, down): float or quantized."""
            if not isinstance(w, QuantWeight):
                return P(AXIS, None)
            groups = P() if w.scales.shape[0] == 1 else P(AXIS, None)
            return QuantWeight(w.kind, P(AXIS, None), groups,
                               None if w.mins is None else groups, w.k_axis)

        def qkv(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array,
                bq: jax.Array | None, bk: jax.Array | None, bv: jax.Array | None,
                **kw: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
            # Each device's columns are whole heads, so RoPE's pairs (within a head) are local.
            g, rope = kw.pop("norm_weight"), kw.pop("rope", None)

            def local(x, g, rope, wq, wk, wv, bq, bk, bv):  # noqa: ANN001, ANN202
                return lin.qkv(x, wq, wk, wv, bq, bk, bv, norm_weight=g, rope=rope, **kw)

            bias_specs = tuple(None if b is None else s
                               for b, s in ((bq, P(AXIS)), (bk, kvb), (bv, kvb)))
            f = jax.shard_map(local, mesh=mesh,
                              in_specs=(rep, rep, None if rope is None else (rep, rep), col, kv,
                                        kv, *bias_specs),
                              out_specs=(col, kv, kv), check_vma=False)
            return f(x, g, rope, wq, wk, wv, bq, bk, bv)

        def gate_up(x: jax.Array, wg: jax.Array, wu: jax.Array, bg: jax.Array | None,
                    bu: jax.Array | None, **kw: Any) -> jax.Array:
            g = kw.pop("norm_weight")

            def local(x, g, wg, wu, bg, bu):  # noqa: ANN001, ANN202
                return lin.gate_up(x, wg, wu, bg, bu, norm_weight=g, **kw)

            bias_specs = tuple(None if b is None else P(AXIS) for b in (bg, bu))
            f = jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, col, col, *bias_specs),
                              out_specs=col, check_vma=False)
            return f(x, g, wg, wu, bg, bu)

        def out(x: jax.Array, w: jax.Array, b: jax.Array | None,
                residual: jax.Array | None) -> jax.Array:
            def local(x, w):  # noqa: ANN001, ANN202
                return jax.lax.psum(lin.out(x, w, None, None), AXIS)

            f = jax.shard_map(local, mesh=mesh, in_specs=(col, by_rows(w)), out_specs=rep,
                              check_vma=False)
            y = f(x, w)
            if b is not None:
                y = y + b.astype(y.dtype)
            return y if residual is None else residual + y

        def logits(h: jax.Array, w: jax.Array, *, transposed: bool) -> jax.Array:
            if isinstance(w, QuantWeight) or not self.split_vocab:
                raise ValueError("the head kernel runs a vocab-split float head under tensor "
                                 "parallel")

            def local(h, w):  # noqa: ANN001, ANN202
                return lin.logits(h, w, transposed=transposed)

            f = jax.shard_map(local, mesh=mesh,
                              in_specs=(rep, P(AXIS, None) if transposed else col),
                              out_specs=col, check_vma=False)
            return f(h, w)

        return DecodeLinears(f"{lin.name}+tp{self.size}", lin.max_rows, qkv, gate_up, out,
                             logits=None if lin.logits is None else logits,
                             logits_max_rows=lin.logits_max_rows)


def kv_bytes_per_device(kv: KVCache) -> int:
    """Bytes of the KV pool (pages and scales) held by the first device that holds any."""
    first = kv.k.addressable_shards[0].device
    total = 0
    for x in (kv.k, kv.v, kv.k_scale, kv.v_scale):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == first)
    return total
