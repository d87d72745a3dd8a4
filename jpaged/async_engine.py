"""AsyncLLMEngine: one background thread steps an LLMEngine; asyncio callers stream its outputs.

Invariants:
- Only the loop thread touches the LLMEngine (add, abort, step, get_metrics); callers talk to it
  through a command list guarded by a Condition, so any thread or event loop may submit or abort.
- Outputs reach a caller's asyncio.Queue through `loop.call_soon_threadsafe`; a queue item is a
  RequestOutput (a pooling engine's: a PoolingRequestOutput) or an exception (the request
  failed). A request's last item is either a finished output (finish_reason "abort", or a
  pooling output without a vector, after an abort) or an exception.
- An exception from `LLMEngine.step` fails the requests in flight and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from jpaged.config import EngineArgs
from jpaged.core_client import create_engine
from jpaged.engine import LLMEngine, PromptType
from jpaged.lora_request import LoRARequest
from jpaged.outputs import PoolingRequestOutput, RequestOutput
from jpaged.pooling_params import PoolerConfig, PoolingParams
from jpaged.runner.multiprocess import ProcessGroupError, exit_soon
from jpaged.sampling_params import SamplingParams

logger = logging.getLogger("jpaged.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or crashed beyond recovery)."""


class RequestFailedError(RuntimeError):
    """The engine raised while this request was in flight; the request was aborted."""


@dataclass
class _Sink:
    """Where one request's outputs go: an asyncio queue owned by `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    sink: _Sink
    done: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Call:
    """A call of an engine method on the loop thread, between two steps (sleep mode)."""

    fn: Any
    done: concurrent.futures.Future


@dataclass
class _Abort:
    request_ids: list[str]


class AsyncLLMEngine:
    """Runs an LLMEngine on a background thread and streams outputs to asyncio callers."""

    def __init__(self, engine: LLMEngine, start: bool = True) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._cmds: list[_Add | _Abort] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._idle = True  # guarded by _cond: no command pending and the engine has no work
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._dead: BaseException | None = None
        self._metrics: dict[str, Any] = self._snapshot()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        """Build an engine from EngineArgs and start its loop."""
        return cls(create_engine(args))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.engine.tokenizer

    @property
    def model_source(self) -> str:
        """Where the model was loaded from (a .gguf file or a directory)."""
        return self.engine.loaded.source

    @property
    def max_model_len(self) -> int:
        """The engine's context limit."""
        return self.engine.config.scheduler.max_model_len

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a request (unless ignore_eos)."""
        return self.engine.eos_token_ids

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The sampling defaults of a request that leaves them unset (generation_config)."""
        return self.engine.default_sampling

    @property
    def pooler(self) -> PoolerConfig | None:
        """How a pooling engine (runner "pooling") pools prompts; None for a generating one."""
        return getattr(self.engine, "pooler", None)

    @property
    def labels(self) -> tuple[str, ...]:
        """A sequence classifier's label names (ModelSpec.labels); () for any other model."""
        return tuple(getattr(getattr(self.engine, "spec", None), "labels", ()))

    @property
    def spec(self) -> Any:
        """The model's ModelSpec."""
        return self.engine.spec

    @property
    def logprobs_limit(self) -> int:
        """The most logprobs a request may ask for (max_logprobs; -1: the vocabulary)."""
        return self.engine.logprobs_limit

    def health(self) -> tuple[bool, dict[str, Any] | None]:
        """(healthy, details) for /health: the loop runs; no details for one engine."""
        return self.is_running, None

    def metrics_registry(self) -> Any:
        """A prometheus registry of this engine's metrics and timing histograms."""
        from jpaged.metrics import build_registry

        return build_registry(self.get_metrics, self.engine.stat_logger)

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and accepting requests."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        """Why the loop stopped unexpectedly (None while healthy or after a clean shutdown)."""
        return self._dead

    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is None:  # never started: fail what was submitted
            with self._cond:
                cmds, self._cmds = self._cmds, []
            self._close(cmds)
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.engine.shutdown()  # the KV event publisher, if any

    # ------------------------------------------------------------------------ caller side
    def _submit(self, cmd: _Add | _Abort) -> None:
        with self._cond:
            if self._stopping or self._dead is not None:
                raise EngineDeadError("the engine loop is not running") from self._dead
            self._cmds.append(cmd)
            self._idle = False
            self._cond.notify_all()

    async def add_request(self, request_id: str, prompt: PromptType,
                          params: SamplingParams | PoolingParams, priority: int = 0,
                          queue: asyncio.Queue | None = None,
                          lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its outputs arrive on.

        Raises what `LLMEngine.add_request` raises (ValueError for bad input). Several requests
        may share one `queue`; items carry their `request_id`. `lora_request`: the LoRA
        adapter it runs with (read on an executor thread the first time). A pooling engine
        takes PoolingParams: its request's one item is a PoolingRequestOutput.
        """
        queue = asyncio.Queue() if queue is None else queue
        if getattr(params, "structured_outputs", None) is not None:
            # Compiled here, on an executor thread, so the engine loop only copies the cached
            # matcher; a grammar that does not compile raises its ValueError here.
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.grammar_compiler.compile, params.structured_outputs)
        if lora_request is not None:  # read off the engine loop; a bad adapter raises here
            await asyncio.get_running_loop().run_in_executor(
                None, self.engine.check_lora, lora_request)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params, priority,
                          _Sink(asyncio.get_running_loop(), queue), done, lora_request))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # It may be added after all: then abort it, but only then (a refused id is
            # another request's, which must go on).
            done.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or self.abort(request_id))
            raise
        return queue

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter as a request's would be (ValueError or
        FileNotFoundError naming the problem); thread-safe."""
        self.engine.check_lora(lora_request)

    def lora_id_for(self, name: str) -> int:
        """Adapter `name`'s lora_int_id in this engine, or one no adapter has."""
        return self.engine.lora_id_for(name)

    def drop_lora(self, name: str) -> bool:
        """Drop LoRA adapter `name`'s host copy (requests running with it go on)."""
        return self.engine.drop_lora(name)

    # vLLM's AsyncLLM adapter calls (the adapter is read on an executor thread).
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.add_lora,
                                                         lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        """Drop the host copy of the adapter with this lora_int_id."""
        return self.engine.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters held on the host."""
        return self.engine.list_loras()

    async def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter with this lora_int_id on the host."""
        return self.engine.pin_lora(lora_id)

    async def _on_loop(self, fn: Any) -> Any:
        """fn() run on the engine loop's thread between two steps; its result."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, done))
        return await asyncio.wrap_future(done)

    async def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode, between two steps of the loop (LLMEngine.sleep)."""
        return await self._on_loop(lambda: self.engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back (LLMEngine.wake_up)."""
        await self._on_loop(lambda: self.engine.wake_up(tags))

    def is_sleeping(self) -> bool:
        """True while the engine sleeps."""
        return self.engine.is_sleeping()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | PoolingParams,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Stream one request's outputs (vLLM's AsyncLLM.generate); leaving the loop early
        aborts the request."""
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        queue = await self.add_request(rid, prompt, sampling_params, priority,
                                       lora_request=lora_request)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling engine's output of one prompt (vLLM's AsyncLLM.encode): one finished
        PoolingRequestOutput, its vector in `outputs.data`; leaving early aborts it."""
        rid = request_id if request_id is not None else f"pool-{uuid.uuid4().hex}"
        params = pooling_params if pooling_params is not None else PoolingParams()
        # Closed at once when the caller leaves early (the request is aborted then).
        async with contextlib.aclosing(self.generate(prompt, params, rid, priority,
                                                     lora_request)) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests from any thread; their KV blocks are freed on the loop thread."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not ids:
            return
        try:
            self._submit(_Abort(ids))
        except EngineDeadError:
            pass  # nothing runs any more

    def get_metrics(self) -> dict[str, Any]:
        """The engine's metrics as of the end of the latest loop iteration."""
        return dict(self._metrics)

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until no command is pending and the engine has no work; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._idle or self._stopping, timeout)

    # ------------------------------------------------------------------------ loop thread
    def _snapshot(self) -> dict[str, Any]:
        m = dict(self.engine.get_metrics())
        m["num_unfinished_requests"] = self.engine.get_num_unfinished_requests()
        return m

    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    while not self._cmds and not self._stopping and not busy:
                        self._idle = True
                        self._cond.notify_all()
                        self._cond.wait()
                    if self._stopping:
                        break
                    cmds, self._cmds = self._cmds, []
                for cmd in cmds:
                    self._apply(cmd)
                if self.engine.has_unfinished_requests() or \
                        self.engine.has_pending_kv_transfers():
                    self._step()
                busy = (self.engine.has_unfinished_requests()
                        or self.engine.has_pending_kv_transfers())
                self._metrics = self._snapshot()
        except BaseException as e:  # a bug in this loop: stop accepting work, fail everyone
            logger.exception("engine loop crashed")
            self._dead = e
        finally:
            with self._cond:
                self._stopping = True
                cmds, self._cmds = self._cmds, []
                self._cond.notify_all()
            self._close(cmds)

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Call):
            if cmd.done.set_running_or_notify_cancel():
                try:
                    cmd.done.set_result(cmd.fn())
                except Exception as e:  # noqa: BLE001 - the caller gets it; the loop goes on
                    cmd.done.set_exception(e)
            return
        if isinstance(cmd, _Abort):
            # Each aborted request's stream ends with its last output (finish_reason
            # "abort", the tokens it had), as vLLM's: a reader in another task is not left
            # waiting.
            for out in self.engine.abort_request(cmd.request_ids) or ():
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink.put(out)
            for rid in cmd.request_ids:
                self._sinks.pop(rid, None)
            return
        # From here the caller can no longer cancel the add (a cancelled caller's callback
        # aborts it once added). Checking cancelled() instead left a window: a cancel between
        # the check and set_result made set_result raise InvalidStateError, which stopped this
        # loop with the request added and never aborted.
        if not cmd.done.set_running_or_notify_cancel():
            return
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    priority=cmd.priority, lora_request=cmd.lora_request)
        except Exception as e:
            cmd.done.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.done.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ProcessGroupError as e:  # the mesh is broken: nothing can run any more
            logger.error("%s", e)
            self._fail_all(RequestFailedError(str(e)))
            exit_soon(e)
            raise EngineDeadError(str(e)) from e
        except Exception as e:
            logger.exception("engine step failed; failing %d request(s)", len(self._sinks))
            self._fail_all(RequestFailedError(f"the engine failed: {type(e).__name__}: {e}"))
            if self.engine.has_unfinished_requests():
                raise EngineDeadError("the engine cannot recover after a failed step") from e
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if isinstance(out, PoolingRequestOutput):
                if out.outputs is None:  # the engine failed it (an abort's output is abort's)
                    sink.put(RequestFailedError(out.error or "the request has no vector"))
                else:
                    sink.put(out)
            elif out.finished and out.outputs and out.outputs[0].finish_reason == "error":
                sink.put(RequestFailedError(str(out.outputs[0].stop_reason)))
            else:
                sink.put(out)
            if out.finished:
                del self._sinks[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        sinks, self._sinks = self._sinks, {}
        try:
            self.engine.abort_request(list(sinks))
        except Exception:
            logger.exception("abort after a failed step raised")
        for sink in sinks.values():
            sink.put(error)

    def _close(self, pending: list[_Add | _Abort | _Call]) -> None:
        error = EngineDeadError("the engine loop stopped")
        for cmd in pending:  # adds and calls still queued: their callers learn it now
            if isinstance(cmd, _Add | _Call) and not cmd.done.done():
                cmd.done.set_exception(error)
        self._fail_all(error)
        try:
            self._metrics = self._snapshot()
        except Exception:
            pass
