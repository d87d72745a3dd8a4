"""The baseline: a contiguous per-sequence KV cache that reserves max_model_len slots per row.

This is how HF's static cache (and pre-paging servers) hold KV: one row of max_model_len slots per
sequence, whatever its real length. Same model code, jitted and batched, greedy or sampled with
the same sampler; used by the benchmarks to show what paging buys at equal KV memory.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jpaged.runner.batch import default_sampling
from jpaged.runner.kv_cache import kv_dtype
from jpaged.runner.sampler import SamplingBatch, SamplingFlags, sample
from jpaged.sampling_params import SamplingParams
from models.loader import LoadedModel
from pallas_kernels.reference import dense_attention_contiguous


@jax.tree_util.register_dataclass
@dataclass
class ContiguousCache:
    """K/V of every layer: [layers, rows, max_model_len, kv_heads, head_dim]."""

    k: Float[Array, "layers rows L kv_heads head_dim"]
    v: Float[Array, "layers rows L kv_heads head_dim"]


@dataclass
class _Row:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is in the row


@dataclass
class NaiveStats:
    """What the benchmarks read: steps, tokens and slot waste."""

    steps: int = 0
    generated_tokens: int = 0
    max_concurrency: int = 0
    waste_sum: float = 0.0  # sum over steps of (allocated - used) / allocated
    waste_steps: int = 0
    wall_s: float = 0.0

    @property
    def waste(self) -> float:
        """Average share of reserved KV slots that hold no token."""
        return self.waste_sum / max(self.waste_steps, 1)


def _write_rows(cache: jax.Array, layer: jax.Array, rows: Int[Array, "B Q"],
                pos: Int[Array, "B Q"], vals: Float[Array, "BQ kv_heads head_dim"]) -> jax.Array:
    """Scatter one layer's new K or V into [layers, rows, L, ...]; pos == L is dropped."""
    rows, pos = rows.reshape(-1), pos.reshape(-1)
    vals = vals.astype(cache.dtype)
    if rows.shape[0] == 1:
        # As in reference.write_kv: a one-row scatter becomes select + dynamic-update-slice,
        # which inside the layer scan copies the whole cache; a dropped second row prevents it.
        rows = jnp.concatenate([rows, rows])
        pos = jnp.concatenate([pos, jnp.full((1,), cache.shape[2], pos.dtype)])
        vals = jnp.concatenate([vals, vals])
    return cache.at[layer, rows, pos].set(vals, mode="drop")


def _bucket(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


class NaiveEngine:
    """Static rows of max_model_len KV slots: prefill one request per step, decode all rows."""

    def __init__(self, loaded: LoadedModel, max_model_len: int, kv_cache_memory_bytes: int,
                 kv_cache_dtype: str = "auto", max_rows: int | None = None) -> None:
        self.spec = loaded.spec
        self.tokenizer = loaded.tokenizer
        self.graphdef, self.params = nnx.split(loaded.model)
        dtype = kv_dtype(kv_cache_dtype, loaded.model.dtype)
        per_row = (self.spec.num_layers * max_model_len * 2 * self.spec.num_kv_heads
                   * self.spec.head_dim * jnp.dtype(dtype).itemsize)
        rows = kv_cache_memory_bytes // per_row
        if max_rows is not None:
            rows = min(rows, max_rows)
        if rows < 1:
            raise ValueError(f"kv_cache_memory_bytes={kv_cache_memory_bytes} cannot hold one "
                             f"row of max_model_len={max_model_len} ({per_row} bytes)")
        self.rows = int(rows)
        self.max_model_len = max_model_len
        shape = (self.spec.num_layers, self.rows, max_model_len, self.spec.num_kv_heads,
                 self.spec.head_dim)
        self.cache = ContiguousCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        self.slots: list[_Row | None] = [None] * self.rows
        self.waiting: deque[_Row] = deque()
        self.finished: dict[str, list[int]] = {}
        self.stats = NaiveStats()
        self._jit = jax.jit(self._forward, static_argnames=("flags",), donate_argnames=("cache",))

    def _forward(self, params: Any, cache: ContiguousCache, ids: Int[Array, "B Q"],
                 rows: Int[Array, " B"], start: Int[Array, " B"], q_len: Int[Array, " B"],
                 sampling: SamplingBatch, flags: SamplingFlags):
        model = nnx.merge(self.graphdef, params)
        b, nq = ids.shape
        positions = start[:, None] + jnp.arange(nq)[None, :]  # [B, Q]
        valid = jnp.arange(nq)[None, :] < q_len[:, None]
        kv_lens = start + q_len
        # Invalid (padding) tokens write past the row end, which the scatter drops.
        write_pos = jnp.where(valid, positions, self.max_model_len)
        r = jnp.broadcast_to(rows[:, None], (b, nq))

        def attn_fn(i: int, q: jax.Array, k: jax.Array, v: jax.Array,
                    state: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, Any]:
            ck, cv = state
            d = k.shape[2]
            ck = _write_rows(ck, i, r, write_pos, k)
            cv = _write_rows(cv, i, r, write_pos, v)
            out = dense_attention_contiguous(
                q.reshape(b, nq, q.shape[1], d), ck[i, rows], cv[i, rows], positions, kv_lens,
                sm_scale=self.spec.attn_scale, soft_cap=self.spec.attn_logit_softcapping,
                sliding_window=self.spec.window_of(i))
            return out.reshape(b * nq, q.shape[1], d), (ck, cv)

        hidden, (ck, cv) = model(ids.reshape(-1), positions.reshape(-1), attn_fn,
                                 (cache.k, cache.v))
        last = jnp.arange(b) * nq + jnp.maximum(q_len - 1, 0)
        logits = model.compute_logits(hidden[last])
        tok = sample(logits, sampling, flags)[0]
        return tok, ContiguousCache(ck, cv)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request (FCFS)."""
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit "
                             f"max_model_len={self.max_model_len}")
        self.waiting.append(_Row(request_id, list(prompt_token_ids), params))

    def has_unfinished_requests(self) -> bool:
        """True while rows are busy or requests wait."""
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def _sampling(self, rows: list[_Row | None]) -> tuple[SamplingBatch, SamplingFlags]:
        sb = default_sampling(len(rows), self.spec.vocab_size)
        for i, r in enumerate(rows):
            if r is not None:
                sb.temperature[i] = 0.0 if r.params.greedy else r.params.temperature
                sb.seeds[i] = r.params.seed or 0
                sb.counters[i] = len(r.output)
        flags = SamplingFlags()
        return sb, flags

    def _run(self, ids: np.ndarray, rows: np.ndarray, start: np.ndarray, q_len: np.ndarray,
             owners: list[_Row | None]) -> np.ndarray:
        sb, flags = self._sampling(owners)
        tok, self.cache = self._jit(self.params, self.cache, ids, rows, start, q_len, sb,
                                    flags=flags)
        return np.asarray(tok)

    def _finish_token(self, row_idx: int, row: _Row, tok: int) -> None:
        row.output.append(tok)
        self.stats.generated_tokens += 1
        p = row.params
        stop = tok in p.all_stop_token_ids and len(row.output) >= p.min_tokens
        if stop or len(row.output) >= (p.max_tokens or self.max_model_len) or (
                row.length + 1 >= self.max_model_len):
            self.finished[row.request_id] = row.output
            self.slots[row_idx] = None

    def step(self) -> None:
        """Admit and prefill one waiting request into a free row, else decode every busy row."""
        t0 = time.perf_counter()
        free = [i for i, r in enumerate(self.slots) if r is None]
        if self.waiting and free:
            row = self.waiting.popleft()
            i = free[0]
            self.slots[i] = row
            toks = row.prompt + row.output
            q = _bucket(len(toks))
            ids = np.zeros((1, q), np.int32)
            ids[0, :len(toks)] = toks
            tok = self._run(ids, np.array([i], np.int32), np.zeros(1, np.int32),
                            np.array([len(toks)], np.int32), [row])
            row.length = len(toks)
            self._finish_token(i, row, int(tok[0]))
        else:
            busy = [i for i, r in enumerate(self.slots) if r is not None]
            if not busy:
                return
            ids = np.zeros((self.rows, 1), np.int32)
            start = np.zeros(self.rows, np.int32)
            q_len = np.zeros(self.rows, np.int32)
            for i in busy:
                r = self.slots[i]
                ids[i, 0] = r.output[-1]
                start[i] = r.length
                q_len[i] = 1
            tok = self._run(ids, np.arange(self.rows, dtype=np.int32), start, q_len,
                            list(self.slots))
            for i in busy:
                r = self.slots[i]
                r.length += 1
                self._finish_token(i, r, int(tok[i]))
        busy_rows = [r for r in self.slots if r is not None]
        self.stats.steps += 1
        self.stats.max_concurrency = max(self.stats.max_concurrency, len(busy_rows))
        if busy_rows:
            allocated = len(busy_rows) * self.max_model_len
            used = sum(r.length for r in busy_rows)
            self.stats.waste_sum += (allocated - used) / allocated
            self.stats.waste_steps += 1
        self.stats.wall_s += time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run token-id prompts to completion; returns generated ids in input order."""
        ids = [f"naive-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            self.add_request(rid, p, params)
        while self.has_unfinished_requests():
            self.step()
        return [self.finished.pop(rid) for rid in ids]
