"""Per-layer paged attention: the reference vs the chunk-skipping XLA version on CPU shapes.

Each case is one step of the embedded model's attention (9 query / 3 KV heads, head_dim 64,
16-token blocks, float32) padded to an engine bucket: the median of `repeats` jitted calls
after a warm-up call. The figures are per layer; an engine step runs it once per layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.bench.timing import median_call_s
from pallas_kernels import reference, xla_attention
from pallas_kernels.bench_inputs import paged_batch

# name -> (seq_lens, q_lens, padded token count)
CASES: dict[str, tuple[list[int], list[int], int]] = {
    "prefill 1 x 1000 (T=1024)": ([1000], [1000], 1024),
    "prefill 4 x 256 (T=1024)": ([256] * 4, [256] * 4, 1024),
    "chunked prefill 256 over a 768 prefix (T=256)": ([1024], [256], 256),
    "decode 8 seqs of 40..270": (list(np.random.default_rng(0).integers(40, 270, 8)), [1] * 8, 8),
    "decode 64 seqs of 40..600": (list(np.random.default_rng(1).integers(40, 600, 64)), [1] * 64,
                                  64),
}
IMPLS = {"reference": reference.ragged_paged_attention,
         "xla": xla_attention.ragged_paged_attention}


def run(repeats: int = 5, cases: dict[str, tuple[list[int], list[int], int]] | None = None
        ) -> list[dict[str, Any]]:
    """Milliseconds per call of each implementation on each case, and their ratio."""
    rows = []
    for i, (name, (lens, qlens, t)) in enumerate((cases or CASES).items()):
        lens = [int(x) for x in lens]
        batch = paged_batch(jax.random.key(i), lens, qlens, hq=9, hkv=3, d=64, bs=16,
                            page_dtype=jnp.float32, q_dtype=jnp.float32,
                            pad_tokens=t - sum(qlens))
        args = (batch.q, batch.k_pages, batch.v_pages, batch.qsl, batch.seq_lens,
                batch.tables[0])
        ms = {}
        for impl, fn in IMPLS.items():
            ms[impl] = 1e3 * median_call_s(jax.jit(fn), *args, repeats=repeats)
        rows.append({"case": name, "reference_ms": ms["reference"], "xla_ms": ms["xla"],
                     "speedup": ms["reference"] / ms["xla"]})
    return rows
