"""The verifying steps of speculative decoding, as `make gpu-aot --spec` compiles and reports them.

A step verifying B sequences with k proposals each is a decode step of B * (k + 1) single-token
rows (`jpaged.runner.batch.expand_verified`), padded to the plan's decode bucket (powers of two
with speculation on; the scheduler keeps a step's rows within the plan's largest bucket, which
caps them here). Its program is the engine's decode step of that shape; only the reading of its
bytes differs:

* `min_hbm_bytes`: as a decode step of the B * (k + 1) rows counts it (each row its own context);
* `min_hbm_bytes_verify`: each sequence's context read once (`StepTraffic.min_hbm_bytes_verify`),
  the least a ragged-query verification (one sequence, k + 1 queries) would move;

`traffic_ratio_verify` = hbm_bytes / min_hbm_bytes_verify: above `traffic_ratio` by what the
k + 1 re-reads of each context cost. Padding rows read no page: the kernels' rules count the
B * (k + 1) real rows.
"""

from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Any

from jpaged.aot.cases import StepBuilder, engine_config
from jpaged.aot.traffic import DECODE_CONTEXTS, hbm_fields
from jpaged.config import EngineConfig
from jpaged.runner.batch import BucketPlan
from models.config import ModelSpec

SPEC_BATCHES = (1, 16)
SPEC_PROPOSALS = (1, 2, 4, 8)  # k: proposed tokens per sequence
# The keys a verifying-step row adds to a decode case's.
SPEC_KEYS = ("batch", "k", "rows", "tokens_per_step_max", "min_hbm_bytes_verify",
             "traffic_ratio_verify")


def spec_engine_config(spec: ModelSpec, **engine_args: Any) -> EngineConfig:
    """The engine's config with speculation on (n-gram proposals, up to max(SPEC_PROPOSALS)
    a step): its bucket plan has the power-of-two decode shapes."""
    return engine_config(spec, speculative_config={
        "method": "ngram", "num_speculative_tokens": max(SPEC_PROPOSALS)}, **engine_args)


def verify_rows(plan: BucketPlan, batch: int, k: int) -> tuple[int, int]:
    """(bucket rows, real rows) of the step verifying `batch` sequences' k proposals each: the
    plan's decode bucket of B * (k + 1) rows, capped by its largest."""
    want = batch * (k + 1)
    buckets = plan.seq_buckets
    rows = buckets[min(bisect.bisect_left(buckets, want), len(buckets) - 1)]
    return rows, min(want, rows)


def verify_shapes(plan: BucketPlan, batches: tuple[int, ...] = SPEC_BATCHES,
                  proposals: tuple[int, ...] = SPEC_PROPOSALS
                  ) -> dict[int, list[tuple[int, int]]]:
    """Bucket rows -> the (B, k) pairs whose verifying step compiles to it (one program each)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for b in batches:
        for k in proposals:
            out.setdefault(verify_rows(plan, b, k)[0], []).append((b, k))
    return dict(sorted(out.items()))


def verify_hbm(hlo_text: str, bld: StepBuilder, batch: int, k: int, context_len: int
               ) -> dict[str, Any]:
    """The HBM_KEYS of one verifying step at a context (the decode count: `hbm_fields` of its
    real rows) plus its SPEC_KEYS."""
    rows, real = verify_rows(bld.plan, batch, k)
    case = bld.traffic_case(real, real, context_len)
    out = hbm_fields(hlo_text, case, bld.num_weights, bld.pool_shape(),
                     lookup_weights=bld.lookup_weights)
    least = case.min_hbm_bytes_verify(batch)
    out.update(batch=batch, k=k, rows=rows, tokens_per_step_max=batch * (k + 1),
               min_hbm_bytes_verify=least,
               traffic_ratio_verify=round(out["hbm_bytes"] / least, 3),
               # a sequence's rows share its block table: B contexts in the pool, not rows
               context_fits_pool=replace(case, seqs=batch).fits_pool())
    return out


def verify_rows_of(row: dict[str, Any], pairs: list[tuple[int, int]], rows: int,
                   contexts: tuple[int, ...] = DECODE_CONTEXTS, keys: tuple[str, ...] = ()
                   ) -> list[dict[str, Any]]:
    """One JSON row per (B, k) and context of one compiled verifying program (its `hbm` list,
    in that order, or None if the estimate failed); rows after the first are marked
    `reuses_compile` (same program). `keys`: the HBM keys every row carries (None if unread)."""
    found = row.pop("hbm", None)
    out = []
    for i, (b, k) in enumerate(pairs):
        for j, c in enumerate(contexts):
            fill = {"context_len": c, "batch": b, "k": k, "rows": rows,
                    "tokens_per_step_max": b * (k + 1)}
            h = found[i * len(contexts) + j] if found else fill
            r = {**row, **dict.fromkeys(keys), **dict.fromkeys(SPEC_KEYS), **fill, **h}
            if i or j:
                r["reuses_compile"] = True
            out.append(r)
    return out
