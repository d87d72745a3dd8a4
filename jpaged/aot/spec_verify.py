"""The verifying steps of speculative decoding, as `make gpu-aot --spec` compiles and reports them.

A step verifying B sequences with k proposals each is a ragged step of B sequences of k + 1 new
tokens, sampled at each (`jpaged.runner.batch.step_rows`): its shape is the plan's verifying
bucket (`BucketPlan.pick_step`: T = R = the decode bucket of the B * (k + 1) rows, powers of two
with speculation on, capped by the largest; B sequences in powers of 4), its attention the
tiled ragged kernel (each sequence's context read once per query tile), the decode matmuls its
projections. Per (B, k) and context:

* `min_hbm_bytes`: the least such a step moves (`StepTraffic.min_hbm_bytes` of a verifying
  case): each sequence's context read once, every new token's K/V written, f32 logits of every
  row (one per position scored);
* `min_hbm_bytes_rows`: the least the same step would move laid out as B * (k + 1)
  single-token rows (a decode step of them, each reading its sequence's context again): what
  the ragged layout saves over it.

Beside them, so that a speculation cycle can be priced in bytes (`cycle_rows`): the target's
plain decode step of each B (`spec_decode_base`, what a cycle replaces), and for a target with
a draft in `DRAFT_MODELS` (tensor parallel 1: a draft under tensor parallel is not supported)
the draft's proposal steps (`runner/draft.py`): its single-token step of B rows
(`draft_decode`, k - 1 of them a cycle) and its first step after a verification, which feeds
it the tokens it lacks (`draft_catch_up`, DRAFT_CATCH_UP_TOKENS a sequence: the last proposal
and the bonus token when all k were accepted), its pages in the target's blocks.
"""

from __future__ import annotations

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
SPEC_KEYS = ("batch", "k", "rows", "seqs_bucket", "tokens_per_step_max", "min_hbm_bytes_rows",
             "rows_ratio")
# The draft that proposes for a target (a smaller model of its tokenizer and vocabulary).
DRAFT_MODELS = {"llama3-8b": "llama3.2-1b"}
# Tokens a draft's first step after a verification feeds a sequence (at most: the last
# proposal and the bonus token, when every proposal was accepted; else the bonus token).
DRAFT_CATCH_UP_TOKENS = 2


def spec_engine_config(spec: ModelSpec, **engine_args: Any) -> EngineConfig:
    """The engine's config with speculation on (n-gram proposals, up to max(SPEC_PROPOSALS)
    a step): its bucket plan has the power-of-two decode shapes."""
    return engine_config(spec, speculative_config={
        "method": "ngram", "num_speculative_tokens": max(SPEC_PROPOSALS)}, **engine_args)


def verify_rows(plan: BucketPlan, batch: int, k: int) -> tuple[int, int, int]:
    """(bucket rows T = R, sequence bucket B, real rows) of the step verifying `batch`
    sequences' k proposals each (`BucketPlan.pick_step`; the rows capped by the plan's largest
    bucket, as the scheduler keeps them)."""
    real = min(batch * (k + 1), plan.seq_buckets[-1])
    t, b, _ = plan.pick_step(real, batch, real)
    return t, b, real


def verify_shapes(plan: BucketPlan, batches: tuple[int, ...] = SPEC_BATCHES,
                  proposals: tuple[int, ...] = SPEC_PROPOSALS
                  ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(bucket rows, sequence bucket) -> the (B, k) pairs whose verifying step compiles to it
    (one program each)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for b in batches:
        for k in proposals:
            t, bb, _ = verify_rows(plan, b, k)
            out.setdefault((t, bb), []).append((b, k))
    return dict(sorted(out.items()))


def verify_hbm(hlo_text: str, bld: StepBuilder, batch: int, k: int, context_len: int
               ) -> dict[str, Any]:
    """The HBM_KEYS of one verifying step at a context (B sequences of its real rows, each
    scoring its last k + 1 positions) plus its SPEC_KEYS."""
    rows, seqs_bucket, real = verify_rows(bld.plan, batch, k)
    case = replace(bld.traffic_case(real, batch, context_len), verifying=True)
    out = hbm_fields(hlo_text, case, bld.num_weights, bld.pool_shape(),
                     lookup_weights=bld.lookup_weights)
    as_rows = case.min_hbm_bytes_rows()
    out.update(batch=batch, k=k, rows=rows, seqs_bucket=seqs_bucket,
               tokens_per_step_max=batch * (k + 1), min_hbm_bytes_rows=as_rows,
               rows_ratio=round(as_rows / out["hbm_bytes"], 3))
    return out


def step_hbm(hlo_text: str, bld: StepBuilder, batch: int, tokens_per_seq: int,
             context_len: int) -> dict[str, Any]:
    """The HBM_KEYS of a step of `batch` sequences each feeding its last `tokens_per_seq`
    tokens at a context (1: a decode step), with its `batch`."""
    case = bld.traffic_case(batch * tokens_per_seq, batch, context_len)
    if tokens_per_seq > 1:
        case = replace(case, verifying=True)  # the new tokens end the context
    out = hbm_fields(hlo_text, case, bld.num_weights, bld.pool_shape(),
                     lookup_weights=bld.lookup_weights)
    out["batch"] = batch
    return out


def base_shapes(plan: BucketPlan, batches: tuple[int, ...] = SPEC_BATCHES,
                tokens_per_seq: int = 1) -> dict[tuple[int, int], list[int]]:
    """(T, B) -> the batches whose step of `tokens_per_seq` tokens a sequence compiles to it
    (1: the plain decode step; the draft's catch-up step: DRAFT_CATCH_UP_TOKENS)."""
    out: dict[tuple[int, int], list[int]] = {}
    for b in batches:
        out.setdefault(plan.pick(b * tokens_per_seq, b), []).append(b)
    return dict(sorted(out.items()))


def batch_rows_of(row: dict[str, Any], batches: list[int],
                  contexts: tuple[int, ...] = DECODE_CONTEXTS, keys: tuple[str, ...] = ()
                  ) -> list[dict[str, Any]]:
    """One JSON row per batch and context of one compiled program (`spec_decode_base`,
    `draft_decode`, `draft_catch_up`), as `verify_rows_of` gives the verifying ones."""
    found = row.pop("hbm", None)
    out = []
    for i, b in enumerate(batches):
        for j, c in enumerate(contexts):
            fill = {"context_len": c, "batch": b}
            h = found[i * len(contexts) + j] if found else fill
            r = {**row, **dict.fromkeys(keys), **fill, **h}
            if i or j:
                r["reuses_compile"] = True
            out.append(r)
    return out


def cycle_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, (B, k) and context with a verifying row and a plain decode row: the
    bytes of one speculation cycle and the mean tokens a cycle must yield a sequence to move
    no more than the plain decode steps it replaces (`break_even_tokens`): the verifying step
    alone (n-gram and suffix proposals cost no device bytes), and with the draft's steps
    (its catch-up step and k - 1 single-token steps) where a draft was compiled."""
    def key(r: dict[str, Any]) -> tuple:  # a draft's rows under their target's name
        return (r.get("draft_for") or r["model"], r.get("weights"), r["kv_cache_dtype"],
                r["backend"], r["tensor_parallel_size"], r["batch"], r["context_len"])

    by = {(r["program"], *key(r)): r for r in rows if r.get("hbm_bytes") is not None}
    out = []
    for r in rows:
        if r["program"] != "spec_verify" or r.get("hbm_bytes") is None:
            continue
        base = by.get(("spec_decode_base", *key(r)))
        if base is None:
            continue
        k, decode = r["k"], base["hbm_bytes"]
        c = {n: r.get(n) for n in ("model", "weights", "kv_cache_dtype", "backend",
                                    "tensor_parallel_size", "batch", "k", "context_len")}
        c.update(decode_hbm_bytes=decode, verify_hbm_bytes=r["hbm_bytes"],
                 break_even_tokens=round(r["hbm_bytes"] / decode, 3))
        step, first = by.get(("draft_decode", *key(r))), by.get(("draft_catch_up", *key(r)))
        if step is not None and first is not None:
            cycle = r["hbm_bytes"] + first["hbm_bytes"] + (k - 1) * step["hbm_bytes"]
            c.update(draft_model=step["model"], draft_decode_hbm_bytes=step["hbm_bytes"],
                     draft_catch_up_hbm_bytes=first["hbm_bytes"], draft_cycle_hbm_bytes=cycle,
                     break_even_tokens_draft=round(cycle / decode, 3))
        out.append(c)
    return out


def verify_rows_of(row: dict[str, Any], pairs: list[tuple[int, int]], rows: int,
                   contexts: tuple[int, ...] = DECODE_CONTEXTS, keys: tuple[str, ...] = (),
                   seqs_bucket: int | None = None) -> list[dict[str, Any]]:
    """One JSON row per (B, k) and context of one compiled verifying program (its `hbm` list,
    in that order, or None if the estimate failed); rows after the first are marked
    `reuses_compile` (same program). `keys`: the HBM keys every row carries (None if unread)."""
    found = row.pop("hbm", None)
    out = []
    for i, (b, k) in enumerate(pairs):
        for j, c in enumerate(contexts):
            fill = {"context_len": c, "batch": b, "k": k, "rows": rows,
                    "seqs_bucket": seqs_bucket, "tokens_per_step_max": b * (k + 1)}
            h = found[i * len(contexts) + j] if found else fill
            r = {**row, **dict.fromkeys(keys), **dict.fromkeys(SPEC_KEYS), **fill, **h}
            if i or j:
                r["reuses_compile"] = True
            out.append(r)
    return out
