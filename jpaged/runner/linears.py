"""The decode projections' kernels as the step's `DecodeLinears` (models/linear_ops.py).

With the Pallas backend, steps of at most `DECODE_MATMUL_MAX_ROWS` tokens run every decoder
layer's projections on the weight-streaming kernels of `pallas_kernels/decode_matmul.py`
(Pallas interpreter off GPU); larger steps keep XLA's GEMMs, which reuse each weight tile
across many rows. A model whose shapes the kernels cannot take keeps XLA's GEMMs, and says
why once in the log. Quantized projections (models/quant_layers.py) run on the same kernels,
which read their bytes as they lie (docs/kernels.md, "Quantized weights"), when every layer's
formats suit them (`unsupported_reason` with the model's quantization plan). The output head
(logits) rides the same linears (`DecodeLinears.logits`) when it suits the kernel too
(`head_unsupported`); else it stays on XLA's GEMM, said once in the log.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from models.config import ModelSpec
from models.linear_ops import DecodeLinears
from models.quant import QuantWeight
from models.quant_layers import QuantLayout
from models.sharding import ROW_SPLIT, plan_layout, vocab_splits
from pallas_kernels import decode_matmul as dm
from pallas_kernels.reference import rope_rows

logger = logging.getLogger("jpaged.runner")

# The largest step (tokens) that runs on the kernels. A program's tile holds up to 64 rows,
# so up to 64 rows a launch reads each weight byte once; past that each row block reads it
# again (from L2 when the blocks run together). The device check times both paths at batch
# 1/16/64/256 (`ms_xla`, `ms_kernels`): the crossover is where they meet.
DECODE_MATMUL_MAX_ROWS = 64
# With integer-quantized projections (int4, int8) the kernels take steps of up to 256 tokens
# (the largest decode bucket): XLA's path dequantizes each such weight into a bf16 copy and
# multiplies that (models/quant.py's quant_matmul; a deviceless H200 compile of the 8B int4
# step at batch 256 writes 14 GB of weight copies), which costs more than the kernels' re-reads
# of each weight slab by their 4 row blocks. fp8 weights keep 64: XLA's GEMM reads the fp8
# bytes itself.
QUANT_DECODE_MATMUL_MAX_ROWS = 256


# A decoder layer's projection in a quantization plan: (the layer's path, the module's name).
_LAYER_PROJ = re.compile(r"^(.*\.layers\.[^.]+)\.(?:self_attn|mlp)\.(\w+_proj)$")
# The four launches of a layer: their weights in launch order.
_LAUNCHES = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")),
             ("o", ("o_proj",)), ("down", ("down_proj",)))


def _layer_formats(quant_plan: Mapping[str, QuantLayout]
                   ) -> dict[str, dict[str, dm.QuantFormat]]:
    """Per decoder layer (its path), the format of each quantized projection of it."""
    out: dict[str, dict[str, dm.QuantFormat]] = {}
    for path, layout in quant_plan.items():
        m = _LAYER_PROJ.match(path)
        if m:
            out.setdefault(m.group(1), {})[m.group(2)] = dm.QuantFormat(
                layout.kind, layout.group_size, layout.has_min)
    return out


def unsupported_reason(spec: ModelSpec, dtype: jnp.dtype, tensor_parallel_size: int = 1,
                       quant_plan: Mapping[str, QuantLayout] | None = None) -> str | None:
    """Why this model's projections cannot take the kernels (per device), or None.

    `quant_plan` (`plan_of(model)`): the quantized linears; every layer's launches
    are checked with their weights' formats (a row-split projection's groups as each device
    holds them).
    """
    tp = tensor_parallel_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    # K and V split by columns unless their heads are replicated (models/sharding.py's rule).
    kv_local = kv // tp if plan_layout(spec, tp).kv_replicas == 1 else kv
    shapes = [(spec.hidden_size, (q // tp, kv_local, spec.intermediate_size // tp)),
              (q // tp, (spec.hidden_size,)), (spec.intermediate_size // tp, (spec.hidden_size,))]
    for k, ns in shapes:
        why = dm.unsupported(1, k, ns, dtype)
        if why is not None:
            return why
    launches = {"qkv": (spec.hidden_size, (q // tp, kv_local, kv_local)),
                "gate_up": (spec.hidden_size, (spec.intermediate_size // tp,)),
                "o": (q // tp, (spec.hidden_size,)),
                "down": (spec.intermediate_size // tp, (spec.hidden_size,))}
    checked: dict[tuple, str | None] = {}
    for layer, fmts in sorted(_layer_formats(quant_plan or {}).items()):
        for launch, modules in _LAUNCHES:
            k, ns = launches[launch]
            formats = tuple(_local_format(fmts.get(m), m, k, tp) for m in modules)
            key = (launch, formats)
            if key not in checked:
                checked[key] = dm.unsupported(1, k, ns, dtype, formats)
            if checked[key] is not None:
                return f"{layer}.{launch}: {checked[key]}"
    return None


def _local_format(f: dm.QuantFormat | None, module: str, k_local: int, tp: int
                  ) -> dm.QuantFormat | None:
    """A projection's format as one device holds it: a row-split one's rows are cut in `tp`
    (its groups kept whole, models/quant_layers.check_quant_splits; a per-channel scale is
    then per channel of each device's rows)."""
    if f is None or tp == 1 or module not in ROW_SPLIT or f.group_size <= k_local:
        return f
    return dm.QuantFormat(f.kind, k_local, f.has_mins)


def head_format(spec: ModelSpec, quant_plan: Mapping[str, QuantLayout] | None = None
                ) -> dm.QuantFormat | None:
    """The output head's format in a quantization plan (None: a float head): lm_head's, or a
    tied model's embedding table's."""
    layout = (quant_plan or {}).get("model.embed_tokens" if spec.tie_word_embeddings
                                    else "lm_head")
    return None if layout is None else dm.QuantFormat(layout.kind, layout.group_size,
                                                      layout.has_min)


def head_unsupported(spec: ModelSpec, dtype: jnp.dtype, tensor_parallel_size: int = 1,
                     quant_plan: Mapping[str, QuantLayout] | None = None) -> str | None:
    """Why the model's output head cannot take the logits kernel (per device), or None.

    Tensor parallel runs it per device on the vocab-split head; a head the loaders replicate
    (quantized, or a vocabulary the mesh does not divide) keeps XLA's path there.
    """
    fmt = head_format(spec, quant_plan)
    tp = tensor_parallel_size
    if tp > 1 and (fmt is not None or not vocab_splits(spec, tp)):
        what = "a quantized head" if fmt is not None else f"vocabulary {spec.vocab_size}"
        return (f"{what} is replicated under tensor_parallel_size={tp} (the kernel runs a "
                "vocab-split float head per device)")
    return dm.logits_unsupported(spec.hidden_size, spec.vocab_size // tp, dtype, fmt,
                                 transposed=spec.tie_word_embeddings)


def kernel_linears(interpret: bool, max_rows: int = DECODE_MATMUL_MAX_ROWS,
                   logits_max_rows: int | None = DECODE_MATMUL_MAX_ROWS) -> DecodeLinears:
    """The weight-streaming kernels behind the `DecodeLinears` seam; the output head's kernel
    for up to `logits_max_rows` rows (None: the head keeps XLA's GEMM)."""

    def qkv(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, bq: jax.Array | None,
            bk: jax.Array | None, bv: jax.Array | None, *, norm_weight: jax.Array,
            norm_eps: float, norm_offset: float,
            rope: tuple[jax.Array, jax.Array] | None = None, head_dim: int | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
        # RoPE in the kernel's epilogue where its tiles allow (head_dim / 2 >= 16), else after.
        fused = rope is not None and dm.rope_fits(
            head_dim, [dm.weight_shape(w)[1] for w in (wq, wk, wv)])
        q, k, v = dm.projections(x, [wq, wk, wv], [bq, bk, bv], norm_weight=norm_weight,
                                 norm_eps=norm_eps, norm_offset=norm_offset,
                                 rope=rope if fused else None, rope_outputs=2 if fused else 0,
                                 head_dim=head_dim, interpret=interpret)
        if rope is not None and not fused:
            q, k = (rope_rows(y, *rope, head_dim) for y in (q, k))
        return q, k, v

    def gate_up(x: jax.Array, wg: jax.Array, wu: jax.Array, bg: jax.Array | None,
                bu: jax.Array | None, *, act: str, norm_weight: jax.Array, norm_eps: float,
                norm_offset: float) -> jax.Array:
        return dm.gated_up(x, wg, wu, bg, bu, act=act, norm_weight=norm_weight,
                           norm_eps=norm_eps, norm_offset=norm_offset, interpret=interpret)

    def out(x: jax.Array, w: jax.Array, b: jax.Array | None,
            residual: jax.Array | None) -> jax.Array:
        if residual is None:
            return dm.projections(x, [w], [b], interpret=interpret)[0]
        return dm.projection_residual(x, w, residual, b, interpret=interpret)

    def logits(h: jax.Array, w: jax.Array | QuantWeight, *, transposed: bool) -> jax.Array:
        return dm.logits(h, w, transposed=transposed, interpret=interpret)

    if logits_max_rows is None:
        return DecodeLinears("pallas", max_rows, qkv, gate_up, out)
    return DecodeLinears("pallas", max_rows, qkv, gate_up, out, logits=logits,
                         logits_max_rows=logits_max_rows)


def is_gpu_platform(platform: str) -> bool:
    """Whether kernels compile for a GPU on this platform (else the Pallas interpreter)."""
    return platform in ("gpu", "cuda", "rocm")


def rope_in_kernel(spec: ModelSpec) -> bool:
    """Whether every layer's q/k/v launch applies RoPE itself (no q/k norm comes between,
    half a head is >= 16 columns): the condition for writing K/V from the same launch."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return not spec.qk_norm and dm.rope_fits(spec.head_dim, [q, kv, kv])


def fused_qkv_write(x: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array,
                    bq: jax.Array | None, bk: jax.Array | None, bv: jax.Array | None, *,
                    pages: tuple[jax.Array, jax.Array], slot_mapping: jax.Array,
                    slot_region: int | jax.Array, scales: tuple[jax.Array, jax.Array],
                    norm_weight: jax.Array, norm_eps: float, norm_offset: float,
                    rope: tuple[jax.Array, jax.Array], head_dim: int, interpret: bool
                    ) -> tuple[jax.Array, ...]:
    """q, k, v (RoPE in the epilogue) with k and v also written into `pages` at the slot
    mapping's slots plus `slot_region` (the layer's rows of a shared pool): q, k, v, k pages,
    v pages. The region is added here, not in the kernel: one kernel serves every layer (a
    static offset would compile a variant a layer), and XLA computes all layers' slots in one
    multi-output fusion before the first layer."""
    slots = jnp.where(slot_mapping < 0, -1, slot_mapping + slot_region)
    q, k, v, kp, vp = dm.projections(
        x, [wq, wk, wv], [bq, bk, bv], norm_weight=norm_weight, norm_eps=norm_eps,
        norm_offset=norm_offset, rope=rope, rope_outputs=2, head_dim=head_dim, kv_pages=pages,
        kv_slots=slots, kv_scales=scales, interpret=interpret)
    return q, k, v, kp, vp


def select_linears(backend: str, platform: str, spec: ModelSpec, dtype: jnp.dtype,
                   tensor_parallel_size: int = 1,
                   quant_plan: Mapping[str, QuantLayout] | None = None
                   ) -> DecodeLinears | None:
    """The kernels when the attention backend is Pallas and the model's shapes (and its
    quantized weights' formats, `plan_of(model)`) fit, else None. Integer-quantized
    projections keep the kernels up to QUANT_DECODE_MATMUL_MAX_ROWS tokens a step, and an
    integer-quantized head up to as many rows (a float or fp8 head: DECODE_MATMUL_MAX_ROWS,
    where XLA's GEMM reads the head's own bytes); a head the kernel cannot take keeps XLA's
    GEMM (`head_unsupported`, logged)."""
    if not backend.startswith("pallas"):
        return None
    why = unsupported_reason(spec, dtype, tensor_parallel_size, quant_plan)
    if why is not None:
        logger.warning("decode projections stay on XLA's GEMMs: %s", why)
        return None
    integer = any(f.kind in ("int4", "int8") for fmts in _layer_formats(quant_plan or {}).values()
                  for f in fmts.values())
    head_rows = None
    why = head_unsupported(spec, dtype, tensor_parallel_size, quant_plan)
    if why is not None:
        logger.warning("the output head stays on XLA's GEMM: %s", why)
    else:
        fmt = head_format(spec, quant_plan)
        head_rows = (QUANT_DECODE_MATMUL_MAX_ROWS if fmt is not None and fmt.kind != "fp8"
                     else DECODE_MATMUL_MAX_ROWS)
    return kernel_linears(interpret=not is_gpu_platform(platform),
                          max_rows=QUANT_DECODE_MATMUL_MAX_ROWS if integer
                          else DECODE_MATMUL_MAX_ROWS, logits_max_rows=head_rows)
