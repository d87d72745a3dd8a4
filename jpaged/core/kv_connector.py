"""The scheduler side of a KV connector: which blocks move between engines (vLLM V1's split).

Disaggregated prefill/decode: a *producer* engine prefills a request sent with
``kv_transfer_params={"do_remote_decode": True}``, returns its first token, and keeps the
request's blocks (``request_finished`` answers delay-free) until a *consumer* has pulled them or
``abort_timeout_s`` passes. Its output carries the params a consumer needs
(``remote_block_ids``, the producer's address and request id). The consumer gets the same
prompt with those params plus ``do_remote_prefill``: at admission it looks its own prefix cache
up first, then asks the connector (``get_num_new_matched_tokens``) for the rest, allocates
blocks for them (``update_state_after_alloc``), and waits, without taking any step's budget,
in ``WAITING_FOR_REMOTE_KVS`` while the worker side (``jpaged/runner/kv_connector.py``) pulls
exactly those pages. Once they land the scheduler commits them to the prefix cache like blocks
it computed, and the request computes its last prompt token and decodes.

What crosses from this side to the worker each step is a ``KVConnectorMetadata``
(``build_connector_meta``); what comes back is a ``KVConnectorOutput`` (``get_finished``).
Plain Python: the transport lives on the worker side.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jpaged.config import KVTransferConfig
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVConnectorScheduler", "LoadSpec",
           "SendSpec", "check_kv_transfer_params", "one_group"]

_REMOTE_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int,
                "remote_request_id": str, "remote_block_ids": list}
# Every key a request's kv_transfer_params may hold: the two roles, and what a producer's
# response hands its consumer.
_KNOWN_KEYS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_num_tokens",
                         *_REMOTE_KEYS})


@dataclass
class LoadSpec:
    """A consumer's pull: the producer's blocks `remote_block_ids` into local `local_block_ids`."""

    request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks pulled
    num_tokens: int = 0  # the request's computed tokens once the pages land


@dataclass
class SendSpec:
    """A producer's finished request whose blocks wait for their consumer until `deadline`."""

    request_id: str
    block_ids: list[int]
    deadline: float  # time.monotonic()
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class KVConnectorMetadata:
    """What the scheduler tells the worker side in one step."""

    loads: list[LoadSpec] = field(default_factory=list)
    sends: list[SendSpec] = field(default_factory=list)
    # (host, port, remote request id): a producer's blocks this engine did not need (its own
    # prefix cache held them all), released at once rather than at the producer's timeout.
    releases: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to do."""
        return not (self.loads or self.sends or self.releases)


@dataclass
class KVConnectorOutput:
    """What the worker side reports back: transfers that completed or failed."""

    finished_sending: set[str] = field(default_factory=set)  # producer: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # consumer: pages landed
    failed_recving: dict[str, str] = field(default_factory=dict)  # consumer: id -> reason
    num_expired: int = 0  # producer: holds that reached their timeout unpulled

    @property
    def is_empty(self) -> bool:
        """True when nothing completed."""
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


def check_kv_transfer_params(params: Any, config: KVTransferConfig | None, n: int = 1) -> None:
    """ValueError naming the problem if a request's kv_transfer_params cannot be honoured."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
    unknown = sorted(set(params) - _KNOWN_KEYS)
    if unknown:  # e.g. vLLM's return_last_hidden_state: refused, never dropped
        raise ValueError(f"kv_transfer_params.{unknown[0]} is not supported (known keys: "
                         f"{sorted(_KNOWN_KEYS)})")
    remote_decode = params.get("do_remote_decode", False)
    remote_prefill = params.get("do_remote_prefill", False)
    for name, v in (("do_remote_decode", remote_decode), ("do_remote_prefill", remote_prefill)):
        if not isinstance(v, bool):
            raise ValueError(f"kv_transfer_params.{name} must be true or false, got {v!r}")
    if not (remote_decode or remote_prefill):
        return
    if config is None:
        raise ValueError("kv_transfer_params asks for a remote "
                         f"{'decode' if remote_decode else 'prefill'}, but this engine has no "
                         "KV connector: start it with --kv-transfer-config")
    if remote_decode and remote_prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot "
                         "both be true")
    if n != 1:
        raise ValueError(f"kv_transfer_params needs n=1 (one sequence's KV moves), got n={n}")
    if remote_decode and not config.is_producer:
        raise ValueError(f"kv_transfer_params.do_remote_decode needs a producer engine "
                         f"(kv_role kv_producer or kv_both), this one is {config.kv_role}")
    if remote_prefill:
        if not config.is_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill needs a consumer engine "
                             f"(kv_role kv_consumer or kv_both), this one is {config.kv_role}")
        if config.kv_connector == "SharedStorageConnector":
            return  # the blocks are found by their hashes in the shared directory
        for name, typ in _REMOTE_KEYS.items():
            v = params.get(name)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a {typ.__name__} (from the "
                                 f"producer's response), got {v!r}")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                   for b in params["remote_block_ids"]):
            raise ValueError("kv_transfer_params.remote_block_ids must be positive block ids, "
                             f"got {params['remote_block_ids']!r}")


class KVConnectorScheduler:
    """The scheduler side of JaxTransferConnector and SharedStorageConnector (vLLM's methods).

    Producer: ``request_finished`` holds a finished remote-decode request's blocks and builds
    its kv_transfer_params. Consumer: ``get_num_new_matched_tokens`` /
    ``update_state_after_alloc`` plan the pull of the blocks the local prefix cache lacks.
    The shared-storage connector names no producer: its consumer reads blocks by hash.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, storage: Any = None) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.host = config.kv_ip
        self.port = config.kv_port  # the worker's bound port, once it is known (set_address)
        self.shared_storage = config.kv_connector == "SharedStorageConnector"
        # SharedStorageConnector: the shared directory's block store (`block_hash in storage`).
        self.storage = storage
        self._meta = KVConnectorMetadata()
        # Consumer: the pull of each request waiting for remote KV. The worker lands a pull only
        # while it is still this request's (`is_pending`): an aborted request's blocks may go to
        # another request before its pages arrive.
        self._loads: dict[str, LoadSpec] = {}

    def set_address(self, host: str, port: int) -> None:
        """Where this producer's worker side listens (named in its kv_transfer_params)."""
        self.host, self.port = host, port

    # -- consumer ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past the `num_computed_tokens` local hit that the remote side provides,
        whether they load asynchronously). The last prompt token is always computed here."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or not params or not params.get("do_remote_prefill"):
            return 0, False
        want = request.num_prompt_tokens - 1 - num_computed_tokens
        if request.skip_reading_prefix_cache:
            want = 0  # its prompt is computed here (prompt logprobs): another engine's pages
            # are a cache like any other
        if self.shared_storage:  # the full blocks found in the directory, in order
            if want <= 0:
                params["do_remote_prefill"] = False
                return 0, False
            bs, hashes = self.block_size, request.block_hashes
            first = k = num_computed_tokens // bs
            end = min((request.num_prompt_tokens - 1) // bs, len(hashes))
            while k < end and hashes[k] in self.storage:
                k += 1
            if k == first:
                params["do_remote_prefill"] = False
            return (k - first) * bs, k > first
        if want <= 0:  # nothing to pull (the local prefix cache holds it all, or the prompt is
            # computed here): the producer may free its blocks now
            self._meta.releases.append((params["remote_host"], params["remote_port"],
                                        params["remote_request_id"]))
            params["do_remote_prefill"] = False
            return 0, False
        return want, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """Plan the pull of the blocks just allocated for `num_external_tokens` tokens
        (`block_ids`: the request's table per KV cache group)."""
        if num_external_tokens <= 0:
            return
        ids = one_group(block_ids)
        params = request.kv_transfer_params
        assert params is not None
        bs = self.block_size
        first = request.num_computed_tokens // bs  # the local hit's blocks come first
        end = request.num_computed_tokens + num_external_tokens
        last = cdiv(end, bs)
        remote = ([] if self.shared_storage else
                  list(params["remote_block_ids"][first:last]))
        hashes = request.block_hashes[first:min(last, len(request.block_hashes))]
        params["do_remote_prefill"] = False  # one try: a failure recomputes or fails, never pulls
        spec = LoadSpec(request.request_id, list(ids[first:last]), remote,
                        params.get("remote_request_id", ""), params.get("remote_engine_id", ""),
                        params.get("remote_host", ""), params.get("remote_port", 0), list(hashes),
                        end)
        self._loads[request.request_id] = spec
        self._meta.loads.append(spec)

    def is_pending(self, spec: LoadSpec) -> bool:
        """True while `spec` is its request's planned pull (not aborted, not replaced)."""
        return self._loads.get(spec.request_id) is spec

    def loaded_tokens(self, request_id: str) -> int:
        """The computed-token count a finished pull gives its request (and forget the pull)."""
        return self._loads.pop(request_id).num_tokens

    def forget(self, request_id: str) -> None:
        """A waiting request went away (aborted) before its pull finished."""
        self._loads.pop(request_id, None)

    def check_remote_blocks(self, request: Request) -> str | None:
        """Why the producer's params cannot cover this prompt (None: they can)."""
        params = request.kv_transfer_params
        if self.shared_storage or not params or not params.get("do_remote_prefill"):
            return None
        need = cdiv(request.num_prompt_tokens - 1, self.block_size)
        have = len(params["remote_block_ids"])
        if have < need:
            return (f"kv_transfer_params.remote_block_ids names {have} blocks but the prompt's "
                    f"{request.num_prompt_tokens} tokens need {need} of {self.block_size}")
        return None

    # -- producer ------------------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks until the consumer has them, the params the consumer needs).

        Only a request that asked for a remote decode and ended normally is held; an aborted
        one frees its blocks at once. `block_ids`: its table per KV cache group. A consumer's
        request that ends before its pull started (aborted while queued) tells the producer
        to free the blocks it holds for it, as vLLM's connectors do, instead of holding them
        to its timeout.
        """
        params = request.kv_transfer_params
        if (self.config.is_consumer and not self.shared_storage and params
                and params.get("do_remote_prefill") and params.get("remote_host")):
            self._meta.releases.append((params["remote_host"], params["remote_port"],
                                        params["remote_request_id"]))
            params["do_remote_prefill"] = False
        if (not self.config.is_producer or not params or not params.get("do_remote_decode")
                or request.status not in (RequestStatus.FINISHED_LENGTH,
                                          RequestStatus.FINISHED_STOPPED)):
            return False, None
        n = request.num_prompt_tokens
        # What a consumer reads: tokens [0, n-1) (the shared directory: only its full blocks).
        num_blocks = ((n - 1) // self.block_size if self.shared_storage
                      else cdiv(n - 1, self.block_size))
        held = list(one_group(block_ids)[:num_blocks])
        out = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_engine_id": self.engine_id, "remote_host": self.host,
               "remote_port": self.port, "remote_request_id": request.request_id,
               "remote_block_ids": held, "remote_num_tokens": n}
        if self.shared_storage:  # nothing waits: the blocks are on disk already
            self._meta.sends.append(SendSpec(request.request_id, held, time.monotonic(),
                                             list(request.block_hashes[:num_blocks])))
            return True, {"do_remote_prefill": True, "do_remote_decode": False,
                          "remote_num_tokens": n}
        self._meta.sends.append(SendSpec(request.request_id, held,
                                         time.monotonic() + self.config.abort_timeout_s))
        return True, out

    # -- both ----------------------------------------------------------------------------------

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's metadata for the worker side (None when there is nothing)."""
        if self._meta.is_empty:
            return None
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta


def one_group(block_ids: Sequence[Sequence[int]]) -> Sequence[int]:
    """The one group's table: pages move between engines of one full-attention group (an
    engine with kv_transfer keeps its layers in one group, as vLLM's connectors need)."""
    if len(block_ids) != 1:
        raise ValueError(f"the KV connector moves one KV cache group's blocks, got "
                         f"{len(block_ids)} groups")
    return block_ids[0]
