"""One data-parallel replica: an engine in its own process (a Ray actor), driven by the front end.

The actor owns an AsyncLLMEngine (its own device set, scheduler and KV pool) and publishes its
KV cache events on a ZMQ socket of its own, which the front end's router indexes. A request is
added in one call (`add`: validation errors come back at once, as from a local engine) and its
outputs are then read from a streaming call (`stream`), which yields lists of RequestOutputs:
whatever the engine produced since the last yield, so a busy replica does not pay one Ray
message per token. Cancelling the stream (the client went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

from jpaged.async_engine import AsyncLLMEngine
from jpaged.config import EngineArgs, KVTransferConfig
from jpaged.engine import LLMEngine, PromptType
from jpaged.gc_heap import freeze_gc_heap
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams


def _node_ip() -> str:
    """This node's address as Ray knows it (replicas on a cluster publish there)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray worker: this machine only
        return "127.0.0.1"


class EngineReplica:
    """The body of a replica actor (`ray.remote(EngineReplica)`); usable in-process too."""

    def __init__(self, engine_args: dict[str, Any], rank: int, events_host: str | None,
                 freeze_gc: bool = False, kv_role: str | None = None,
                 cpu_affinity: list[int] | None = None) -> None:
        if cpu_affinity:  # before the engine makes its device (XLA's threads follow it)
            os.sched_setaffinity(0, cpu_affinity)
        host = events_host or _node_ip()
        ev = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://{host}:*", "replay_endpoint": f"tcp://{host}:*"}
        extra: dict[str, Any] = {"kv_events_config": ev, "data_parallel_rank": rank}
        if kv_role is not None:  # disaggregated serving: this replica's half, on its own address
            base = KVTransferConfig.parse(engine_args.get("kv_transfer_config"))
            cfg = dataclasses.asdict(base) if base is not None else {}
            extra["kv_transfer_config"] = {**cfg, "kv_role": kv_role, "kv_ip": host,
                                           "kv_port": 0}
        args = EngineArgs(**{**engine_args, **extra})
        self.rank = rank
        self.kv_role = kv_role
        self.engine = AsyncLLMEngine(LLMEngine(args))
        self._queues: dict[str, asyncio.Queue] = {}
        if freeze_gc:  # an actor's process is the replica's own (see jpaged/gc_heap.py)
            freeze_gc_heap()

    def info(self) -> dict[str, Any]:
        """What the front end needs: events endpoints, model, limits, pid."""
        e = self.engine.engine
        pub = e.kv_events.publisher if e.kv_events is not None else None
        cache = e.config.cache
        return {"rank": self.rank, "pid": os.getpid(), "source": e.loaded.source,
                "max_model_len": e.config.scheduler.max_model_len,
                "eos_token_ids": list(e.eos_token_ids),
                "logprobs_limit": e.logprobs_limit,
                "default_sampling": e.default_sampling,
                "block_size": cache.block_size, "hash_algo": cache.prefix_caching_hash_algo,
                "kv_role": self.kv_role,
                "events_endpoint": pub.endpoint if pub is not None else None,
                "replay_endpoint": pub.replay_endpoint if pub is not None else None,
                "running": self.engine.is_running}

    def tokenizer(self) -> Any:
        """The model's tokenizer (pickled to the front end)."""
        return self.engine.tokenizer

    async def add(self, request_id: str, prompt: PromptType, params: SamplingParams,
                  priority: int = 0, lora_request: Any = None) -> None:
        """Queue a request; raises ValueError for bad input, as LLMEngine.add_request."""
        self._queues[request_id] = await self.engine.add_request(
            request_id, prompt, params, priority, lora_request=lora_request)

    def check_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter here (the server's --lora-modules, its loads)."""
        self.engine.check_lora(lora_request)

    def drop_lora(self, name: str) -> bool:
        """Drop LoRA adapter `name`'s host copy here (the server's unload)."""
        return self.engine.drop_lora(name)

    async def stream(self, request_id: str) -> AsyncIterator[list[RequestOutput]]:
        """The request's outputs, in batches, until it finishes; cancelled: it is aborted."""
        queue = self._queues.get(request_id)
        if queue is None:
            raise KeyError(f"request {request_id!r} was not added to replica {self.rank}")
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                outs = []
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    outs.append(item)
                    finished = finished or item.finished
                yield outs
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)

    def abort(self, request_ids: list[str], forget: bool = True) -> None:
        """Abort requests (unknown ids are ignored). `forget`: drop their output queues (no
        stream will read them); else each stream reads its request's final "abort" output
        and ends (a stream asked for after the abort still finds it)."""
        if forget:
            for rid in request_ids:
                self._queues.pop(rid, None)
        self.engine.abort(request_ids)

    def metrics(self) -> dict[str, Any]:
        """The engine's metrics as of its latest loop iteration."""
        return self.engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the engine loop and the event publisher."""
        self.engine.shutdown()
