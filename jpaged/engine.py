"""LLMEngine: the request front end of an in-process EngineCore (vLLM V1's split).

The front end takes requests (tokenize, check, fan n > 1 out: frontend.py) and turns what each
core step applied into RequestOutputs (text, logprobs, stop strings); the core
(engine_core.py) owns the scheduler, the runner and the step. `CoreProcessEngine`
(core_client.py) is the same front end over a core in its own process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jpaged.config import EngineArgs, EngineConfig
from jpaged.core.kv_cache_groups import KVCacheLayout
from jpaged.core.metrics_history import MetricsHistory
from jpaged.core.scheduler import Scheduler
from jpaged.core.structured_output import GrammarCompiler
from jpaged.engine_core import EngineCore
from jpaged.frontend import PromptType, RequestFrontend
from jpaged.kv_events import KVEventBatch, KVEventHub
from jpaged.outputs import RequestOutput
from jpaged.request import Request, RequestStatus
from jpaged.runner.kv_connector import KVConnectorWorker
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.multiprocess import ProcessGroup
from models.build import LoadedModel

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine(RequestFrontend):
    """The engine behind `LLM` and the server: one jitted device step per `step()` call.

    `core` is the EngineCore it drives; `scheduler`, `runner`, `config` and the like are that
    core's (read-only views, for tests, benchmarks and tools).
    """

    def __init__(self, args: EngineArgs | None = None, loaded: LoadedModel | None = None, *,
                 group: ProcessGroup | None = None) -> None:
        args = args or EngineArgs()
        self.core = EngineCore(args, loaded, group=group)
        core = self.core
        self.spec, self.tokenizer = core.spec, core.tokenizer
        self.pooler = core.pooler  # runner "pooling": how prompts pool (None: generating)
        self._init_frontend(log_stats=not args.disable_log_stats, lora_cache=core.lora_cache)

    @property
    def loaded(self) -> LoadedModel:
        """The core's LoadedModel (its `model` is None while the weights sleep)."""
        return self.core.loaded

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode (EngineCore.sleep): the device memory given back while idle."""
        return self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back ("weights", "kv_cache", or both)."""
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while the engine sleeps (no request may be added)."""
        return self.core.is_sleeping()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Build an engine from EngineArgs (vLLM's spelling)."""
        return cls(args)

    # ----------------------------------------------------------------- the core's parts
    @property
    def config(self) -> EngineConfig:
        """The core's EngineConfig (num_blocks resolved)."""
        return self.core.config

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler."""
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        """The core's device runner (the pool, the compiled steps)."""
        return self.core.runner

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The core's KV cache groups."""
        return self.core.kv_layout

    @property
    def tiers(self) -> Any:
        """The core's host/disk KV tiers (None without kv_offloading_size)."""
        return self.core.tiers

    @property
    def kv_events(self) -> KVEventHub | None:
        """The core's KV cache event hub (None when events are off)."""
        return self.core.kv_events

    @property
    def metrics_history(self) -> MetricsHistory:
        """The core's per-step metrics history."""
        return self.core.metrics_history

    @property
    def kv_worker(self) -> KVConnectorWorker | None:
        """The core's KV connector worker side (None without a connector)."""
        return self.core.kv_worker

    @property
    def ops(self) -> Any:
        """The core's attention backend (AttentionOps)."""
        return self.core.ops

    @property
    def kv_dtype(self) -> Any:
        """The KV pool's dtype."""
        return self.core.kv_dtype

    @property
    def async_scheduling(self) -> bool:
        """Whether the core runs the overlapped loop."""
        return self.core.async_scheduling

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The core's grammar compiler (one cache of compiled grammars for checks and steps)."""
        return self.core.grammar_compiler

    # ----------------------------------------------------------------- requests
    def _submit(self, requests: list[Request]) -> None:
        # All or none: the children of one request share everything the scheduler checks but
        # their ids, so an id in use is the one refusal that could come after a child is queued.
        for req in requests:
            if req.request_id in self.core.scheduler.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
        self.core.queue_requests(requests)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        self.core.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.core.has_unfinished_requests()

    def has_pending_kv_transfers(self) -> bool:
        """True while a KV connector holds blocks for a consumer or pulls pages: the engine's
        loop must keep stepping (an idle step waits on the connector, it does not spin)."""
        return self.core.has_pending_kv_transfers()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use now."""
        return self.core.kv_cache_usage

    def set_async_scheduling(self, enabled: bool) -> None:
        """Switch an idle engine between the overlapped and the synchronous loop (see
        EngineCore.set_async_scheduling)."""
        self.core.set_async_scheduling(enabled)

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one device step; return outputs of the requests it updated.

        With async scheduling the outputs are those of the step dispatched by the previous
        call: this step is on the device while the host reads them (and learns of stops one
        step late; a token computed past a request's end is dropped).
        """
        res = self.core.step()
        if res.applied:
            outputs = self._outputs(res.updated, res.rows, res.token_ids, res.logprobs,
                                    res.result)
        else:
            self.stat_logger.on_step([], time.monotonic())
            outputs = []
        if res.failures:
            outputs = self._failed_outputs(res.failures) + outputs
        return outputs

    # ----------------------------------------------------------------- metrics and state
    def get_metrics(self) -> dict[str, Any]:
        """Scheduler and cache gauges plus engine counters (vLLM's names)."""
        m = self.core.get_metrics()
        m.update(self.front_metrics())
        return m

    def cache_state(self) -> dict[str, Any]:
        """Read-only JSON-able snapshot of the KV pool and block tables (see LLM.cache_state)."""
        return self._user_request_ids(self.core.cache_state())

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses, device and host tier (the disk tier
        persists: LLM.reset_prefix_cache); False if some are in use."""
        return self.core.reset_prefix_cache()

    def subscribe_kv_events(self, fn: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Call fn(batch) with every later KVEventBatch, in order; returns the unsubscribe.

        Batches are handed over on the engine's thread at the end of the step that made them.
        """
        return self.core.subscribe_kv_events(fn)

    def cached_block_hashes(self) -> dict[str, set[bytes]]:
        """The block hashes each tier holds now ("GPU", "CPU", "DISK"), read off the pool."""
        return self.core.cached_block_hashes()

    def warmup_decode(self) -> None:
        """Compile every decode step shape (benchmarks time no compiles)."""
        self.core.warmup_decode()

    def shutdown(self) -> None:
        """Stop the engine's background parts (the KV event publisher; in a multi-process run,
        the other processes' loops); idempotent."""
        self.core.shutdown()
