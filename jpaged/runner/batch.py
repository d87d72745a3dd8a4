"""The step batch: scheduled requests packed into padded numpy arrays of a few bucket shapes."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, Int

from jpaged.core.sched_output import PLACEHOLDER_TOKEN
from jpaged.intmath import cdiv
from jpaged.runner.sampler import SamplingBatch, SamplingFlags

# Sampling history (penalties) is padded to a power of two no smaller than this.
MIN_HISTORY_BUCKET = 64


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    """A flattened ragged token batch, padded to a bucket shape (T tokens, B sequences, R
    sampled rows; R == B but in a step verifying proposals, where a sequence samples a row at
    each of its new tokens: `step_rows`)."""

    input_ids: Int[Array, " T"]
    positions: Int[Array, " T"]
    # -1 for padding tokens: their K/V is written nowhere. With G KV cache groups: [G*T], group
    # g's slots at [g*T, (g+1)*T) (each group has its own block table).
    slot_mapping: Int[Array, " GT"]
    query_start_loc: Int[Array, " B+1"]  # padded sequences repeat the last value (q_len 0)
    seq_lens: Int[Array, " B"]  # tokens of each sequence after this step (0 for padding)
    # 0 (the null block) past a sequence's blocks; with G groups [B, G*max_blocks], group g's
    # table in columns [g*max_blocks, (g+1)*max_blocks).
    block_tables: Int[Array, "B GM"]
    logits_indices: Int[Array, " R"]  # each row's token (a sequence's last new one, or each
    # of a verifying sequence's)
    # Async scheduling: row of the device's last-token buffer holding this row's token
    # (sampled by the step still in flight), or -1 when input_ids has it.
    feed_rows: Int[Array, " R"]
    sampling: SamplingBatch  # [R] rows
    # prompt_logprobs: flat token indices whose logits score the next prompt token, and those
    # tokens ([P] each, P a power of two; padding scores index 0 against token 0, unread).
    # None when no scheduled request asked for prompt logprobs.
    plp_idx: Int[Array, " P"] | None = None
    plp_target: Int[Array, " P"] | None = None
    # LoRA (a runner with adapter slots): each token's slot, -1 for the base model and for
    # padding. None when the runner has no slots.
    lora_slots: Int[Array, " T"] | None = None


def _powers(base: int, start: int, cap: int) -> list[int]:
    out, x = [], start
    while x < cap:
        out.append(x)
        x *= base
    out.append(cap)
    return out


class BucketPlan:
    """The small set of step shapes; every step is padded up to one of them.

    Pure-decode steps (one token per sequence) use T == B with B in powers of 4 from 1. Other
    steps take T from powers of 4 from 64 and B from powers of 4 from 16 (both capped): on a
    CPU a 16-token step costs nearly what a 64-token one does, and a few padded rows cost less
    than the extra executables (<= 16 shapes with the default limits). max_blocks is fixed at
    the blocks of one max_model_len sequence; the attention visits only as many key chunks as
    the step's longest sequence needs, so short sequences do not pay for it.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, num_speculative_tokens: int = 0) -> None:
        # Speculative decoding: a verifying step samples a row at each of a request's k + 1
        # new tokens (`step_rows`), so a step holds up to max_rows rows (each a token of the
        # budget), and decode shapes come in powers of two (k + 1 rows a request land
        # anywhere). A step of decodes alone, some verifying, is T = R rows (a decode bucket)
        # of B sequences (powers of 4): its attention reads each context once per query tile.
        k = num_speculative_tokens
        self.num_speculative_tokens = k
        self.max_rows = max_num_seqs if not k else max(max_num_seqs, min(
            max_num_seqs * (1 + k), max_num_batched_tokens))
        self.seq_buckets = _powers(2 if k else 4, 1, self.max_rows)
        self.mixed_seq_buckets = _powers(4, 16, self.max_rows)
        self.verify_seq_buckets = _powers(4, 1, max_num_seqs)
        self.token_buckets = _powers(4, 64, max(max_num_batched_tokens, self.max_rows))
        self.max_blocks = cdiv(max_model_len, block_size)
        # KV cache groups (kv_cache_groups.py): each has its own block table and slot mapping.
        self.num_groups = 1

    @classmethod
    def for_config(cls, config: Any) -> BucketPlan:
        """The plan of an EngineConfig (its scheduler limits and block size)."""
        s = config.scheduler
        spec = getattr(config, "speculative", None)
        return cls(s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len,
                   config.cache.block_size,
                   num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens)

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """(T, B) for a step with this many tokens and sequences."""
        if num_tokens == num_seqs:
            b = self.seq_buckets[bisect.bisect_left(self.seq_buckets, num_seqs)]
            return b, b
        b = self.mixed_seq_buckets[bisect.bisect_left(self.mixed_seq_buckets, num_seqs)]
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        return t, b

    def pick_step(self, num_tokens: int, num_seqs: int, num_rows: int) -> tuple[int, int, int]:
        """(T, B, R) for a step with this many tokens, sequences and sampled rows.

        Without verification (R == sequences) as `pick`, R = B. A step of decodes only, some
        verifying proposals (every token a row): T = R = the decode bucket of its rows, B = the
        `verify_seq_buckets` bucket of its sequences. Verifying beside a prompt chunk: a mixed
        shape whose B holds the rows (R = B; sequences fill the first of them)."""
        if num_rows == num_seqs:
            t, b = self.pick(num_tokens, num_seqs)
            return t, b, b
        if num_tokens == num_rows:
            r = self.seq_buckets[bisect.bisect_left(self.seq_buckets, num_rows)]
            b = self.verify_seq_buckets[bisect.bisect_left(self.verify_seq_buckets, num_seqs)]
            return r, b, r
        b = self.mixed_seq_buckets[bisect.bisect_left(self.mixed_seq_buckets, num_rows)]
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        return t, b, b

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (T, B) pair a step can use."""
        return sorted(set(self.decode_shapes()) | set(self.mixed_shapes()))

    def decode_shapes(self) -> list[tuple[int, int]]:
        """The (B, B) shapes of pure decode steps."""
        return [(b, b) for b in self.seq_buckets]

    def mixed_shapes(self) -> list[tuple[int, int]]:
        """The shapes of steps with some sequence taking more than one token (a few, such as
        (64, 64), are decode shapes too: both kinds of step use them)."""
        return sorted((t, b) for t in self.token_buckets for b in self.mixed_seq_buckets
                      if b <= t)

    def verify_shapes(self) -> list[tuple[int, int, int]]:
        """The (T, B, R) shapes of steps of decodes some of which verify proposals (none
        without speculation): T = R rows, B <= R sequences."""
        if not self.num_speculative_tokens:
            return []
        return [(r, b, r) for r in self.seq_buckets for b in self.verify_seq_buckets
                if b <= r and r > 1]


@dataclass
class PackedStep:
    """A step batch plus what the host needs to read the results."""

    batch: StepBatch
    flags: SamplingFlags
    num_seqs: int
    num_tokens: int
    # (request id, first prompt position, count) of each run of plp rows, in row order.
    prompt_spans: tuple[tuple[str, int, int], ...] = ()
    num_rows: int = -1  # sampled rows (-1: one a sequence)
    # Speculative decoding: the first row of each scheduled request (`StepRows.first`).
    first_rows: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            self.num_rows = self.num_seqs


def is_decode_step(num_seqs: int, num_tokens: int) -> bool:
    """Whether a step of these counts is a pure decode step (one new token per sequence; every
    scheduled sequence has at least one): the steps `BucketPlan.pick` gives a T == B shape."""
    return num_seqs > 0 and num_tokens == num_seqs


def default_sampling(rows: int, vocab_size: int) -> SamplingBatch:
    """Sampling arrays of `rows` padding rows, each a value that changes nothing (greedy,
    top_k = vocab, top_p 1, no penalties, no history, no constraints); a step fills its real
    rows in place. Every array is its own (writing one row changes no other field)."""
    return SamplingBatch(np.zeros(rows, np.float32), np.full(rows, vocab_size, np.int32),
                         np.ones(rows, np.float32), np.zeros(rows, np.float32),
                         np.zeros(rows, np.uint32), np.zeros(rows, np.int32),
                         np.ones(rows, np.float32), np.zeros(rows, np.float32),
                         np.zeros(rows, np.float32), np.zeros((rows, 0), np.int32),
                         np.zeros((rows, 0), bool))


def empty_step(plan: BucketPlan, num_tokens: int, num_seqs: int, vocab_size: int,
               decode_only: bool = False, num_rows: int | None = None) -> PackedStep:
    """An all-padding step of one bucket shape: writes nothing, attends to nothing (warm-up).
    `decode_only`: the flags of a pure decode step of that shape (T == B only); `num_rows`:
    its sampled rows (default B; a verifying step's shape has R = T)."""
    t, b = num_tokens, num_seqs
    r = b if num_rows is None else num_rows
    sampling = default_sampling(r, vocab_size)
    g = plan.num_groups
    batch = StepBatch(np.zeros(t, np.int32), np.zeros(t, np.int32),
                      np.full(g * t, -1, np.int32), np.zeros(b + 1, np.int32),
                      np.zeros(b, np.int32), np.zeros((b, g * plan.max_blocks), np.int32),
                      np.zeros(r, np.int32),
                      np.full(r, -1, np.int32), sampling)
    return PackedStep(batch, SamplingFlags(decode_only=decode_only), 0, 0)


def _next_pow2(x: int, floor: int) -> int:
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def seed32(seed: int) -> int:
    """The 32-bit seed the sampler's key is made from: a 64-bit seed's low half mixed with its
    high half (a seed below 2^32 is itself; 0 and 2^32 no longer draw alike)."""
    low, high = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return (low ^ (high * 0x9E3779B1)) & 0xFFFFFFFF


def sampling_row(params: Any, vocab_size: int, default_seed: int
                 ) -> tuple[float, int, float, float, int, float, float, float, bool, bool]:
    """A request's sampling values as the step batch holds them: (temperature, top_k, top_p,
    min_p, uint32 seed, repetition, presence, frequency penalty, uses penalties, wants
    logprobs: its top candidates' and the sampled token's rank, logprobs=0 included)."""
    p = params
    # k >= vocab keeps every token; clamped so it fits int32.
    top_k = min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size
    seed = p.seed if p.seed is not None else default_seed
    pen = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    return (0.0 if p.greedy else p.temperature, top_k, p.top_p, p.min_p, seed32(seed),
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty, pen,
            p.logprobs is not None)


MIN_BIAS_BUCKET = 8  # token-constraint entries per row: a power of two no smaller than this


MIN_PLP_BUCKET = 8  # prompt-logprob rows per step: a power of two no smaller than this


def prompt_logprob_rows(scheduled: Sequence[Any], starts: Sequence[int]
                        ) -> tuple[np.ndarray | None, np.ndarray | None,
                                   tuple[tuple[str, int, int], ...]]:
    """The step's prompt-logprob rows: for each scheduled request with prompt_logprobs, every
    new position p that is not the prompt's last scores prompt token p + 1 (the last prompt
    position's logits are the first sample's). `starts[i]`: sequence i's first flat token.
    Returns (flat indices [P], target tokens [P], spans) or (None, None, ())."""
    spans: list[tuple[str, int, int]] = []
    idx: list[int] = []
    tgt: list[int] = []
    for i, s in enumerate(scheduled):
        req = s.request
        if req.sampling_params.prompt_logprobs is None:
            continue
        start = s.start_pos
        end = min(start + s.num_tokens, req.num_prompt_tokens - 1)
        if end <= start:
            continue
        spans.append((req.request_id, start, end - start))
        idx.extend(range(int(starts[i]), int(starts[i]) + end - start))
        tgt.extend(req.prompt_token_ids[start + 1:end + 1])
    if not spans:
        return None, None, ()
    p = _next_pow2(len(idx), MIN_PLP_BUCKET)
    plp_idx = np.zeros(p, np.int32)
    plp_tgt = np.zeros(p, np.int32)
    plp_idx[:len(idx)], plp_tgt[:len(tgt)] = idx, tgt
    return plp_idx, plp_tgt, tuple(spans)


def token_constraints(params: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """A request's logit_bias and allowed_token_ids as (ids, values) entries (None: neither):
    a bias is its value, an allowed token +inf (SamplingBatch.bias_ids; a banned one, -inf,
    comes from `stop_ban`)."""
    bias, allowed = params.logit_bias, params.allowed_token_ids
    if not bias and not allowed:
        return None
    ids = [*(bias or {}), *(allowed or ())]
    vals = [*(float(v) for v in (bias or {}).values()), *([np.inf] * len(allowed or ()))]
    return np.asarray(ids, np.int32), np.asarray(vals, np.float32)


def stop_ban(request: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The entries that keep a request with min_tokens from sampling a stop token (EOS unless
    ignore_eos, and its stop_token_ids) before it has min_tokens outputs: each id at -inf
    (None without min_tokens or stop ids). Applied only while the request is short of them."""
    if not request.sampling_params.min_tokens or not request.stop_token_ids:
        return None
    ids = np.asarray(sorted(request.stop_token_ids), np.int32)
    return ids, np.full(len(ids), -np.inf, np.float32)


def join_entries(a: tuple[np.ndarray, np.ndarray] | None,
                 b: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Two token-constraint entry lists as one (either may be None)."""
    if a is None or b is None:
        return a if b is None else b
    return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])


def constraint_rows(entries: Sequence[tuple[np.ndarray, np.ndarray] | None], b_pad: int
                    ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """[b_pad, K] ids (-1 padded) and values of the rows' token constraints (None, None when
    no row has any; K a power of two, so a step compiles once per size class)."""
    if not any(e is not None for e in entries):
        return None, None
    k = _next_pow2(max(len(e[0]) for e in entries if e is not None), MIN_BIAS_BUCKET)
    ids = np.full((b_pad, k), -1, np.int32)
    vals = np.zeros((b_pad, k), np.float32)
    for i, e in enumerate(entries):
        if e is not None:
            ids[i, :len(e[0])], vals[i, :len(e[1])] = e
    return ids, vals


def penalty_history(scheduled: Sequence[Any], b_pad: int, use_penalties: bool,
                    priors: Sequence[Sequence[int]] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Penalty history rows (prompt + known outputs, -1 padded) and their is-output flags.

    A token still on device is the last of its row: its column (its position) is filled in
    the jitted step, its is-output flag here. Without penalties both are [b_pad, 0].
    `priors[i]`: proposals row i's token follows (speculative decoding, `StepRows.priors`):
    outputs too, after the known ones.
    """
    if not use_penalties:
        return np.zeros((b_pad, 0), np.int32), np.zeros((b_pad, 0), bool)
    extra = [0] * len(scheduled) if priors is None else [len(p) for p in priors]
    h = _next_pow2(max(s.request.num_tokens_with_placeholders + e
                       for s, e in zip(scheduled, extra, strict=True)), MIN_HISTORY_BUCKET)
    history = np.full((b_pad, h), -1, np.int32)
    is_out = np.zeros((b_pad, h), bool)
    for i, s in enumerate(scheduled):
        req = s.request
        toks = req.all_token_ids
        history[i, :len(toks)] = toks
        if extra[i]:
            history[i, len(toks):len(toks) + extra[i]] = priors[i]
        is_out[i, req.num_prompt_tokens:req.num_tokens_with_placeholders + extra[i]] = True
    return history, is_out


@dataclass(frozen=True, slots=True)
class StepRows:
    """A step's sampled rows: one per scheduled request (at its last new token), or, for a
    request verifying k proposals, k + 1 (one at each new token: row j holds the target's
    logits after position start + j; the step writes every new token's K/V before any
    attention reads, and causal attention keeps each row to its own prefix)."""

    seq: list[int]  # each row's scheduled request
    offset: list[int]  # its token among that request's new ones
    first: list[int] | None  # each request's first row (None: row i is request i)

    def priors(self, scheduled: Sequence[Any]) -> list[list[int]] | None:
        """Each row's proposals before its token (outputs for its RNG counter, penalties and
        min_tokens), or None when no row verifies."""
        if self.first is None:
            return None
        return [scheduled[i].spec_token_ids[:j] for i, j in zip(self.seq, self.offset,
                                                                strict=True)]


def step_rows(scheduled: Sequence[Any]) -> StepRows:
    """The sampled rows of a step (speculative decoding: k + 1 for a request verifying k
    proposals, in request order; `first` ascends)."""
    n = len(scheduled)
    if not any(s.spec_token_ids for s in scheduled):
        return StepRows(list(range(n)), [s.num_tokens - 1 for s in scheduled], None)
    seq: list[int] = []
    offset: list[int] = []
    first: list[int] = []
    for i, s in enumerate(scheduled):
        first.append(len(seq))
        k = len(s.spec_token_ids)
        if k and s.num_tokens != k + 1:
            raise ValueError(f"request {s.request.request_id!r}: {k} proposals verified in a "
                             f"share of {s.num_tokens} tokens (a decode verifies its input "
                             "token and its proposals only)")
        offs = range(k + 1) if k else (s.num_tokens - 1,)
        seq.extend([i] * len(offs))
        offset.extend(offs)
    return StepRows(seq, offset, first)


def mask_rows(masks: np.ndarray | None, b_pad: int) -> np.ndarray | None:
    """[b_pad, W] packed token masks: the scheduled rows' (in order), then all-ones padding
    (None when no row is constrained)."""
    if masks is None:
        return None
    out = np.full((b_pad, masks.shape[1]), -1, np.int32)
    out[:len(masks)] = masks
    return out


def pack_step(scheduled: Sequence[Any], plan: BucketPlan, block_size: int, vocab_size: int,
              default_seed: int, prev_rows: Mapping[str, int] | None = None,
              token_masks: np.ndarray | None = None) -> PackedStep:
    """Pack scheduled requests (duck-typed ScheduledRequest) into numpy arrays of bucket shape.

    A PLACEHOLDER_TOKEN (always a sequence's last new token) is read on device from row
    `prev_rows[request_id]` of the last-token buffer: the row it had in the previous step.
    token_masks: [rows, W] packed allowed-token bits of the step's rows (`step_rows`;
    structured outputs). Block ids come per KV cache group (`plan.num_groups` of them); a
    position a window freed holds 0 here, where the persistent batch keeps the stale id
    (nothing reads either). A request verifying k proposals is one sequence of k + 1 new
    tokens and k + 1 rows; a row's proposals before its token count as outputs for its RNG
    counter, penalties and min_tokens.
    """
    n = len(scheduled)
    srows = step_rows(scheduled)
    nr = len(srows.seq)
    num_tokens = sum(s.num_tokens for s in scheduled)
    t_pad, b_pad, r_pad = plan.pick_step(num_tokens, n, nr)
    mb, groups = plan.max_blocks, plan.num_groups
    input_ids = np.zeros(t_pad, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slot_mapping = np.full(groups * t_pad, -1, np.int32)
    qsl = np.zeros(b_pad + 1, np.int32)
    seq_lens = np.zeros(b_pad, np.int32)
    tables = np.zeros((b_pad, groups * mb), np.int32)
    fed_from: dict[int, int] = {}  # sequence -> previous step's row holding its last token

    cur = 0
    for i, s in enumerate(scheduled):
        req = s.request
        start, k = s.start_pos, s.num_tokens
        input_ids[cur:cur + k] = s.token_ids
        if s.token_ids[-1] == PLACEHOLDER_TOKEN:
            if prev_rows is None or req.request_id not in prev_rows:
                raise ValueError(f"request {req.request_id!r}: a token on device but no row "
                                 "of the previous step holds it")
            fed_from[i] = prev_rows[req.request_id]
            input_ids[cur + k - 1] = 0
        pos = np.arange(start, start + k, dtype=np.int32)
        positions[cur:cur + k] = pos
        for g, ids in enumerate(s.block_ids):  # per KV cache group (0 where a window freed)
            blocks = np.asarray(ids, np.int32)
            slot_mapping[g * t_pad + cur:g * t_pad + cur + k] = (
                blocks[pos // block_size] * block_size + pos % block_size)
            tables[i, g * mb:g * mb + len(blocks)] = blocks
        cur += k
        qsl[i + 1] = cur
        seq_lens[i] = start + k
    qsl[n + 1:] = cur

    logits_idx = np.zeros(r_pad, np.int32)
    feed_rows = np.full(r_pad, -1, np.int32)
    sp = default_sampling(r_pad, vocab_size)
    counters = sp.counters
    use_pen = use_top = False
    priors = srows.priors(scheduled)
    rows = [scheduled[i] for i in srows.seq]  # each row's request share
    for r, (i, j) in enumerate(zip(srows.seq, srows.offset, strict=True)):
        s = rows[r]
        req = s.request
        logits_idx[r] = qsl[i] + j
        if i in fed_from and j == s.num_tokens - 1:
            feed_rows[r] = fed_from[i]
        (sp.temperature[r], sp.top_k[r], sp.top_p[r], sp.min_p[r], sp.seeds[r],
         sp.repetition_penalty[r], sp.presence_penalty[r], sp.frequency_penalty[r],
         pen, top) = sampling_row(req.sampling_params, vocab_size, default_seed)
        use_pen = use_pen or pen
        use_top = use_top or top
        counters[r] = req.num_output_tokens + req.num_output_placeholders + (
            len(priors[r]) if priors is not None else 0)
    history, is_out = penalty_history(rows, r_pad, use_pen, priors)
    bias_ids, bias_vals = constraint_rows(
        [join_entries(token_constraints(s.request.sampling_params),
                      stop_ban(s.request) if counters[r] < s.request.sampling_params.min_tokens
                      else None) for r, s in enumerate(rows)], r_pad)

    sampling = replace(sp, history=history, history_is_output=is_out, bias_ids=bias_ids,
                       bias_vals=bias_vals, token_mask=mask_rows(token_masks, r_pad))
    plp_idx, plp_tgt, spans = prompt_logprob_rows(scheduled, qsl)
    batch = StepBatch(input_ids, positions, slot_mapping, qsl, seq_lens, tables, logits_idx,
                      feed_rows, sampling, plp_idx, plp_tgt)
    flags = SamplingFlags(use_penalties=use_pen, top_logprobs=use_top,
                          decode_only=is_decode_step(n, num_tokens))
    return PackedStep(batch, flags, n, num_tokens, spans, nr, srows.first)


@jax.tree_util.register_dataclass
@dataclass
class FlatStep:
    """A StepBatch as two host buffers (int32 and float32) plus its static shape.

    The jitted step takes this and slices the fields back out on device: two host-to-device
    copies per step instead of one per field (twenty), which is what a step's dispatch costs
    on a GPU. Layout (row-major, in this order): ints = input_ids[T], positions[T],
    slot_mapping[G*T], query_start_loc[B+1], seq_lens[B], logits_indices[R], feed_rows[R],
    top_k[R], seeds[R] (uint32 bits), counters[R], block_tables[B*G*M], history[R*H],
    history_is_output[R*H] (0/1), bias_ids[R*K], token_mask[R*W]; floats = temperature,
    top_p, min_p, repetition, presence, frequency penalties, [R] each, then bias_vals[R*K]
    (K = bias_len, 0 when no row has token constraints; W = mask_words, 0 when no row has a
    grammar), then plp_idx[P], plp_target[P] (P = plp_len, 0 without prompt logprobs), then
    lora_slots[T] when `lora` (a runner with LoRA slots).
    """

    ints: Int[Array, " N"]
    floats: Array
    num_tokens: int = field(metadata={"static": True})
    num_seqs: int = field(metadata={"static": True})
    max_blocks: int = field(metadata={"static": True})  # per group
    history_len: int = field(metadata={"static": True})
    num_groups: int = field(default=1, metadata={"static": True})
    bias_len: int = field(default=0, metadata={"static": True})
    mask_words: int = field(default=0, metadata={"static": True})
    plp_len: int = field(default=0, metadata={"static": True})
    num_rows: int = field(default=-1, metadata={"static": True})  # R (-1: B)
    lora: bool = field(default=False, metadata={"static": True})  # lora_slots present

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            self.num_rows = self.num_seqs


def flatten_step(batch: StepBatch) -> FlatStep:
    """The two host buffers of a (numpy) StepBatch."""
    s = batch.sampling
    t, (b, gm), h = batch.input_ids.shape[0], batch.block_tables.shape, s.history.shape[1]
    r = batch.logits_indices.shape[0]
    g = batch.slot_mapping.shape[0] // t
    k = 0 if s.bias_ids is None else s.bias_ids.shape[1]
    bias = [] if s.bias_ids is None else [s.bias_ids.reshape(-1)]
    w = 0 if s.token_mask is None else s.token_mask.shape[1]
    mask = [] if s.token_mask is None else [s.token_mask.reshape(-1)]
    p = 0 if batch.plp_idx is None else batch.plp_idx.shape[0]
    plp = [] if batch.plp_idx is None else [batch.plp_idx, batch.plp_target]
    lora = [] if batch.lora_slots is None else [batch.lora_slots]
    ints = np.concatenate([
        batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc,
        batch.seq_lens, batch.logits_indices, batch.feed_rows, s.top_k,
        np.asarray(s.seeds, np.uint32).view(np.int32), s.counters,
        batch.block_tables.reshape(-1), s.history.reshape(-1),
        s.history_is_output.reshape(-1), *bias, *mask, *plp, *lora], dtype=np.int32)
    floats = np.concatenate([s.temperature, s.top_p, s.min_p, s.repetition_penalty,
                             s.presence_penalty, s.frequency_penalty,
                             *([] if s.bias_vals is None else [s.bias_vals.reshape(-1)])],
                            dtype=np.float32)
    return FlatStep(ints, floats, t, b, gm // g, h, g, k, w, p, r, bool(lora))


def unflatten_step(flat: FlatStep) -> StepBatch:
    """The StepBatch of a FlatStep (inside the jitted step: static slices)."""
    import jax.numpy as jnp

    t, b, h, g, k, w, p = (flat.num_tokens, flat.num_seqs, flat.history_len, flat.num_groups,
                           flat.bias_len, flat.mask_words, flat.plp_len)
    r, m = flat.num_rows, g * flat.max_blocks
    sizes = [t, t, g * t, b + 1, b, r, r, r, r, r, b * m, r * h, r * h, r * k, r * w, p, p,
             t if flat.lora else 0]
    parts, off = [], 0
    for n in sizes:
        parts.append(flat.ints[off:off + n])
        off += n
    (ids, pos, slots, qsl, lens, logits_idx, feed, top_k, seeds, counters, tables, hist,
     is_out, bias_ids, mask, plp_idx, plp_tgt, lora_slots) = parts
    f = flat.floats[:6 * r].reshape(6, r)
    bias = (None, None) if k == 0 else (bias_ids.reshape(r, k),
                                        flat.floats[6 * r:].reshape(r, k))
    sampling = SamplingBatch(f[0], top_k, f[1], f[2],
                             jax.lax.bitcast_convert_type(seeds, jnp.uint32), counters,
                             f[3], f[4], f[5], hist.reshape(r, h), is_out.reshape(r, h) != 0,
                             *bias, None if w == 0 else mask.reshape(r, w))
    return StepBatch(ids, pos, slots, qsl, lens, tables.reshape(b, m), logits_idx, feed,
                     sampling, *((plp_idx, plp_tgt) if p else (None, None)),
                     lora_slots if flat.lora else None)
