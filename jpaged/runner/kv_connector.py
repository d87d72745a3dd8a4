"""The worker side of a KV connector: pages move between engines' device pools.

`JaxTransferWorker` moves pages with `jax.experimental.transfer`. A producer binds a control
socket (ZMQ ROUTER on ``kv_ip:kv_port``) and a transfer server; a consumer opens a REQ socket
per pull and a transfer server of its own to pull with:

```
consumer (pull thread)                          producer
  ["hello", identity] ───────────────────────►  control thread: compare model, block size,
                      ◄──── ["ok", {address}]   KV dtype, layers, heads (both values named
                                                 on a mismatch)
  ["pull", request, block ids, uuid] ────────►  queued; the engine thread (get_finished)
                                                 checks the request is held and owns the
                                                 blocks, gathers them on device, await_pull
                      ◄── ["ok", shape, dtype]   and frees them (the copy is what is pulled)
  connection.pull(uuid) ◄══════ pages ═══════   transfer server
  engine thread (get_finished): scatter into the blocks allocated for them
```

Every device use (gather, scatter) runs on the engine's thread, in step order: a pool donated
to each step is never read from another thread. The pulls themselves run on a small thread pool,
so the engine keeps stepping its other requests meanwhile. Only the pages a consumer lacks are
asked for (its own prefix-cache hit comes first, see jpaged/core/kv_connector.py).

`SharedStorageWorker` is the disk tier's file store shared by engines that share a directory:
a producer writes a finished request's full prompt blocks there by hash; a consumer reads the
blocks its prefix cache lacks.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jpaged.config import KVTransferConfig
from jpaged.core.kv_connector import KVConnectorMetadata, KVConnectorOutput, LoadSpec, SendSpec
from jpaged.runner.kv_cache import KVCache
from jpaged.runner.tier_transfer import TierTransfer, gather_on_device, scatter_from_device

logger = logging.getLogger("jpaged")

__all__ = ["JaxTransferWorker", "KVConnectorWorker", "KVTransferRefused", "SharedStorageWorker",
           "kv_identity"]

# What must agree between a producer and its consumer, in the order a mismatch is reported.
IDENTITY_FIELDS = ("model", "block_size", "kv_dtype", "num_kv_layers", "num_kv_heads",
                   "head_dim", "hash_algo")
PULL_THREADS = 4


class KVTransferRefused(RuntimeError):
    """The other engine refused a handshake or a pull (the reason names what differs)."""


def kv_identity(model: str, block_size: int, kv: KVCache, hash_algo: str) -> dict[str, Any]:
    """What a producer and a consumer compare at connect."""
    layers = kv.k.shape[0] // kv.num_blocks
    return {"model": model, "block_size": block_size, "kv_dtype": jnp.dtype(kv.dtype).name,
            "num_kv_layers": layers, "num_kv_heads": int(kv.k.shape[2]),
            "head_dim": int(kv.k.shape[3]), "hash_algo": hash_algo}


def identity_mismatch(producer: dict[str, Any], consumer: dict[str, Any]) -> str | None:
    """The first field that differs, with both values (None: they agree)."""
    for f in IDENTITY_FIELDS:
        if producer.get(f) != consumer.get(f):
            return (f"KV connector refused: {f} differs between the producer "
                    f"({producer.get(f)!r}) and the consumer ({consumer.get(f)!r})")
    return None


def _pool_device(kv: KVCache) -> Any:
    devices = kv.k.sharding.device_set
    if len(devices) != 1:
        raise ValueError("kv_transfer_config: a KV connector needs a pool on one device "
                         "(tensor_parallel_size=1)")
    return next(iter(devices))


class KVConnectorWorker:
    """The worker side's interface (vLLM's names); subclasses move the pages."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.host = config.kv_ip
        self.port = config.kv_port
        self._wake = threading.Condition()
        self._ready = False  # something for get_finished to do (under _wake)
        self.stats = dict.fromkeys((
            "kv_transfer_blocks_sent_total", "kv_transfer_bytes_sent_total",
            "kv_transfer_blocks_received_total",
            "kv_transfer_bytes_received_total", "kv_transfer_requests_expired_total",
            "kv_transfer_pulls_refused_total", "kv_transfer_requests_released_total",
            "kv_transfer_load_failures_total", "kv_transfer_loads_dropped_total"), 0)
        self.stats["kv_transfer_receive_seconds_total"] = 0.0

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Start the pulls `meta` plans (they land in a later get_finished)."""
        raise NotImplementedError

    def save_kv(self, meta: KVConnectorMetadata, kv: KVCache) -> None:
        """Offer the blocks of the requests `meta` says finished (producer)."""
        raise NotImplementedError

    def get_finished(self, kv: KVCache, is_pending: Callable[[LoadSpec], bool]
                     ) -> tuple[KVCache, KVConnectorOutput]:
        """Serve queued asks, land finished pulls into `kv` (donated; returned), report."""
        raise NotImplementedError

    def wait_for_load(self, timeout: float) -> bool:
        """Block until no pull is outstanding; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.has_pending_loads():
            if not self.wait_for_work(max(0.0, deadline - time.monotonic())):
                return not self.has_pending_loads()
        return True

    def has_pending_loads(self) -> bool:
        """True while a pull started here has not been reported."""
        return False

    def has_pending(self) -> bool:
        """True while any transfer (either way) is outstanding."""
        return self.has_pending_loads()

    def _notify(self) -> None:
        with self._wake:
            self._ready = True
            self._wake.notify_all()

    def wait_for_work(self, timeout: float) -> bool:
        """Block until get_finished has something to do, at most `timeout` s (an idle engine
        waits here instead of spinning)."""
        with self._wake:
            got = self._wake.wait_for(lambda: self._ready, timeout)
            self._ready = False
            return got

    def close(self) -> None:
        """Stop threads and sockets; idempotent."""


class JaxTransferWorker(KVConnectorWorker):
    """JaxTransferConnector: control over ZMQ, pages over jax.experimental.transfer."""

    def __init__(self, config: KVTransferConfig, kv: KVCache, identity: dict[str, Any],
                 engine_id: str) -> None:
        super().__init__(config)
        import jax.experimental.transfer as jxt
        import zmq

        self.identity = identity
        self.engine_id = engine_id
        self.device = _pool_device(kv)
        ip = config.kv_ip
        self.server = jxt.start_transfer_server(self.device.client, f"{ip}:0", [f"{ip}:0"])
        self._zmq = zmq.Context()
        self._stop = threading.Event()
        # Producer: held requests by id; asks queued by the control thread for the engine's.
        self._sends: dict[str, SendSpec] = {}
        self._asks: collections.deque = collections.deque()
        self._replies: collections.deque = collections.deque()
        self._served: set[str] = set()  # answered by serve_asks, reported by get_finished
        # Consumer: pulls in flight and those done (spec, data or an exception).
        self._pool = concurrent.futures.ThreadPoolExecutor(PULL_THREADS, "jpaged-kv-pull")
        self._inflight = 0
        self._done: collections.deque = collections.deque()
        self._conns: dict[str, tuple[Any, threading.Lock]] = {}
        self._conns_lock = threading.Lock()
        self._control: threading.Thread | None = None
        if config.is_producer:
            sock = self._zmq.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                if config.kv_port == 0:
                    self.port = sock.bind_to_random_port(f"tcp://{ip}")
                else:
                    sock.bind(f"tcp://{ip}:{config.kv_port}")
            except zmq.ZMQError as e:
                sock.close()
                self.close()
                raise ValueError(f"kv_transfer_config: cannot bind the control socket on "
                                 f"{ip}:{config.kv_port}: {e}") from e
            self._control = threading.Thread(target=self._serve, args=(sock,),
                                             name="jpaged-kv-control", daemon=True)
            self._control.start()
        logger.info("KV connector %s (%s): engine %s, control %s:%s, transfer server %s",
                    config.kv_connector, config.kv_role, engine_id, ip, self.port,
                    self.server.address())

    # -- producer ------------------------------------------------------------------------------

    def _serve(self, sock: Any) -> None:
        import msgpack

        while not self._stop.is_set():
            if sock.poll(10):
                frames = sock.recv_multipart()
                ident, body = frames[0], frames[-1]
                try:
                    msg = msgpack.unpackb(body)
                    op = msg[0]
                except Exception:
                    msg, op = None, None
                if op == "hello":
                    problem = identity_mismatch(self.identity, msg[1])
                    reply = (["error", problem] if problem else
                             ["ok", {"transfer_address": self.server.address(),
                                     "engine_id": self.engine_id, "identity": self.identity}])
                    sock.send_multipart([ident, b"", msgpack.packb(reply)])
                elif op in ("pull", "release") and len(msg) > 1 and msg[1] not in self._sends:
                    # Refused here: an engine holding nothing may not be stepping to answer.
                    # (A hold is registered before its params leave the engine.)
                    self.stats["kv_transfer_pulls_refused_total"] += 1
                    sock.send_multipart([ident, b"", msgpack.packb(
                        ["error", self._not_held(msg[1])])])
                elif op in ("pull", "release"):
                    self._asks.append((ident, msg))
                    self._notify()
                else:
                    sock.send_multipart([ident, b"", msgpack.packb(
                        ["error", f"unknown KV connector message {str(msg)[:80]!r}"])])
            while self._replies:
                ident, reply = self._replies.popleft()
                sock.send_multipart([ident, b"", msgpack.packb(reply)])
        sock.close()

    def _not_held(self, rid: Any) -> str:
        return (f"request {rid!r} holds no blocks on producer {self.engine_id} (never held, "
                "already pulled, or its hold timed out)")

    def save_kv(self, meta: KVConnectorMetadata, kv: KVCache) -> None:
        """Hold the finished requests' blocks for their consumers (until pulled or deadline)."""
        for send in meta.sends:
            self._sends[send.request_id] = send

    def _answer(self, kv: KVCache, msg: list[Any], out: KVConnectorOutput) -> list[Any]:
        op, rid = msg[0], msg[1]
        send = self._sends.get(rid)
        if send is None:
            self.stats["kv_transfer_pulls_refused_total"] += 1
            return ["error", self._not_held(rid)]
        if op == "release":
            del self._sends[rid]
            out.finished_sending.add(rid)
            self.stats["kv_transfer_requests_released_total"] += 1
            return ["ok"]
        ids, uid = list(msg[2]), int(msg[3])
        foreign = sorted(set(ids) - set(send.block_ids))
        if not ids or foreign:
            self.stats["kv_transfer_pulls_refused_total"] += 1
            return ["error", f"request {rid!r} on producer {self.engine_id} does not hold "
                             f"block(s) {foreign or ids}"]
        chunks = gather_on_device(kv, ids)  # copies: the blocks may be freed now
        deadline = _datetime_in(self.config.transfer_timeout_s)
        self.server.await_pull(uid, chunks, timeout=deadline)
        del self._sends[rid]
        out.finished_sending.add(rid)
        self.stats["kv_transfer_blocks_sent_total"] += len(ids)
        self.stats["kv_transfer_bytes_sent_total"] += sum(c.nbytes for c in chunks)
        return ["ok", [list(c.shape) for c in chunks], jnp.dtype(chunks[0].dtype).name]

    # -- consumer ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Pull each planned request's pages on the pull threads; tell producers whose blocks
        this engine's prefix cache already held."""
        for spec in meta.loads:
            self._inflight += 1
            self._pool.submit(self._pull_job, spec)
        for host, port, rid in meta.releases:
            self._pool.submit(self._release_job, host, port, rid)

    def _ask(self, sock: Any, msg: list[Any], where: str) -> list[Any]:
        import msgpack

        sock.send(msgpack.packb(msg))
        if not sock.poll(int(self.config.transfer_timeout_s * 1000)):
            raise TimeoutError(f"producer {where} did not answer within "
                               f"{self.config.transfer_timeout_s:g} s")
        return msgpack.unpackb(sock.recv())

    def _socket(self, host: str, port: int) -> Any:
        import zmq

        sock = self._zmq.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        return sock

    def _connection(self, address: str) -> tuple[Any, threading.Lock]:
        with self._conns_lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = (self.server.connect(address), threading.Lock())
            return conn

    def _pull_job(self, spec: LoadSpec) -> None:
        where = f"{spec.remote_host}:{spec.remote_port}"
        sock = self._socket(spec.remote_host, spec.remote_port)
        t0 = time.perf_counter()
        try:
            hello = self._ask(sock, ["hello", self.identity], where)
            if hello[0] != "ok":
                raise KVTransferRefused(hello[1])
            problem = identity_mismatch(hello[1]["identity"], self.identity)
            if problem:
                raise KVTransferRefused(problem)
            uid = secrets.randbits(62)
            r = self._ask(sock, ["pull", spec.remote_request_id, spec.remote_block_ids, uid],
                          where)
            if r[0] != "ok":
                raise KVTransferRefused(r[1])
            dtype, where_to = jnp.dtype(r[2]), SingleDeviceSharding(self.device)
            specs = [jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=where_to)
                     for shape in r[1]]
            conn, lock = self._connection(hello[1]["transfer_address"])
            with lock:
                chunks = conn.pull(uid, specs)
            for c in chunks:
                c.block_until_ready()
            self._done.append((spec, chunks, time.perf_counter() - t0))
        except Exception as e:  # any failure is this request's: the engine goes on
            reason = str(e) if isinstance(e, KVTransferRefused | TimeoutError) else (
                f"pull from producer {where} failed: {type(e).__name__}: {e}")
            self._done.append((spec, e if isinstance(e, KVTransferRefused)
                               else RuntimeError(reason), 0.0))
        finally:
            sock.close()
            self._notify()

    def _release_job(self, host: str, port: int, rid: str) -> None:
        sock = self._socket(host, port)
        try:
            self._ask(sock, ["release", rid], f"{host}:{port}")
        except Exception as e:  # the producer frees them at its timeout anyway
            logger.info("KV connector: releasing %r on %s:%s failed: %s", rid, host, port, e)
        finally:
            sock.close()

    # -- both ----------------------------------------------------------------------------------

    def serve_asks(self, kv: KVCache, timeout: float = 0.0) -> None:
        """Answer the queued pulls (gather + await_pull) after waiting up to `timeout` s for
        one; the engine calls it while a step runs too, so a consumer need not wait for the
        step's end (its gathers queue behind that step, reading what it wrote)."""
        if timeout > 0 and not self._asks:
            self.wait_for_work(timeout)
        out = KVConnectorOutput(finished_sending=self._served)
        while self._asks:
            ident, msg = self._asks.popleft()
            try:
                reply = self._answer(kv, msg, out)
            except Exception as e:  # a malformed ask is refused, nothing else changes
                reply = ["error", f"bad KV connector request: {type(e).__name__}: {e}"]
            self._replies.append((ident, reply))

    def get_finished(self, kv: KVCache, is_pending: Callable[[LoadSpec], bool]
                     ) -> tuple[KVCache, KVConnectorOutput]:
        """Answer queued pulls (gather + await_pull), expire holds, land finished pulls."""
        self.serve_asks(kv)
        out = KVConnectorOutput(finished_sending=self._served)
        self._served = set()
        if self._sends:
            now = time.monotonic()
            for rid, send in list(self._sends.items()):
                if send.deadline <= now:
                    del self._sends[rid]
                    out.finished_sending.add(rid)
                    out.num_expired += 1
                    self.stats["kv_transfer_requests_expired_total"] += 1
                    logger.warning("KV connector: request %r was not pulled within %g s; its "
                                   "blocks are freed", rid, self.config.abort_timeout_s)
        while self._done:
            spec, data, seconds = self._done.popleft()
            self._inflight -= 1
            if not is_pending(spec):
                self.stats["kv_transfer_loads_dropped_total"] += 1  # aborted while it was pulled
                continue
            if isinstance(data, BaseException):
                out.failed_recving[spec.request_id] = str(data)
                self.stats["kv_transfer_load_failures_total"] += 1
                continue
            kv = scatter_from_device(kv, spec.local_block_ids, data)
            out.finished_recving.add(spec.request_id)
            self.stats["kv_transfer_blocks_received_total"] += len(spec.local_block_ids)
            self.stats["kv_transfer_bytes_received_total"] += sum(c.nbytes for c in data)
            self.stats["kv_transfer_receive_seconds_total"] += seconds
        return kv, out

    def has_pending_loads(self) -> bool:
        """True while a pull started here has not been reported."""
        return self._inflight > 0

    def has_pending(self) -> bool:
        """True while pulls run here or blocks are held for a consumer."""
        return self._inflight > 0 or bool(self._sends) or bool(self._asks)

    def close(self) -> None:
        """Stop the control thread and the pull threads; idempotent."""
        self._stop.set()
        if self._control is not None:
            self._control.join(timeout=5)
            self._control = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._zmq.closed:
            self._zmq.destroy(linger=0)


def _datetime_in(seconds: float) -> Any:
    import datetime

    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


class SharedStorageWorker(KVConnectorWorker):
    """SharedStorageConnector: blocks written to and read from a directory engines share."""

    def __init__(self, config: KVTransferConfig, storage: Any) -> None:
        super().__init__(config)
        self.storage = storage  # a DiskTier on kv_connector_extra_config.shared_storage_path
        self._copy = TierTransfer()
        self._saved: set[str] = set()
        self._loads: list[LoadSpec] = []

    def save_kv(self, meta: KVConnectorMetadata, kv: KVCache) -> None:
        """Write each finished request's full prompt blocks to the directory (by hash)."""
        for send in meta.sends:
            todo = [(b, h) for b, h in zip(send.block_ids, send.block_hashes, strict=False)
                    if h not in self.storage]
            if todo:
                data = self._copy.gather(kv, [b for b, _ in todo])
                for (_, h), page in zip(todo, data, strict=True):
                    self.storage.put(h, page)
                self.stats["kv_transfer_blocks_sent_total"] += len(todo)
                self.stats["kv_transfer_bytes_sent_total"] += data.nbytes
            self._saved.add(send.request_id)
        if meta.sends:
            self._notify()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Queue the reads; they land in the next get_finished, on the engine's thread."""
        self._loads.extend(meta.loads)
        if meta.loads:
            self._notify()

    def get_finished(self, kv: KVCache, is_pending: Callable[[LoadSpec], bool]
                     ) -> tuple[KVCache, KVConnectorOutput]:
        """Report saved requests; read and land the queued loads."""
        out = KVConnectorOutput(finished_sending=self._saved)
        self._saved = set()
        loads, self._loads = self._loads, []
        for spec in loads:
            if not is_pending(spec):
                continue
            t0 = time.perf_counter()
            pages = [self.storage.get(h) for h in spec.block_hashes]
            missing = sum(p is None for p in pages)
            if missing:
                out.failed_recving[spec.request_id] = (
                    f"{missing} of {len(pages)} blocks are gone from "
                    f"{self.config.kv_connector_extra_config['shared_storage_path']}")
                self.stats["kv_transfer_load_failures_total"] += 1
                continue
            data = np.stack(pages)
            kv = self._copy.scatter(kv, spec.local_block_ids, data)
            out.finished_recving.add(spec.request_id)
            self.stats["kv_transfer_blocks_received_total"] += len(pages)
            self.stats["kv_transfer_bytes_received_total"] += data.nbytes
            self.stats["kv_transfer_receive_seconds_total"] += time.perf_counter() - t0
        return kv, out

    def has_pending_loads(self) -> bool:
        """True while a read is queued."""
        return bool(self._loads)

    def has_pending(self) -> bool:
        """True while a read or a save's report is queued."""
        return bool(self._loads) or bool(self._saved)
