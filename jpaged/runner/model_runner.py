"""The jitted device step: forward, KV write, paged attention, sampling; the KV pool donated."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.runner.batch import BucketPlan, StepBatch, empty_step, pack_step
from jpaged.runner.kv_cache import KVCache, amax_scale
from jpaged.runner.sampler import SamplingFlags, sample
from pallas_kernels.backend import AttentionOps
from pallas_kernels.reference import from_bits, to_bits

if TYPE_CHECKING:
    from jpaged.runner.parallel import TensorParallel

logger = logging.getLogger("jpaged")


@dataclass
class StepResult:
    """Host copies of one step's sampled tokens (rows = scheduled requests, in order)."""

    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray  # [n] float32, log-prob of the sampled token
    top_ids: np.ndarray  # [n, N] int32
    top_logprobs: np.ndarray  # [n, N] float32


class ModelRunner:
    """Owns the parameters and the KV pool on device and runs one jitted call per engine step."""

    def __init__(self, model: nnx.Module, kv: KVCache, plan: BucketPlan, block_size: int,
                 vocab_size: int, ops: AttentionOps, seed: int = 0,
                 parallel: TensorParallel | None = None,
                 calculate_kv_scales: bool = False) -> None:
        self.graphdef, self.params = nnx.split(model)
        self.kv = kv
        self.plan = plan
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.ops = ops
        self.seed = seed
        self.parallel = parallel
        if parallel is not None:  # params and pool on the mesh; attention per device's heads
            self.params = parallel.shard_params(self.params)
            self.kv = parallel.place_kv(kv)
            self.ops = parallel.wrap_ops(ops)
        self.last_pack_s = self.last_device_s = 0.0  # timings of the latest execute()
        # True until the first real step has computed the fp8 scales (then they stay fixed).
        self.scales_pending = calculate_kv_scales
        self._jit_step = jax.jit(self._step, static_argnames=("flags", "calc_scales"),
                                 donate_argnames=("kv",))

    def _step(self, params: Any, kv: KVCache, batch: StepBatch, flags: SamplingFlags,
              calc_scales: bool = False):
        model = nnx.merge(self.graphdef, params)
        head_dim, nb, bs = kv.k.shape[-1], kv.num_blocks, kv.k.shape[1]
        sm_scale = 1.0 / math.sqrt(head_dim)
        ops = self.ops

        def attn_fn(i: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                    pages: tuple[jax.Array, ...]) -> tuple[jax.Array, Any]:
            # The carry holds the stored arrays (fp8/bf16 as bits); the ops see page-dtype views.
            k_stored, v_stored, k_scale, v_scale = pages
            k_pages, v_pages = from_bits(k_stored, kv.dtype), from_bits(v_stored, kv.dtype)
            if calc_scales:  # this batch's own amax sets layer i's scales before its write
                valid = batch.slot_mapping >= 0
                k_scale = k_scale.at[i].set(amax_scale(k, valid, k_pages.dtype))
                v_scale = v_scale.at[i].set(amax_scale(v, valid, v_pages.dtype))
            # Layer i's blocks are rows i*nb .. i*nb+nb-1 of the shared pool; padding stays -1.
            slots = jnp.where(batch.slot_mapping < 0, -1, batch.slot_mapping + i * (nb * bs))
            k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, slots, k_scale[i],
                                            v_scale[i])
            # Write first, then attend: the new tokens see themselves through the pages.
            out = ops.ragged_paged_attention(
                q, k_pages, v_pages, batch.query_start_loc, batch.seq_lens,
                batch.block_tables + i * nb, sm_scale=sm_scale, k_scale=k_scale[i],
                v_scale=v_scale[i])
            return out, (to_bits(k_pages), to_bits(v_pages), k_scale, v_scale)

        hidden, (k_pages, v_pages, k_scale, v_scale) = model(
            batch.input_ids, batch.positions, attn_fn, (kv.k, kv.v, kv.k_scale, kv.v_scale))
        logits = model.compute_logits(jnp.take(hidden, batch.logits_indices, axis=0))
        if self.parallel is not None:  # vocab-split lm_head: whole logits on every device
            logits = self.parallel.gather_logits(logits)
        ids, lp, top_ids, top_lp = sample(logits, batch.sampling, flags)
        new_kv = KVCache(k_pages, v_pages, k_scale, v_scale, kv.num_blocks, kv.dtype)
        return (ids, lp, top_ids, top_lp), new_kv

    @property
    def num_compiled(self) -> int:
        """Executables the jitted step holds (one per bucket shape and flag set seen)."""
        return self._jit_step._cache_size()

    def warmup(self, shapes: Sequence[tuple[int, int]] | None = None) -> int:
        """Compile the step for every bucket shape (or the given ones); returns the count."""
        for t, b in shapes if shapes is not None else self.plan.all_shapes():
            packed = empty_step(self.plan, t, b, self.vocab_size)
            # calc_scales passed as execute() passes it: the kwargs are part of the cache key.
            outs, self.kv = self._jit_step(self.params, self.kv, packed.batch, flags=packed.flags,
                                           calc_scales=False)
            jax.block_until_ready(outs)
        return self.num_compiled

    def execute(self, scheduled: Sequence[Any]) -> StepResult:
        """Run one step for the scheduled requests; returns one sampled token per request."""
        t0 = time.perf_counter()
        packed = pack_step(scheduled, self.plan, self.block_size, self.vocab_size, self.seed)
        t1 = time.perf_counter()
        calc, self.scales_pending = self.scales_pending, False
        outs, self.kv = self._jit_step(self.params, self.kv, packed.batch, flags=packed.flags,
                                       calc_scales=calc)
        if calc:
            logger.info("fp8 KV scales from the first batch: k=%s v=%s",
                        np.asarray(self.kv.k_scale).tolist(), np.asarray(self.kv.v_scale).tolist())
        ids, lp, top_ids, top_lp = (np.asarray(x) for x in outs)
        # Host seconds packing the batch, and device seconds (dispatch to results on the host).
        self.last_pack_s, self.last_device_s = t1 - t0, time.perf_counter() - t1
        n = packed.num_seqs
        return StepResult(ids[:n], lp[:n], top_ids[:n], top_lp[:n])
