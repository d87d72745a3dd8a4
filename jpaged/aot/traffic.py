"""The HBM figures of one compiled step case: what its kernels read, the least it could move.

`StepTraffic` describes a case (shape, context, model and pool geometry per device); from it come
the Pallas kernels' read rules for `hbm.estimate_traffic` and `min_hbm_bytes`, and `hbm_fields`
gives the JSON fields of a case from the compiled program's optimized HLO text.

Kernel rules, per launch (one layer): `kv_write` writes the step's new tokens' K (and V) rows and
reads none of the pool, as does a `decode_matmul_proj` launch that writes them (the decode
matmuls read their weights and inputs whole and write their outputs whole); the split-K
decode kernel `paged_decode_ppb{P}_ppp{Q}` reads, per
sequence, its context rounded up to its P-page steps, and stores the f32 partials (acc, m, l)
of the Q-page partitions holding a visible key, real query rows only; the tiled kernel
`ragged_paged_qt{T}_ppb{P}` reads, per query tile of T tokens, the keys up to the tile's last
position rounded up to P pages (each sequence prefilling tokens / seqs tokens from position 0,
or, in a verifying step, scoring them as the last of its context).
The engine's steps launch one of the two (a decode step the split-K kernel); a kernel launched
inactive anyway (the kernels' `decode_only=None` dispatch) reads no page, and the tiled one
stores nothing then. Both attention kernels read K and V of their own kv heads only. The XLA
path's chunk loop, whose trip count is data, runs the trips its schedule gives the case
(`StepTraffic.loop_trips`), each gathering its chunks' pages.

`hbm_bytes` is a greedy batch's traffic: the sampler's lax.conds run no random draw and no
top-k/top-p filtering when no row asks (conditionals at their smallest branch);
`hbm_bytes_sampling` counts their largest branch (a batch with a filtered random row whose
filters the draw's candidates cannot settle, so that it searches the whole row too);
`hbm_bytes_sampling_candidates` a batch whose filtering rows the candidates settle (a top-k of
at most 64, a nucleus above the best run of 64 tokens left out: jpaged/runner/sampler.py), its
whole-row conditionals (`WHOLE_ROW_SCOPE`) at their smallest branch; in a program with no
candidate path (`CANDIDATES_SCOPE` absent: a vocabulary too small for it) it is
`hbm_bytes_sampling`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from jpaged.aot.hbm import HbmModel, KernelRule, estimate_traffic
from jpaged.aot.target import H200_HBM_BYTES_PER_S, HBM_REALISTIC_FRACTION
from jpaged.intmath import cdiv
from jpaged.runner.sampler import CANDIDATES_SCOPE, WHOLE_ROW_SCOPE

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096)
# Every key a case row carries (None when its program did not compile).
HBM_KEYS = ("context_len", "hbm_bytes", "hbm_bytes_sampling", "hbm_bytes_sampling_candidates",
            "min_hbm_bytes", "traffic_ratio",
            "param_copy_bytes", "param_collective_bytes", "predicted_step_ms",
            "predicted_step_ms_at_80pct", "kernel_hbm_bytes", "hbm_notes", "context_fits_pool",
            "largest_traffic")


_CHUNK_LOOP = re.compile(r"xla_chunks_t(\d+)_g(\d+)_ck(\d+)_n(\d+)(?:_w(\d+))?")


def _param(name: str, key: str) -> int:
    m = re.search(rf"{key}(\d+)", name)
    if not m:
        raise ValueError(f"kernel name {name!r} has no {key}<n>")
    return int(m.group(1))


def _window(name: str) -> int | None:
    """The sliding window a kernel was specialized to (its `_w<N>` suffix), None: full."""
    m = re.search(r"_w(\d+)", name)
    return None if m is None else int(m.group(1))


def _reach(first_key: int, end: int, step: int) -> int:
    """Keys read, in whole `step`-key units, by a kernel whose queries see keys first_key ..
    end-1 (first_key <= 0: from the start): the steps from the one holding first_key on."""
    return (cdiv(end, step) - max(0, first_key) // step) * step


@dataclass(frozen=True)
class StepTraffic:
    """One step case on one device: (tokens, seqs) at a context length, and the geometry."""

    tokens: int
    seqs: int
    context_len: int  # tokens of each sequence the step attends over (its new ones included)
    num_layers: int
    block_size: int
    kv_heads: int  # per device
    head_dim: int
    page_bytes: int  # bytes of one stored K (or V) element: 2 for bf16, 1 for fp8
    vocab_size: int
    param_bytes: int  # per device
    num_blocks: int  # pool blocks per layer
    layer_windows: tuple[int | None, ...] = ()  # per layer (None: full); () = all full
    q_per_kv: int = 1  # query heads per KV head on this device
    model_bytes: int = 2  # bytes of one activation element (the model's dtype)
    # A verifying step (speculative decoding): each sequence's tokens // seqs new tokens are
    # the last of its context_len (its input token and proposals), each one a logits row.
    verifying: bool = False
    # A mixture of experts: sparse layers, experts a layer, experts a token, and the bytes of
    # one expert's matrix (gate, up or down: the same size) on this device. 0: a dense model.
    sparse_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_matrix_bytes: int = 0
    expert_width: int = 0  # one expert's (per-device) width, the down matrix's K
    expert_hidden: int = 0  # the model's hidden size, the gate and up matrices' K

    @property
    def experts_read(self) -> float:
        """Experts a sparse layer's step reads, the data-dependent part of an MoE step: the
        number a batch of `tokens` routed uniformly is expected to choose,
        E * (1 - (1 - k/E)^tokens), which both the kernel's reads and the minimum count."""
        if not self.num_experts:
            return 0.0
        e = self.num_experts
        return e * (1 - (1 - self.top_k / e) ** self.tokens)

    @property
    def unread_expert_bytes(self) -> int:
        """Bytes of the experts a step leaves unread (every sparse layer, 3 matrices each)."""
        unread = self.num_experts - self.experts_read
        return round(self.sparse_layers * 3 * unread * self.expert_matrix_bytes)

    @property
    def decode(self) -> bool:
        """One new token per sequence: the split-K decode kernel is the active one."""
        return self.tokens == self.seqs

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer on this device."""
        return self.kv_heads * self.head_dim * self.page_bytes

    def kernel_rule(self, name: str) -> KernelRule | None:
        """Pool bytes one launch of the named Pallas kernel reads / writes (None: unknown)."""
        if name.startswith("kv_write"):
            return KernelRule(0, self.tokens * self.row_bytes)
        if name.startswith("decode_matmul_"):
            # Each weight, x and the other inputs read once, its outputs written once (counted
            # whole); the q/k/v launch that writes K/V stores the new tokens' rows, as kv_write.
            return KernelRule(0, self.tokens * self.row_bytes)
        if name.startswith("paged_decode_"):
            if not self.decode:
                return KernelRule(0, 0)
            step = _param(name, "ppb") * self.block_size
            part = _param(name, "ppp") * self.block_size
            w, ctx = _window(name), self.context_len
            keys = _reach(0 if w is None else max(0, ctx - w), ctx, step)
            # Partials (acc, m, l in f32) of the partitions holding a visible key, real rows.
            return KernelRule(self.seqs * keys * self.row_bytes, 0,
                              write=self._partial_bytes(part, w))
        if name.startswith("paged_merge_"):
            if not self.decode:
                return KernelRule(0, 0)
            # It loads those partials and the lengths, and stores the merged real rows in the
            # model's dtype.
            rows = self.seqs * self.kv_heads * self.q_per_kv
            return KernelRule(0, 0, write=rows * self.head_dim * self.model_bytes,
                              read=self._partial_bytes(_param(name, "pk"), _window(name))
                              + self.seqs * 4)
        if name.startswith("moe_grouped_"):
            # Its tile-expert map and padded rows whole, and of each [E, K, N] weight (gate and
            # up together, or one) only the experts its tiles hold (experts_read); its output
            # counted whole.
            weights = 2 if name.startswith("moe_grouped_gate_up") else 1
            tiles = cdiv(self.tokens * self.top_k, 16) + min(self.num_experts,
                                                           self.tokens * self.top_k)
            rows = tiles * 16 * max(self.expert_hidden, self.expert_width) * self.model_bytes
            return KernelRule(0, 0, read=4 * tiles + rows
                              + round(weights * self.experts_read * self.expert_matrix_bytes))
        if name.startswith("ragged_paged_"):
            if self.decode:  # launched inactive: no tile has a valid row
                return KernelRule(0, 0, idle=True)
            qt, step = _param(name, "qt"), _param(name, "ppb") * self.block_size
            n, w, at = max(1, self.tokens // self.seqs), _window(name), self.first_new
            # Tile j holds rows j*qt .. min((j+1)*qt, n)-1 (positions from `at` on); its first
            # row sees w keys back.
            keys = sum(_reach(0 if w is None else at + j * qt - w + 1,
                              at + min((j + 1) * qt, n), step) for j in range(cdiv(n, qt)))
            # It stores the real rows of its output tiles: every token's query heads, in the
            # model's dtype (f32 for fp8 pages, whose v_scale is applied after).
            out = 4 if self.page_bytes == 1 else self.model_bytes
            rows = self.tokens * self.kv_heads * self.q_per_kv * self.head_dim * out
            return KernelRule(self.seqs * keys * self.row_bytes, 0, write=rows)
        return None

    def _partial_bytes(self, part_keys: int, window: int | None) -> int:
        """The split-K decode kernel's f32 partials (acc, m, l) for the real query rows of the
        `part_keys`-key partitions that hold a key the window sees, in this decode case."""
        ctx = self.context_len
        first = 0 if window is None else max(0, ctx - window)
        parts = cdiv(ctx, part_keys) - first // part_keys
        return self.seqs * self.kv_heads * self.q_per_kv * parts * (self.head_dim + 2) * 4

    def loop_trips(self, op_name: str) -> int | None:
        """Trips of the XLA attention's chunk loop (`xla_chunks_t{T}_g{G}_ck{K}_n{N}[_w{W}]` in
        its op_name) in this case, as `pallas_kernels.xla_attention` schedules them: each
        T-token query tile needs the K-key chunks from the one its first query's window reaches
        to the one holding its last query; rank j's tiles run G per trip. None: another loop."""
        m = _CHUNK_LOOP.search(op_name)
        if m is None:
            return None
        tile, group, ck, n_chunks = (int(m.group(k)) for k in range(1, 5))
        w = None if m.group(5) is None else int(m.group(5))
        if self.decode:  # one token per sequence, at position context_len - 1
            spans = [(self.context_len - 1, self.context_len - 1)] * self.seqs
        else:  # each sequence's tokens // seqs new tokens, from position `first_new` on
            n, at = max(1, self.tokens // self.seqs), self.first_new
            spans = [(at + k * tile, at + min((k + 1) * tile, n) - 1)
                     for k in range(cdiv(n, tile))]
            spans *= self.seqs
        need = []
        for first, last in spans:
            end = min(last // ck + 1, n_chunks)
            start = 0 if w is None else min(max(first - w + 1, 0) // ck, end)
            need.append(end - start)
        return sum(cdiv(sum(1 for x in need if x > j), group) for j in range(n_chunks))

    @property
    def first_new(self) -> int:
        """Position of each sequence's first new token: 0 (a prefill), or in a verifying
        step context_len - tokens // seqs."""
        return self.context_len - self.tokens // self.seqs if self.verifying else 0

    def min_hbm_bytes(self) -> int:
        """Weights once (of a mixture of experts' experts, the ones `experts_read` counts),
        the attended K/V once (a sliding layer's window of it), the new K/V
        written once, f32 logits once (a row per sequence; in a verifying step per token)."""
        windows = self.layer_windows or (None,) * self.num_layers
        attended = sum(self.context_len if w is None else min(w, self.context_len)
                       for w in windows)
        kv = 2 * self.row_bytes * (self.seqs * attended + self.num_layers * self.tokens)
        rows = self.tokens if self.verifying else self.seqs
        return self.param_bytes - self.unread_expert_bytes + kv + rows * self.vocab_size * 4

    def min_hbm_bytes_rows(self) -> int:
        """The least this verifying step would move laid out as one single-token sequence a
        row (a decode step of its tokens): each row reads its sequence's context again."""
        return replace(self, seqs=self.tokens, verifying=True).min_hbm_bytes()

    def fits_pool(self) -> bool:
        """Whether the pool holds every sequence's context at once."""
        return self.seqs * cdiv(self.context_len, self.block_size) <= self.num_blocks


def predicted_ms(hbm_bytes: float, bandwidth: float = H200_HBM_BYTES_PER_S
                 ) -> tuple[float, float]:
    """ms to move `hbm_bytes` at `bandwidth` and at HBM_REALISTIC_FRACTION of it (rounded as
    the gpu-aot JSON keeps them)."""
    return (round(hbm_bytes / bandwidth * 1e3, 3),
            round(hbm_bytes / (bandwidth * HBM_REALISTIC_FRACTION) * 1e3, 3))


def hbm_fields(hlo_text: str, case: StepTraffic, num_weights: int, pool_shape: str,
               bandwidth: float = H200_HBM_BYTES_PER_S,
               lookup_weights: tuple[int, ...] = ()) -> dict[str, Any]:
    """The HBM_KEYS of one case from its program's optimized HLO text (`lookup_weights`: the
    entry parameters that are embedding tables)."""
    model = HbmModel(num_weights=num_weights, pool_shape=pool_shape,
                     lookup_weights=tuple(lookup_weights), kernel_rule=case.kernel_rule,
                     branch="smallest", loop_trips=case.loop_trips)
    t = estimate_traffic(hlo_text, model)
    sampling = estimate_traffic(hlo_text, replace(model, branch="largest"))
    # Without a candidate path (a vocabulary too small for one) the whole row is the only one.
    settled = sampling if CANDIDATES_SCOPE not in hlo_text else estimate_traffic(
        hlo_text, replace(model, branch="largest", skip_scopes=(WHOLE_ROW_SCOPE,)))
    least = case.min_hbm_bytes()
    at_peak, realistic = predicted_ms(t.hbm_bytes, bandwidth)
    return {
        "context_len": case.context_len, "hbm_bytes": t.hbm_bytes,
        "hbm_bytes_sampling": sampling.hbm_bytes,
        "hbm_bytes_sampling_candidates": settled.hbm_bytes, "min_hbm_bytes": least,
        "traffic_ratio": round(t.hbm_bytes / least, 3),
        "param_copy_bytes": t.param_copy_bytes,
        "param_collective_bytes": t.param_collective_bytes,
        "predicted_step_ms": at_peak, "predicted_step_ms_at_80pct": realistic,
        "kernel_hbm_bytes": t.kernel_bytes, "hbm_notes": t.notes,
        "context_fits_pool": case.fits_pool(),
        "largest_traffic": t.largest(),
    }

