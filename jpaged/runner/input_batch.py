"""The persistent batch: per-request rows of block table and sampling parameters kept between
steps, so a step packs with little per-request Python (vLLM V1's InputBatch, in spirit).

A request gets a row the first time it is scheduled and keeps it until it finishes, is aborted
or is preempted (its table is then rebuilt on re-admission). Its sampling parameters are written
once, when the row is made; its block table row only grows: a step writes just the block ids
added since the previous step (tables only ever grow by appending, see KVCacheManager). A step's
arrays are then numpy gathers over the rows of its requests, plus one short Python loop for the
values that change every step (position, token, RNG counter).

`pack_step` in batch.py builds the same arrays from scratch; it stays the reference the tests
compare this against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter
from typing import Any

import numpy as np

from jpaged.core.sched_output import PLACEHOLDER_TOKEN
from jpaged.runner.batch import (
    BucketPlan,
    PackedStep,
    StepBatch,
    constraint_rows,
    default_sampling,
    is_decode_step,
    join_entries,
    mask_rows,
    penalty_history,
    prompt_logprob_rows,
    sampling_row,
    step_rows,
    stop_ban,
    token_constraints,
)
from jpaged.runner.sampler import SamplingFlags

_START_POS, _NUM_TOKENS = attrgetter("start_pos"), attrgetter("num_tokens")


class InputBatch:
    """Rows of the requests the runner has seen, reused step after step."""

    def __init__(self, plan: BucketPlan, block_size: int, vocab_size: int,
                 default_seed: int) -> None:
        self.plan = plan
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.default_seed = default_seed
        # Rows grow on demand (doubling): the scheduler caps the running set at max_num_seqs,
        # but a preempted request's row may outlive its slot until its removal is reported.
        self.capacity = 0
        self.row_of: dict[str, int] = {}
        self._free: list[int] = []
        self._nblocks: list[int] = []  # block ids written into each row's table (per group)
        # KV cache groups: row r holds group g's table in columns [g*M, (g+1)*M) (the
        # scheduled block ids come per group; one group: the row is that table).
        self.num_groups = plan.num_groups
        self.tables = np.zeros((0, plan.num_groups * plan.max_blocks), np.int32)
        # temp, top_p, min_p, rep, pres, freq, uses penalties, wants top logprobs
        self._sampling = np.zeros((0, 8), np.float32)
        self._top_k = np.zeros(0, np.int32)
        self._seeds = np.zeros(0, np.uint32)
        self._bias: list[tuple[np.ndarray, np.ndarray] | None] = []  # token constraints
        self._constrained: set[int] = set()  # rows whose _bias entry is not None
        # min_tokens: the stop-token ban of each row whose request has one (applied while the
        # request has fewer outputs than min_tokens), and those rows.
        self._ban: list[tuple[np.ndarray, np.ndarray] | None] = []
        self._min_tokens = np.zeros(0, np.int32)
        self._banning: set[int] = set()
        self._plp: set[int] = set()  # rows whose request asked for prompt logprobs

    def _grow(self) -> None:
        old = self.capacity
        new = max(16, 2 * old)
        self.tables = np.concatenate([self.tables, np.zeros((new - old, self.tables.shape[1]),
                                                            np.int32)])
        self._sampling = np.concatenate([self._sampling, np.zeros((new - old, 8), np.float32)])
        self._top_k = np.concatenate([self._top_k, np.zeros(new - old, np.int32)])
        self._seeds = np.concatenate([self._seeds, np.zeros(new - old, np.uint32)])
        self._nblocks.extend([0] * (new - old))
        self._bias.extend([None] * (new - old))
        self._ban.extend([None] * (new - old))
        self._min_tokens = np.concatenate([self._min_tokens, np.zeros(new - old, np.int32)])
        self._free.extend(range(new - 1, old - 1, -1))  # pop() hands out low rows first
        self.capacity = new

    def _add(self, request: Any) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[request.request_id] = row
        temp, top_k, top_p, min_p, seed, rep, pres, freq, pen, top = sampling_row(
            request.sampling_params, self.vocab_size, self.default_seed)
        self._sampling[row] = (temp, top_p, min_p, rep, pres, freq, float(pen), float(top))
        self._top_k[row] = top_k
        self._seeds[row] = seed
        self._bias[row] = token_constraints(request.sampling_params)
        if self._bias[row] is None:
            self._constrained.discard(row)
        else:
            self._constrained.add(row)
        self._ban[row] = stop_ban(request)
        self._min_tokens[row] = request.sampling_params.min_tokens
        if self._ban[row] is None:
            self._banning.discard(row)
        else:
            self._banning.add(row)
        if request.sampling_params.prompt_logprobs is None:
            self._plp.discard(row)
        else:
            self._plp.add(row)
        self._nblocks[row] = 0
        self.tables[row] = 0
        return row

    def remove(self, request_ids: Iterable[str]) -> None:
        """Free the rows of requests that finished, were aborted or were preempted."""
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self._constrained.discard(row)
                self._banning.discard(row)
                self._free.append(row)

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """A request's tables were cut to `num_blocks` (speculative decoding gave back the
        blocks of rejected proposals): the ids past them are rewritten when they grow again,
        even where a new block reuses a position."""
        row = self.row_of.get(request_id)
        if row is not None and self._nblocks[row] > num_blocks:
            self._nblocks[row] = num_blocks

    @property
    def num_rows(self) -> int:
        """Rows in use."""
        return len(self.row_of)

    def pack(self, scheduled: Sequence[Any], prev_rows: Mapping[str, int] | None = None,
             token_masks: np.ndarray | None = None, lora_slots: np.ndarray | None = None
             ) -> PackedStep:
        """The step batch of `scheduled` (duck-typed ScheduledRequest), as pack_step has it
        (a request verifying proposals: its k + 1 rows share its persistent row);
        `lora_slots`: each scheduled request's LoRA slot (-1: none), given when the runner has
        slots (the batch then carries one per token)."""
        n = len(scheduled)
        bs = self.block_size
        row_of, nblocks, tables = self.row_of, self._nblocks, self.tables
        groups, mb = self.num_groups, self.plan.max_blocks
        srows = step_rows(scheduled)
        rows: list[int] = []
        base: list[int] = []  # each request's RNG counter: its tokens sampled so far
        last_ids: list[int] = []
        for s in scheduled:  # the only per-request loop: rows, new blocks, ...
            req = s.request
            row = row_of.get(req.request_id)
            if row is None:
                row = self._add(req)
                tables = self.tables  # _add may have grown it
            ids = s.block_ids  # per group, all of the same length
            n_ids = len(ids[0])
            if n_ids != nblocks[row]:  # grown since the last step: write only the new ids
                have = nblocks[row]
                for g, gids in enumerate(ids):
                    # Positions a windowed group freed since keep their stale ids here: no step
                    # reads or writes outside the window (KVCacheManager.live_block_ids).
                    tables[row, g * mb + have:g * mb + n_ids] = gids[have:]
                nblocks[row] = n_ids
            rows.append(row)
            base.append(len(req.output_token_ids) + req.num_output_placeholders)
            last_ids.append(s.token_ids[-1])
        starts = list(map(_START_POS, scheduled))
        lens = list(map(_NUM_TOKENS, scheduled))
        # Sequences whose last token is still on device: read from the previous step's rows.
        fed = np.flatnonzero(np.asarray(last_ids) == PLACEHOLDER_TOKEN)
        prev = prev_rows or {}
        fed_from = [prev.get(scheduled[i].request.request_id, -1) for i in fed]
        if -1 in fed_from:
            bad = scheduled[fed[fed_from.index(-1)]].request.request_id
            raise ValueError(f"request {bad!r}: a token on device but no row of the "
                             "previous step holds it")
        num_tokens = sum(lens)
        nr = len(srows.seq)
        t_pad, b_pad, r_pad = self.plan.pick_step(num_tokens, n, nr)
        r = np.asarray(rows, np.intp)
        start = np.asarray(starts, np.int32)
        k = np.asarray(lens, np.int32)
        step_tables = np.zeros((b_pad, groups * mb), np.int32)
        step_tables[:n] = tables[r]
        qsl = np.zeros(b_pad + 1, np.int32)
        np.cumsum(k, out=qsl[1:n + 1])
        qsl[n + 1:] = num_tokens
        seq_lens = np.zeros(b_pad, np.int32)
        seq_lens[:n] = start + k
        input_ids = np.zeros(t_pad, np.int32)
        positions = np.zeros(t_pad, np.int32)
        slot_mapping = np.full(groups * t_pad, -1, np.int32)
        if num_tokens == n:  # pure decode: one token per row, no per-token loop
            input_ids[:n] = last_ids
            positions[:n] = start
            seq_rows = np.arange(n)
        else:
            seq_rows = np.repeat(np.arange(n), k)
            # Position of each token: its sequence's start plus its offset in the chunk.
            pos = np.arange(num_tokens, dtype=np.int32) - np.repeat(qsl[:n], k) + np.repeat(
                start, k)
            positions[:num_tokens] = pos
            cur = 0
            for s, kk in zip(scheduled, lens, strict=True):
                input_ids[cur:cur + kk] = s.token_ids
                cur += kk
        pos = positions[:num_tokens]
        col, off = pos // bs, pos % bs
        for g in range(groups):
            slot_mapping[g * t_pad:g * t_pad + num_tokens] = (
                step_tables[seq_rows, g * mb + col] * bs + off)

        # Sampled rows: one a sequence at its last token, or one a token of a verifying one.
        seq_of = np.asarray(srows.seq, np.intp)
        offset = np.asarray(srows.offset, np.int32)
        logits_idx = np.zeros(r_pad, np.int32)
        logits_idx[:nr] = qsl[seq_of] + offset
        feed_rows = np.full(r_pad, -1, np.int32)
        if len(fed):
            last_row = (np.arange(1, n + 1) if srows.first is None
                        else np.append(srows.first[1:], nr)) - 1  # each sequence's last row
            feed_rows[last_row[fed]] = fed_from
            input_ids[qsl[fed + 1] - 1] = 0
        priors = srows.priors(scheduled)
        counters = (base if priors is None else
                    [base[i] + len(p) for i, p in zip(srows.seq, priors, strict=True)])
        prow = r[seq_of]  # each sampled row's persistent row
        samp = self._sampling[prow]  # [nr, 8]
        sp = default_sampling(r_pad, self.vocab_size)
        for c, arr in enumerate((sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty,
                                 sp.presence_penalty, sp.frequency_penalty)):
            arr[:nr] = samp[:, c]  # (the column order of self._sampling)
        sp.top_k[:nr] = self._top_k[prow]
        sp.seeds[:nr] = self._seeds[prow]
        sp.counters[:nr] = counters
        use_pen = bool(n) and bool(samp[:, 6].any())
        use_top = bool(n) and bool(samp[:, 7].any())
        row_shares = scheduled if srows.first is None else [scheduled[i] for i in srows.seq]
        history, is_out = penalty_history(row_shares, r_pad, use_pen, priors)
        bias_ids = bias_vals = None
        if ((self._constrained and not self._constrained.isdisjoint(rows))
                or (self._banning and not self._banning.isdisjoint(rows))):  # else no row work
            bias, ban, min_tokens = self._bias, self._ban, self._min_tokens
            bias_ids, bias_vals = constraint_rows(
                [join_entries(bias[i], ban[i] if c < min_tokens[i] else None)
                 for i, c in zip(prow.tolist(), counters, strict=True)], r_pad)
        sampling = replace(sp, history=history, history_is_output=is_out, bias_ids=bias_ids,
                           bias_vals=bias_vals, token_mask=mask_rows(token_masks, r_pad))
        plp_idx, plp_tgt, spans = (prompt_logprob_rows(scheduled, qsl) if self._plp
                                   and not self._plp.isdisjoint(rows) else (None, None, ()))
        token_slots = None
        if lora_slots is not None:  # padding tokens use no adapter
            token_slots = np.full(t_pad, -1, np.int32)
            token_slots[:num_tokens] = np.repeat(np.asarray(lora_slots, np.int32), k)
        batch = StepBatch(input_ids, positions, slot_mapping, qsl, seq_lens, step_tables,
                          logits_idx, feed_rows, sampling, plp_idx, plp_tgt, token_slots)
        flags = SamplingFlags(use_penalties=use_pen, top_logprobs=use_top,
                              decode_only=is_decode_step(n, num_tokens))
        return PackedStep(batch, flags, n, num_tokens, spans, nr, srows.first)
