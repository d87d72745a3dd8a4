"""Routing requests between data-parallel replicas: a prefix index built from their KV cache
events, and the three policies of `--routing-policy`.

The index maps each block hash to the replicas holding it (and on which tiers); it is fed only
by the replicas' events (`jpaged/kv_events.py`), so it is exactly what a router outside the
engine could keep. A prompt's block hashes come from `hash_request_blocks`, the function the
engine's own requests use (same tokenizer, block size, hash algorithm and `cache_salt`), so a
prefix a replica cached is found under the same hashes.

kv_aware: each healthy replica scores its cached prefix of the prompt (tokens; blocks that a
request routed there is computing count too, until their events arrive) minus
`load_weight` times its load (the prompt tokens it still has to compute for the requests in
flight there, plus `decode_cost` per such request); the best score wins, ties to the replica
with fewer requests in flight. So a hot prefix stays on the replica that holds it until that
replica is busier than recomputing the prefix elsewhere costs, and then the prefix gets cached
on a second replica too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from jpaged.core.block_hash import hash_request_blocks
from jpaged.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

ROUTING_POLICIES = ("kv_aware", "round_robin", "least_load")


class PrefixIndex:
    """block hash -> {replica: tiers holding it}, from the replicas' events alone."""

    def __init__(self) -> None:
        self._where: dict[bytes, dict[int, set[str]]] = {}
        self._of: dict[int, set[bytes]] = {}  # replica -> hashes it holds (any tier)
        # Blocks a replica is computing now: hash -> {replica: requests routed there with it}.
        # A request's prompt blocks are cached one step after its prefill, and their events
        # arrive later still; until then these stand in for them, so a burst of one prefix is
        # not spread over replicas before the first copy is even cached.
        self._pending: dict[bytes, dict[int, int]] = {}

    def apply(self, replica: int, event: KVEvent) -> None:
        """Apply one event of `replica`."""
        if isinstance(event, BlockStored):
            held = self._of.setdefault(replica, set())
            for h in event.block_hashes:
                self._where.setdefault(h, {}).setdefault(replica, set()).add(event.medium)
                held.add(h)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                reps = self._where.get(h)
                media = reps.get(replica) if reps is not None else None
                if media is None:
                    continue
                media.discard(event.medium)
                if not media:
                    del reps[replica]
                    self._of[replica].discard(h)
                    if not reps:
                        del self._where[h]
        elif isinstance(event, AllBlocksCleared):
            self.drop_replica(replica)

    def drop_replica(self, replica: int) -> None:
        """Forget everything `replica` held (it died, restarted or cleared its cache)."""
        for h in self._of.pop(replica, ()):
            reps = self._where.get(h)
            if reps is not None:
                reps.pop(replica, None)
                if not reps:
                    del self._where[h]

    def add_pending(self, replica: int, hashes: Sequence[bytes]) -> None:
        """A request with these prompt blocks was routed to `replica` (it will cache them)."""
        for h in hashes:
            reps = self._pending.setdefault(h, {})
            reps[replica] = reps.get(replica, 0) + 1

    def remove_pending(self, replica: int, hashes: Sequence[bytes]) -> None:
        """That request ended: its blocks are in the events by now (or were never cached)."""
        for h in hashes:
            reps = self._pending.get(h)
            if reps is None or replica not in reps:
                continue
            reps[replica] -= 1
            if not reps[replica]:
                del reps[replica]
                if not reps:
                    del self._pending[h]

    def hashes_of(self, replica: int) -> set[bytes]:
        """The hashes `replica` holds on any tier."""
        return set(self._of.get(replica, ()))

    def match(self, hashes: Sequence[bytes]) -> dict[int, int]:
        """Per replica, how many leading blocks of `hashes` it holds (on any tier) or is
        computing for a request routed there."""
        out: dict[int, int] = {}
        alive: set[int] | None = None
        for i, h in enumerate(hashes):
            reps, pending = self._where.get(h), self._pending.get(h)
            here = set(reps) if reps else set()
            if pending:
                here.update(pending)
            alive = here if alive is None else alive & here
            if not alive:
                break
            for r in alive:
                out[r] = i + 1
        return out


@dataclass
class ReplicaLoad:
    """What the front end has sent one replica and not yet seen finish."""

    in_flight: int = 0
    prefill_tokens: int = 0  # prompt tokens still to compute (not cached when routed)
    # request id -> its prefill tokens, until its first output arrives
    pending_prefill: dict[str, int] = field(default_factory=dict)

    def tokens(self, decode_cost: int) -> int:
        """The load the router weighs: prefill tokens plus decode_cost per request."""
        return self.prefill_tokens + decode_cost * self.in_flight


@dataclass
class Route:
    """Where a request goes and why."""

    replica: int
    cached_tokens: int  # the prefix the index says the replica holds
    prompt_tokens: int
    hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks (kv_aware)


class Router:
    """Chooses a replica per request; keeps the loads it routed."""

    def __init__(self, num_replicas: int, policy: str, block_size: int,
                 hash_algo: str = "sha256", load_weight: float = 1.0,
                 decode_cost: int | None = None, hash_seed: str | None = None) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {num_replicas!r}")
        self.policy = policy
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed  # the deployment's prefix-hash seed (the replicas' own)
        self.load_weight = load_weight
        # A running request costs about a block of prefill per step it decodes.
        self.decode_cost = block_size if decode_cost is None else decode_cost
        self.index = PrefixIndex()
        self.loads = [ReplicaLoad() for _ in range(num_replicas)]
        self.healthy = [True] * num_replicas
        self._rr = itertools.count()
        self.routed = [0] * num_replicas
        self._hashes: dict[str, list[bytes]] = {}  # request in flight -> its pending blocks

    def prompt_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None
                      ) -> list[bytes]:
        """The prompt's full-block hashes, as the engine computes them."""
        return hash_request_blocks(token_ids, self.block_size, self.hash_algo, cache_salt,
                                   seed=self.hash_seed)

    def choose(self, token_ids: Sequence[int] | None, cache_salt: str | None = None,
               among: Sequence[int] | None = None, policy: str | None = None) -> Route:
        """The replica for a prompt (token ids None: routed by load only), among the given
        replicas (default: all) under `policy` (default: the router's)."""
        pool = range(len(self.healthy)) if among is None else among
        live = [r for r in pool if self.healthy[r]]
        if not live:
            raise RuntimeError("no replica is healthy")
        policy = self.policy if policy is None else policy
        n = len(token_ids) if token_ids is not None else 0
        matched: dict[int, int] = {}
        hashes: list[bytes] = []
        if token_ids is not None and policy == "kv_aware":
            # The last prompt token is always computed, so at most n - 1 tokens can be cached.
            full = (n - 1) // self.block_size
            hashes = self.prompt_hashes(token_ids, cache_salt)[:full]
            matched = self.index.match(hashes)
        if policy == "round_robin":
            start = next(self._rr)
            r = min(live, key=lambda i: (i - start) % len(self.healthy))
        elif policy == "least_load":
            r = min(live, key=lambda i: (self.loads[i].tokens(self.decode_cost),
                                         self.loads[i].in_flight, i))
        else:
            def score(i: int) -> tuple[float, int, int]:
                cached = matched.get(i, 0) * self.block_size
                load = self.loads[i].tokens(self.decode_cost)
                return (cached - self.load_weight * load, -self.loads[i].in_flight, -i)
            r = max(live, key=score)
        cached = min(matched.get(r, 0) * self.block_size, max(0, n - 1))
        return Route(r, cached, n, hashes)

    # -- load bookkeeping ------------------------------------------------------------------------

    def started(self, request_id: str, route: Route) -> None:
        """A request was sent to route.replica."""
        load = self.loads[route.replica]
        prefill = max(0, route.prompt_tokens - route.cached_tokens)
        load.in_flight += 1
        load.prefill_tokens += prefill
        load.pending_prefill[request_id] = prefill
        self.routed[route.replica] += 1
        self.index.add_pending(route.replica, route.hashes)
        self._hashes[request_id] = route.hashes

    def first_output(self, request_id: str, replica: int) -> None:
        """The request's prompt is computed: its prefill no longer loads the replica."""
        load = self.loads[replica]
        load.prefill_tokens -= load.pending_prefill.pop(request_id, 0)

    def finished(self, request_id: str, replica: int) -> None:
        """The request ended (finished, aborted or failed)."""
        self.first_output(request_id, replica)
        self.loads[replica].in_flight -= 1
        self.index.remove_pending(replica, self._hashes.pop(request_id, ()))

    def set_healthy(self, replica: int, ok: bool) -> None:
        """Mark a replica up or down; a down replica's index entries are dropped."""
        self.healthy[replica] = ok
        if not ok:
            self.index.drop_replica(replica)
