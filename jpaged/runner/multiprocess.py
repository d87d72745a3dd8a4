"""One model over several processes: JAX's multi-controller runtime plus process 0's step batches.

Every process runs `jax.distributed.initialize` before touching a device; the mesh then spans
every process's devices and each process places only its own parameter slices and KV heads.
Process 0 alone owns the scheduler, block tables and prefix cache. For every device program it
launches (a step, a warm-up step) it first sends the other processes the same call over a ZMQ
channel (a small msgpack header: op, bucket shape, flags; then the two step buffers), so all of
them run the same executable on the same inputs, as multi-controller JAX requires. The others
loop on "receive, launch" until process 0 says stop (jpaged/multiprocess_worker.py: that loop
builds an engine, so it stands above the engine; this module holds only what the engine and
that loop share: the group, the step channel, the step's wire format).

Ports: the JAX coordinator listens on master_port (process 0), the step channel on
master_port + 1 (process 0).

Faults, with `timeout_s` = distributed_timeout_s (default 120 s):
- a process that never joins: process 0 raises ProcessGroupError after timeout_s naming the
  ranks that never said hello on the step channel (checked before JAX starts, since JAX's own
  start-up aborts a process it cannot register); the others raise it after timeout_s without
  process 0's welcome;
- a process that dies mid-run: the next step's collective fails at once on the others (the
  peer's socket is gone); process 0 raises ProcessGroupError from that step. Whether or not a
  step runs, process 0 sees the step channel's connection drop and ends itself (exit_soon);
  the others raise ProcessGroupError when process 0's connection drops. JAX runs recoverable,
  so its coordination service does not abort the survivors first (though a process that loses
  process 0, which hosts that service, may still be aborted by JAX's client);
- mismatched flags or models: process 0 compares every process's fingerprint at start-up and
  refuses, naming the first field that differs and the two values.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

logger = logging.getLogger("jpaged")

if TYPE_CHECKING:
    from jpaged.config import EngineArgs
    from jpaged.runner.batch import FlatStep
    from jpaged.runner.sampler import SamplingFlags

CHANNEL_PORT_OFFSET = 1  # the step channel listens on master_port + this
# EngineArgs fields allowed to differ between processes: who this process is, and what only
# process 0 uses (its scheduler, cache bookkeeping and logs; it sends the pool size itself).
_LOCAL_FIELDS = ("node_rank", "extra", "disable_log_stats", "kv_events_config",
                 "scheduling_policy", "enable_prefix_caching", "prefix_caching_hash_algo",
                 "preemption_mode", "long_prefill_token_threshold", "async_scheduling",
                 "gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override",
                 "structured_outputs_config")


class ProcessGroupError(RuntimeError):
    """A process of a multi-process mesh failed, never joined or left: the run cannot go on."""


def rss_bytes() -> int:
    """This process's resident memory now (Linux; 0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux's VmHWM: unlike getrusage's
    ru_maxrss, not inherited from the parent across fork and exec; 0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        pass
    return 0


def model_identity(model: str | None) -> dict[str, Any]:
    """What a process will load: the model name and, for local files, their names and sizes
    (cheap to compare; a different checkpoint under the same path shows in its sizes)."""
    from models.loader import DEFAULT_MODEL, embedded_gguf_path

    if model is None or model == DEFAULT_MODEL:
        path: Path | None = embedded_gguf_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            return {"model": model}
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    root = path if path.is_dir() else path.parent
    return {"model": model or DEFAULT_MODEL,
            "files": {str(p.relative_to(root)): p.stat().st_size for p in files}}


def fingerprint(args: EngineArgs) -> dict[str, Any]:
    """Every engine argument a process must share with process 0, plus its model's identity."""
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
           if f.name not in _LOCAL_FIELDS}
    out["model_identity"] = model_identity(args.model)
    return out


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """'field: A != B' for the first field that differs, else None."""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                inner = first_difference(a, b)
                return f"{key}.{inner}" if inner else f"{key}: {a!r} != {b!r}"
            return f"{key}: {a!r} (process 0) != {b!r}"
    return None


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int,
               timeout_s: float) -> None:
    """jax.distributed.initialize for this process (CPU: collectives over gloo); call before any
    device use. Raises ProcessGroupError when the coordinator cannot be reached in time."""
    import jax

    if jax.distributed.is_initialized():
        return
    # Only the CPU client reads this; on a GPU the collectives are NCCL's.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A dead process must not make JAX's coordination service abort the others at a moment
    # of its choosing: the failed step raises on process 0, which ends the run itself (the
    # module's faults).
    jax.config.update("jax_enable_recoverability", True)
    t = max(1, int(timeout_s))
    try:
        jax.distributed.initialize(f"{master_addr}:{master_port}", nnodes, node_rank,
                                   initialization_timeout=t, heartbeat_timeout_seconds=t)
        # Every process starts its backend now, together: a backend's start-up exchanges
        # device topologies with all the others (process 0 would wait for them otherwise).
        jax.devices()
    except Exception as e:
        raise ProcessGroupError(
            f"process {node_rank} of {nnodes} could not join the JAX coordinator at "
            f"{master_addr}:{master_port} within {t} s ({type(e).__name__}: {e}); start every "
            "process with the same --nnodes/--master-addr/--master-port") from e


class StepChannel:
    """Process 0's ROUTER socket to the other processes' DEALERs: hello, refuse, steps, stop."""

    def __init__(self, nnodes: int, node_rank: int, master_addr: str, master_port: int,
                 timeout_s: float) -> None:
        import zmq

        self.nnodes, self.rank, self.timeout_s = nnodes, node_rank, timeout_s
        self._ctx = zmq.Context()
        endpoint = f"tcp://{master_addr}:{master_port + CHANNEL_PORT_OFFSET}"
        if node_rank == 0:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
            self._sock.bind(endpoint)
        else:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.IDENTITY, str(node_rank).encode())
            self._sock.connect(endpoint)
        # Unsent messages are kept at most 1 s at close (a refusal must still go out).
        self._sock.setsockopt(zmq.LINGER, 1000)
        self.endpoint = endpoint
        self._monitor: Any = None  # PAIR socket of disconnect events, once watched
        self._watcher: Any = None  # process 0's thread reading it
        self._closing = False

    # -- start-up -------------------------------------------------------------------------------
    def gather_hellos(self, mine: dict[str, Any]) -> None:
        """Process 0: wait for every other process's fingerprint; refuse any that differs."""
        import zmq

        deadline = time.monotonic() + self.timeout_s
        seen: dict[int, dict[str, Any]] = {}
        while len(seen) < self.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000), zmq.POLLIN):
                missing = sorted(set(range(1, self.nnodes)) - set(seen))
                raise ProcessGroupError(
                    f"process(es) {missing} never said hello on {self.endpoint} within "
                    f"{self.timeout_s:.0f} s")
            ident, raw = self._sock.recv_multipart()
            seen[int(ident)] = msgpack.unpackb(raw)
        problems = {r: d for r, fp in seen.items() if (d := first_difference(mine, fp))}
        for r in seen:
            reply = ({"op": "refuse", "reason": self._refusal(problems)} if problems else
                     {"op": "welcome"})
            self._sock.send_multipart([str(r).encode(), msgpack.packb(reply)])
        if problems:
            raise ValueError(self._refusal(problems))

    @staticmethod
    def _refusal(problems: dict[int, str]) -> str:
        return "the processes disagree on their settings: " + "; ".join(
            f"process {r} differs from process 0 in {d}" for r, d in sorted(problems.items()))

    def hello(self, mine: dict[str, Any]) -> None:
        """Another process: send the fingerprint, wait for process 0's welcome or refusal."""
        self._sock.send(msgpack.packb(mine, default=str))
        reply = self._recv_header(self.timeout_s, "welcome from process 0")
        if reply["op"] == "refuse":
            raise ValueError(reply["reason"])

    # -- steps ----------------------------------------------------------------------------------
    def send(self, header: dict[str, Any], *buffers: np.ndarray) -> None:
        """Process 0: the same message to every other process, in rank order."""
        import zmq

        frames = [msgpack.packb(header), *(np.ascontiguousarray(b) for b in buffers)]
        for r in range(1, self.nnodes):
            try:
                self._sock.send_multipart([str(r).encode(), *frames], copy=False)
            except zmq.ZMQError as e:  # ROUTER_MANDATORY: that peer is gone
                raise ProcessGroupError(f"process {r} is gone (its step channel closed: "
                                        f"{e})") from e

    def recv(self) -> tuple[dict[str, Any], list[bytes]]:
        """Another process: the next message from process 0; ProcessGroupError as soon as the
        connection to process 0 drops (it died) with nothing left to read."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        if self._monitor is None:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._sock in ready:  # what process 0 sent before it went is still read
                header, *buffers = self._sock.recv_multipart()
                return msgpack.unpackb(header), buffers
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                raise ProcessGroupError(f"process {self.rank}: process 0 is gone (the step "
                                        f"channel {self.endpoint} closed); the run cannot "
                                        "continue")

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Process 0: call `on_lost` (on a daemon thread) when another process's connection
        drops before `close`: it died, even while no step runs."""
        import threading

        import zmq
        from zmq.utils.monitor import recv_monitor_message

        self._monitor = monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

        def run() -> None:
            try:
                while True:
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_MONITOR_STOPPED:  # close() was called
                        return
                    if event == zmq.EVENT_DISCONNECTED and not self._closing:
                        on_lost()
                        return
            finally:
                monitor.close(linger=0)

        self._watcher = threading.Thread(target=run, name="jpaged-step-channel-watch",
                                         daemon=True)
        self._watcher.start()

    def expect_disconnects(self) -> None:
        """From here on a process's connection dropping is its orderly exit, not a death."""
        self._closing = True

    def bye(self) -> None:
        """Another process: tell process 0 this process has left the JAX runtime."""
        self._sock.send(msgpack.packb({"op": "bye"}))

    def gather_byes(self, timeout_s: float) -> None:
        """Process 0: wait until every other process said bye, at most `timeout_s` (a process
        that died says nothing; the wait then just ends)."""
        import zmq

        start = time.monotonic()
        deadline = start + timeout_s
        left_ranks = set(range(1, self.nnodes))
        while left_ranks:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000), zmq.POLLIN):
                logger.warning("process(es) %s did not say bye within %.0f s of the stop",
                               sorted(left_ranks), timeout_s)
                return
            ident, *frames = self._sock.recv_multipart()
            if frames and msgpack.unpackb(frames[0]).get("op") == "bye":
                left_ranks.discard(int(ident))
        logger.info("process 0: the other processes left the JAX runtime in %.2f s",
                    time.monotonic() - start)

    def _recv_header(self, timeout_s: float, what: str) -> dict[str, Any]:
        import zmq

        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise ProcessGroupError(f"process {self.rank}: no {what} on {self.endpoint} "
                                    f"within {timeout_s:.0f} s")
        return msgpack.unpackb(self._sock.recv_multipart()[0])

    def close(self) -> None:
        """Close the socket and its context (a disconnect from here on is expected)."""
        self.expect_disconnects()
        if self._monitor is not None:
            self._sock.disable_monitor()  # the watcher reads MONITOR_STOPPED and closes it
            if self._watcher is not None:
                self._watcher.join(timeout=1.0)
            else:
                self._monitor.close(linger=0)
        self._sock.close()
        if self._watcher is None or not self._watcher.is_alive():  # else term() would wait
            self._ctx.term()


class ProcessGroup:
    """This process's place in a multi-process mesh: rank, the JAX runtime, the step channel."""

    def __init__(self, args: EngineArgs) -> None:
        self.nnodes, self.rank = args.nnodes, args.node_rank
        self.timeout_s = args.distributed_timeout_s
        self._stopped = False
        # The channel's handshake first: a missing process or a mismatch is our clear error
        # within timeout_s (JAX's own start-up aborts the process instead); then JAX.
        self.channel = StepChannel(args.nnodes, args.node_rank, args.master_addr,
                                   args.master_port, self.timeout_s)
        mine = fingerprint(args)
        try:
            if self.is_leader:
                self.channel.gather_hellos(msgpack.unpackb(msgpack.packb(mine, default=str)))
            else:
                self.channel.hello(mine)
        except BaseException:
            self.channel.close()
            raise
        initialize(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                   self.timeout_s)
        if self.is_leader:  # a process that dies while nothing runs still ends the run
            self.channel.watch(lambda: exit_soon(ProcessGroupError(
                "a process of the mesh is gone (its step channel to process 0 closed); the "
                "run cannot continue")))

    @property
    def is_leader(self) -> bool:
        """True on process 0 (scheduler, requests, outputs)."""
        return self.rank == 0

    def send_config(self, num_blocks: int) -> None:
        """Process 0: the pool size it settled on (every process must allocate the same)."""
        self.channel.send({"op": "config", "num_blocks": num_blocks})

    def recv_config(self) -> int:
        """Another process: process 0's pool size."""
        header, _ = self.channel.recv()
        if header["op"] != "config":
            raise ProcessGroupError(f"expected the pool size from process 0, got {header}")
        return int(header["num_blocks"])

    def announce_step(self, flat: FlatStep, flags: SamplingFlags, calc_scales: bool,
                      scratch: bool) -> None:
        """Process 0: tell the others to launch this step (before launching it here)."""
        self.channel.send({"op": "step", "shape": [flat.num_tokens, flat.num_seqs,
                                                   flat.max_blocks, flat.history_len,
                                                   flat.bias_len, flat.mask_words,
                                                   flat.plp_len, flat.num_rows],
                           "flags": dataclasses.asdict(flags), "calc": calc_scales,
                           "scratch": scratch}, flat.ints, flat.floats)

    def failed(self, e: BaseException) -> ProcessGroupError:
        """The error process 0 raises when a step failed across processes."""
        return ProcessGroupError(
            f"a multi-process step failed: another process died or left the mesh "
            f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); the run cannot continue")

    def stop(self) -> None:
        """Process 0: tell the others to exit their loops and wait (bounded) until each has left
        the JAX runtime; the others: leave it, then say so. Once; closes the channel.

        Process 0 hosts JAX's coordination service: were it to exit while another process
        still shuts its JAX client down, that process's shutdown call would find no service and
        abort the process (status -6). So the others leave first and process 0 waits for them."""
        if self._stopped:
            return
        self._stopped = True
        if self.is_leader:
            self.channel.expect_disconnects()  # the others close their ends after their bye
            try:
                self.channel.send({"op": "stop"})
                self.channel.gather_byes(min(self.timeout_s, BYE_TIMEOUT_S))
            except ProcessGroupError:
                pass  # a gone process needs no stop and says no goodbye
        else:
            import jax

            jax.distributed.shutdown()
            self.channel.bye()
        self.channel.close()


# Longest process 0 waits at stop for the others to leave the JAX runtime.
BYE_TIMEOUT_S = 30.0

# Seconds a server on process 0 of a broken mesh keeps running so clients get their errors.
EXIT_GRACE_S = 2.0


def exit_now(error: BaseException) -> None:
    """Print `error` and end this process with status 1 at once: after a multi-process
    failure JAX's own shutdown at exit would wait on the process that is gone, then abort."""
    import sys

    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def exit_soon(error: BaseException, grace_s: float = EXIT_GRACE_S) -> None:
    """exit_now after `grace_s` (process 0 of a broken mesh, serving: clients get errors)."""
    import threading

    threading.Timer(grace_s, exit_now, (error,)).start()


def decode_step(header: dict[str, Any], buffers: list[bytes]) -> tuple[FlatStep, SamplingFlags]:
    """The step process 0 announced: its FlatStep and flags."""
    from jpaged.runner.batch import FlatStep
    from jpaged.runner.sampler import SamplingFlags

    t, b, m, h, k, w, p, r = header["shape"]
    ints = np.frombuffer(buffers[0], np.int32)
    floats = np.frombuffer(buffers[1], np.float32)
    return (FlatStep(ints, floats, t, b, m, h, bias_len=k, mask_words=w, plp_len=p,
                     num_rows=r),
            SamplingFlags(**header["flags"]))
