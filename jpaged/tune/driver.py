"""The tuning loop (policy + any trial runner, under a time limit) and its report; pure Python."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jpaged.tune.policy import TrialConfig, TrialResult, TunePolicy

RunTrial = Callable[[TrialConfig], TrialResult]
OnTrial = Callable[[int, str, TrialResult, str], None]  # (step, phase, result, note)

# Flags always printed in the recommendation, and the defaults of those printed only if changed.
ALWAYS = ("max_num_seqs", "enable_prefix_caching")
UNLESS_DEFAULT = {"kv_cache_dtype": "auto", "kv_offloading_size": 0.0,
                  "preemption_mode": "recompute"}


@dataclass
class TuneReport:
    """Every trial in order, the recommendation, and whether the time limit cut the flow."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    recommended: dict[str, Any] = field(default_factory=dict)
    recommended_step: int | None = None  # index into steps of the recommended trial
    stopped_early: bool = False
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """{"steps": [...], "recommended": {flag: value}, ...}."""
        return {"steps": self.steps, "recommended": self.recommended,
                "recommended_step": self.recommended_step, "stopped_early": self.stopped_early,
                "elapsed_s": self.elapsed_s}


def recommended_flags(cfg: TrialConfig) -> dict[str, Any]:
    """The tuned flags: memory, max_num_seqs, prefix caching, and dtype/offload if changed."""
    flags = cfg.flags()
    out = {cfg.memory_flag: flags[cfg.memory_flag]}
    out.update({k: flags[k] for k in ALWAYS})
    out.update({k: flags[k] for k, d in UNLESS_DEFAULT.items() if flags[k] != d})
    return out


def _cli_value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def serve_command(recommended: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> str:
    """`jpaged serve ...` with the starting flags that were set and the recommended ones."""
    parts = ["jpaged", "serve"]
    for name, value in {**(base or {}), **recommended}.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + flag[2:])
        else:
            parts += [flag, _cli_value(value)]
    return " ".join(parts)


def run_tune(policy: TunePolicy, run_trial: RunTrial, *, max_seconds: float,
             clock: Callable[[], float] = time.monotonic, on_trial: OnTrial | None = None
             ) -> TuneReport:
    """Ask the policy for trials and run them until it is done or the time is up.

    A trial is not started when the time left is shorter than the mean trial so far; the
    recommendation is then the best the flow had settled on (the incumbent).
    """
    if not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0, got {max_seconds!r}")
    t0 = clock()
    report = TuneReport()
    durations: list[float] = []
    while True:
        cfg = policy.next_trial()
        if cfg is None:
            break
        used = clock() - t0
        mean = sum(durations) / len(durations) if durations else 0.0
        if used >= max_seconds or (durations and used + mean > max_seconds):
            report.stopped_early = True
            break
        start = clock()
        result = run_trial(cfg)
        durations.append(clock() - start)
        phase = policy.phase
        note = policy.observe(result)
        phase = policy.steps[-1][0] if policy.steps else phase
        report.steps.append({"step": len(report.steps), "phase": phase, "note": note,
                             **result.to_json()})
        if on_trial is not None:
            on_trial(len(report.steps) - 1, phase, result, note)
    best = policy.recommended_result()
    report.recommended = recommended_flags(policy.recommend())
    if best is not None:
        report.recommended_step = next(
            (i for i, (_, r, _) in enumerate(policy.steps) if r is best), None)
    report.elapsed_s = clock() - t0
    return report
