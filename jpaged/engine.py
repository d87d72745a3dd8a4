"""LLMEngine: add_request / step / abort; ties the host scheduler to the device runner."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jpaged.config import EngineArgs, EngineConfig
from jpaged.core.cache_state import snapshot as _cache_snapshot
from jpaged.core.cache_state import tier_metrics as _tier_metrics
from jpaged.core.kv_cache_groups import blocks_needed, kv_cache_layout
from jpaged.core.kv_connector import KVConnectorScheduler
from jpaged.core.metrics_history import MetricsHistory
from jpaged.core.scheduler import Scheduler
from jpaged.core.structured_output import consume, forbid, mask_words
from jpaged.core_step import CoreStep
from jpaged.frontend import PromptType, RequestFrontend
from jpaged.kv_events import KVEventBatch, KVEventHub
from jpaged.metrics import StatLogger
from jpaged.outputs import RequestOutput
from jpaged.request import Request, RequestStatus
from jpaged.runner.batch import BucketPlan
from jpaged.runner.compile_cache import enable_compilation_cache
from jpaged.runner.kv_cache import allocate_kv_cache, kv_dtype, num_blocks_for
from jpaged.runner.kv_connector import (
    JaxTransferWorker,
    KVConnectorWorker,
    SharedStorageWorker,
    kv_identity,
)
from jpaged.runner.kv_transfer import KVTransfer
from jpaged.runner.memory_probe import step_activation_bytes
from jpaged.runner.model_runner import DeferredStep, ModelRunner, PendingStep, scans_layers
from jpaged.runner.multiprocess import (
    ProcessGroup,
    ProcessGroupError,
    peak_rss_bytes,
    rss_bytes,
)
from jpaged.runner.parallel import TensorParallel, kv_bytes_per_device
from jpaged.runner.tier_setup import build_host_tier, check_tier_config, open_disk_tier
from models.llama import stack_layers
from models.loader import LoadedModel, load_model
from models.sharding import check_device_count
from pallas_kernels.backend import select_backend
from pallas_kernels.reference import is_fp8

logger = logging.getLogger("jpaged")

__all__ = ["LLMEngine", "PromptType"]


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


class LLMEngine(RequestFrontend):
    """The engine behind `LLM` and the server: one jitted device step per `step()` call."""

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
        self.loaded = loaded or load_model(args.model, args.dtype, args.tensor_parallel_size)
        if self.group is not None:  # what loading took from this process (docs/distributed.md)
            mine = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(nnx.state(
                self.loaded.model)) for s in x.addressable_shards)
            logger.info("process %d of %d loaded its parameter slices: %d bytes on its devices; "
                        "peak RSS %d bytes, %d before loading", self.group.rank,
                        self.group.nnodes, mine, peak_rss_bytes(), rss_before)
        if scans_layers():  # XLA:CPU: one scanned layer compiles ~5x faster than 30 unrolled
            # A model this engine loaded gives up its per-layer arrays; a caller's stays whole.
            self.loaded = dataclasses.replace(self.loaded, model=stack_layers(self.loaded.model))
        self.spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        config = args.create_engine_config(self.spec.max_position_embeddings)
        self.kv_dtype = kv_dtype(config.cache.kv_cache_dtype, self.loaded.model.dtype)
        tp = config.parallel.tensor_parallel_size
        # Sizes below are per device: each holds its share of the params and of the KV heads.
        self.parallel = TensorParallel(self.spec, tp) if tp > 1 else None
        params_bytes = (_param_bytes(nnx.state(self.loaded.model)) if self.parallel is None else
                        self.parallel.param_bytes_per_device(nnx.state(self.loaded.model)))
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
                                        blocks_per_seq=blocks_needed(
                                            s.max_model_len, self.kv_layout,
                                            config.cache.block_size, s.max_chunk_tokens))
            if self.group is not None:
                self.group.send_config(num_blocks)
        self.config: EngineConfig = config.with_num_blocks(num_blocks)
        # KV tiers (host RAM, then disk) below the device pool; None when kv_offloading_size=0.
        self.tiers = build_host_tier(self.config.cache, self.spec, self.kv_dtype, kv_layers)
        self.kv_transfer = KVTransfer()
        # With chunked prefill the scheduler fits each step's token budget to these buckets.
        xfer = self.config.kv_transfer
        connector = (KVConnectorScheduler(xfer, self.config.cache.block_size)
                     if xfer is not None else None)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks,
                                   self.tiers, token_buckets=plan.token_buckets,
                                   kv_layout=self.kv_layout, connector=connector)
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
        self.runner = ModelRunner(self.loaded.model, kv, plan, self.config.cache.block_size,
                                  self.spec.vocab_size, self.ops, self.config.model.seed,
                                  parallel=self.parallel, calculate_kv_scales=calc_scales,
                                  kv_layout=self.kv_layout,
                                  num_top_logprobs=config.model.logprobs_limit(
                                      self.spec.vocab_size))
        if self.group is not None and self.group.is_leader:
            self.runner.announce = self.group.announce_step  # the others launch it too
        # The disk tier is keyed by the fp8 scales too: opened once they are final.
        self._disk_pending = (self.tiers is not None and self.config.cache.swap_space > 0
                              and self.config.cache.enable_prefix_caching)
        self._open_disk_tier()
        self.kv_worker: KVConnectorWorker | None = None
        if connector is not None:
            self.kv_worker = self._build_kv_worker(connector)
        self._failed: list[RequestOutput] = []  # outputs of requests a failed KV load ended
        # Structured outputs: each constrained request's grammar matcher, by request id (set
        # when queued, dropped once the scheduler no longer holds the request).
        self._matchers: dict[str, Any] = {}
        # bad_words: each such request's words as token sequences (by request id, pruned as
        # the matchers are).
        self._bad_words: dict[str, tuple[tuple[int, ...], ...]] = {}
        # Async scheduling: the dispatched step whose tokens the next step() reads.
        self.async_scheduling = self.config.scheduler.async_scheduling
        self._in_flight: tuple[Any, PendingStep] | None = None
        self._init_frontend()
        # Request timing histograms + the periodic stats log line (fed once per step).
        self.stat_logger = StatLogger(self.get_metrics, log=not args.disable_log_stats,
                                      max_model_len=self.config.scheduler.max_model_len)
        c = self.config.cache
        self.stat_logger.set_cache_config(
            block_size=c.block_size, cache_dtype=c.kv_cache_dtype, num_gpu_blocks=num_blocks,
            enable_prefix_caching=c.enable_prefix_caching,
            prefix_caching_hash_algo=c.prefix_caching_hash_algo)
        self.metrics_history = MetricsHistory()  # one point per step()
        logger.info("engine ready in %.1fs: %s, %d KV blocks, backend %s",
                    time.perf_counter() - t0, self.loaded.source, num_blocks, self.ops.name)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Build an engine from EngineArgs (vLLM's spelling)."""
        return cls(args)

    # ----------------------------------------------------------------- requests
    def _submit(self, requests: list[Request]) -> None:
        # All or none: the children of one request share everything the scheduler checks but
        # their ids, so an id in use is the one refusal that could come after a child is queued.
        for req in requests:
            if req.request_id in self.scheduler.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
        self.queue_requests(requests)

    def queue_requests(self, requests: list[Request]) -> None:
        """Hand checked requests to the scheduler, with their grammar matchers and bad words
        (the engine-core process calls this for what its front end sends)."""
        matchers = {r.request_id: self.grammar_compiler.matcher(so) for r in requests
                    if (so := r.sampling_params.structured_outputs) is not None}
        for req in requests:
            self.scheduler.add_request(req)
        self._matchers.update(matchers)
        for req in requests:
            words = req.sampling_params.bad_words_token_ids
            if words:
                self._bad_words[req.request_id] = words

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

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

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

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
        """Switch an idle engine between the overlapped and the synchronous loop.

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
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one device step; return outputs of the requests it updated.

        With async scheduling the outputs are those of the step dispatched by the previous
        call: this step is on the device while the host reads them (and learns of stops one
        step late; a token computed past a request's end is dropped).
        """
        cur, done = self._launch()
        if done[0] is None:
            cur = self._finish_deferred(cur)
            self.stat_logger.on_step([], time.monotonic())
            outputs = []
        else:
            rows: list[int] = []  # the row of each updated request
            updated, ids, lps, result = self._apply(*done, rows)
            cur = self._finish_deferred(cur)  # its masks follow the tokens just applied
            outputs = self._outputs(updated, rows, ids, lps, result)
        self._record(cur)
        if self._failed:
            outputs, self._failed = self._failed + outputs, []
        if (self.kv_worker is not None and cur[1] is None and done[1] is None
                and self.has_pending_kv_transfers()):
            self.kv_worker.wait_for_work(0.02)  # nothing ran: wait for pages or a pull
        return outputs

    def core_step(self) -> CoreStep:
        """`step` for an engine-core process: the sampled tokens, no text or RequestOutputs.

        The requests are those the front end queued (`scheduler.add_request`); a front end
        (`CoreProcessEngine`) turns the CoreStep into outputs.
        """
        cur, done = self._launch()
        step = CoreStep()
        if done[0] is not None:
            rows: list[int] = []
            finished_at: list[int] = []
            updated, ids, lps, result = self._apply(*done, rows, finished_at)
            cur = self._finish_deferred(cur)
            step.fill(updated, rows, ids, lps, result, finished_at)
        else:
            cur = self._finish_deferred(cur)
        self._record(cur)
        return step

    def _launch(self) -> tuple[tuple[Any, PendingStep | None],
                               tuple[Any, PendingStep | None]]:
        """Dispatch one step; return it and the step whose tokens to apply now.

        (None, None) to apply: the first step of an overlapped run (nothing back yet).
        """
        self.runner.last_wait_s = 0.0
        if not self.async_scheduling or self._grammar_needs_sync():
            if self._in_flight is not None:
                # A constrained request's next mask needs the token in flight: apply that step
                # first and dispatch nothing in this call (one bubble, then synchronous steps).
                prev, self._in_flight = self._in_flight, None
                return (None, None), prev
            cur = self._dispatch(advance=False)
            return cur, cur
        cur = self._dispatch(advance=True)
        prev, self._in_flight = self._in_flight, (cur if cur[1] is not None else None)
        if prev is None and cur[1] is not None:
            return cur, (None, None)
        return cur, (prev if prev is not None else cur)

    def _finish_deferred(self, cur: tuple[Any, Any]) -> tuple[Any, Any]:
        """Sample the step just dispatched if its forward ran without its token masks: the
        previous step's tokens are applied now, so the grammars are where that step left
        them. Returns `cur` with its PendingStep (and keeps it as the step in flight)."""
        if not isinstance(cur[1], DeferredStep):
            return cur
        pending = self._on_device(self.runner.finish_deferred, cur[1],
                                  self._token_masks(cur[0].scheduled))
        cur = (cur[0], pending)
        if self._in_flight is not None and self._in_flight[0] is cur[0]:
            self._in_flight = cur
        return cur

    def _grammar_needs_sync(self) -> bool:
        """True while a request with a grammar (or a bad word of several tokens) is queued or
        running on a multi-process mesh, whose other processes run whole steps: its next
        token's mask needs its previous token on the host, so steps go one at a time there.
        In one process such a step is deferred instead (docs/architecture.md, "Structured
        outputs")."""
        if not self._matchers and not self._bad_words:
            return False
        held = self.scheduler.requests
        for rid in [r for r in self._matchers if r not in held]:
            del self._matchers[rid]  # finished or aborted
        for rid in [r for r in self._bad_words if r not in held]:
            del self._bad_words[rid]
        if self.runner.announce is None:
            return False
        # bad_words of several tokens look at the output's last tokens too.
        return bool(self._matchers) or any(len(w) > 1 for ws in self._bad_words.values()
                                           for w in ws)

    def _needs_deferral(self, scheduled: list[Any]) -> bool:
        """Whether a sampling row's mask depends on its previous token: a grammar, or a bad
        word of several tokens (one-token words give the same mask every step)."""
        if not self._matchers and not self._bad_words:
            return False
        for s in scheduled:
            if s.sample:
                rid = s.request.request_id
                if rid in self._matchers or any(len(w) > 1 for w in self._bad_words.get(rid, ())):
                    return True
        return False

    def _token_masks(self, scheduled: list[Any]) -> np.ndarray | None:
        """[len(scheduled), W] packed masks when a scheduled sampling row has a grammar."""
        if not self._matchers and not self._bad_words:
            return None
        rows = [(m, i) for i, s in enumerate(scheduled)
                if s.sample and (m := self._matchers.get(s.request.request_id)) is not None]
        banned = [(i, ban) for i, s in enumerate(scheduled)
                  if s.sample and (ban := self._banned(s.request))]
        if not rows and not banned:
            return None
        masks = np.full((len(scheduled), mask_words(self.spec.vocab_size)), -1, np.int32)
        if rows:
            self.grammar_compiler.fill_masks(rows, masks)
        for i, ban in banned:
            forbid(masks[i], ban)
        return masks

    def _banned(self, req: Request) -> list[int]:
        """Tokens a request's bad_words forbid next (vLLM's rule: a word's last token, where
        the output ends with the word's other tokens; a one-token word always)."""
        words = self._bad_words.get(req.request_id) if self._bad_words else None
        if not words:
            return []
        out = req.output_token_ids
        ban = []
        for w in words:
            k = len(w) - 1
            if k == 0 or (len(out) >= k and tuple(out[len(out) - k:]) == w[:k]):
                ban.append(w[-1])
        return ban

    def _record_prompt_logprobs(self, result: Any) -> None:
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

    def _consume(self, updated: list[Request], rows: list[int], ids: list[int],
                 finished_at: list[int] | None = None) -> None:
        """Advance each constrained request's matcher past the token it just sampled (a
        request it ends goes into `finished_at`, as update_from_output's own)."""
        for i, (req, row) in enumerate(zip(updated, rows, strict=True)):
            m = self._matchers.get(req.request_id)
            if m is not None and req.output_token_ids:
                err = consume(m, ids[row])
                if err is not None:  # only if another constraint overrode the grammar's mask
                    # (allowed_token_ids or logit_bias leaving no token the grammar allows):
                    # the request ends here, aborted with the reason as its stop_reason,
                    # rather than going on unconstrained as if it had succeeded.
                    why = (err.strip().splitlines() or [""])[0][:200]
                    req.stop_reason = (f"sampled token {ids[row]} is outside the request's "
                                       f"structured output (another constraint, such as "
                                       f"allowed_token_ids, left no token it allows): {why}")
                    logger.warning("request %s aborted: %s", req.request_id, req.stop_reason)
                    del self._matchers[req.request_id]
                    if not req.is_finished():
                        self._finish([req.request_id], RequestStatus.FINISHED_ABORTED)
                        if finished_at is not None:
                            finished_at.append(i)

    def _record(self, cur: tuple[Any, PendingStep | None]) -> None:
        # One point per call, for the step dispatched by it (none: a drain call, see _launch).
        n = cur[0].num_scheduled_tokens if cur[0] is not None else 0
        self.metrics_history.record(self.scheduler, n)
        if self.kv_events is not None:
            self.kv_events.flush()  # this step's cache changes, as one batch

    def _dispatch(self, advance: bool) -> tuple[Any, PendingStep | None]:
        """Schedule one step and launch it (advance: as if it had run, for async scheduling)."""
        if self.kv_worker is not None:
            self._kv_connector_before_schedule()
        out = self.scheduler.schedule()
        if self.kv_worker is not None:
            self._kv_connector_meta()
        if out.kv_transfers is not None and not out.kv_transfers.is_empty:
            # Gathers, then loads, both before the forward (see jpaged/core/offload.py).
            self.runner.kv = self.kv_transfer.apply(self.runner.kv, out.kv_transfers,
                                                    self.tiers.host.store)
        # Packed from the requests as scheduled; only then advanced past this step.
        self.runner.remove_requests(out.finished_request_ids)
        self.runner.remove_requests(out.preempted)  # re-admitted with a new block table
        pending = None
        if out.scheduled:
            if advance and self._needs_deferral(out.scheduled):
                # Async: the masks need the tokens of the step in flight. The forward goes now;
                # the sampling once those tokens are applied (_finish_deferred).
                pending = self._on_device(self.runner.dispatch_deferred, out.scheduled,
                                          mask_words(self.spec.vocab_size))
            else:
                masks = self._token_masks(out.scheduled)
                pending = (self._on_device(self.runner.dispatch, out.scheduled) if masks is None
                           else self._on_device(self.runner.dispatch, out.scheduled, masks))
        if advance:
            self.scheduler.update_after_schedule(out)
        return out, pending

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
            self._failed.extend(self._failed_outputs(
                [(rid, f"KV load failed: {why}") for rid, why in failures]))

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

    def _apply(self, out: Any, pending: PendingStep | None, rows: list[int],
               finished_at: list[int] | None = None) -> tuple[list[Request], list[int],
                                                                list[float], Any]:
        """Read a step's sampled tokens and apply them to the scheduler's requests.

        Returns (updated requests, the step's tokens by row, their logprobs by row, the
        StepResult); `rows` gets each updated request's row (row i: out.scheduled[i]).
        """
        result = None
        ids: list[int] = []
        lps: list[float] = []
        if pending is not None:
            result = self._on_device(pending.result)
            self._open_disk_tier()
            ids = result.token_ids.tolist()
            lps = result.logprobs.tolist()
        if result is not None and result.prompt_spans:
            self._record_prompt_logprobs(result)
        updated = self.scheduler.update_from_output(out, ids, rows, finished_at)
        if self._matchers and ids:
            self._consume(updated, rows, ids, finished_at)
        if self.kv_worker is not None:
            self._kv_connector_meta()
        return updated, ids, lps, result

    # ----------------------------------------------------------------- metrics
    def get_metrics(self) -> dict[str, Any]:
        """Scheduler and cache gauges plus engine counters (vLLM's names)."""
        m = dict(self.scheduler.get_stats())
        m.update(self.stats)
        m["num_gpu_blocks"] = self.config.cache.num_gpu_blocks
        m["block_size"] = self.config.cache.block_size
        m["tensor_parallel_size"] = self.config.parallel.tensor_parallel_size
        m["kv_pool_bytes_per_device"] = kv_bytes_per_device(self.runner.kv)
        if self.kv_worker is not None:
            m.update(self.kv_worker.stats)
        return m

    def cache_state(self) -> dict[str, Any]:
        """Read-only JSON-able snapshot of the KV pool and block tables (see LLM.cache_state)."""
        state = self._user_request_ids(_cache_snapshot(self.scheduler))
        state["tiers"] = _tier_metrics(self.get_metrics())
        return state

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses, device and host tier (the disk tier
        persists: LLM.reset_prefix_cache); False if some are in use."""
        ok = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return ok

    # ----------------------------------------------------------------- KV cache events
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
        """Stop the engine's background parts (the KV event publisher; in a multi-process run,
        the other processes' loops); idempotent."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_worker is not None:
            self.kv_worker.close()
        if self.group is not None:
            self.group.stop()
