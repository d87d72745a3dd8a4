"""The front end of data-parallel serving: N engine replicas as Ray actors behind one router.

`DPEngineClient` offers what the OpenAI server needs of an engine (`add_request` onto an
asyncio queue, `abort`, metrics, health, the tokenizer), as `AsyncLLMEngine` does for one
engine, so `build_app` serves either. Each request is routed (`router.py`), added to its
replica, and its outputs are pumped from the replica's streaming call into the caller's queue.

Threads: the caller's event loop routes and pumps; one thread reads every replica's KV events
(`event_reader.py`: ZMQ SUB sockets, replaying any gap from the replica's replay socket) into
the router's index; one thread checks each replica every `HEALTH_INTERVAL_S` (a Ray call with
a timeout) and refreshes its metrics (merged in `metrics.py`). The router is shared under one
lock.

Faults: a replica that dies fails the requests it was serving with `RequestFailedError`
(naming the replica); the others keep serving. Ray restarts the actor (a fresh engine, empty
cache); the health thread sees the new process, the router forgets what the old one held and
re-reads the new one's events from their start.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from jpaged.async_engine import EngineDeadError, RequestFailedError
from jpaged.config import EngineArgs
from jpaged.dp.event_reader import KVEventReader
from jpaged.dp.metrics import ReplicaCollector, metric_totals
from jpaged.dp.replica import EngineReplica
from jpaged.dp.router import ROUTING_POLICIES, Route, Router
from jpaged.engine import PromptType
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jpaged.dp")

HEALTH_INTERVAL_S = 0.5  # how often each replica is checked (and its metrics read)
HEALTH_TIMEOUT_S = 5.0  # a replica that does not answer within this is marked down
# No replica healthy for this long (Ray lost their node, or cannot restart them): the server
# exits non-zero, naming the cause, so a supervisor restarts it (vLLM exits when its engine
# dies).
DEAD_TIMEOUT_S = 60.0


def _pd_roles(size: int, prefill: int, decode: int, args: EngineArgs) -> list[str] | None:
    """Each replica's kv_role for --prefill-replicas / --decode-replicas (None: plain data
    parallel); ValueError naming the flag for counts that do not add up."""
    if not prefill and not decode:
        if args.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config with data-parallel replicas is set per replica "
                             "by --prefill-replicas / --decode-replicas; pass both")
        return None
    for name, v in (("prefill_replicas", prefill), ("decode_replicas", decode)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1 when the other is set, got {v!r}")
    if size not in (1, prefill + decode):
        raise ValueError(f"data_parallel_size ({size}) must equal prefill_replicas + "
                         f"decode_replicas ({prefill + decode}) (or be left at 1)")
    return ["kv_producer"] * prefill + ["kv_consumer"] * decode


def _prefill_id(request_id: str) -> str:
    """The id a disaggregated request has on its prefill replica."""
    return f"{request_id}::prefill"


class DPEngineClient:
    """N replicas of one engine on Ray, one router; the server's engine for --data-parallel-size."""

    def __init__(self, args: EngineArgs, data_parallel_size: int,
                 routing_policy: str = "kv_aware", ray_address: str | None = None,
                 ray_init_kwargs: Mapping[str, Any] | None = None, replica_cpus: float = 1.0,
                 ready_timeout: float = 600.0, load_weight: float = 1.0,
                 prefill_replicas: int = 0, decode_replicas: int = 0,
                 dead_timeout_s: float = DEAD_TIMEOUT_S,
                 cpu_affinity: list[list[int]] | None = None) -> None:
        import ray

        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, "
                             f"got {data_parallel_size!r}")
        roles = _pd_roles(data_parallel_size, prefill_replicas, decode_replicas, args)
        if roles is not None:
            data_parallel_size = len(roles)
        if not isinstance(dead_timeout_s, int | float) or dead_timeout_s <= 0:
            raise ValueError(f"dead_timeout_s must be a number > 0, got {dead_timeout_s!r}")
        if args.create_engine_config(2**31 - 1).model.runner == "pooling":
            raise ValueError("runner 'pooling' serves from one engine in this version, not "
                             "data-parallel replicas")
        if args.engine_core_process:
            raise ValueError("engine_core_process is not supported with data-parallel replicas "
                             "(each replica's engine already runs in its own Ray actor process)")
        if args.kv_events_config is not None:
            raise ValueError("kv_events_config is set by data-parallel serving itself (each "
                             "replica publishes to the router); leave it unset")
        # Bad engine flags and a missing model fail here, before Ray starts.
        if routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, "
                             f"got {routing_policy!r}")
        # The hash seed as resolved here ($JPAGED_PREFIX_CACHING_HASH_SEED included) goes to
        # every replica and the router: one deployment, one chain.
        seed = args.create_engine_config(2**31 - 1).cache.prefix_caching_hash_seed
        from models.loader import check_model_source

        check_model_source(args.model)
        self.size = data_parallel_size
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kw = dict(ray_init_kwargs or {})
            kw.setdefault("include_dashboard", False)
            kw.setdefault("configure_logging", False)
            ray.init(address=ray_address, **kw)
        # Events sockets on loopback for a cluster of this machine only; else the node's address.
        local = ray_address is None
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        options: dict[str, Any] = {"max_restarts": -1, "max_task_retries": 0,
                                   "num_cpus": replica_cpus, "max_concurrency": 10_000}
        if gpus:
            options["num_gpus"] = args.tensor_parallel_size
        actor_cls = ray.remote(EngineReplica).options(**options)
        engine_args = {k: v for k, v in vars(args).items() if k != "extra"}
        engine_args["prefix_caching_hash_seed"] = seed
        engine_args.update(args.extra)
        self._actors = [actor_cls.remote(engine_args, r, "127.0.0.1" if local else None,
                                         freeze_gc=True,
                                         kv_role=roles[r] if roles is not None else None,
                                         cpu_affinity=(cpu_affinity[r % len(cpu_affinity)]
                                                       if cpu_affinity else None))
                        for r in range(data_parallel_size)]
        # Disaggregated serving: which replicas prefill and which decode (else None).
        self.prefill_ranks = ([r for r, k in enumerate(roles) if k == "kv_producer"]
                              if roles is not None else None)
        self.decode_ranks = ([r for r, k in enumerate(roles) if k == "kv_consumer"]
                             if roles is not None else None)
        self.dead_timeout_s = float(dead_timeout_s)
        # Called once when every replica stayed down past dead_timeout_s: the server exits
        # (jpaged serve passes exit_now); a library caller may pass its own.
        self.on_dead: Any = None
        try:
            infos = ray.get([a.info.remote() for a in self._actors], timeout=ready_timeout)
            self.tokenizer = ray.get(self._actors[0].tokenizer.remote(), timeout=ready_timeout)
        except ray.exceptions.GetTimeoutError:
            self._abandon()
            asks = {k: options[k] for k in ("num_cpus", "num_gpus") if k in options}
            raise RuntimeError(
                f"the {data_parallel_size} replicas did not start within {ready_timeout:.0f} s; "
                f"each asks Ray for {asks}, and Ray has {ray.available_resources()} free"
            ) from None
        except ray.exceptions.RayTaskError as e:  # the engine refused its arguments
            self._abandon()
            raise _cause(e) from None
        except ray.exceptions.RayActorError as e:
            self._abandon()
            if getattr(e, "_actor_init_failed", False):  # the engine refused to start
                raise _init_error(str(e)) from None
            raise
        except Exception:
            self._abandon()
            raise
        first = infos[0]
        self.model_source: str = first["source"]
        self.max_model_len: int = first["max_model_len"]
        self.eos_token_ids: tuple[int, ...] = tuple(first["eos_token_ids"])
        self.logprobs_limit: int = first["logprobs_limit"]
        self.default_sampling: dict[str, Any] = dict(first["default_sampling"])
        self.router = Router(data_parallel_size, routing_policy, first["block_size"],
                             first["hash_algo"], load_weight=load_weight, hash_seed=seed)
        self._lock = threading.Lock()  # guards the router
        self._lora_ids: dict[str, int] = {}  # LoRA adapter name -> lora_int_id (the server's)
        self._infos: list[dict[str, Any] | None] = list(infos)
        self._metrics: list[dict[str, Any]] = [{} for _ in range(data_parallel_size)]
        self._errors: list[str | None] = [None] * data_parallel_size
        self._tasks: dict[str, tuple[asyncio.Task, asyncio.AbstractEventLoop, int]] = {}
        # Requests whose replica streams their outputs to the caller (an abort there ends the
        # stream with the replica's final "abort" output), and those aborted before that
        # (a disaggregated request's prefill hop: its pump ends the stream itself).
        self._streaming: set[str] = set()
        self._aborted: set[str] = set()
        self._stopping = threading.Event()
        self._events = KVEventReader(self.router, self._lock)
        for r, info in enumerate(infos):
            self._events.follow(r, info)
        self._health = threading.Thread(target=self._watch, name="jpaged-dp-health",
                                        daemon=True)
        self._health.start()

    # -- what the server needs -------------------------------------------------------------------

    def start(self) -> None:
        """Nothing to do: the replicas run from construction (the server calls this)."""

    @property
    def is_running(self) -> bool:
        """True while at least one replica is healthy."""
        return not self._stopping.is_set() and any(self.router.healthy)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(any replica up, per-replica status) for /health."""
        reps = []
        for r in range(self.size):
            info = self._infos[r]
            reps.append({"replica": r, "healthy": self.router.healthy[r],
                         "pid": info["pid"] if info else None,
                         "requests_routed": self.router.routed[r],
                         "in_flight": self.router.loads[r].in_flight,
                         "error": self._errors[r]})
        return self.is_running, {"replicas": reps}

    def get_metrics(self) -> dict[str, Any]:
        """Totals over the replicas (fractions averaged), plus the router's per-replica counts."""
        out = metric_totals([m for m, ok in zip(self._metrics, self.router.healthy, strict=True)
                             if ok and m])
        out["num_unfinished_requests"] = len(self._tasks)
        out["data_parallel_size"] = self.size
        if self.prefill_ranks is not None:
            out["prefill_replicas"] = len(self.prefill_ranks)
            out["decode_replicas"] = len(self.decode_ranks)
        out["num_replicas_healthy"] = sum(self.router.healthy)
        return out

    def replica_metrics(self) -> list[dict[str, Any]]:
        """Each replica's latest metrics ({} while it is down)."""
        return [dict(m) if ok else {} for m, ok in zip(self._metrics, self.router.healthy,
                                                        strict=True)]

    def metrics_registry(self) -> Any:
        """A prometheus registry: every series per replica (label engine) and its total."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(ReplicaCollector(self))
        return registry

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0, queue: asyncio.Queue | None = None,
                          lora_request: Any = None) -> asyncio.Queue:
        """Route and add a request; its outputs (or an exception) arrive on the queue.

        Disaggregated (prefill and decode replicas): the prompt goes first to the least loaded
        prefill replica (one token, its blocks held), then with that replica's
        kv_transfer_params to the decode replica the KV-aware score picks (the one holding most
        of the prompt already pulls least); both hops run in the request's pump task.
        """
        if self._stopping.is_set():
            raise EngineDeadError("the data-parallel engine is shut down")
        queue = asyncio.Queue() if queue is None else queue
        ids, salt, payload = self._for_routing(prompt)
        if lora_request is not None:
            # A LoRA adapter's blocks are keyed by a digest of its files the router cannot
            # compute: its requests are placed by load alone (no prefix estimate).
            ids, salt = None, None
        loop = asyncio.get_running_loop()
        if self._disaggregate(params):
            pid = _prefill_id(request_id)
            pparams = params.clone(max_tokens=1, min_tokens=0, logprobs=None,
                                   output_kind=RequestOutputKind.FINAL_ONLY, extra_args={
                                       "kv_transfer_params": {"do_remote_decode": True}})
            route, actor = await self._place(pid, payload, pparams, priority, ids, salt,
                                             self.prefill_ranks, "least_load",
                                             lora_request=lora_request)
            task = loop.create_task(self._pump_pd(request_id, pid, route, actor, ids, salt,
                                                  payload, params, priority, queue,
                                                  lora_request))
        else:
            among = self.decode_ranks  # disaggregated: what cannot split runs on a decoder
            route, actor = await self._place(request_id, payload, params, priority, ids, salt,
                                             among, lora_request=lora_request)
            self._streaming.add(request_id)
            task = loop.create_task(self._pump(request_id, route, actor, queue))
        task.add_done_callback(lambda t: self._task_done(request_id, t, payload, ids, queue))
        self._tasks[request_id] = (task, loop, route.replica)
        return queue

    def _disaggregate(self, params: SamplingParams) -> bool:
        """True if this request runs as a remote prefill then a decode."""
        if self.prefill_ranks is None or params.n != 1:
            return False
        return not (params.extra_args or {}).get("kv_transfer_params")

    async def _place(self, request_id: str, payload: Any, params: SamplingParams, priority: int,
                     ids: list[int] | None, salt: str | None, among: list[int] | None,
                     policy: str | None = None, decode_only: bool = False,
                     lora_request: Any = None) -> tuple[Route, Any]:
        """Choose a replica among `among` (all: None) and add the request there; a dead
        replica is marked down and another tried; bad input raises as from one engine."""
        import ray

        group = among if among is not None else list(range(self.size))
        tried: set[int] = set()
        while True:
            with self._lock:
                route = (self.router.choose(ids, salt, among=group, policy=policy)
                         if len(tried) < len(group) and any(self.router.healthy[r]
                                                            for r in group) else None)
                if route is not None and route.replica in tried:
                    route = None
                if route is not None:
                    if decode_only:  # its prompt arrives as pulled pages, not as prefill work
                        route.cached_tokens = max(0, route.prompt_tokens - 1)
                    self.router.started(request_id, route)
            if route is None:
                what = "" if among is None else (
                    " prefill" if among is self.prefill_ranks else " decode")
                raise EngineDeadError(f"no{what} replica could take the request")
            actor = self._actors[route.replica]
            try:
                await actor.add.remote(request_id, payload, params, priority, lora_request)
                return route, actor
            except ray.exceptions.RayTaskError as e:  # the engine refused it (bad input)
                self._end(request_id, route.replica)
                raise _cause(e) from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                self._end(request_id, route.replica)
                self._down(route.replica, e)
                tried.add(route.replica)  # try another replica

    async def _pump_pd(self, request_id: str, pid: str, route: Route, actor: Any,
                       ids: list[int] | None, salt: str | None, payload: Any,
                       params: SamplingParams, priority: int, queue: asyncio.Queue,
                       lora_request: Any = None) -> None:
        """The prefill hop's final output, then the decode hop pumped into `queue` (both hops
        with the request's LoRA adapter)."""
        import ray

        kvp = None
        gen = actor.stream.remote(pid)
        try:
            async for ref in gen:
                for out in await ref:
                    if out.finished:
                        kvp = out.kv_transfer_params
        except asyncio.CancelledError:
            ray.cancel(gen)
            self._end(pid, route.replica)
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._down(route.replica, e)  # its prompt is computed on the decode replica
            logger.warning("prefill replica %d failed during %r; decoding it from scratch",
                           route.replica, request_id)
        except Exception as e:  # the prefill failed: the decode replica computes it all
            logger.warning("prefill of %r on replica %d failed (%s: %s); decoding it from "
                           "scratch", request_id, route.replica, type(e).__name__, e)
        self._end(pid, route.replica)
        dparams = params if kvp is None else params.clone(extra_args={
            **(params.extra_args or {}), "kv_transfer_params": kvp})
        try:
            droute, dactor = await self._place(request_id, payload, dparams, priority, ids, salt,
                                               self.decode_ranks, decode_only=kvp is not None,
                                               lora_request=lora_request)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise
            queue.put_nowait(e if isinstance(e, ValueError | EngineDeadError)
                             else RequestFailedError(f"{type(e).__name__}: {e}"))
            self._tasks.pop(request_id, None)
            return
        entry = self._tasks.get(request_id)
        if entry is not None:  # aborts now go to the decode replica
            self._tasks[request_id] = (entry[0], entry[1], droute.replica)
        await self._pump(request_id, droute, dactor, queue)

    # -- LoRA adapters: every replica reads them (the server's --lora-modules and loads) ------

    def check_lora(self, lora_request: Any) -> None:
        """Read and check a LoRA adapter on every replica (the error a replica raised when one
        cannot: ValueError or FileNotFoundError naming the problem)."""
        import ray

        try:
            ray.get([a.check_lora.remote(lora_request) for a in self._actors],
                    timeout=self.dead_timeout_s + 60)
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        self._lora_ids.setdefault(lora_request.lora_name, lora_request.lora_int_id)

    def drop_lora(self, name: str) -> bool:
        """Drop adapter `name`'s host copy on every replica."""
        import ray

        self._lora_ids.pop(name, None)
        return any(ray.get([a.drop_lora.remote(name) for a in self._actors],
                           timeout=self.dead_timeout_s + 60))

    def lora_id_for(self, name: str) -> int:
        """Adapter `name`'s lora_int_id here, or one no adapter has."""
        return self._lora_ids.get(name, max(self._lora_ids.values(), default=0) + 1)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests from any thread (their replicas forget them too). As one engine's
        abort, each request's stream ends with a finished output, finish_reason "abort",
        holding the tokens it had."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        # (replica, forget its queues) -> ids: a streamed request's replica keeps its queue,
        # whose stream brings the final output (even one asked for after the abort); a
        # cancelled prefill hop's stream may never be asked for.
        by_replica: dict[tuple[int, bool], list[str]] = {}
        for rid in ids:
            entry = self._tasks.get(rid)
            if entry is None:
                continue
            task, loop, r = entry
            if rid in self._streaming:
                by_replica.setdefault((r, False), []).append(rid)
                continue
            by_replica.setdefault((r, True), []).extend((rid, _prefill_id(rid)))
            self._aborted.add(rid)
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed
                pass
        for (r, forget), rids in by_replica.items():
            self._actors[r].abort.remote(rids, forget)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the replicas and the threads (and Ray, if this client started it)."""
        import ray

        if self._stopping.is_set():
            return
        self._stopping.set()
        self._health.join(timeout)
        self._events.close()
        for r in range(self.size):
            try:
                ray.get(self._actors[r].shutdown.remote(), timeout=timeout)
            except Exception:  # dead or stuck: killed below anyway
                pass
        self._kill_all()
        if self._owns_ray:
            ray.shutdown()

    # -- internals -------------------------------------------------------------------------------

    def _for_routing(self, prompt: PromptType) -> tuple[list[int] | None, str | None, Any]:
        """Token ids and salt the router hashes, and the prompt sent on (with those ids, so the
        replica computes exactly the tokens that were routed)."""
        if isinstance(prompt, str):
            if not prompt:
                return None, None, prompt  # the replica names the problem
            ids = list(self.tokenizer.encode(prompt))
            return ids, None, {"prompt": prompt, "prompt_token_ids": ids}
        if isinstance(prompt, Mapping):
            salt = prompt.get("cache_salt")
            salt = salt if isinstance(salt, str) else None
            ids = prompt.get("prompt_token_ids")
            if ids is None and isinstance(prompt.get("prompt"), str) and prompt["prompt"]:
                ids = list(self.tokenizer.encode(prompt["prompt"]))
                return ids, salt, {**prompt, "prompt_token_ids": ids}
            if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                return ids, salt, prompt
        return None, None, prompt

    async def _pump(self, request_id: str, route: Route, actor: Any,
                    queue: asyncio.Queue) -> None:
        import ray

        r = route.replica
        gen = actor.stream.remote(request_id)
        first = True
        self._streaming.add(request_id)
        try:
            async for ref in gen:
                outs = await ref
                if first:
                    first = False
                    with self._lock:
                        self.router.first_output(request_id, r)
                for out in outs:
                    queue.put_nowait(out)
        except asyncio.CancelledError:
            ray.cancel(gen)
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self._down(r, e)
            queue.put_nowait(RequestFailedError(
                f"replica {r} failed while serving this request ({type(e).__name__}); "
                "the other replicas keep serving"))
        except ray.exceptions.RayTaskError as e:
            queue.put_nowait(_cause(e))
        except Exception as e:  # never leave the caller waiting
            queue.put_nowait(RequestFailedError(f"replica {r}: {type(e).__name__}: {e}"))
        finally:
            self._end(request_id, r)

    def _task_done(self, request_id: str, task: asyncio.Task, payload: Any,
                   ids: list[int] | None, queue: asyncio.Queue) -> None:
        """A request's pump ended. One that an abort cancelled (a disaggregated request before
        its decode) ends its stream with a finished "abort" output: no token was generated."""
        self._streaming.discard(request_id)
        if request_id not in self._aborted:
            return
        self._aborted.discard(request_id)
        if not task.cancelled():
            return  # it ended on its own first
        prompt = payload if isinstance(payload, str) else (
            payload.get("prompt") if isinstance(payload, Mapping) else None)
        queue.put_nowait(RequestOutput(
            request_id, prompt if isinstance(prompt, str) else None, list(ids or []),
            [CompletionOutput(0, "", [], finish_reason="abort")], finished=True))

    def _end(self, request_id: str, replica: int) -> None:
        with self._lock:
            self.router.finished(request_id, replica)
        entry = self._tasks.get(request_id)
        if entry is not None and entry[2] == replica:
            del self._tasks[request_id]

    def _down(self, replica: int, error: BaseException | str) -> None:
        with self._lock:
            was = self.router.healthy[replica]
            self.router.set_healthy(replica, False)
        self._errors[replica] = str(error).splitlines()[0][:300] if str(error) else repr(error)
        self._events.unfollow(replica)
        if was:
            logger.warning("replica %d is down: %s", replica, self._errors[replica])

    def _watch(self) -> None:
        down_since: float | None = None
        while not self._stopping.wait(HEALTH_INTERVAL_S):
            self._check_replicas()
            if any(self.router.healthy):
                down_since = None
                continue
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since >= self.dead_timeout_s and not self._stopping.is_set():
                errors = "; ".join(f"replica {r}: {e}" for r, e in enumerate(self._errors) if e)
                cause = RuntimeError(
                    f"no data-parallel replica has been healthy for {self.dead_timeout_s:g} s "
                    f"(Ray could not bring any back: {errors or 'no answer'}); exiting so a "
                    "supervisor can restart the server")
                logger.error("%s", cause)
                self._on_dead(cause)
                return

    def _check_replicas(self) -> None:
        """Ask every replica for its info and metrics; mark it down or up again."""
        import ray

        for r, actor in enumerate(self._actors):
            try:
                info, metrics = ray.get([actor.info.remote(), actor.metrics.remote()],
                                        timeout=HEALTH_TIMEOUT_S)
            except Exception as e:
                if self.router.healthy[r]:
                    self._down(r, e)
                continue
            old = self._infos[r]
            self._metrics[r] = metrics
            if not info["running"]:  # the actor lives but its engine loop died
                self._down(r, "its engine loop stopped; restarting it")
                ray.kill(actor, no_restart=False)  # Ray starts a fresh one
                continue
            if not self.router.healthy[r] or old is None or old["pid"] != info["pid"]:
                # Up again (or restarted under us): a fresh engine, its events from 0.
                self._infos[r] = info
                self._events.unfollow(r)
                with self._lock:
                    self.router.index.drop_replica(r)
                self._events.follow(r, info)
                with self._lock:
                    self.router.healthy[r] = True
                self._errors[r] = None
                logger.info("replica %d is up (pid %d)", r, info["pid"])

    def _on_dead(self, cause: BaseException) -> None:
        self._stopping.set()  # new requests get EngineDeadError; /health answers down
        if self.on_dead is not None:
            self.on_dead(cause)

    def _abandon(self) -> None:
        """Start-up failed: kill the replicas, and stop Ray if this client started it."""
        import ray

        self._kill_all()
        if self._owns_ray:
            ray.shutdown()

    def _kill_all(self) -> None:
        import ray

        for a in self._actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass


def _cause(e: BaseException) -> BaseException:
    """The exception a replica raised (ValueError for bad input), without Ray's wrapping."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


_ERROR_LINE = re.compile(r"^(ValueError|FileNotFoundError|RuntimeError): ", re.M)


def _init_error(message: str) -> Exception:
    """The error a replica's engine raised while starting, from Ray's report of it (its last
    'ValueError: ...' and what follows), as that type."""
    found = list(_ERROR_LINE.finditer(message))
    if not found:
        return RuntimeError(f"a replica failed to start: {message}")
    kind, text = found[-1].group(1), message[found[-1].end():].strip()
    cls = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(kind,
                                                                                RuntimeError)
    return cls(f"a replica failed to start: {' '.join(text.split())}")
