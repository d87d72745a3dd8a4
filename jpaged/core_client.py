"""The engine core in a process of its own (vLLM V1's EngineCoreProc), its front end in yours.

`EngineArgs(engine_core_process=True)` (CLI `--engine-core-process`) splits the engine in two,
as vLLM V1 does:

- the **engine-core process** runs an `EngineCore` (engine_core.py: the scheduler, the KV
  pool and the device step, `EngineCore.core_step`) in a busy loop: it takes new requests and
  aborts between steps and sends back each step's sampled tokens (a `CoreStep`: ids, tokens,
  logprobs, finishes);
- the **front end** (`CoreProcessEngine`, in the caller's process) validates and tokenizes
  prompts, fans n > 1 out, and turns each CoreStep into RequestOutputs: incremental
  detokenization, stop strings (a stop string found ends the sequence in the core by an abort,
  one or more steps later; tokens past it are never shown), logprobs, timing metrics.

The two overlap: the host loop the device waits on does no per-token text work, and the text
work runs on another core. Queries of the core's state (metrics, cache state, prefix-cache
reset, metrics history) are calls answered between two steps.

Invariants:
- Messages are pickled tuples on one duplex pipe. Front end -> core: ("add", [Request]),
  ("abort", [id], status name), ("ack", n), ("call", seq, name, args), ("shutdown",).
  Core -> front end:
  ("ready", info), ("step", CoreStep), ("reply", seq, ok, value), ("fatal", text).
- The core never blocks on sending (a sender thread writes its messages), so it always drains
  the front end's messages and neither side can wait on the other's full pipe.
- Every CoreStep is delivered, in order, to one `step()` call, which acknowledges it; a reply
  read while waiting for a call's answer leaves the steps before it queued. The core steps
  only while fewer than MAX_AHEAD of its steps are unacknowledged (it still answers messages).
- The front end checks what the scheduler would refuse (`check_request_fits`) before sending:
  a request the core takes is never refused there.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from jpaged.config import EngineArgs
from jpaged.core_step import CoreStep
from jpaged.engine_core import EngineCore
from jpaged.frontend import RequestFrontend
from jpaged.kv_events import KVEventBatch
from jpaged.outputs import RequestOutput
from jpaged.request import Request, RequestStatus

logger = logging.getLogger("jpaged.engine_core")

# How long the front end waits for the core process to load the model and report ready.
DEFAULT_START_TIMEOUT_S = 900.0
_POLL_S = 0.5  # the front end's wait between liveness checks of the core process
# Steps the core may run ahead of the front end: past it the core waits, so a slow front end
# (or one not stepping) bounds the tokens computed unseen: stream latency, the tokens past a
# stop string, and the steps queued in memory.
MAX_AHEAD = 4
# Core-state queries the front end may make (LLMEngine methods, run between two steps).
_CALLS = frozenset({"get_metrics", "cache_state", "reset_prefix_cache", "cached_block_hashes",
                    "metrics_snapshot", "warmup_decode", "sleep", "wake_up", "is_sleeping"})


class CoreProcessError(RuntimeError):
    """The engine-core process failed or exited; the message says how."""


# ----------------------------------------------------------------------------- core process
def _core_main(conn: Any, args: EngineArgs, loader: Callable[[], Any] | None,
               log_level: int) -> None:
    """The engine-core process: build the engine, then step it while it has work."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = EngineCore(args, loaded=loader() if loader is not None else None)
    except BaseException as e:  # noqa: BLE001 - every start-up failure goes to the front end
        try:  # the exception itself when it pickles (the front end raises it: bad input)
            exc = e if isinstance(e, ValueError | OSError) and pickle.loads(pickle.dumps(e)) \
                else None
        except Exception:  # noqa: BLE001
            exc = None
        conn.send(("fatal", f"{type(e).__name__}: {e}", exc))
        return
    from jpaged.gc_heap import freeze_gc_heap

    freeze_gc_heap()  # a long-lived serving loop, like jpaged serve's (JPAGED_GC_FREEZE=0: no)
    conn.send(("ready", {"tokenizer": engine.tokenizer, "spec": engine.spec,
                         "config": engine.config, "source": engine.loaded.source,
                         "generation_config": engine.loaded.generation_config,
                         "pid": os.getpid()}))
    _CoreLoop(engine, conn).run()


class _CoreLoop:
    """The core's busy loop: take messages, step while there is work, send each CoreStep."""

    def __init__(self, engine: EngineCore, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.sender = threading.Thread(target=self._send_all, name="core-sender", daemon=True)
        self.parent = os.getppid()
        self.last_ids: list[str] | None = None  # req_ids of the latest CoreStep sent
        self.sent = 0  # CoreSteps sent
        self.acked = 0  # CoreSteps the front end has taken (its "ack" messages)
        self.adds = 0  # "add" messages taken (each CoreStep says how many: adds_seen)

    def _send_all(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # the front end is gone
                return

    def _send(self, msg: tuple[Any, ...]) -> None:
        self.outbox.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def _ready(self) -> bool:
        """Work to step, and the front end has read all but MAX_AHEAD - 1 of the steps sent."""
        e = self.engine
        return e.has_work() and (
            self.sent - self.acked < MAX_AHEAD)

    def run(self) -> None:
        """Serve until the front end says shutdown or goes away."""
        self.sender.start()
        engine, conn = self.engine, self.conn
        loop_s = 0.0
        try:
            while True:
                if not self._ready():  # idle, or far enough ahead: wait for a message
                    while not conn.poll(_POLL_S):
                        if os.getppid() != self.parent:
                            return  # the front end died without a word
                c0 = time.thread_time()
                while conn.poll(0):
                    if not self._handle(pickle.loads(conn.recv_bytes())):
                        return
                if not self._ready():
                    continue
                step = engine.core_step()
                step.loop_s = loop_s
                step.kv_cache_usage = engine.kv_cache_usage
                step.adds_seen = self.adds
                if step.req_ids == self.last_ids:
                    step.req_ids = None  # the front end has this list already
                else:
                    self.last_ids = step.req_ids
                self._send(("step", step))
                self.sent += 1
                loop_s = time.thread_time() - c0
        except (EOFError, OSError):
            return  # the front end closed the pipe
        except BaseException:  # noqa: BLE001 - the front end must learn why the core stopped
            self._send(("fatal", traceback.format_exc(), None))
        finally:
            try:
                engine.shutdown()
            finally:
                self.outbox.put(None)
                self.sender.join(timeout=30)

    def _handle(self, msg: tuple[Any, ...]) -> bool:
        """Apply one front-end message; False on shutdown."""
        op = msg[0]
        if op == "add":
            self.adds += 1
            self.engine.queue_requests(msg[1])
        elif op == "ack":
            self.acked += msg[1]
        elif op == "abort":
            self.engine.finish_requests(msg[1], RequestStatus[msg[2]])
        elif op == "call":
            _, seq, name, args = msg
            try:
                if name not in _CALLS:
                    raise ValueError(f"unknown engine-core call {name!r}")
                value = self._call(name, args)
                self._send(("reply", seq, True, value))
            except Exception as e:  # noqa: BLE001 - the caller gets the error, the core goes on
                # (raised again there as a ValueError: its own message needs no type prefix)
                why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
                self._send(("reply", seq, False, why))
        elif op == "shutdown":
            return False
        else:
            raise ValueError(f"unknown engine-core message {op!r}")
        return True

    def _call(self, name: str, args: tuple[Any, ...]) -> Any:
        engine = self.engine
        if name == "metrics_snapshot":
            return engine.metrics_history.snapshot()
        return getattr(engine, name)(*args)


# ----------------------------------------------------------------------------- front end
class _RemoteHistory:
    """`engine.metrics_history` of a core process: `snapshot()` asks the core."""

    def __init__(self, engine: CoreProcessEngine) -> None:
        self._engine = weakref.proxy(engine)

    def snapshot(self) -> dict[str, Any]:
        """The core's metrics history (see MetricsHistory.snapshot)."""
        return self._engine._call("metrics_snapshot")


class _Source:
    """What the front end knows of the loaded model (LoadedModel's `source`, `spec`,
    `tokenizer`); the weights stay in the core process."""

    def __init__(self, spec: Any, tokenizer: Any, source: str,
                 generation_config: dict[str, Any] | None = None) -> None:
        self.spec, self.tokenizer, self.source = spec, tokenizer, source
        self.generation_config = generation_config or {}


def _stop_core(proc: Any, conn: Any, timeout: float = 30.0) -> None:
    """Ask the core process to stop, then make sure it has (terminate, kill)."""
    try:
        conn.send_bytes(pickle.dumps(("shutdown",)))
    except (OSError, ValueError):
        pass
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    try:
        conn.close()
    except OSError:
        pass


class CoreProcessEngine(RequestFrontend):
    """LLMEngine's API with the engine core in a child process (see the module docstring).

    `loader`: a picklable function returning the LoadedModel, called in the core process
    (instead of loading `args.model`); for benchmarks and tests of made-up models.
    """

    def __init__(self, args: EngineArgs, loader: Callable[[], Any] | None = None,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        early = args.create_engine_config(model_max_len=2**31 - 1)  # validated before spawning
        if early.parallel.nnodes > 1:
            raise ValueError("engine_core_process: not supported with nnodes > 1 (process 0 "
                             "already coordinates the others from its engine loop)")
        if early.model.runner == "pooling":
            raise ValueError("engine_core_process: runner 'pooling' runs its engine core in "
                             "process in this version")
        ctx = multiprocessing.get_context("spawn")  # a forked JAX runtime is not safe
        self._conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_core_main, name="jpaged-engine-core", daemon=True,
                                args=(child, args, loader, logging.getLogger().level))
        self.proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop_core, self.proc, self._conn)
        self._steps: collections.deque[CoreStep] = collections.deque()
        self._last_req_ids: list[str] = []  # of the latest CoreStep (see CoreStep.req_ids)
        self._seq = 0
        self._adds_sent = 0  # "add" messages sent (see CoreStep.adds_seen)
        self._asleep = False  # sleep mode: this front end put the core to sleep
        self._closed = False
        try:
            msg = self._recv(deadline=time.monotonic() + start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        if msg[0] != "ready":
            self._finalizer()
            raise CoreProcessError(f"the engine-core process failed to start: {msg}")
        info = msg[1]
        self.tokenizer, self.spec, self.config = info["tokenizer"], info["spec"], info["config"]
        self.loaded = _Source(self.spec, self.tokenizer, info["source"],
                              info["generation_config"])
        self.async_scheduling = self.config.scheduler.async_scheduling
        self.metrics_history = _RemoteHistory(self)
        self.last_core_loop_s = 0.0  # the core loop's CPU time of the step before the last
        self.kv_cache_usage = 0.0  # the KV pool's usage after the core's latest step read
        self._init_frontend(log_stats=not args.disable_log_stats)
        logger.info("engine core running in process %d", info["pid"])

    # ----------------------------------------------------------------- the pipe
    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._closed:
            raise CoreProcessError("the engine has been shut down")
        try:
            self._conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError) as e:
            raise self._died() from e

    def _died(self) -> CoreProcessError:
        self.proc.join(1)
        return CoreProcessError(f"the engine-core process exited (exit code "
                                f"{self.proc.exitcode}); the engine cannot go on")

    def _recv(self, deadline: float | None = None) -> tuple[Any, ...]:
        """The core's next message (a "fatal" one raised), waiting while it is alive."""
        if self._closed:
            raise CoreProcessError("the engine has been shut down")
        conn = self._conn
        while not conn.poll(_POLL_S):
            if not self.proc.is_alive() and not conn.poll(0):
                raise self._died()
            if deadline is not None and time.monotonic() > deadline:
                raise CoreProcessError("the engine-core process did not answer in time")
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise self._died() from e
        if msg[0] == "fatal":
            self._closed = True
            self._finalizer()
            if msg[2] is not None:  # bad input found while starting (a model path, a flag)
                raise msg[2]
            raise CoreProcessError(f"engine-core process failed: {msg[1]}")
        return msg

    def _call(self, name: str, *args: Any) -> Any:
        """Run an engine method in the core between two steps; its steps meanwhile queue."""
        self._seq += 1
        seq = self._seq
        self._send(("call", seq, name, args))
        while True:
            msg = self._recv()
            if msg[0] == "step":
                self._steps.append(msg[1])
            elif msg[0] == "reply" and msg[1] == seq:
                if not msg[2]:
                    raise ValueError(msg[3])
                return msg[3]

    # ----------------------------------------------------------------- requests
    def _submit(self, requests: list[Request]) -> None:
        from jpaged.core.request_fit import check_request_fits

        sc, cc = self.config.scheduler, self.config.cache
        for req in requests:
            if req.request_id in self._child_of:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            check_request_fits(req, sc.max_model_len, cc.block_size, cc.num_gpu_blocks)
        self._adds_sent += 1
        for req in requests:  # the front end's copy: which add carried it (CoreStep.adds_seen)
            req.core_add_seq = self._adds_sent
        self._send(("add", requests))

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            entry = self._child_of.get(rid)
            if entry is not None:
                entry[1].request.status = status  # the front end's copy; the core's below
        if request_ids:
            self._send(("abort", request_ids, status.name))

    def has_unfinished_requests(self) -> bool:
        """True while any request is not finished (the core may still be running one the
        front end has stopped: its abort is on the way)."""
        return bool(self._groups)

    def has_pending_kv_transfers(self) -> bool:
        """Always False: a KV connector is refused with an engine-core process."""
        return False

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Outputs of the core's next step (waits for it); see LLMEngine.step.

        With no request unfinished and no step waiting to be read it returns [] at once (the
        core has nothing to step), as the in-process engine's empty step does.
        """
        if not self._groups and not self._steps and not self._conn.poll(0):
            return []
        if self._steps:
            step = self._steps.popleft()
        else:
            while (msg := self._recv())[0] != "step":
                pass  # a late reply to a call that raised on the front end's side
            step = msg[1]
        self._send(("ack", 1))  # the core may run one more step ahead
        if step.req_ids is None:
            step.req_ids = self._last_req_ids
        else:
            self._last_req_ids = step.req_ids
        self.last_core_loop_s = step.loop_s
        self.kv_cache_usage = step.kv_cache_usage
        child_of = self._child_of
        seen = step.adds_seen

        def live(rid: str) -> Any:
            """The child whose request this step's row of `rid` is: None when aborted, ended
            by a stop string (the core learns it later), or added again under the same id
            after the core computed this step (the row was the old request's)."""
            entry = child_of.get(rid)
            if entry is None or entry[1].request.core_add_seq > seen:
                return None
            return entry

        updated: list[Request] = []  # the front end's copy of each updated sequence
        rows: list[int] = []
        tokens = step.token_ids
        for i, rid in enumerate(step.req_ids):
            entry = live(rid)
            if entry is None or entry[1].finish_reason is not None:
                continue  # aborted, or ended by a stop string: the core learns it later
            req = entry[1].request
            req.append_output_token(tokens[i])
            updated.append(req)
            rows.append(i)
        if step.finished or step.num_cached or step.prompt_logprobs:
            names = step.req_ids
            for i, status, stop_reason in step.finished:
                entry = live(names[i])
                if entry is not None and entry[1].finish_reason is None:
                    entry[1].request.status = RequestStatus[status]
                    entry[1].request.stop_reason = stop_reason
            for i, n in step.num_cached:
                entry = live(names[i])
                if entry is not None:
                    entry[1].request.num_cached_tokens = n
            for i, plp in step.prompt_logprobs:
                entry = live(names[i])
                if entry is not None:
                    entry[1].request.prompt_logprob_rows = plp
        outputs = self._outputs(updated, rows, tokens, step.logprobs, step)
        if step.failures:  # ended by the core (never queued there): finish_reason "error"
            failed = [(rid, why) for rid, why in step.failures if live(rid) is not None]
            outputs = self._failed_outputs(failed) + outputs
        return outputs

    # ----------------------------------------------------------------- core state
    def get_metrics(self) -> dict[str, Any]:
        """The core's scheduler and cache gauges plus the front end's request counters."""
        m = dict(self._call("get_metrics"))
        m.update(self.front_metrics())
        return m

    def cache_state(self) -> dict[str, Any]:
        """The core's KV pool and block tables (see LLM.cache_state)."""
        return self._user_request_ids(self._call("cache_state"))

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode, in the core process (EngineCore.sleep)."""
        freed = self._call("sleep", level)
        self._asleep = True
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the core's device memory back ("weights", "kv_cache", or both)."""
        self._call("wake_up", tags)
        self._asleep = self._call("is_sleeping")

    def is_sleeping(self) -> bool:
        """True while the core sleeps (known here: only this front end puts it to sleep)."""
        return self._asleep

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses; False if some are in use."""
        return self._call("reset_prefix_cache")

    def cached_block_hashes(self) -> dict[str, set[bytes]]:
        """The block hashes each tier holds now ("GPU", "CPU", "DISK")."""
        return self._call("cached_block_hashes")

    def warmup_decode(self) -> None:
        """Compile every decode step shape in the core (benchmarks time no compiles)."""
        self._call("warmup_decode")

    def subscribe_kv_events(self, fn: Callable[[KVEventBatch], None]) -> Callable[[], None]:
        """Refused: the events are made in the core process; use the ZMQ publisher."""
        raise ValueError("subscribe_kv_events: with engine_core_process the KV cache events are "
                         "made in the engine-core process; subscribe to its ZMQ publisher "
                         "(kv_events_config={'enable_kv_cache_events': True, 'publisher': "
                         "'zmq', 'endpoint': ...}) instead")

    def shutdown(self) -> None:
        """Stop the engine-core process (idempotent)."""
        self._closed = True
        self._finalizer()


def create_engine(args: EngineArgs, loaded: Any = None) -> Any:
    """The engine `args` ask for: an LLMEngine, or a CoreProcessEngine when
    `args.engine_core_process` (which loads the model in its core process, not from `loaded`)."""
    if not isinstance(args.engine_core_process, bool):
        raise ValueError(f"EngineArgs.engine_core_process must be True or False, got "
                         f"{args.engine_core_process!r}")
    if args.engine_core_process:
        if loaded is not None:
            raise ValueError("engine_core_process: the core process loads the model itself; "
                             "pass model= (not an already loaded model)")
        return CoreProcessEngine(args)
    from jpaged.engine import LLMEngine

    return LLMEngine(args, loaded=loaded)
