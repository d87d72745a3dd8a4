"""The jitted device step: forward, KV write, paged attention, sampling; the KV pool donated."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.runner.batch import (
    BucketPlan,
    FlatStep,
    empty_step,
    flatten_step,
    mask_rows,
    unflatten_step,
)
from jpaged.runner.input_batch import InputBatch
from jpaged.runner.kv_cache import KVCache, amax_scale, zeros_as
from jpaged.runner.linears import (
    fused_qkv_write,
    is_gpu_platform,
    rope_in_kernel,
    select_linears,
)
from jpaged.runner.lora import LoraSlots
from jpaged.runner.sampler import NUM_TOP_LOGPROBS, SamplingFlags, sample, searches_wide
from models.linear_ops import DecodeLinears
from models.lora import LoraBatch, slot_mask
from models.moe import expert_impl, experts_run_as
from models.quant_layers import plan_of
from pallas_kernels.backend import AttentionOps
from pallas_kernels.reference import from_bits, to_bits

if TYPE_CHECKING:
    from jpaged.core.kv_cache_groups import KVCacheLayout
    from jpaged.runner.parallel import TensorParallel

logger = logging.getLogger("jpaged")

# XLA options of the step program. XLA:GPU's rematerialization counts the donated KV pool twice
# (as input and as output), so at the pool the engine sizes (most of the card) it finds the
# step "over" its memory limit and recomputes whatever it can, the layers' GEMMs included:
# each recompute reads the weights again (+31% HBM traffic in the Llama-3-8B decode step; a
# pool cannot be rematerialized, so it never fits either way). The pool and the step's
# temporaries are sized to fit by the engine (plan_kv_pool), so the limit is lifted 100x.
STEP_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_memory_limit_slop_factor": 10000}
# On a GPU, every thunk of a step in command buffers (CUDA graphs): one graph launch a step
# instead of ~300 kernel launches. XLA's default command types plus WHILE (the sampler's
# searches; without it the conditionals holding them stay out too, each a host round trip a
# step) and no minimum graph size. CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, CONDITIONAL and WHILE
# need a CUDA >= 12.3 driver and runtime. COLLECTIVES stay out (XLA's default): a tensor
# parallel step's all-reduces run between graphs. `make gpu-aot` checks that every decode step
# compiles to one graph (jpaged/aot/launches.py).
COMMAND_BUFFER_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "CONDITIONAL",
                        "WHILE", "DYNAMIC_SLICE_FUSION")
COMMAND_BUFFER_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_TYPES),
    "xla_gpu_graph_min_graph_size": 1,
}


@functools.cache
def _accepts(options: tuple[tuple[str, Any], ...]) -> str | None:
    """None if this jax's XLA compiles a program with these options, else why not."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(
            jnp.zeros(2, jnp.float32)).compile()
    except Exception as e:  # noqa: BLE001 - any refusal means: leave them out
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


# vLLM's enforce_eager: no command buffers at all (XLA's default types included).
EAGER_OPTIONS: dict[str, Any] = {"xla_gpu_enable_command_buffer": ""}


def step_compiler_options(platform: str, eager: bool = False) -> dict[str, Any]:
    """The step program's XLA options on `platform`: STEP_COMPILER_OPTIONS, and on a GPU the
    command-buffer options unless this XLA refuses them (then one log line says why), or with
    `eager` (vLLM's enforce_eager) none: every kernel launched on its own."""
    out = dict(STEP_COMPILER_OPTIONS)
    if is_gpu_platform(platform) and eager:
        out.update(EAGER_OPTIONS)
    elif is_gpu_platform(platform):
        why = _accepts(tuple(sorted(COMMAND_BUFFER_OPTIONS.items())))
        if why is None:
            out.update(COMMAND_BUFFER_OPTIONS)
        else:
            logger.warning("step programs outside CUDA graphs: XLA refused %s (%s)",
                           COMMAND_BUFFER_OPTIONS, why)
    return out


def scans_layers(platform: str | None = None) -> bool:
    """True where the step runs the decoder layers as a `lax.scan` over stacked weights
    (models.llama.stack_layers): XLA:CPU, which compiles one layer instead of every layer
    (~5x faster warm-up for the embedded model) and runs it as fast. Elsewhere each layer
    keeps its own arrays: XLA:GPU would copy a layer's weights out of a stack every step."""
    return (platform or jax.default_backend()) == "cpu"


def _head(linears: DecodeLinears | None, rows: int) -> DecodeLinears | None:
    """The step's linears for an output head of `rows` rows (static) when their head kernel
    takes them (`DecodeLinears.logits`, at most `logits_max_rows` rows), else None: XLA's."""
    if linears is None or linears.logits is None or rows > linears.logits_max_rows:
        return None
    return linears


def _last_rows(scheduled: Sequence[Any], first_rows: list[int] | None) -> dict[str, int]:
    """Request id -> the step's row sampled at its last new token, for each request the step
    samples (the next step feeds a token still on device from there)."""
    if first_rows is None:
        return {s.request.request_id: i for i, s in enumerate(scheduled) if s.sample}
    return {s.request.request_id: first_rows[i] + len(s.spec_token_ids)
            for i, s in enumerate(scheduled) if s.sample}


def _fed_history(batch: Any, fed_ids: jax.Array, flags: SamplingFlags) -> Any:
    """The step's sampling batch, with each fed token (sampled by the previous step, never seen
    by the host) as the last of its row's penalty history."""
    sampling = batch.sampling
    if flags.use_penalties:
        fed = batch.feed_rows >= 0
        r, h = sampling.history.shape
        col = jnp.where(fed, jnp.take(batch.positions, batch.logits_indices), h)  # its position
        sampling = dataclasses.replace(sampling, history=sampling.history.at[
            jnp.arange(r), col].set(fed_ids, mode="drop"))
    return sampling


@dataclass
class DeferredStep:
    """A step whose forward is on the device and whose sampling waits for token masks."""

    packed: Any  # PackedStep
    outs: tuple[Any, ...]  # (logits, prompt-logprob outputs when any)
    t_dispatch: float


@dataclass
class StepResult:
    """Host copies of one step's sampled tokens (rows = scheduled requests, in order)."""

    token_ids: np.ndarray  # [n] int32
    logprobs: np.ndarray  # [n] float32, log-prob of the sampled token
    top_ids: np.ndarray  # [n, N] int32
    top_logprobs: np.ndarray  # [n, N] float32
    ranks: np.ndarray  # [n] int32: the sampled token's rank (read where logprobs were asked)
    # prompt_logprobs: (request id, first prompt position, count) runs over the rows below.
    prompt_spans: tuple[tuple[str, int, int], ...] = ()
    prompt_logprobs: np.ndarray | None = None  # [P] float32: of the next prompt token
    prompt_ranks: np.ndarray | None = None  # [P] int32: its rank (1 = the most likely)
    prompt_top_ids: np.ndarray | None = None  # [P, N] int32
    prompt_top_logprobs: np.ndarray | None = None  # [P, N] float32
    # A pooling runner's: row i's pooled hidden state, float32 [n, hidden] (the runner's
    # `pooling` says how: LAST the row's last token, CLS its first, MEAN the sum over its
    # tokens); None for a generating runner.
    pooled: np.ndarray | None = None


class PendingStep:
    """A dispatched step whose sampled tokens are still on device; `result()` waits for them."""

    def __init__(self, outs: tuple[jax.Array, ...], num_rows: int, t_dispatch: float,
                 runner: ModelRunner, prompt_spans: tuple[tuple[str, int, int], ...] = (),
                 first_rows: list[int] | None = None) -> None:
        self._outs = outs
        self.num_rows = num_rows
        # Speculative decoding: the first result row of each scheduled row (its k + 1
        # verification rows follow it); None: row i is scheduled row i.
        self.first_rows = first_rows
        self.prompt_spans = prompt_spans
        self._t_dispatch = t_dispatch
        self._runner = runner
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """Host copies of the step's sampled tokens (blocks until the device has them)."""
        if self._result is None:
            t0 = time.perf_counter()
            ids, lp, top_ids, top_lp, ranks = (np.asarray(x) for x in self._outs[:5])
            plp = ((np.asarray(x) for x in self._outs[5]) if self.prompt_spans
                   else (None,) * 4)
            pooled = (np.asarray(self._outs[-1])[:self.num_rows]
                      if self._runner.pooling is not None else None)
            t1 = time.perf_counter()
            self._runner.last_wait_s += t1 - t0
            # Device seconds: dispatch until the results are on the host.
            self._runner.last_device_s = t1 - self._t_dispatch
            n = self.num_rows
            self._result = StepResult(ids[:n], lp[:n], top_ids[:n], top_lp[:n], ranks[:n],
                                      self.prompt_spans, *plp, pooled=pooled)
            self._outs = ()
        return self._result


class ModelRunner:
    """Owns the parameters and the KV pool on device and runs one jitted call per engine step."""

    def __init__(self, model: nnx.Module, kv: KVCache, plan: BucketPlan, block_size: int,
                 vocab_size: int, ops: AttentionOps, seed: int = 0,
                 parallel: TensorParallel | None = None,
                 calculate_kv_scales: bool = False,
                 kv_layout: KVCacheLayout | None = None, platform: str | None = None,
                 num_top_logprobs: int = NUM_TOP_LOGPROBS,
                 decode_matmuls: bool = True, eager: bool = False,
                 lora: LoraSlots | None = None, pooling: str | None = None) -> None:
        self.graphdef, self.params = nnx.split(model)
        # A pooling runner ("LAST", "MEAN", "CLS"; jpaged/pooling_params.py): every step also
        # returns each row's pooled final hidden state (static: part of every compiled step).
        self.pooling = pooling
        # LoRA: the adapter slots on the device (None: no adapters; steps carry no slot
        # inputs and compile as they always did). Requests bring their adapters' weights.
        self.lora = lora
        # Sleep mode: the parts given up ("weights", "kv_cache"), and the host copies of the
        # params and LoRA slots a level-1 sleep keeps (None otherwise).
        self._asleep: set[str] = set()
        self._host_params: Any = None
        self._host_lora: Any = None
        if self.lora is not None and decode_matmuls:
            # The fused kernels have no adapter epilogue: every step runs on XLA's GEMMs.
            logger.info("LoRA: decode steps run on XLA's GEMMs, not the fused projections")
            decode_matmuls = False
        platform = platform or jax.default_backend()
        # How a mixture-of-experts model's grouped matmuls run in this step (models/moe.py).
        self.experts_impl = expert_impl(platform)
        # Candidates a step with logprobs returns per row (sampled and prompt alike): the
        # engine's max_logprobs, at most the vocabulary. Static: part of every compiled step.
        self.num_top_logprobs = max(1, min(num_top_logprobs, vocab_size))
        # The platform the step compiles for (a deviceless GPU compile runs on the CPU backend):
        # off XLA:CPU the sampler's filters search the row in as few reads as they can.
        self.wide_search = searches_wide(platform)
        # KV cache groups: layer i writes and reads slot slot_of[i] of the blocks in group
        # group_of[i]'s table. None (or one group): layer i is slot i, one table.
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.num_groups > 1 else None
        if plan.num_groups != (1 if self.kv_layout is None else self.kv_layout.num_groups):
            raise ValueError(f"BucketPlan.num_groups ({plan.num_groups}) does not match the KV "
                             "cache layout's groups")
        self.kv = kv
        self.plan = plan
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.ops = ops
        # Fused projections for small steps (`decode_matmuls` and the Pallas backend; None: XLA's
        # GEMMs for every step). Off: the XLA path, which the device check times beside it.
        self.linears = None if not decode_matmuls else select_linears(
            ops.name, platform, model.spec, model.dtype,
            parallel.size if parallel is not None else 1, plan_of(model))
        self.linears_interpret = not is_gpu_platform(platform)
        # The q/k/v launch also writes K/V when its RoPE runs in the kernel (one launch less a
        # layer); not under tensor parallel, whose pool shards go through the backend's write.
        self.write_kv_in_qkv = (self.linears is not None and parallel is None
                                and rope_in_kernel(model.spec))
        self.seed = seed
        self.parallel = parallel
        if parallel is not None:  # params and pool on the mesh; attention per device's heads
            self.params = parallel.shard_params(self.params)
            self.kv = parallel.place_kv(kv)
            self.ops = parallel.wrap_ops(ops)
            if self.linears is not None:
                self.linears = parallel.wrap_linears(self.linears)
        # Plain nested dicts of the same arrays: every launch flattens the params, and an nnx
        # State flattens in Python (17 µs a step for the embedded model's 11 leaves, more with
        # more leaves), nested dicts in C++ (5 µs). nnx.merge takes either.
        self.params = nnx.to_pure_dict(self.params)
        self.last_pack_s = self.last_device_s = 0.0  # timings of the latest step
        # Seconds blocked on the device (dispatch waits + result reads) since the engine zeroed
        # it at the start of its latest step.
        self.last_wait_s = 0.0
        # Device buffer of the tokens the latest step sampled, by its batch row; the next step
        # reads its PLACEHOLDER_TOKEN inputs from it (async scheduling). Rows are the previous
        # step's rows of the requests in `_prev_rows`.
        self.last_tokens: jax.Array | None = None  # made by the first step (see _buffer)
        # On XLA:CPU the "device" is the host's own cores: a step queued behind the running one
        # gains nothing there and measurably slows both (docs/benchmarks.md, host work), so a
        # dispatch first waits for the running step. The host's packing before it and output
        # processing after it still overlap a running step; on a GPU steps queue.
        self.wait_before_dispatch = jax.default_backend() == "cpu"
        # Work the engine does while that wait lasts (a KV connector's producer answers pulls:
        # its gathers queue behind the running step); called with the pool, returns within
        # milliseconds. None: a plain wait.
        self.while_waiting: Callable[[KVCache], None] | None = None
        self._prev_rows: dict[str, int] = {}
        self.input_batch = InputBatch(plan, block_size, vocab_size, seed)
        # Multi-process (process 0): tells the other processes to launch the same step first.
        # Arguments: the step, its flags, calc_scales, scratch (see launch).
        self.announce: Callable[[FlatStep, SamplingFlags, bool, bool], None] | None = None
        # True until the first real step has computed the fp8 scales (then they stay fixed).
        self.scales_pending = calculate_kv_scales
        self._jit_step = jax.jit(self._step, static_argnames=("flags", "calc_scales", "defer"),
                                 donate_argnames=("kv", "last_tokens"),
                                 compiler_options=step_compiler_options(platform, eager))
        self._jit_sample = jax.jit(self._sample_step, static_argnames=("flags",),
                                   donate_argnames=("last_tokens",),
                                   compiler_options=(dict(EAGER_OPTIONS) if eager and
                                                     is_gpu_platform(platform) else None))
        self.num_deferred = 0  # steps sampled after their forward (finish_deferred)

    @property
    def num_rows(self) -> int:
        """Rows of the last-token buffer: the most sequences any step shape holds."""
        return max(self.plan.seq_buckets[-1], self.plan.mixed_seq_buckets[-1])

    def last_tokens_spec(self) -> jax.ShapeDtypeStruct:
        """Shape and dtype of the last-token buffer (for lowering the step abstractly)."""
        return jax.ShapeDtypeStruct((self.num_rows,), jnp.int32)

    def _new_buffer(self) -> jax.Array:
        x = jnp.zeros(self.num_rows, jnp.int32)
        return x if self.parallel is None else self.parallel.replicate(x)

    def _buffer(self) -> jax.Array:
        if self.last_tokens is None:
            self.last_tokens = self._new_buffer()
        return self.last_tokens

    def _step(self, params: Any, kv: KVCache, flat: FlatStep, last_tokens: jax.Array,
              flags: SamplingFlags, calc_scales: bool = False, defer: bool = False,
              lora_weights: dict[str, tuple[jax.Array, jax.Array]] | None = None):
        batch = unflatten_step(flat)  # two host buffers in, the step's fields sliced out here
        model = nnx.merge(self.graphdef, params)
        lora = None
        if lora_weights is not None:  # every slot's adapters; each token picks its own
            lora = LoraBatch(lora_weights, slot_mask(batch.lora_slots, self.lora.num_slots,
                                                     self.lora.rank))
        # Tokens sampled by the previous step (never seen by the host) enter here.
        fed = batch.feed_rows >= 0
        fed_ids = jnp.take(last_tokens, jnp.maximum(batch.feed_rows, 0))
        input_ids = batch.input_ids.at[jnp.where(fed, batch.logits_indices,
                                                 batch.input_ids.shape[0])].set(fed_ids,
                                                                                mode="drop")
        sampling = _fed_history(batch, fed_ids, flags)
        nb, bs = kv.num_blocks, kv.k.shape[1]
        spec = model.spec
        ops = self.ops
        layout = self.kv_layout
        t, m = batch.input_ids.shape[0], flat.max_blocks

        def group_inputs(i: Any) -> tuple[Any, jax.Array, jax.Array]:
            # (slot, slot mapping, block tables) of layer i; i is traced only without groups.
            if layout is None:
                return i, batch.slot_mapping, batch.block_tables
            g = layout.group_of[i]
            return (layout.slot_of[i], batch.slot_mapping[g * t:(g + 1) * t],
                    batch.block_tables[:, g * m:(g + 1) * m])

        def attn_fn(i: int, q: jax.Array, k: jax.Array, v: jax.Array,
                    pages: tuple[jax.Array, ...], kv_written: bool = False
                    ) -> tuple[jax.Array, Any]:
            # The carry holds the stored arrays (fp8/bf16 as bits); the ops see page-dtype views.
            k_stored, v_stored, k_scale, v_scale = pages
            k_pages, v_pages = from_bits(k_stored, kv.dtype), from_bits(v_stored, kv.dtype)
            j, slot_mapping, tables = group_inputs(i)
            if calc_scales:  # this batch's own amax sets layer i's scales before its write
                valid = slot_mapping >= 0
                k_scale = k_scale.at[i].set(amax_scale(k, valid, k_pages.dtype))
                v_scale = v_scale.at[i].set(amax_scale(v, valid, v_pages.dtype))
            if not kv_written:  # (else the q/k/v launch wrote them: `qkv_write` below)
                # Slot j's blocks are rows j*nb .. j*nb+nb-1 of the shared pool (j = i without
                # groups); padding stays -1.
                slots = jnp.where(slot_mapping < 0, -1, slot_mapping + j * (nb * bs))
                k_pages, v_pages = ops.write_kv(k_pages, v_pages, k, v, slots, k_scale[i],
                                                v_scale[i])
            # Write first, then attend: the new tokens see themselves through the pages.
            # Layer i's window (static: unrolled layers, or scanned ones that all share it).
            out = ops.ragged_paged_attention(
                q, k_pages, v_pages, batch.query_start_loc, batch.seq_lens,
                tables + j * nb, sm_scale=spec.attn_scale,
                soft_cap=spec.attn_logit_softcapping, sliding_window=spec.window_of(i),
                k_scale=k_scale[i], v_scale=v_scale[i], decode_only=flags.decode_only)
            return out, (to_bits(k_pages), to_bits(v_pages), k_scale, v_scale)

        # Tensor parallel: the vocab-split table is looked up in place (no collective of it).
        embed_fn = None if self.parallel is None else self.parallel.embed_lookup
        # Small steps stream each weight once through the fused kernels (static: t is a bucket).
        linears = self.linears if self.linears is not None and t <= self.linears.max_rows else None
        if linears is not None and self.write_kv_in_qkv and not calc_scales:
            # K/V written by the q/k/v launch itself (fp8 scales must exist before it runs).
            def qkv_write(*args: Any, layer_idx: int, attn_state: Any, **kw: Any
                          ) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
                k_stored, v_stored, k_scale, v_scale = attn_state
                j, slot_mapping, _ = group_inputs(layer_idx)
                q, k, v, kp, vp = fused_qkv_write(
                    *args, pages=(from_bits(k_stored, kv.dtype), from_bits(v_stored, kv.dtype)),
                    slot_mapping=slot_mapping, slot_region=j * (nb * bs),
                    scales=(k_scale[layer_idx], v_scale[layer_idx]),
                    interpret=self.linears_interpret, **kw)
                return q, k, v, (to_bits(kp), to_bits(vp), k_scale, v_scale)

            linears = dataclasses.replace(linears, qkv_write=qkv_write)
        # A mixture of experts routes the bucket's padding tokens (no KV slot) to no expert.
        with experts_run_as(self.experts_impl,
                            None if self.parallel is None else self.parallel.mesh,
                            valid=batch.slot_mapping[:t] >= 0):
            hidden, (k_pages, v_pages, k_scale, v_scale) = model(
                input_ids, batch.positions, attn_fn, (kv.k, kv.v, kv.k_scale, kv.v_scale),
                embed_fn=embed_fn, linears=linears, lora=lora)
        logits = model.compute_logits(jnp.take(hidden, batch.logits_indices, axis=0),
                                      linears=_head(linears, batch.logits_indices.shape[0]))
        if self.parallel is not None:  # vocab-split lm_head: the sampler works on the split
            logits = self.parallel.split_logits(logits)
        new_kv = KVCache(k_pages, v_pages, k_scale, v_scale, kv.num_blocks, kv.dtype)
        plp = ()
        if batch.plp_idx is not None:  # prompt logprobs: only the rows that score a prompt token
            plp = (self._prompt_logprobs(model, hidden, batch.plp_idx, batch.plp_target,
                                         linears),)
        if self.pooling is not None:  # (after plp: PendingStep reads it as the last output)
            plp = (*plp, self._pool(model, hidden, batch))
        if defer:  # sampled later by _sample_step, once the host has the token masks
            return (logits, *plp), new_kv, last_tokens
        outs = sample(logits, sampling, flags, num_top=self.num_top_logprobs, **self._vocab_ops)
        if self.parallel is not None:  # [B]-sized results, whole on every device
            outs = tuple(map(self.parallel.replicated, outs))
        last_tokens = jax.lax.dynamic_update_slice(last_tokens, outs[0], (0,))
        return (*outs, *plp), new_kv, last_tokens

    def _pool(self, model: Any, hidden: jax.Array, batch: Any) -> jax.Array:
        """Each row's pooled final hidden state this step, float32 [R, hidden]: its last
        token's (LAST), its first token's (CLS), or the sum over its tokens (MEAN; the engine
        divides by the prompt's length once every chunk is in). A sequence classifier's rows
        are its score head's class logits of those, [R, num_labels] (the head is linear:
        MEAN's chunk sums still add up). Rows past the real ones hold whatever their padding
        indexes."""
        if self.pooling == "LAST":
            out = jnp.take(hidden, batch.logits_indices, axis=0)
        elif self.pooling == "CLS":
            out = jnp.take(hidden, batch.query_start_loc[:-1], axis=0)
        else:  # MEAN: token j belongs to row i where qsl[i] <= j < qsl[i + 1]; padding to none
            rows = batch.logits_indices.shape[0]
            qsl = batch.query_start_loc
            owner = jnp.searchsorted(qsl[1:], jnp.arange(hidden.shape[0], dtype=qsl.dtype),
                                     side="right")
            out = jax.ops.segment_sum(hidden.astype(jnp.float32), owner,
                                      num_segments=rows + 1)[:rows]
        out = out.astype(jnp.float32)
        if getattr(model, "score", None) is not None:
            out = model.classify(out)
        return out if self.parallel is None else self.parallel.replicated(out)

    def _sample_step(self, logits: jax.Array, flat: FlatStep, last_tokens: jax.Array,
                     flags: SamplingFlags) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """The sampling half of a deferred step: its logits, the step's buffers (now holding
        the token masks) and the last-token buffer, which it updates as `_step` does."""
        batch = unflatten_step(flat)
        fed_ids = jnp.take(last_tokens, jnp.maximum(batch.feed_rows, 0))
        outs = sample(logits, _fed_history(batch, fed_ids, flags), flags,
                      num_top=self.num_top_logprobs, **self._vocab_ops)
        if self.parallel is not None:  # as _step: [B]-sized results whole on every device
            outs = tuple(map(self.parallel.replicated, outs))
        return outs, jax.lax.dynamic_update_slice(last_tokens, outs[0], (0,))

    def _prompt_logprobs(self, model: Any, hidden: jax.Array, idx: jax.Array,
                         target: jax.Array, linears: DecodeLinears | None = None
                         ) -> tuple[jax.Array, ...]:
        """Logprob and rank of each target token at its row's logits, and the top candidates
        (`linears`: the step's, whose head kernel takes these rows if it can)."""
        logits = model.compute_logits(jnp.take(hidden, idx, axis=0),
                                      linears=_head(linears, idx.shape[0]))
        if self.parallel is not None:  # vocab-split, as the sampler's: [P]-sized combines
            logits = self.parallel.split_logits(logits)
        logits = logits.astype(jnp.float32)
        norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        chosen = jnp.take_along_axis(logits, target[:, None], axis=-1)
        rank = 1 + jnp.sum(logits > chosen, axis=-1).astype(jnp.int32)
        top_k = self._vocab_ops["top_k"]
        top_logits, top_ids = top_k(logits, min(self.num_top_logprobs, logits.shape[-1]))
        out = ((chosen - norm)[:, 0], rank, top_ids.astype(jnp.int32), top_logits - norm)
        return out if self.parallel is None else tuple(map(self.parallel.replicated, out))

    @property
    def _vocab_ops(self) -> dict[str, Any]:
        """The sampler's vocabulary operations (`sample`'s keywords): lax.top_k, nothing, 1 and
        the whole-row candidate pick, or under tensor parallel the two-stage top-k, the pin to
        the vocab split, its share count and the two-stage candidate pick; and the platform's
        search."""
        if self.parallel is None:
            return {"top_k": jax.lax.top_k, "keep_split": lambda x: x, "vocab_shards": 1,
                    "wide_search": self.wide_search}
        shards = self.parallel.size if self.parallel.split_vocab else 1  # divides V
        return {"top_k": self.parallel.top_k, "keep_split": self.parallel.split_logits,
                "vocab_shards": shards, "wide_search": self.wide_search,
                "pick_candidates": self.parallel.candidates}

    @property
    def num_compiled(self) -> int:
        """Executables the jitted step holds (one per bucket shape and flag set seen), and
        the sampling halves of deferred steps."""
        return self._jit_step._cache_size() + self._jit_sample._cache_size()

    def warmup(self, shapes: Sequence[tuple[int, ...]] | None = None) -> int:
        """Compile the step for every bucket shape (or the given ones); returns the count.

        T == B shapes compile as pure decode steps, and those the plan also gives mixed steps
        compile a second time as such (on the Pallas backend; elsewhere both are one program).
        With speculation the plan's verifying shapes (T, B, R) compile too; a given shape of
        three is one of them.
        """
        if shapes is None:
            kinds = [((*s, s[1]), True) for s in self.plan.decode_shapes()]
            kinds += [((*s, s[1]), False) for s in self.plan.mixed_shapes()]
            kinds += [(s, False) for s in self.plan.verify_shapes()]
        else:
            kinds = [((s[0], s[1], s[1]), s[0] == s[1]) if len(s) == 2 else (tuple(s), False)
                     for s in shapes]
        for (t, b, r), decode_only in kinds:
            packed = empty_step(self.plan, t, b, self.vocab_size, decode_only, num_rows=r)
            if self.lora is not None:  # the program real steps run: slot inputs included
                packed.batch.lora_slots = np.full(t, -1, np.int32)
            flat = flatten_step(packed.batch)
            if self.announce is not None:
                self.announce(flat, packed.flags, False, True)
            # calc_scales passed as dispatch() passes it: the kwargs are part of the cache key.
            jax.block_until_ready(self.launch(flat, packed.flags, False, scratch=True))
        return self.num_compiled

    def launch(self, flat: FlatStep, flags: SamplingFlags, calc_scales: bool,
               scratch: bool = False, defer: bool = False) -> tuple[jax.Array, ...]:
        """Run one packed step on the device (returns at once); the pool and the last-token
        buffer are replaced by the step's (scratch: a throwaway token buffer, for warm-up
        steps, so a step in flight keeps its tokens). The other processes of a multi-process
        mesh call this with what process 0 announced."""
        flags = self.static_flags(flags)
        if scratch:
            outs, self.kv, _ = self._jit_step(self.params, self.kv, flat, self._new_buffer(),
                                              flags=flags, calc_scales=calc_scales,
                                              lora_weights=self._lora_weights)
            return outs
        if self.wait_before_dispatch and self.last_tokens is not None:
            w0 = time.perf_counter()
            if self.while_waiting is None:
                self.last_tokens.block_until_ready()  # the running step (it writes this buffer)
            else:
                while not self.last_tokens.is_ready():
                    self.while_waiting(self.kv)
            self.last_wait_s += time.perf_counter() - w0
        if defer:  # the forward only: the last-token buffer stays as it is (read, not written)
            outs, self.kv, self.last_tokens = self._jit_step(
                self.params, self.kv, flat, self._buffer(), flags=flags,
                calc_scales=calc_scales, defer=True, lora_weights=self._lora_weights)
            return outs
        outs, self.kv, self.last_tokens = self._jit_step(
            self.params, self.kv, flat, self._buffer(), flags=flags, calc_scales=calc_scales,
            lora_weights=self._lora_weights)
        return outs

    @property
    def _lora_weights(self) -> dict[str, tuple[jax.Array, jax.Array]] | None:
        """The slots' arrays a step reads (None without LoRA)."""
        return None if self.lora is None else self.lora.weights

    def _lora_slots(self, scheduled: Sequence[Any]) -> np.ndarray | None:
        """Each scheduled request's LoRA slot for this step (adapters loaded as needed), or
        None without LoRA."""
        if self.lora is None:
            return None
        return self.lora.step_slots([s.request for s in scheduled])

    # ----------------------------------------------------------------- sleep mode
    @property
    def asleep(self) -> frozenset[str]:
        """The parts whose device memory is given up: "weights", "kv_cache" (none: awake)."""
        return frozenset(self._asleep)

    def sleep(self, level: int) -> int:
        """Give up the device memory of the KV pages (their contents are lost) and of the
        weights and LoRA slots: kept on the host at level 1, dropped at level 2. Returns the
        bytes let go. While asleep the pool and the params hold ShapeDtypeStructs."""
        if self.asleep:
            raise ValueError("sleep: the runner is asleep already")
        freed = 0

        def abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
            nonlocal freed
            freed += x.nbytes
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        self.kv = dataclasses.replace(self.kv, k=abstract(self.kv.k), v=abstract(self.kv.v))
        self._host_params = jax.device_get(self.params) if level == 1 else None
        self.params = jax.tree.map(abstract, self.params)
        if self.lora is not None:
            self._host_lora = jax.device_get(self.lora.weights) if level == 1 else None
            self.lora.weights = jax.tree.map(abstract, self.lora.weights)
        self.last_tokens = None  # remade by the next step
        self._prev_rows = {}
        self._asleep = {"weights", "kv_cache"}
        return freed

    def wake_up(self, tags: Iterable[str], model: nnx.Module | None = None) -> None:
        """Take the device memory of `tags` back: the weights from the host copy (level 1) or
        from `model`, a fresh load of the same model (level 2), and a zeroed KV pool."""
        asleep = set(self.asleep)
        if "weights" in tags and "weights" in asleep:
            placed = lambda host, spec: jax.device_put(host, spec.sharding)  # noqa: E731
            if model is not None:
                graphdef, state = nnx.split(model)
                if graphdef != self.graphdef:
                    raise ValueError("wake_up: the reloaded model is not the one put to sleep")
                if self.parallel is not None:
                    state = self.parallel.shard_params(state)
                fresh = nnx.to_pure_dict(state)
                self.params = jax.tree.map(lambda x, spec: x if x.sharding == spec.sharding
                                           else placed(x, spec), fresh, self.params)
            elif self._host_params is not None:
                self.params = jax.tree.map(placed, self._host_params, self.params)
            else:
                raise ValueError("wake_up: the weights were dropped (sleep level 2) and no "
                                 "model was given to take them from")
            self._host_params = None
            if self.lora is not None:
                if self._host_lora is not None:
                    self.lora.weights = jax.tree.map(placed, self._host_lora, self.lora.weights)
                else:  # level 2: empty slots; adapters load again as steps need them
                    self.lora.clear()
                self._host_lora = None
            asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in asleep:
            self.kv = dataclasses.replace(self.kv, k=zeros_as(self.kv.k), v=zeros_as(self.kv.v))
            asleep.discard("kv_cache")
        self._asleep = asleep

    def static_flags(self, flags: SamplingFlags) -> SamplingFlags:
        """The flags as the compile key holds them: `decode_only` matters to Pallas alone."""
        if flags.decode_only and not self.ops.name.startswith("pallas"):  # "pallas+tp2" too
            return dataclasses.replace(flags, decode_only=False)
        return flags

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget requests finished, aborted or preempted (their persistent-batch rows)."""
        self.input_batch.remove(request_ids)

    def dispatch_deferred(self, scheduled: Sequence[Any], mask_words: int) -> DeferredStep:
        """Pack and launch the forward of a step whose token masks are not known yet (a
        grammar's previous token is still in flight); `finish_deferred` samples it. Not for a
        multi-process mesh (the other processes run whole steps)."""
        t0 = time.perf_counter()
        if any(s.spec_token_ids for s in scheduled):
            raise ValueError("a step verifying proposals runs whole (dispatch), never deferred")
        placeholder = np.full((len(scheduled), mask_words), -1, np.int32)
        packed = self.input_batch.pack(scheduled, self._prev_rows, placeholder,
                                       self._lora_slots(scheduled))
        t1 = time.perf_counter()
        calc, self.scales_pending = self.scales_pending, False
        outs = self.launch(flatten_step(packed.batch), packed.flags, calc, defer=True)
        self._prev_rows = _last_rows(scheduled, None)
        self.last_pack_s = t1 - t0
        return DeferredStep(packed, outs, t1)

    def finish_deferred(self, step: DeferredStep, token_masks: np.ndarray | None
                        ) -> PendingStep:
        """Sample a deferred step with its token masks ([rows, W], or None: unconstrained)."""
        packed = step.packed
        s = packed.batch.sampling
        if token_masks is not None:
            s.token_mask = mask_rows(token_masks, s.token_mask.shape[0])
        else:
            s.token_mask[:] = -1
        flat = flatten_step(packed.batch)
        if self.wait_before_dispatch:  # as launch: the forward it follows has run
            w0 = time.perf_counter()
            step.outs[0].block_until_ready()
            self.last_wait_s += time.perf_counter() - w0
        # The sampling half has no attention: one program serves decode and mixed steps.
        flags = dataclasses.replace(packed.flags, decode_only=False)
        outs, self.last_tokens = self._jit_sample(step.outs[0], flat, self._buffer(),
                                                  flags=flags)
        self.num_deferred += 1
        return PendingStep((*outs, *step.outs[1:]), packed.num_rows, step.t_dispatch, self,
                           packed.prompt_spans)

    def dispatch(self, scheduled: Sequence[Any], token_masks: np.ndarray | None = None
                 ) -> PendingStep:
        """Pack and launch one step; returns at once, its tokens still on device.

        Its sampled tokens land in `last_tokens` too, so the next step may be dispatched before
        this one's result is read (its PLACEHOLDER_TOKEN inputs are read from there). Call
        `remove_requests` first for the requests that left since the previous step.
        token_masks: [rows, W] packed allowed-token bits (structured outputs), or None; a row
        with k proposals has k + 1 of them (one per position it scores).
        """
        t0 = time.perf_counter()
        # A request verifying k proposals is one sequence of k + 1 tokens sampled at each of
        # them (k + 1 rows, `step_rows`); token_masks come by those rows
        # (StructuredOutputManager.token_masks).
        packed = self.input_batch.pack(scheduled, self._prev_rows, token_masks,
                                       self._lora_slots(scheduled))
        t1 = time.perf_counter()
        calc, self.scales_pending = self.scales_pending, False
        flat = flatten_step(packed.batch)
        if self.announce is not None:
            self.announce(flat, packed.flags, calc, False)
        outs = self.launch(flat, packed.flags, calc)
        if calc:
            logger.info("fp8 KV scales from the first batch: k=%s v=%s",
                        np.asarray(self.kv.k_scale).tolist(), np.asarray(self.kv.v_scale).tolist())
        self._prev_rows = _last_rows(scheduled, packed.first_rows)
        self.last_pack_s = t1 - t0  # host seconds packing the batch
        return PendingStep(outs, packed.num_rows, t1, self, packed.prompt_spans,
                           packed.first_rows)
