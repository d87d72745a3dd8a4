"""The tuning flow (memory, then max_num_seqs, then features) as a pure decision procedure
(no engine, no jax).

Given the trials measured so far, `TunePolicy` chooses the next trial and the recommendation:

1. memory: walk the memory ladder (gpu_memory_utilization +0.05 from 0.70, or on CPU
   kv_cache_memory_bytes / num_gpu_blocks_override in geometric steps) at the starting
   max_num_seqs, and stop at the first setting whose preemption rate is at most
   `max_preemption_rate` ("until preemptions stop being frequent") and whose pool did not fill
   up (a full pool makes requests queue instead of preempting);
2. max_num_seqs: if memory sufficed, raise it from 32 (doubling, up to the sample size) until
   tokens/s gains less than `saturation_gain` or preemptions become frequent; if the top of the
   memory ladder still preempts, halve it instead until preemptions are rare;
3. features, only where they help: prefix caching when it was off; fp8 KV and host-RAM
   offloading (swap preemption) when memory ran out and preemptions remain.

The incumbent (`recommend()`) is always the best configuration the flow has settled on so far,
so a run stopped by a time limit still has an answer. Results are fed with `observe()`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MEMORY_FLAGS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override")
GPU_START_UTILIZATION = 0.70  # where the memory ladder starts on a GPU
GPU_MAX_UTILIZATION = 0.95
SEQS_START = 32  # max_num_seqs is raised (doubled) from here
POOL_FULL = 0.99  # peak KV usage at which the pool, not max_num_seqs, limited admission


@dataclass(frozen=True)
class TrialConfig:
    """The engine flags one trial runs with (the rest come from the starting flags)."""

    memory_flag: str  # one of MEMORY_FLAGS
    memory: float  # its value (a fraction, bytes or blocks)
    max_num_seqs: int
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_offloading_size: float = 0.0  # GiB of host RAM
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        if self.memory_flag not in MEMORY_FLAGS:
            raise ValueError(f"TrialConfig.memory_flag must be one of {MEMORY_FLAGS}, got "
                             f"{self.memory_flag!r}")
        if not self.memory > 0:
            raise ValueError(f"TrialConfig.memory must be > 0, got {self.memory!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"TrialConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def flags(self) -> dict[str, Any]:
        """EngineArgs field -> value for this trial."""
        mem = self.memory if self.memory_flag == "gpu_memory_utilization" else int(self.memory)
        return {self.memory_flag: mem, "max_num_seqs": self.max_num_seqs,
                "enable_prefix_caching": self.enable_prefix_caching,
                "kv_cache_dtype": self.kv_cache_dtype,
                "kv_offloading_size": self.kv_offloading_size,
                "preemption_mode": self.preemption_mode}


@dataclass(frozen=True)
class TrialResult:
    """What one replay of the workload sample measured."""

    config: TrialConfig
    num_requests: int
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    tokens_per_second: float = 0.0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    tpot_p50_ms: float = 0.0
    tpot_p99_ms: float = 0.0
    num_gpu_blocks: int = 0
    kv_cache_usage_peak: float = 0.0
    elapsed_s: float = 0.0
    error: str | None = None  # the trial could not run (e.g. the pool cannot hold a request)

    @property
    def ok(self) -> bool:
        """True when the trial ran."""
        return self.error is None

    @property
    def preemption_rate(self) -> float:
        """Preemptions per request (inf when the trial failed)."""
        if not self.ok:
            return math.inf
        return self.num_preemptions / max(self.num_requests, 1)

    def to_json(self) -> dict[str, Any]:
        """A flat JSON-able dict: the trial's flags and its measurements."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "config"}
        d["preemption_rate"] = self.preemption_rate if self.ok else None
        return {**self.config.flags(), **d}


def memory_ladder(flag: str, start: float, *, quick: bool = False, top: float | None = None,
                  max_steps: int = 8) -> list[float]:
    """The memory settings the flow walks, `start` first, ascending.

    gpu_memory_utilization: +0.05 (quick: +0.10) up to 0.95. Bytes and blocks: x1.5 (quick: x2)
    up to the first value >= `top` (the setting that holds the whole sample at once), at most
    `max_steps` values.
    """
    if flag not in MEMORY_FLAGS:
        raise ValueError(f"memory flag must be one of {MEMORY_FLAGS}, got {flag!r}")
    if not start > 0:
        raise ValueError(f"{flag} start must be > 0, got {start!r}")
    if flag == "gpu_memory_utilization":
        step = 0.10 if quick else 0.05
        out = [round(start, 4)]
        while out[-1] + step <= GPU_MAX_UTILIZATION + 1e-9:
            out.append(round(out[-1] + step, 4))
        if out[-1] < GPU_MAX_UTILIZATION and start < GPU_MAX_UTILIZATION:
            out.append(GPU_MAX_UTILIZATION)
        return out
    factor = 2.0 if quick else 1.5
    out = [int(start)]
    while len(out) < max_steps and (top is None or out[-1] < top):
        out.append(int(math.ceil(out[-1] * factor)))
    return out


def seqs_ladder(start: int, cap: int, *, quick: bool = False) -> list[int]:
    """max_num_seqs values to try upwards: from min(32, cap), doubling (quick: x4), then cap."""
    if cap < 1:
        raise ValueError(f"max_num_seqs cap must be >= 1, got {cap}")
    factor = 4 if quick else 2
    v = min(start, cap)
    out = []
    while v < cap:
        out.append(v)
        v *= factor
    out.append(cap)
    return out


class TunePolicy:
    """Chooses trials phase by phase; `recommend()` is the flow's current best."""

    def __init__(self, start: TrialConfig, memory_values: Sequence[float], *, seqs_cap: int,
                 quick: bool = False, max_preemption_rate: float = 0.05,
                 saturation_gain: float = 0.05, keep_gain: float = 0.03,
                 try_fp8: bool = True, offload_gib: float = 4.0) -> None:
        if not memory_values:
            raise ValueError("memory_values must not be empty")
        if max_preemption_rate < 0:
            raise ValueError(f"max_preemption_rate must be >= 0, got {max_preemption_rate}")
        self.start = start
        self.memory_values = list(memory_values)
        self.seqs_cap = max(1, seqs_cap)
        self.quick = quick
        self.max_preemption_rate = max_preemption_rate
        self.saturation_gain = saturation_gain
        self.keep_gain = keep_gain
        self.try_fp8 = try_fp8 and start.kv_cache_dtype == "auto"
        self.offload_gib = offload_gib
        self.results: dict[TrialConfig, TrialResult] = {}
        self.steps: list[tuple[str, TrialResult, str]] = []  # (phase, result, note) in order
        self.phase = "memory"
        self.incumbent: TrialResult | None = None
        self.memory_exhausted = False  # the top of the ladder still preempts too often
        self._mem_i = 0
        self._seqs: list[int] = []
        self._seqs_dir = +1
        self._prev: TrialResult | None = None  # the previous rung of the upward seqs ladder
        self._features: list[str] = []

    # ---------------------------------------------------------------- helpers
    def rare(self, r: TrialResult) -> bool:
        """True when the trial ran and preempted at most max_preemption_rate per request."""
        return r.ok and r.preemption_rate <= self.max_preemption_rate

    def _at_memory(self, i: int) -> TrialConfig:
        return dataclasses.replace(self.start, memory=self.memory_values[i])

    def _less_pressured(self, a: TrialResult, b: TrialResult | None) -> bool:
        """a is better than b while preemptions are still frequent."""
        if b is None:
            return True
        return (a.preemption_rate, -a.tokens_per_second) < (b.preemption_rate,
                                                             -b.tokens_per_second)

    # ---------------------------------------------------------------- the flow
    def next_trial(self) -> TrialConfig | None:
        """The next configuration to measure, or None when the flow is done."""
        while True:
            cfg = self._propose()
            if cfg is None:
                return None
            if cfg not in self.results:
                return cfg
            self.observe(self.results[cfg], repeat=True)  # measured already: reuse it

    def _propose(self) -> TrialConfig | None:
        inc = self.incumbent
        if self.phase == "memory":
            return self._at_memory(self._mem_i)
        if self.phase == "seqs":
            if not self._seqs:
                self._start_features()
                return self._propose()
            return dataclasses.replace(inc.config, max_num_seqs=self._seqs[0])
        if self.phase == "features":
            if not self._features:
                self.phase = "done"
                return None
            f = self._features[0]
            if f == "prefix":
                return dataclasses.replace(inc.config, enable_prefix_caching=True)
            # fp8 / offloading make room for the starting concurrency the pool could not hold.
            wide = dataclasses.replace(inc.config, max_num_seqs=self.start.max_num_seqs)
            if f == "fp8":
                return dataclasses.replace(wide, kv_cache_dtype="fp8")
            return dataclasses.replace(wide, kv_offloading_size=self.offload_gib,
                                       preemption_mode="swap")
        return None

    def observe(self, result: TrialResult, repeat: bool = False) -> str:
        """Record a measured trial (the one `next_trial` returned); returns a verdict note."""
        self.results.setdefault(result.config, result)
        phase = self.phase
        if phase == "memory":
            note = self._advance_memory(result)
        elif phase == "seqs":
            note = self._advance_seqs(result)
        elif phase == "features":
            note = self._advance_features(result)
        else:
            note = "after the flow ended"
        if not repeat:
            self.steps.append((phase, result, note))
        return note

    def _advance_memory(self, r: TrialResult) -> str:
        # The scheduler admits only what fits, so a small pool shows as a full pool and a queue
        # as often as preemptions: a full pool also asks for the next rung.
        full = r.ok and r.kv_cache_usage_peak >= POOL_FULL
        if self.rare(r) and not full:
            self.incumbent = r
            self._start_seqs()
            return "preemptions rare, pool not full: memory chosen"
        if r.ok and self._memory_better(r, self.incumbent):
            self.incumbent = r
        self._mem_i += 1
        if self._mem_i < len(self.memory_values):
            if not r.ok:
                return f"failed: {r.error}"
            return "pool full: more memory" if self.rare(r) else "preemptions frequent: more memory"
        if self.incumbent is None:  # nothing ran at all
            self.phase = "done"
            return "no memory setting could run the workload"
        self.memory_exhausted = not self.rare(self.incumbent)
        self._start_seqs()
        if self.memory_exhausted:
            return "top of the memory ladder still preempts: fewer sequences next"
        return "pool full at every setting: the fastest one kept"

    def _memory_better(self, a: TrialResult, b: TrialResult | None) -> bool:
        """Rare preemption first, then fewer preemptions, then tokens/s."""
        if b is None:
            return True
        return (not self.rare(a), a.preemption_rate, -a.tokens_per_second) < (
            not self.rare(b), b.preemption_rate, -b.tokens_per_second)

    def _start_seqs(self) -> None:
        self.phase = "seqs"
        self._prev = None
        cur = self.incumbent.config.max_num_seqs
        if self.memory_exhausted:  # halve (quick: quarter) until preemptions are rare
            self._seqs_dir = -1
            step = 4 if self.quick else 2
            vals, v = [], cur
            while v > 1:
                v = max(1, v // step)
                vals.append(v)
            self._seqs = vals
        else:  # raise from 32 until throughput saturates
            self._seqs_dir = +1
            self._seqs = seqs_ladder(SEQS_START, self.seqs_cap, quick=self.quick)

    def _advance_seqs(self, r: TrialResult) -> str:
        self._seqs.pop(0)
        inc = self.incumbent
        if self._seqs_dir < 0:
            if self.rare(r):
                self.incumbent = r
                self._seqs = []
                return "preemptions rare: max_num_seqs chosen"
            if self._less_pressured(r, inc):
                self.incumbent = r
            return "still preempting: fewer sequences"
        prev, self._prev = self._prev, r
        if not self.rare(r):
            self._seqs = []
            return "preemptions frequent: stop raising max_num_seqs"
        # The first rare rung replaces the memory-phase point; a later one must be clearly
        # faster (fewer sequences at equal speed leave more memory per request).
        if prev is None or r.tokens_per_second >= inc.tokens_per_second * (
                1 + self.saturation_gain):
            self.incumbent = r
        if prev is not None and r.tokens_per_second < prev.tokens_per_second * (
                1 + self.saturation_gain):
            self._seqs = []
            return "throughput saturated"
        return "throughput still rising" if prev is not None else "first rung"

    def _start_features(self) -> None:
        self.phase = "features"
        inc = self.incumbent.config
        feats = []
        if not inc.enable_prefix_caching:
            feats.append("prefix")
        if self.memory_exhausted:  # memory is the limit: make each block count more
            if self.try_fp8:
                feats.append("fp8")
            if inc.kv_offloading_size <= 0:
                feats.append("offload")
        self._features = feats

    def _advance_features(self, r: TrialResult) -> str:
        f = self._features.pop(0)
        inc = self.incumbent
        if not r.ok:
            return f"{f}: failed ({r.error})"
        if f == "prefix":  # cheap when it does not hit; keep it unless it clearly costs
            keep = r.tokens_per_second >= inc.tokens_per_second * (
                1 + (-self.keep_gain if r.prefix_cache_hit_rate > 0 else self.keep_gain))
        else:  # the starting concurrency, now without frequent preemption (offload: cheap ones)
            keep = (self.rare(r) or f == "offload") and (
                r.tokens_per_second >= inc.tokens_per_second * (1 + self.keep_gain))
        if keep:
            self.incumbent = r
            return f"{f}: helps, kept"
        return f"{f}: no gain, dropped"

    # ---------------------------------------------------------------- answer
    def recommend(self) -> TrialConfig:
        """The configuration the flow recommends now (the start when nothing has run)."""
        return self.incumbent.config if self.incumbent is not None else self.start

    def recommended_result(self) -> TrialResult | None:
        """The measurement behind `recommend()`, if any."""
        return self.incumbent

    def max_trials(self) -> int:
        """An upper bound on the trials the flow can still ask for (for a progress bar)."""
        seqs = len(seqs_ladder(SEQS_START, self.seqs_cap, quick=self.quick)) + 8
        return len(self.memory_values) + seqs + 3
