"""EngineCore: the scheduler, the device runner, the KV tiers and connector, and the step.

vLLM V1's split: the core owns everything a step needs and nothing a user sees. `step()`
schedules one step, dispatches it (one jitted device call), and applies the tokens of the step
it reads back (this one; with async scheduling the one dispatched by the previous call, so the
host plans step N+1 while step N runs). It returns what it applied (`CoreOutput`): the requests
that got a token, the tokens, and what a front end needs to turn them into outputs. It never
makes text or RequestOutputs and never imports a front end: `LLMEngine` (engine.py) is the
front end of an in-process core, `CoreProcessEngine` (core_client.py) of a core in its own
process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from jpaged.config import EngineArgs, EngineConfig, parse_hf_overrides
from jpaged.core.cache_state import snapshot as _cache_snapshot
from jpaged.core.cache_state import tier_metrics as _tier_metrics
from jpaged.core.kv_cache_groups import blocks_by_length, kv_cache_layout
from jpaged.core.kv_connector import KVConnectorScheduler
from jpaged.core.metrics_history import MetricsHistory
from jpaged.core.sched_output import SchedulerOutput
from jpaged.core.scheduler import Scheduler
from jpaged.core.spec_proposer import Proposer
from jpaged.core.structured_output import GrammarCompiler, make_grammar_compiler
from jpaged.core.structured_output_manager import StructuredOutputManager
from jpaged.core_step import CoreStep
from jpaged.kv_events import KVEventBatch, KVEventHub
from jpaged.pooling_params import PoolerConfig, pooler_from_checkpoint, refuse_unrun_st_modules
from jpaged.request import Request, RequestStatus
from jpaged.runner.batch import BucketPlan
from jpaged.runner.compile_cache import enable_compilation_cache
from jpaged.runner.draft import DraftRunner
from jpaged.runner.kv_cache import allocate_kv_cache, bytes_per_block, kv_dtype, num_blocks_for
from jpaged.runner.kv_connector import (
    JaxTransferWorker,
    KVConnectorWorker,
    SharedStorageWorker,
    kv_identity,
)
from jpaged.runner.lora import LoraSlots
from jpaged.runner.memory_probe import step_activation_bytes
from jpaged.runner.model_runner import (
    DeferredStep,
    ModelRunner,
    PendingStep,
    StepResult,
    scans_layers,
)
from jpaged.runner.multiprocess import (
    ProcessGroup,
    ProcessGroupError,
    peak_rss_bytes,
    rss_bytes,
)
from jpaged.runner.parallel import TensorParallel, kv_bytes_per_device
from jpaged.runner.tier_setup import build_host_tier, check_tier_config, open_disk_tier
from jpaged.runner.tier_transfer import TierTransfer
from models.build import LoadedModel
from models.llama import stack_layers
from models.loader import load_model
from models.lora import LoraCache, lora_slot_bytes
from models.sharding import check_device_count
from pallas_kernels.backend import select_backend
from pallas_kernels.reference import is_fp8

logger = logging.getLogger("jpaged")

__all__ = ["CoreOutput", "Dispatched", "EngineCore"]

# Speculative decoding: the most overlapped steps between two proposing steps while proposals
# are not accepted (EngineCore._spec_pause).
SPEC_MAX_PAUSE = 16


@dataclass(frozen=True)
class Dispatched:
    """A scheduled step and its device work (`pending` None: it scheduled nothing to run)."""

    out: SchedulerOutput
    pending: PendingStep | DeferredStep | None


@dataclass
class CoreOutput:
    """What one EngineCore.step applied: `updated[i]` got token `token_ids[rows[i]]` (log-prob
    `logprobs[rows[i]]`; `result` has the rows' top candidates and ranks); `finished_at`: the
    positions in `updated` of the sequences that ended; `failures`: (id, reason) of requests a
    failed KV load ended (already released). `applied` is False when no step's tokens came
    back (the first call of an overlapped run, or nothing scheduled)."""

    applied: bool = False
    updated: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    result: StepResult | None = None
    finished_at: list[int] = field(default_factory=list)
    failures: list[tuple[str, str]] = field(default_factory=list)


def _param_bytes(params: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def _check_multiprocess(config: EngineConfig, loaded: LoadedModel | None) -> None:
    """Refuse what a multi-process run cannot do, before joining the others."""
    p = config.parallel
    if p.node_rank != 0:
        raise ValueError(
            f"ParallelConfig.node_rank={p.node_rank}: only process 0 builds an LLM or an engine; "
            "the other processes run jpaged.multiprocess_worker.run_worker(args) (CLI: the same "
            "command with --node-rank N)")
    if loaded is not None:
        raise ValueError("a preloaded model cannot span several processes (nnodes > 1): "
                         "each process loads its own slices; pass model= instead")
    if config.cache.kv_offloading_size > 0 or config.cache.swap_space > 0:
        raise ValueError("CacheConfig.kv_offloading_size: the host and disk KV tiers are not "
                         "supported with nnodes > 1 (their copies would run on process 0 only)")


def _check_connector(config: EngineConfig, args: EngineArgs) -> None:
    """Refuse what a KV connector cannot do, naming the setting."""
    x = config.kv_transfer
    if x is None:
        return
    if config.parallel.tensor_parallel_size > 1 or config.parallel.nnodes > 1:
        raise ValueError("kv_transfer_config: a KV connector moves the pages of a pool on one "
                         "device; tensor_parallel_size and nnodes must be 1")
    if args.engine_core_process:
        raise ValueError("kv_transfer_config is not supported with engine_core_process (the "
                         "connector's outputs are made beside the scheduler)")
    if config.cache.calculate_kv_scales:
        raise ValueError("kv_transfer_config with calculate_kv_scales: each engine would scale "
                         "its fp8 pages differently; use fixed scales (the default)")
    if x.kv_connector == "SharedStorageConnector" and not config.cache.enable_prefix_caching:
        raise ValueError("kv_transfer_config: SharedStorageConnector finds blocks by their "
                         "prefix hashes; it needs enable_prefix_caching")


def _check_supported(config: EngineConfig) -> None:
    """Refuse settings this version cannot honour, with the field named."""
    check_device_count(config.parallel.tensor_parallel_size)
    check_tier_config(config.cache)  # swap needs a host tier; the disk tier needs one too
    ev = config.kv_events
    if ev is not None and ev.enable_kv_cache_events and not config.cache.enable_prefix_caching:
        raise ValueError("kv_events_config: KV cache events need enable_prefix_caching "
                         "(without it no block is ever cached)")
    if config.model.runner == "pooling":  # prefill-only requests, pooled on one process
        for name, on in (("speculative_config", config.speculative is not None),
                         ("kv_transfer_config", config.kv_transfer is not None),
                         ("nnodes", config.parallel.nnodes > 1)):
            if on:
                raise ValueError(f"runner 'pooling': {name} is for generation (a pooling "
                                 "model runs each prompt once, on one process)")
    if config.lora is not None and config.parallel.nnodes > 1:
        raise ValueError("enable_lora: LoRA adapters run in one process in this version "
                         f"(nnodes is {config.parallel.nnodes})")



def _read_model(args: EngineArgs) -> LoadedModel:
    """The model `args` name, read as the engine reads it at start (sleep level 2 again)."""
    return load_model(args.model, args.dtype, args.tensor_parallel_size, args.quantization,
                      parse_hf_overrides(args.hf_overrides))


def _as_run(model: Any) -> Any:
    """`model` in the layout this platform runs: on XLA:CPU one scanned layer compiles ~5x
    faster than 30 unrolled (stack_layers); elsewhere each layer's own arrays."""
    return stack_layers(model) if scans_layers() else model


class EngineCore:
    """The engine's core: one jitted device step per `step()` call, no front end.

    Built from EngineArgs: joins a multi-process group when asked, loads the model (or takes
    `loaded`), sizes the KV pool, and builds the scheduler, the runner, the KV tiers, the KV
    events and the connector's worker side.
    """

    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, *,
                 group: ProcessGroup | None = None) -> None:
        args = args or EngineArgs()
        t0 = time.perf_counter()
        early = args.create_engine_config(model_max_len=2**31 - 1)  # validated before loading
        enable_compilation_cache()
        # Several processes, one model: join them before any device use (group: a process
        # other than 0 joined already, in run_worker).
        self.group = group
        if early.parallel.nnodes > 1 and group is None:
            _check_multiprocess(early, loaded)
            self.group = ProcessGroup(args)
        if self.group is not None and jax.device_count() != early.parallel.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={early.parallel.tensor_parallel_size} must equal the "
                f"{jax.device_count()} devices of the {early.parallel.nnodes} processes "
                "(the mesh spans every process's devices)")
        _check_supported(early)
        _check_connector(early, args)
        # With tensor parallelism the weights load straight into their shards.
        rss_before = rss_bytes()
        self.loaded = loaded or _read_model(args)
        if self.group is not None:  # what loading took from this process (docs/distributed.md)
            mine = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(nnx.state(
                self.loaded.model)) for s in x.addressable_shards)
            logger.info("process %d of %d loaded its parameter slices: %d bytes on its devices; "
                        "peak RSS %d bytes, %d before loading", self.group.rank,
                        self.group.nnodes, mine, peak_rss_bytes(), rss_before)
        # A model this engine loaded gives up its per-layer arrays; a caller's stays whole.
        self.loaded = dataclasses.replace(self.loaded, model=_as_run(self.loaded.model))
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        # runner "pooling": how prompts pool (the config's, the checkpoint's
        # sentence-transformers modules, else LAST normalized); None for a generating engine.
        self.pooler: PoolerConfig | None = None
        if self.spec.labels and early.model.runner != "pooling":
            raise ValueError(f"{args.model} is a sequence classifier "
                             f"({self.spec.hf_architecture}, {self.spec.num_labels} labels): it "
                             "has no LM head to generate with; start it with runner='pooling' "
                             "(vLLM's --runner pooling) and classify or score prompts")
        if early.model.runner == "pooling":
            refuse_unrun_st_modules(self.loaded.source)  # a pooler_config does not run them
            self.pooler = (early.model.pooler_config or pooler_from_checkpoint(
                self.loaded.source) or PoolerConfig())
            logger.info("pooling runner: %s pooling%s", self.pooler.pooling_type,
                        f", then the classifier's head ({self.spec.num_labels} "
                        f"label{'' if self.spec.num_labels == 1 else 's'})"
                        if self.spec.labels else
                        ", normalized" if self.pooler.normalize else "")
        # Sleep level 2 reads the weights again as they were read here: only a model this
        # engine loaded itself can be.
        self._args, self._reloadable, self._sleep_level = args, loaded is None, 0
        config = args.create_engine_config(self.spec.max_position_embeddings)
        self.kv_dtype = kv_dtype(config.cache.kv_cache_dtype, self.loaded.model.dtype)
        # A speculative draft model: loaded and checked against the target before the pool
        # is sized (its weights and its KV per block count there).
        self.draft_loaded = (self._load_draft(config, args)
                             if config.speculative is not None
                             and config.speculative.method == "draft_model" else None)
        tp = config.parallel.tensor_parallel_size
        # Sizes below are per device: each holds its share of the params and of the KV heads.
        self.parallel = TensorParallel(self.spec, tp) if tp > 1 else None
        params_bytes = (_param_bytes(nnx.state(self.loaded.model)) if self.parallel is None else
                        self.parallel.param_bytes_per_device(nnx.state(self.loaded.model)))
        lora = config.lora
        if lora is not None:  # the adapter slots, whole on every device, beside the weights
            params_bytes += lora_slot_bytes(self.spec, lora.max_loras, lora.max_lora_rank,
                                            self.loaded.model.dtype.itemsize)
        draft_block_bytes = 0
        if self.draft_loaded is not None:
            params_bytes += _param_bytes(nnx.state(self.draft_loaded.model))
            draft_block_bytes = bytes_per_block(self.draft_loaded.spec, config.cache.block_size,
                                                self.kv_dtype)
        plan = BucketPlan.for_config(config)
        # KV cache groups: sliding-window layers keep only their window's blocks (one group
        # over all layers when the model has none or the hybrid manager is disabled).
        # A KV connector moves one group's blocks: with one, the hybrid manager is off (as in
        # vLLM), and sliding-window layers keep every block like full ones.
        hybrid = not config.cache.disable_hybrid_kv_cache_manager and config.kv_transfer is None
        self.kv_layout = kv_cache_layout(self.spec.layer_windows, hybrid=hybrid)
        if config.kv_transfer is not None and kv_cache_layout(self.spec.layer_windows).is_hybrid:
            logger.info("kv_transfer_config: the hybrid KV cache manager is disabled")
        kv_layers = self.kv_layout.num_slots
        self.ops = select_backend(config.model.attention_backend)
        # Compiles the largest step shape; called only when the budget depends on it.
        probe = functools.partial(step_activation_bytes, self.loaded.model, self.spec, plan,
                                  config.cache.block_size, self.kv_dtype, self.ops)
        if self.group is not None and not self.group.is_leader:
            num_blocks = self.group.recv_config()  # every process allocates process 0's pool
        else:
            # Forced CPU devices share the machine's RAM: the CPU budget is split between them.
            s = config.scheduler
            num_blocks = num_blocks_for(config.cache, self.spec, self.kv_dtype, params_bytes,
                                        s.max_model_len, activation_bytes=probe,
                                        kv_head_shards=tp, host_devices=tp, kv_layers=kv_layers,
                                        request_blocks=blocks_by_length(
                                            self.kv_layout, config.cache.block_size,
                                            s.chunk_limit),
                                        extra_bytes_per_block=draft_block_bytes)
            if self.group is not None:
                self.group.send_config(num_blocks)
        self.config: EngineConfig = config.with_num_blocks(num_blocks)
        # KV tiers (host RAM, then disk) below the device pool; None when kv_offloading_size=0.
        self.tiers = build_host_tier(self.config.cache, self.spec, self.kv_dtype, kv_layers)
        self.tier_transfer = TierTransfer()  # host/disk tier copies (not the KV connector)
        # With chunked prefill the scheduler fits each step's token budget to these buckets.
        xfer = self.config.kv_transfer
        connector = (KVConnectorScheduler(xfer, self.config.cache.block_size)
                     if xfer is not None else None)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks,
                                   self.tiers, token_buckets=plan.token_buckets,
                                   kv_layout=self.kv_layout, connector=connector,
                                   max_rows=plan.max_rows,
                                   max_loras=lora.max_loras if lora is not None else None)
        plan.num_groups = self.kv_layout.num_groups  # after the probe, which runs one group
        if self.kv_layout.is_hybrid:
            logger.info("hybrid KV cache: %d groups (%s), %d layers' KV per block",
                        self.kv_layout.num_groups, ", ".join(
                            g.kind if g.sliding_window is None else f"sliding {g.sliding_window}"
                            for g in self.kv_layout.groups), kv_layers)
        # KV cache events: set before the disk tier opens, so its blocks are stated too.
        self.kv_events: KVEventHub | None = None
        ev = self.config.kv_events
        if ev is not None and ev.enable_kv_cache_events and (self.group is None
                                                             or self.group.is_leader):
            self.kv_events = KVEventHub(ev, self.config.cache.block_size,
                                        self.config.parallel.data_parallel_rank)
            self.scheduler.kv_cache_manager.set_events(self.kv_events.collector)
        kv = (allocate_kv_cache(self.spec, num_blocks, self.config.cache.block_size, self.kv_dtype,
                                kv_layers)
              if self.parallel is None else
              self.parallel.allocate_kv(num_blocks, self.config.cache.block_size, self.kv_dtype,
                                        kv_layers))
        calc_scales = config.cache.calculate_kv_scales and is_fp8(self.kv_dtype)
        if config.cache.calculate_kv_scales and not calc_scales:
            logger.warning("calculate_kv_scales is ignored: kv_cache_dtype=%s is not fp8 "
                           "(scales stay 1.0)", config.cache.kv_cache_dtype)
        self.lora_cache: LoraCache | None = None  # LoRA adapters read (set by _lora_slots)
        self.runner = ModelRunner(self.loaded.model, kv, plan, self.config.cache.block_size,
                                  self.spec.vocab_size, self.ops, self.config.model.seed,
                                  parallel=self.parallel, calculate_kv_scales=calc_scales,
                                  kv_layout=self.kv_layout,
                                  num_top_logprobs=config.model.logprobs_limit(
                                      self.spec.vocab_size),
                                  eager=config.model.enforce_eager,
                                  lora=self._lora_slots(config),
                                  pooling=None if self.pooler is None
                                  else self.pooler.pooling_type)
        if self.group is not None and self.group.is_leader:
            self.runner.announce = self.group.announce_step  # the others launch it too
        self.draft: DraftRunner | None = None
        if self.draft_loaded is not None:  # its pages: the pool's blocks, its own shape
            d = self.draft_loaded
            self.draft = DraftRunner(ModelRunner(
                d.model, allocate_kv_cache(d.spec, num_blocks, self.config.cache.block_size,
                                           self.kv_dtype),
                BucketPlan.for_config(self.config), self.config.cache.block_size,
                d.spec.vocab_size, self.ops, self.config.model.seed,
                eager=self.config.model.enforce_eager))
        # The disk tier is keyed by the fp8 scales too: opened once they are final.
        self._disk_pending = (self.tiers is not None and self.config.cache.swap_space > 0
                              and self.config.cache.enable_prefix_caching)
        self._open_disk_tier()
        self.kv_worker: KVConnectorWorker | None = None
        if connector is not None:
            self.kv_worker = self._build_kv_worker(connector)
        # (request id, reason) of requests a failed KV load ended, for the front end to report.
        self.failures: list[tuple[str, str]] = []
        # Structured outputs and bad_words of the requests the scheduler holds.
        self.structured_output = StructuredOutputManager(lambda: self.grammar_compiler,
                                                         self.spec.vocab_size)
        self._grammar_compiler: GrammarCompiler | None = None
        # Speculative decoding (None: off): proposals made before a schedule (see below for
        # which steps propose).
        self.proposer = (Proposer(self.config.speculative)
                         if self.config.speculative is not None else None)
        if self.proposer is not None:
            logger.info("speculative decoding: %s, up to %d tokens a step",
                        self.proposer.method, self.proposer.num_speculative_tokens)
        # Speculation while it pays (async scheduling only): a step that proposes runs
        # synchronously (a proposal follows the request's last token, which must be on the
        # host). After a proposing step in which no proposal was accepted, the next
        # `_spec_pause` steps run overlapped without proposals; the pause doubles while probes
        # keep failing (up to SPEC_MAX_PAUSE) and is gone after one that gains a token. Both
        # loops are exact, so outputs do not depend on it.
        self._spec_pause = 0
        self._spec_backoff = 1
        self._spec_probe: tuple[SchedulerOutput, int] | None = None
        self.num_spec_overlapped_steps = 0
        # Async scheduling: the dispatched step whose tokens the next step() reads.
        self.async_scheduling = self.config.scheduler.async_scheduling
        self._in_flight: Dispatched | None = None
        self.metrics_history = MetricsHistory()  # one point per step()
        logger.info("engine ready in %.1fs: %s, %d KV blocks, backend %s",
                    time.perf_counter() - t0, self.loaded.source, num_blocks, self.ops.name)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' grammars for this model's tokenizer (made on first use)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = make_grammar_compiler(
                self.tokenizer, self.spec.eos_token_ids, self.spec.vocab_size,
                self.config.structured_outputs)
        return self._grammar_compiler

    # ----------------------------------------------------------------- requests
    def _lora_slots(self, config: EngineConfig) -> LoraSlots | None:
        """The runner's LoRA slots, and the host cache adapters are read through (None and
        no cache: LoRA off)."""
        lora = config.lora
        if lora is None:
            return None
        # The front end of an in-process engine reads adapters through this same cache.
        self.lora_cache = LoraCache(self.spec, lora.max_lora_rank, lora.host_capacity)
        place = self.parallel.replicate if self.parallel is not None else None
        slots = LoraSlots(self.spec, lora.max_loras, lora.max_lora_rank,
                          self.loaded.model.dtype, place)
        logger.info("LoRA: %d slots of rank %d, %d bytes on the device", lora.max_loras,
                    lora.max_lora_rank, slots.nbytes)
        return slots

    def _read_adapters(self, requests: list[Request]) -> list[Request]:
        """The requests whose LoRA adapter reads, each holding it from now to its end (others
        end as failures, with the reason: the front end checked them, but a core process
        reads them again, and a directory can change in between)."""
        if self.lora_cache is None:
            return requests
        kept = []
        for req in requests:
            lr = req.lora_request
            if lr is not None:
                try:
                    req.attach_lora(self.lora_cache.get(lr.lora_name, lr.lora_path))
                except (OSError, ValueError) as e:
                    self.failures.append((req.request_id, f"LoRA adapter: {e}"))
                    continue
            kept.append(req)
        return kept

    def queue_requests(self, requests: list[Request]) -> None:
        """Hand checked requests to the scheduler, with their grammar matchers and bad words
        (all or none: a grammar that does not compile raises before any is queued)."""
        requests = self._read_adapters(requests)
        so = self.structured_output
        matchers = so.add_requests(requests)
        for req in requests:
            self.scheduler.add_request(req)
        so.track(requests, matchers)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests early (an abort, a stop string found by the front end)."""
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    @property
    def step_in_flight(self) -> bool:
        """True while a dispatched step's tokens are unread (async scheduling)."""
        return self._in_flight is not None

    def has_work(self) -> bool:
        """True while a request is unfinished, a dispatched step's tokens are unread, or a
        failure is still to be reported (the next step carries it)."""
        return (self._in_flight is not None or self.scheduler.has_unfinished_requests()
                or bool(self.failures))

    def has_pending_kv_transfers(self) -> bool:
        """True while a KV connector holds blocks for a consumer or pulls pages: the engine's
        loop must keep stepping (an idle step waits on the connector, it does not spin)."""
        return self.kv_worker is not None and (self.scheduler.has_held_blocks()
                                               or self.kv_worker.has_pending())

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use now."""
        return self.scheduler.kv_cache_manager.usage

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch an idle core between the overlapped and the synchronous loop.

        For A/B runs of the two loops on one engine (the same compiled steps, pool and heap):
        the host benchmark and the device check use it. A step still in flight (its requests
        all finished or aborted) is read first; its tokens are dropped as they would be.
        """
        # SchedulerConfig validates the value (ValueError naming the field).
        scheduler = dataclasses.replace(self.config.scheduler, async_scheduling=enabled)
        if self.has_unfinished_requests():
            raise ValueError("set_async_scheduling: the engine has unfinished requests; switch "
                             "loops on an idle engine")
        if self._in_flight is not None:
            self.step()  # schedules nothing; applies the step in flight
        self.async_scheduling = enabled
        self.config = dataclasses.replace(self.config, scheduler=scheduler)

    # ----------------------------------------------------------------- stepping
    def step(self) -> CoreOutput:
        """Schedule and dispatch one device step; apply the tokens of the step read back now.

        With async scheduling that is the step dispatched by the previous call: this step is
        on the device while the host applies them (and learns of stops one step late; a token
        computed past a request's end is dropped).
        """
        cur, done = self._launch()
        res = CoreOutput()
        if done is not None:
            res.applied = True
            self._apply(done, res)
            if self._spec_probe is not None and done.out is self._spec_probe[0]:
                self._judge_probe()
        cur = self._finish_deferred(cur)  # its masks follow the tokens just applied
        self._record(cur)
        if self.failures:
            res.failures, self.failures = self.failures, []
        if (self.kv_worker is not None and (cur is None or cur.pending is None)
                and (done is None or done.pending is None) and self.has_pending_kv_transfers()):
            self.kv_worker.wait_for_work(0.02)  # nothing ran: wait for pages or a pull
        return res

    def core_step(self) -> CoreStep:
        """`step` for an engine-core process: the sampled tokens as sent to its front end."""
        res = self.step()
        step = CoreStep()
        step.fill(res.updated, res.rows, res.token_ids, res.logprobs, res.result,
                  res.finished_at)
        step.failures = res.failures
        return step

    def _launch(self) -> tuple[Dispatched | None, Dispatched | None]:
        """Dispatch one step; return it and the step whose tokens to apply now.

        None to apply: the first step of an overlapped run (nothing back yet). None
        dispatched: a drain call (a constrained request needs the step in flight first).
        """
        self.runner.last_wait_s = 0.0
        so = self.structured_output
        proposing = self.proposer is not None and (self._spec_pause == 0
                                                   or not self.async_scheduling)
        if not self.async_scheduling or proposing or so.needs_sync(
                self.scheduler.requests, self.runner.announce is not None):
            if self._in_flight is not None:
                # A constrained request's next mask needs the token in flight: apply that step
                # first and dispatch nothing in this call (one bubble, then synchronous steps).
                prev, self._in_flight = self._in_flight, None
                return None, prev
            cur = self._dispatch(advance=False)
            return cur, cur
        cur = self._dispatch(advance=True)
        prev, self._in_flight = self._in_flight, (cur if cur.pending is not None else None)
        if prev is None and cur.pending is not None:
            return cur, None
        return cur, (prev if prev is not None else cur)

    def _finish_deferred(self, cur: Dispatched | None) -> Dispatched | None:
        """Sample the step just dispatched if its forward ran without its token masks: the
        previous step's tokens are applied now, so the grammars are where that step left
        them. Returns `cur` with its PendingStep (and keeps it as the step in flight)."""
        if cur is None or not isinstance(cur.pending, DeferredStep):
            return cur
        pending = self._on_device(self.runner.finish_deferred, cur.pending,
                                  self.structured_output.token_masks(cur.out.scheduled))
        done = Dispatched(cur.out, pending)
        if self._in_flight is not None and self._in_flight.out is cur.out:
            self._in_flight = done
        return done

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        """File a step's prompt-logprob rows under their requests, by prompt position (a
        prefill recomputed after a preemption rewrites the same entries)."""
        held = self.scheduler.requests
        lp, rank = result.prompt_logprobs.tolist(), result.prompt_ranks.tolist()
        top_ids, top_lp = result.prompt_top_ids, result.prompt_top_logprobs
        row = 0
        for rid, first, count in result.prompt_spans:
            req = held.get(rid)
            if req is not None:
                rows = req.prompt_logprob_rows
                for j in range(count):
                    entry = (lp[row + j], rank[row + j], top_ids[row + j], top_lp[row + j])
                    if first + j < len(rows):
                        rows[first + j] = entry
                    elif first + j == len(rows):
                        rows.append(entry)
                    else:  # positions computed elsewhere (a KV connector's remote prefill)
                        break  # stay incomplete: the output then carries no prompt_logprobs
            row += count

    def _record_pooled(self, out: SchedulerOutput, pooled: np.ndarray) -> None:
        """File a pooling step's rows (row i: out.scheduled[i]'s chunk, as the runner pooled
        it) under their requests: LAST takes the prompt's final chunk's row, CLS the first
        chunk's, MEAN sums every chunk's and divides by the prompt's length at its end. A chunk
        from position 0 (the first, or a preempted request's recompute) starts over."""
        held = self.scheduler.requests
        for i, sr in enumerate(out.scheduled):
            req = sr.request
            if req.pooling is None or held.get(req.request_id) is not req:
                continue
            row = pooled[i]
            if req.pooling == "MEAN":
                req.pool_sum = row.copy() if sr.start_pos == 0 or req.pool_sum is None \
                    else req.pool_sum + row
                if sr.sample:
                    req.pooled = req.pool_sum / req.num_prompt_tokens
            elif req.pooling == "CLS":
                if sr.start_pos == 0:
                    req.pool_sum = row.copy()
                if sr.sample:
                    req.pooled = req.pool_sum
            elif sr.sample:  # LAST: the prompt's last token is the sampling row's
                req.pooled = row.copy()

    def _record(self, cur: Dispatched | None) -> None:
        # One point per call, for the step dispatched by it (none: a drain call, see _launch).
        n = cur.out.num_scheduled_tokens if cur is not None else 0
        self.metrics_history.record(self.scheduler, n)
        if self.kv_events is not None:
            self.kv_events.flush()  # this step's cache changes, as one batch

    def _dispatch(self, advance: bool) -> Dispatched:
        """Schedule one step and launch it (advance: as if it had run, for async scheduling)."""
        if self.kv_worker is not None:
            self._kv_connector_before_schedule()
        if self.proposer is not None:
            if advance:  # an overlapped step while speculation pauses: nothing proposed
                self._spec_pause -= 1
                self.num_spec_overlapped_steps += 1
                for r in self.scheduler.running:
                    r.spec_token_ids = []
            else:
                self._propose()
        out = self.scheduler.schedule()
        if self.proposer is not None and not advance and self.async_scheduling and any(
                sr.spec_token_ids or (sr.sample and sr.num_tokens == 1) for sr in out.scheduled):
            # A decode was scheduled: a chance to propose, judged once its tokens are back.
            self._spec_probe = (out, self.scheduler.spec_decode.num_accepted_tokens)
        if self.kv_worker is not None:
            self._kv_connector_meta()
        if out.tier_transfers is not None and not out.tier_transfers.is_empty:
            # Gathers, then loads, both before the forward (see jpaged/core/offload.py).
            self.runner.kv = self.tier_transfer.apply(self.runner.kv, out.tier_transfers,
                                                      self.tiers.host.store)
        # Packed from the requests as scheduled; only then advanced past this step.
        self.runner.remove_requests(out.finished_request_ids)
        self.runner.remove_requests(out.preempted)  # re-admitted with a new block table
        if self.draft is not None:
            self.draft.remove([*out.finished_request_ids, *out.preempted])
            self._draft_fill(out)
        pending = None
        if out.scheduled:
            so = self.structured_output
            if advance and so.needs_deferral(out.scheduled):
                # Async: the masks need the tokens of the step in flight. The forward goes now;
                # the sampling once those tokens are applied (_finish_deferred).
                pending = self._on_device(self.runner.dispatch_deferred, out.scheduled,
                                          so.mask_words)
            else:
                masks = so.token_masks(out.scheduled)
                pending = (self._on_device(self.runner.dispatch, out.scheduled) if masks is None
                           else self._on_device(self.runner.dispatch, out.scheduled, masks))
        if advance:
            self.scheduler.update_after_schedule(out)
        return Dispatched(out, pending)

    def _load_draft(self, config: EngineConfig, args: EngineArgs) -> LoadedModel:
        """The speculative draft model, refused (ValueError naming the field) unless it can
        share this target's tokens and blocks."""
        c = "speculative_config.model"
        if config.parallel.tensor_parallel_size > 1 or self.group is not None:
            raise ValueError(f"{c}: a draft model runs on one device (tensor_parallel_size 1, "
                             "one process) in this version")
        if kv_cache_layout(self.spec.layer_windows,
                           hybrid=not config.cache.disable_hybrid_kv_cache_manager).is_hybrid:
            raise ValueError(f"{c}: the target's sliding-window layers free blocks the draft "
                             "still reads; set disable_hybrid_kv_cache_manager")
        draft = load_model(config.speculative.model, args.dtype)
        draft = dataclasses.replace(draft, model=_as_run(draft.model))
        if draft.spec.vocab_size != self.spec.vocab_size:
            raise ValueError(f"{c}: the draft's vocabulary ({draft.spec.vocab_size} tokens) is "
                             f"not the target's ({self.spec.vocab_size})")
        ids = list(range(self.spec.vocab_size))
        if draft.tokenizer.convert_ids_to_tokens(ids) != self.tokenizer.convert_ids_to_tokens(ids):
            raise ValueError(f"{c}: the draft model's tokenizer is not the target's (their "
                             "vocabularies map tokens to different ids)")
        if draft.spec.max_position_embeddings < config.scheduler.max_model_len:
            raise ValueError(f"{c}: the draft's context ({draft.spec.max_position_embeddings} "
                             f"tokens) is shorter than max_model_len "
                             f"({config.scheduler.max_model_len})")
        logger.info("speculative draft model %s: %d layers, %d bytes of weights", draft.source,
                    draft.spec.num_layers, _param_bytes(nnx.state(draft.model)))
        return draft

    def _draft_fill(self, out: SchedulerOutput) -> None:
        """The draft model writes the proposal slots the schedule gave, then a grammar cuts
        them where it refuses (the row shrinks; its spare slots go back after the step)."""
        self.draft.propose(out.scheduled)
        so = self.structured_output
        if not so.matchers:
            return
        for sr in out.scheduled:
            if sr.spec_token_ids:
                so.check_proposals([sr.request])
                k = len(sr.request.spec_token_ids)
                if k < len(sr.spec_token_ids):
                    cut = len(sr.spec_token_ids) - k
                    del sr.spec_token_ids[k:], sr.token_ids[len(sr.token_ids) - cut:]
                    sr.num_tokens -= cut
                    out.num_scheduled_tokens -= cut

    def _judge_probe(self) -> None:
        """After a proposing step (async scheduling): pause speculation if it gained nothing."""
        _, before = self._spec_probe
        self._spec_probe = None
        if self.scheduler.spec_decode.num_accepted_tokens > before:
            self._spec_backoff = 1
        else:
            self._spec_pause = self._spec_backoff
            self._spec_backoff = min(2 * self._spec_backoff, SPEC_MAX_PAUSE)

    def _propose(self) -> None:
        """Proposals for the decoding requests (speculative decoding), cut where a grammar
        would refuse them; a request whose proposer failed ends with the reason."""
        sched = self.scheduler
        failed = self.proposer.propose(sched.running)
        if failed:
            ids = [rid for rid, _ in failed]
            sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.proposer.forget(ids)
            self.failures.extend(failed)
        if self.draft is None:  # (a draft's slots are checked once filled: _draft_fill)
            self.structured_output.check_proposals(sched.running)

    def _kv_connector_meta(self) -> None:
        """Hand the scheduler side's plan to the worker: after a schedule (pulls to start) and
        after a step's tokens are applied (holds of finished requests: registered before their
        kv_transfer_params reach anyone, so a consumer never asks too early)."""
        meta = self.scheduler.connector.build_connector_meta()
        if meta is not None:
            self.kv_worker.save_kv(meta, self.runner.kv)
            self.kv_worker.start_load_kv(meta)

    def _kv_connector_before_schedule(self) -> None:
        """Land finished pulls and serve queued ones (on this thread, in step order), then
        let the scheduler free pulled blocks and queue requests whose pages landed."""
        sched = self.scheduler
        self.runner.kv, kout = self.kv_worker.get_finished(self.runner.kv,
                                                           sched.connector.is_pending)
        if not kout.is_empty:
            sched.update_from_kv_xfer(kout)
        if sched.kv_failures:
            failures, sched.kv_failures = sched.kv_failures, []
            self.failures.extend((rid, f"KV load failed: {why}") for rid, why in failures)

    def _on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args); in a multi-process run a failure is the mesh's (ProcessGroupError)."""
        if self.group is None:
            return fn(*args)
        try:
            return fn(*args)
        except ProcessGroupError:
            raise
        except Exception as e:
            raise self.group.failed(e) from e

    def _apply(self, done: Dispatched, res: CoreOutput) -> None:
        """Read a step's sampled tokens and apply them to the scheduler's requests, into
        `res` (row i of the step: done.out.scheduled[i])."""
        result = None
        ids: list[int] = []
        lps: list[float] = []
        if done.pending is not None:
            result = self._on_device(done.pending.result)
            self._open_disk_tier()
            ids = result.token_ids.tolist()
            lps = result.logprobs.tolist()
        if result is not None and result.prompt_spans:
            self._record_prompt_logprobs(result)
        if result is not None and result.pooled is not None:
            self._record_pooled(done.out, result.pooled)
        first_rows = getattr(done.pending, "first_rows", None)
        updated = self.scheduler.update_from_output(done.out, ids, res.rows, res.finished_at,
                                                    first_rows)
        if first_rows is not None:  # verified rows gave back their rejected proposals' blocks
            kv = self.scheduler.kv_cache_manager
            for sr in done.out.scheduled:
                if sr.spec_token_ids:
                    rid = sr.request.request_id
                    self.runner.input_batch.truncate(rid, kv.num_positions(rid))
                    if self.draft is not None:
                        self.draft.truncate(rid, kv.num_positions(rid))
            if self.draft is not None:
                self.draft.after_verify(done.out.scheduled)
        so = self.structured_output
        if so.matchers and ids:
            for i in so.accept_tokens(updated, res.rows, ids):
                req = updated[i]
                if not req.is_finished():
                    self.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
                    res.finished_at.append(i)
        if self.kv_worker is not None:
            self._kv_connector_meta()
        res.updated, res.token_ids, res.logprobs, res.result = updated, ids, lps, result

    # ----------------------------------------------------------------- state
    def get_metrics(self) -> dict[str, Any]:
        """Scheduler and cache gauges (vLLM's names)."""
        m = dict(self.scheduler.get_stats())
        m["num_gpu_blocks"] = self.config.cache.num_gpu_blocks
        m["block_size"] = self.config.cache.block_size
        m["tensor_parallel_size"] = self.config.parallel.tensor_parallel_size
        m["kv_pool_bytes_per_device"] = (0 if "kv_cache" in self.runner.asleep
                                          else kv_bytes_per_device(self.runner.kv))
        if self.kv_worker is not None:
            m.update(self.kv_worker.stats)
        if self.proposer is not None:
            m.update(self.scheduler.spec_decode.as_metrics(self.proposer.num_speculative_tokens))
            m["spec_decode_overlapped_steps_total"] = self.num_spec_overlapped_steps
        if self.config.model.enable_sleep_mode:  # exported as vLLM's engine_sleep_state
            m["engine_sleep_state"] = self.sleep_state()
        if self.config.lora is not None:  # exported as vLLM's lora_requests_info
            m["lora_requests_info"] = (self.config.lora.max_loras,
                                       *self.scheduler.lora_names())
        return m

    def cache_state(self) -> dict[str, Any]:
        """Read-only JSON-able snapshot of the KV pool and block tables, by scheduler ids."""
        state = _cache_snapshot(self.scheduler)
        state["tiers"] = _tier_metrics(self.get_metrics())
        return state

    # ----------------------------------------------------------------- sleep mode
    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode: with no request unfinished, give up the device memory of the KV
        pages (the device prefix cache is emptied; the host and disk tiers keep theirs) and
        of the weights: kept on the host at level 1, dropped at level 2 (read again from the
        model's source at `wake_up`). Returns the device bytes let go (ValueError naming what
        stands in the way otherwise)."""
        if not self.config.model.enable_sleep_mode:
            raise ValueError("sleep: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level!r}")
        if self.runner.asleep:  # (vLLM's: a warning, nothing done)
            logger.warning("sleep: the engine is asleep already")
            return 0
        if self.scheduler.has_unfinished_requests():
            raise ValueError(f"sleep: {self.scheduler.get_num_unfinished_requests()} requests "
                             "are unfinished; sleep when the engine is idle")
        for what, present in (("a speculative draft model", self.draft is not None),
                              ("a KV connector", self.kv_worker is not None),
                              ("several processes", self.group is not None)):
            if present:
                raise ValueError(f"sleep: not with {what} in this version")
        if level == 2 and not self._reloadable:
            raise ValueError("sleep: level 2 reads the weights again at wake_up, so it needs "
                             "an engine that loaded its model itself (LLM(model=...)), not one "
                             "given a loaded model")
        # Async scheduling: a step dispatched before the last requests ended is still in
        # flight (its tokens are past those requests' ends, dropped); apply it first. With no
        # request unfinished, a step dispatches nothing new, so this ends.
        while self._in_flight is not None:
            self.step()
        # The device pages go: their prefix-cache entries with them; the host and disk tiers
        # hold copies, which stay.
        ok = self.scheduler.reset_prefix_cache(keep_host_tier=True)
        if self.kv_events is not None:
            self.kv_events.flush()
        if not ok:
            raise ValueError("sleep: KV blocks are still in use")
        freed = self.runner.sleep(level)
        self._sleep_level = level
        # The engine's own handle on the arrays goes too, so nothing keeps them on the device.
        self.loaded = dataclasses.replace(self.loaded, model=None)
        logger.info("asleep (level %d): %d bytes of device memory let go", level, freed)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back: "weights", "kv_cache" or both (None); requests run
        again once both are back."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown or not tags:
            raise ValueError(f"wake_up: tags must be among 'weights' and 'kv_cache', got "
                             f"{tags!r}")
        if not self.runner.asleep:
            return
        model = None
        if "weights" in tags and "weights" in self.runner.asleep and self._sleep_level == 2:
            model = _as_run(_read_model(self._args).model)  # as it was read at start
        self.runner.wake_up(tags, model)
        if "weights" not in self.runner.asleep:
            self.loaded = dataclasses.replace(
                self.loaded, model=nnx.merge(self.runner.graphdef, self.runner.params))
        logger.info("awake: %s", ", ".join(sorted({"weights", "kv_cache"}
                                                   - self.runner.asleep)))

    def is_sleeping(self) -> bool:
        """True while any part of the device memory is given up (no request may be added)."""
        return bool(self.runner.asleep)

    def sleep_state(self) -> str:
        """vLLM's engine_sleep_state: "awake", "weights_offloaded" (level 1) or "discard_all"
        (level 2)."""
        if not self.runner.asleep:
            return "awake"
        return "weights_offloaded" if self._sleep_level == 1 else "discard_all"

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses, device and host tier (the disk tier
        persists: LLM.reset_prefix_cache); False if some are in use."""
        ok = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return ok

    def warmup_decode(self) -> None:
        """Compile every decode step shape (benchmarks time no compiles)."""
        self.runner.warmup([(b, b) for b in self.runner.plan.seq_buckets])

    def subscribe_kv_events(self, fn: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call fn(batch) with every later KVEventBatch, in order; returns the unsubscribe.

        Batches are handed over on the engine's thread at the end of the step that made them.
        """
        if self.kv_events is None:
            raise ValueError("KV cache events are off: start the engine with "
                             "kv_events_config={'enable_kv_cache_events': True}")
        return self.kv_events.subscribe(fn)

    def cached_block_hashes(self) -> dict[str, set[bytes]]:
        """The block hashes each tier holds now ("GPU", "CPU", "DISK"), read off the pool."""
        return self.scheduler.kv_cache_manager.cached_hashes()

    def shutdown(self) -> None:
        """Stop the core's background parts (the KV event publisher, the connector; in a
        multi-process run, the other processes' loops); idempotent."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_worker is not None:
            self.kv_worker.close()
        if self.group is not None:
            self.group.stop()

    # ----------------------------------------------------------------- set-up helpers
    def _open_disk_tier(self) -> None:
        if not self._disk_pending or self.runner.scales_pending:
            return
        self._disk_pending = False
        self.tiers.attach_disk(open_disk_tier(
            self.config.cache, self.spec, self.kv_dtype, self.loaded.source, self.loaded.model,
            self.runner.kv, self.kv_layout if self.kv_layout.is_hybrid else None))

    def _build_kv_worker(self, connector: KVConnectorScheduler) -> KVConnectorWorker:
        """The connector's worker side, on this engine's pool; tells the scheduler side where
        it listens (a producer's kv_transfer_params name it)."""
        xfer = connector.config
        if xfer.kv_connector == "SharedStorageConnector":
            storage = open_disk_tier(
                self.config.cache, self.spec, self.kv_dtype, self.loaded.source,
                self.loaded.model, self.runner.kv,
                directory=xfer.kv_connector_extra_config["shared_storage_path"],
                capacity_bytes=2**62)  # the directory is the engines' to prune, as vLLM's
            connector.storage = storage
            return SharedStorageWorker(xfer, storage)
        source = self.loaded.source
        identity = kv_identity(source.rsplit("/", 1)[-1], self.config.cache.block_size,
                               self.runner.kv, self.config.cache.prefix_caching_hash_algo)
        worker = JaxTransferWorker(xfer, self.runner.kv, identity, connector.engine_id)
        connector.set_address(xfer.kv_ip, worker.port)
        if xfer.is_producer:  # answer pulls while a step runs, not only between steps
            self.runner.while_waiting = functools.partial(worker.serve_asks, timeout=0.002)
        return worker
