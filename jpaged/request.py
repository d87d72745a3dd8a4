"""Host state of one request: tokens, progress through the KV cache, status, prefix hashes."""

from __future__ import annotations

import copy
import enum
import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

from jpaged.lora_request import LoRARequest
from jpaged.sampling_params import SamplingParams


class PrefixHasher(Protocol):
    """What a request needs of its prefix-block hasher (jpaged.core.block_hash.BlockHasher).

    Injected by whoever creates the request (the engine, the tests) so this leaf module never
    imports jpaged.core: the one hashing implementation stays in jpaged/core/block_hash.py.
    """

    block_size: int

    def extra_bytes(self, cache_salt: str | None, extra_keys: tuple) -> tuple[bytes, bytes]:
        """Encoded extra keys of (the first block, every later block) of one request."""
        ...

    def extend(self, hashes: list[bytes], token_ids: Sequence[int],
               extra: tuple[bytes, bytes]) -> None:
        """Append to `hashes` the hashes of every full block of `token_ids` not yet hashed."""
        ...

# Tie-breaker of the ordering key: requests created later sort later at equal arrival time.
_REQUEST_SEQ = itertools.count()


class RequestStatus(enum.Enum):
    """Lifecycle of a request; every FINISHED_* status is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again after preemption (recompute)
    # Its blocks are allocated and a KV connector is pulling their pages from another engine
    # (vLLM's name); it takes no step's budget until they land.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the terminal statuses."""
        return status in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED})
_STOPPED, _LENGTH, _ABORTED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                               RequestStatus.FINISHED_ABORTED)
_FINISH_REASON = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


class Request:
    """One sequence being generated: prompt + outputs, computed-token count, status, hashes.

    Invariants: all_token_ids == prompt_token_ids + output_token_ids;
    0 <= num_computed_tokens <= num_tokens_with_placeholders (between steps);
    block_hashes[i] is the chain hash of full block i of
    all_token_ids (len(block_hashes) == num_tokens // block_size once a hasher is set).
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, priority: int = 0,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 extra_keys: tuple = (), block_hasher: PrefixHasher | None = None,
                 lora_request: LoRARequest | None = None, pooling: str | None = None) -> None:
        if len(prompt_token_ids) == 0:
            raise ValueError(f"Request.prompt_token_ids must be non-empty (request {request_id!r})")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        # The prompt never changes: its length is a plain attribute (read per request per step).
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # The adapter as the engine read it (`attach_lora`, before the request is queued):
        # its weights stay with the request until it ends, and its key (name and digest of
        # its files) is what the scheduler counts, the device slots hold and every block's
        # hash includes (a directory rewritten and read again never shares blocks or a slot
        # with what was read before). None for the base model, or until attached.
        self.lora_adapter: Any = None
        self.lora_key: str | None = None
        self.extra_keys = tuple(extra_keys)
        self.seq = next(_REQUEST_SEQ)
        # Ordering keys, fixed at creation (priority and arrival never change): plain tuples
        # so that sorting the running batch every step calls no Python per request.
        self.sort_key: tuple[int, float, int] = (self.priority, self.arrival_time, self.seq)
        self.fcfs_key: tuple[float, int] = (self.arrival_time, self.seq)
        self.output_token_ids: list[int] = []
        # prompt + outputs, appended in place so append_output_token is O(1). A plain attribute
        # (read per request per step): a live list, never reassigned; do not mutate it.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        # Tokens sampled by a dispatched step whose ids have not reached the host yet (async
        # scheduling: 0 or 1). They follow all_token_ids; num_computed_tokens may count them.
        self.num_output_placeholders = 0
        # Speculative decoding: tokens proposed to follow all_token_ids, not yet verified (set
        # by the engine before a schedule; the scheduler gives them slots). Never in
        # all_token_ids nor block_hashes: nothing unverified is hashed or cached.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        # prompt_logprobs: entry p scores prompt token p + 1 (logprob, rank, top ids, top
        # logprobs), filled by the engine as prefill chunks run; complete at the first output.
        self.prompt_logprob_rows: list[tuple[float, int, Any, Any]] = []
        self.last_token_time: float | None = None  # when its latest token reached the host
        self.first_token_time: float | None = None  # when its first token did
        self.first_scheduled_time: float | None = None  # when the scheduler first admitted it
        # Snapshot: SamplingParams.all_stop_token_ids builds a set on every call.
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.all_stop_token_ids)
        # The token count at which the request ends by length (set_length_limit; the
        # scheduler sets it with its max_model_len): read per request per step, a plain int.
        self.set_length_limit(2**62)
        # Disaggregated prefill/decode (a KV connector): the request's kv_transfer_params as
        # given (SamplingParams.extra_args), and the ones its finish hands to the next engine.
        # Its own copy: the connector marks it (do_remote_prefill False once pulled), and the
        # caller's dict may serve other requests (one SamplingParams for many prompts).
        extra = sampling_params.extra_args or {}
        given = extra.get("kv_transfer_params")
        self.kv_transfer_params: dict | None = copy.deepcopy(given) if given else given
        self.finished_kv_transfer_params: dict | None = None
        # A core process's front end: the number of the "add" message that carried this
        # request (core_client.py: rows of an earlier request of the same id are not its).
        self.core_add_seq = 0
        # True: every prompt position is computed here, none taken from a cache (the device
        # prefix cache, the host/disk tiers, another engine's pages). Prompt logprobs need each
        # position's logits (vLLM's rule). Every lookup of any tier asks this one attribute.
        # A pooling request (runner "pooling": "LAST", "MEAN" or "CLS", pooling_params.py):
        # its prompt's final hidden states are pooled as its chunks run (`pool_sum`: MEAN's
        # running sum), into `pooled` once the prompt is through. MEAN and CLS need every
        # prompt position computed here (LAST's last position always is).
        self.pooling = pooling
        self.pool_sum: Any = None
        self.pooled: Any = None
        self.skip_reading_prefix_cache: bool = (sampling_params.prompt_logprobs is not None
                                                or pooling in ("MEAN", "CLS"))
        self.block_hashes: list[bytes] = []
        self._hasher: PrefixHasher | None = None
        self._hash_extra: tuple[bytes, bytes] = (b"", b"")
        if block_hasher is not None:
            self.set_block_hasher(block_hasher)

    # -- tokens -----------------------------------------------------------------------------

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those sampled on device but not yet on the host."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens a step may compute: the known ones, those on device, and the proposals."""
        return len(self.all_token_ids) + self.num_output_placeholders + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int | None:
        """Generation limit from the sampling params (None: only max_model_len limits it)."""
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        """Append one generated token; extends block_hashes when a block becomes full."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        h = self._hasher
        n = len(self.all_token_ids)
        if h is not None and n >= (len(self.block_hashes) + 1) * h.block_size:
            h.extend(self.block_hashes, self.all_token_ids, self._hash_extra)

    def set_length_limit(self, max_model_len: int) -> None:
        """The one length rule: the request ends once it holds max_model_len tokens, or its
        prompt plus max_tokens outputs, whichever comes first (`length_limit`)."""
        mt = self.sampling_params.max_tokens
        self.length_limit = (max_model_len if mt is None
                             else min(max_model_len, self.num_prompt_tokens + mt))

    # -- prefix hashes -------------------------------------------------------------------------

    @property
    def block_hasher(self) -> PrefixHasher | None:
        """The hasher maintaining block_hashes (None: prefix caching unused)."""
        return self._hasher

    @property
    def lora_name(self) -> str | None:
        """The name of its LoRA adapter, None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_name

    def attach_lora(self, adapter: Any) -> None:
        """Hold the LoRA adapter read for this request (before its block hashes are set)."""
        if self.block_hashes:
            raise ValueError(f"request {self.request_id!r}: its LoRA adapter must be attached "
                             "before its blocks are hashed")
        self.lora_adapter = adapter
        self.lora_key = adapter.key
        self.extra_keys = (*self.extra_keys, adapter.key)

    def set_block_hasher(self, hasher: PrefixHasher) -> None:
        """Use `hasher` for block_hashes, recomputing them for the current tokens."""
        self._hasher = hasher
        self._hash_extra = hasher.extra_bytes(self.cache_salt, self.extra_keys)
        self.block_hashes = []
        hasher.extend(self.block_hashes, self.all_token_ids, self._hash_extra)

    # -- status --------------------------------------------------------------------------------

    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        # Identity tests: hashing an Enum member runs Python code (this is on the hot path).
        s = self.status
        return s is _STOPPED or s is _LENGTH or s is _ABORTED

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" once finished (as vLLM), else None."""
        return _FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, priority={self.priority})")
