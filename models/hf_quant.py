"""Hugging Face checkpoints quantized by their producer -> jpaged's device form (models/quant.py),
losslessly: every weight the device holds dequantizes to exactly the float its format defines.

config.json's `quantization_config.quant_method` names the format (docs/quantization.md,
"Hugging Face checkpoints"):

  compressed-tensors  fp8 weights (llm-compressor): `weight` F8_E4M3 [N, K] and `weight_scale`
                      per tensor ([] / [1]) or per output channel ([N, 1]) -> fp8, scales [1, N]
  fp8                 vLLM's / transformers' fp8 (AutoFP8): `weight` F8_E4M3 and a per-tensor
                      `weight_scale` (or `weight_scale_inv`, multiplied all the same) -> fp8
  gptq                `qweight` int32 [K * bits / 32, N] (packed along K), `qzeros` int32
                      [G, N * bits / 32] (packed along N), `scales` [G, N], `g_idx` [K]:
                      w = (q - z) * s -> int4 (bits 4) or int8 (bits 8) with mins
  awq                 GEMM: `qweight` int32 [K, N / 8], `qzeros` int32 [G, N / 8] (packed along
                      N, nibbles in the order 0 2 4 6 1 3 5 7), `scales` [G, N] -> int4 + mins

A mixture of experts' linears (one per expert, `...experts.{e}.gate_proj` or Mixtral's `w1`)
are read and checked as any linear of their format, then a layer's E experts of one matrix are
stacked into one QuantExperts (k_axis 1), all quantized or none.

Static activation scales (`input_scale`) and KV-cache scales are ignored: the math is weight
only. Each quantized module is checked (tensors present, dtypes, shapes, group size, g_idx)
before the model is built; its device arrays are made when the loader reads them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from .moe import expert_matrices, expert_tensor_names
from .quant import QuantWeight, narrow_scales, pack_int4
from .quant_layers import QuantLayout, QuantSource, QuantTensors

METHODS = ("awq", "compressed-tensors", "fp8", "gptq")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# AWQ's GEMM packing: nibble i of an int32 holds column AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_QC = "quantization_config"
_FLOATS = tuple(np.dtype(d) for d in (np.float16, ml_dtypes.bfloat16, np.float32))


def quant_method(cfg: Mapping[str, Any], where: str) -> str | None:
    """The method of a config.json's `quantization_config` (None: the checkpoint is not
    quantized); ValueError naming the field when it is one jpaged cannot load."""
    qc = cfg.get(_QC)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: {_QC} must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ValueError(f"{where}: {_QC}.quant_method is missing or not a string "
                         f"({method!r})")
    method = method.lower()
    if method not in METHODS:
        raise ValueError(f"{where}: {_QC}.quant_method {method!r} is not a format jpaged "
                         f"loads (it loads: {', '.join(METHODS)})")
    return method


def check_requested(method: str | None, wanted: str | None, where: str) -> None:
    """ValueError naming both when `wanted` (load_model's quantization) is not the
    checkpoint's own method; None loads the checkpoint as it is."""
    if method is not None and wanted is not None and wanted != method:
        raise ValueError(f"{where} is quantized with {method!r} ({_QC}.quant_method); "
                         f"quantization={wanted!r} names another method (leave it out to "
                         "load the checkpoint's own)")


def hf_quantized(cfg: Mapping[str, Any], weights: Mapping[str, np.ndarray], model: nnx.Module,
                 where: str) -> tuple[dict[str, QuantLayout], QuantTensors]:
    """(plan, tensors) of a quantized HF checkpoint for `build_model(..., quant_plan=plan)`:
    `model` (abstract) gives the linears' shapes, `where` (config.json) names the config in
    errors. ValueError naming the field or tensor when the checkpoint is not loadable."""
    method = quant_method(cfg, where)
    if method is None:
        raise ValueError(f"{where} has no {_QC}")
    qc = cfg[_QC]
    linears = _linears(model)
    reader = _Reader(weights, where)
    experts = expert_matrices(model)
    if method == "gptq":
        modules = _gptq(qc, linears, reader, experts)
    elif method == "awq":
        modules = _awq(qc, linears, reader, experts)
    else:
        modules = _fp8(method, qc, linears, reader, experts)
    return {m: mod.layout for m, mod in modules.items()}, QuantTensors(weights, modules)


# ---------------------------------------------------------------------------------------------
# Shared checks


def _linears(model: nnx.Module) -> dict[str, tuple[int, int]]:
    """HF module path -> (in, out) of every linear layer."""
    return {".".join(map(str, path)): (node.in_features, node.out_features)
            for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)}


class _Reader:
    """Tensors by name with checks that name the tensor and its file."""

    def __init__(self, weights: Mapping[str, np.ndarray], where: str):
        self.weights, self.where = weights, where
        self.origin = getattr(weights, "origin", "<weights dict>")
        self._source = getattr(weights, "source_of", lambda _: self.origin)

    def has(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: str | None = None,
            what: str = "") -> np.ndarray:
        """The tensor, checked: present, of `shape`, and (dtype "int32") int32 or (dtype
        "float") float16, bfloat16 or float32."""
        if name not in self.weights:
            raise ValueError(f"checkpoint {self.origin} lacks tensor {name!r}{what}")
        arr = self.weights[name]
        if shape is not None and tuple(arr.shape) != shape:
            raise self.fail(name, f"has shape {tuple(arr.shape)}, expected {shape}{what}")
        allowed = {"int32": (np.dtype(np.int32),), "float": _FLOATS}.get(dtype or "", None)
        if allowed is not None and np.dtype(arr.dtype) not in allowed:
            raise self.fail(name, f"has dtype {np.dtype(arr.dtype)}, expected "
                            f"{' or '.join(d.name for d in allowed)}{what}")
        return arr

    def fail(self, name: str, message: str) -> ValueError:
        """A ValueError about tensor `name`."""
        return ValueError(f"tensor {name!r} in {self._source(name)} {message}")


def _field(qc: Mapping[str, Any], key: str, where: str, allowed: tuple[Any, ...],
           default: Any = None, prefix: str = _QC) -> Any:
    """qc[key] (or `default` when absent), ValueError naming the field unless in `allowed`."""
    value = qc.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: {prefix}.{key} = {value!r} is not supported (jpaged "
                         f"loads {' or '.join(map(repr, allowed))})")
    return value


def _group_size(qc: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> int:
    """The config's group size (-1: one group per column), ValueError naming the field."""
    key = next((k for k in keys if k in qc), keys[0])
    gs = qc.get(key)
    if isinstance(gs, bool) or not isinstance(gs, int) or (gs < 1 and gs != -1):
        raise ValueError(f"{where}: {_QC}.{key} = {gs!r} must be a positive integer or -1")
    return gs


def _groups(gs: int, k: int, module: str, where: str, bits: int = 4) -> int:
    """Input rows per group of `module` (K when gs is -1), checked to divide K evenly (and,
    for 4 bits, to pair up in bytes)."""
    size = k if gs == -1 else gs
    if k % size:
        raise ValueError(f"{where}: {_QC}.group_size {gs} does not divide the input size {k} "
                         f"of {module}")
    if bits == 4 and size % 2:
        raise ValueError(f"{where}: {_QC}.group_size {gs} of {module} is odd; 4-bit groups "
                         "need an even size")
    return size


def _scale_dtype(*arrays: np.ndarray) -> str:
    """float16 when every value of every array survives the cast exactly, else float32."""
    exact = all(np.dtype(narrow_scales(a).dtype) == np.float16 for a in arrays)
    return "float16" if exact else "float32"


def _packed_owner(names: Mapping[str, Any], leaves: tuple[str, ...],
                  linears: Mapping[str, Any], reader: _Reader) -> list[str]:
    """Modules with any of `leaves` (e.g. qweight, qzeros, scales), checked to be linears."""
    modules: dict[str, None] = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf in leaves:
            if module not in linears:
                raise reader.fail(name, "is quantized but names no linear layer of the model")
            modules[module] = None
    return list(modules)


def _expert_linears(experts: Mapping[str, tuple[int, int, int]]
                    ) -> tuple[dict[str, list[str]], dict[str, tuple[int, int]]]:
    """(stacked matrix -> its experts' HF linears in expert order, each expert's linear
    (`...experts.{e}.w1` / `gate_proj`) -> its (in, out)) of a model's expert matrices."""
    parts_of = {m: [name[:-len(".weight")] for name in expert_tensor_names(m, e)]
                for m, (e, _, _) in experts.items()}
    shapes = {p: (k, n) for m, (_, k, n) in experts.items() for p in parts_of[m]}
    return parts_of, shapes


def _all_or_none(parts: list[str], quantized: Container[str], reader: _Reader, stack: str,
                 form: str, leaf: str) -> bool:
    """Whether the experts' linears `parts` of stacked matrix `stack` are all quantized
    (True) or none is (False); a layer's experts are quantized together, so a mix is a
    ValueError naming the first unquantized one's tensor (`weight`, or `leaf` if absent)."""
    done = [p in quantized for p in parts]
    if all(done) or not any(done):
        return all(done)
    odd, layer = parts[done.index(False)], stack.rsplit(".", 1)[0]
    others = f"{sum(done)} of the {len(parts)} experts of {layer} are"
    if not reader.has(f"{odd}.weight"):
        raise ValueError(f"checkpoint {reader.origin} lacks tensor '{odd}.{leaf}' ({others} "
                         f"{form})")
    raise reader.fail(f"{odd}.weight", f"is not {form}, but {others} (a layer's experts are "
                      "quantized together)")


# ---------------------------------------------------------------------------------------------
# GPTQ and AWQ: integer values, a zero point and a scale per group


def _unpack(packed: np.ndarray, bits: int, axis: int,
            order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 words -> their 32 / bits values (uint8) along `axis`: value i of a word at bits
    [bits * i, bits * (i + 1)), unless `order` says which value nibble i holds."""
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    vals = (np.expand_dims(words, axis + 1) >> np.expand_dims(shifts, tuple(
        i for i in range(words.ndim + 1) if i != axis + 1))) & ((1 << bits) - 1)
    if order is not None:  # nibble i holds value order[i]: value j sits in nibble inv[j]
        vals = np.take(vals, np.argsort(order), axis=axis + 1)
    shape = list(words.shape)
    shape[axis] *= per
    return vals.astype(np.uint8).reshape(shape)


def _mins(zeros: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """float32 mins of w = (q - z) * s: -z * s for int4's 0..15, (128 - z) * s for int8's
    q - 128 (exact: a zero of at most 9 bits times a float16 or bfloat16 scale)."""
    offset = 0 if bits == 4 else 128
    return (offset - zeros.astype(np.float32)) * np.asarray(scales, np.float32)


def _int_weight(values: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int,
                group: int, dtype: str | None = None) -> QuantWeight:
    """Values [K, N] 0..2^bits-1, zeros and scales [G, N]: w = (q - z) * s as the device's
    int4 (bits 4, min -z*s) or int8 (bits 8, q - 128, min (128 - z) * s)."""
    s = np.asarray(scales, np.float32)
    mins = _mins(zeros, s, bits)
    if bits == 4:
        kind, q = "int4", pack_int4(values, group, 0)
    else:
        kind, q = "int8", (values.astype(np.int16) - 128).astype(np.int8)
    dtype = dtype or _scale_dtype(s, mins)
    return QuantWeight(kind, q, s.astype(dtype), mins.astype(dtype), 0)


@dataclass(frozen=True)
class _IntLinear:
    """One GPTQ / AWQ linear, checked: its group (input rows), the narrowest dtype that holds
    its scales and mins exactly, and `make(dtype)`, its device form with them in `dtype`."""

    group: int
    dtype: str
    make: Callable[[str], QuantWeight]


# How a format checks one packed linear: (module, in, out, group) -> the linear, checked.
_LinearCheck = Callable[[str, int, int, int], _IntLinear]


def _int_linear(group: int, bits: int, parts: Callable[[], tuple[np.ndarray, np.ndarray]],
                values: Callable[[], np.ndarray]) -> _IntLinear:
    """A checked linear of `parts()` (zeros, scales [G, N]) and `values()` ([K, N],
    0..2^bits-1), read again each time its device form is made."""
    zeros, scales = parts()
    dtype = _scale_dtype(scales, _mins(zeros, scales, bits))

    def make(dtype: str) -> QuantWeight:
        zeros, scales = parts()
        return _int_weight(values(), zeros, scales, bits, group, dtype)

    return _IntLinear(group, dtype, make)


def _int_modules(method: str, bits: int, gs: int, leaves: tuple[str, ...],
                 check: _LinearCheck, linears: Mapping[str, tuple[int, int]], reader: _Reader,
                 experts: Mapping[str, tuple[int, int, int]]) -> dict[str, QuantSource]:
    """The QuantSource of every linear holding `leaves` (`check` reads each as its format
    packs it): a dense linear on its own, a layer's experts stacked per matrix (k_axis 1,
    one layout for all: float32 scales and mins unless every expert's narrow to float16)."""
    where = reader.where
    parts_of, expert_linears = _expert_linears(experts)
    shapes = {**linears, **expert_linears}
    owners = _packed_owner(reader.weights, leaves, shapes, reader)
    groups = {m: _groups(gs, shapes[m][0], m, where, bits) for m in owners}  # config first
    checked = {m: check(m, *shapes[m], group) for m, group in groups.items()}
    kind = "int4" if bits == 4 else "int8"
    modules: dict[str, QuantSource] = {}
    for m, lin in checked.items():
        if m in linears:
            modules[m] = QuantSource(QuantLayout(kind, lin.group, True, lin.dtype),
                                     functools.partial(lin.make, lin.dtype), f"{m}.qweight")
    for m, parts in parts_of.items():
        if not _all_or_none(parts, checked, reader, m, f"{method}-packed ({', '.join(leaves)})",
                            "qweight"):
            continue  # (a layer's experts unquantized: they load as float)
        ones = [checked[p] for p in parts]  # one group: the config's, and every K is the same
        dtype = ones[0].dtype if len({o.dtype for o in ones}) == 1 else "float32"

        def make_stack(ones: list[_IntLinear] = ones, dtype: str = dtype) -> QuantWeight:
            ws = [o.make(dtype) for o in ones]
            return QuantWeight(kind, np.stack([w.q for w in ws]),
                               np.stack([w.scales for w in ws]),
                               np.stack([w.mins for w in ws]), 1)

        modules[m] = QuantSource(QuantLayout(kind, ones[0].group, True, dtype), make_stack,
                                 f"{parts[0]}.qweight")
    if not modules:
        raise ValueError(f"{where}: {_QC} says {method}, but no linear of {reader.origin} "
                         f"holds its packed tensors ({', '.join(leaves)})")
    return modules


def _gptq(qc: Mapping[str, Any], linears: Mapping[str, tuple[int, int]], reader: _Reader,
          experts: Mapping[str, tuple[int, int, int]]) -> dict[str, QuantSource]:
    where = reader.where
    bits = _field(qc, "bits", where, (4, 8))
    gs = _group_size(qc, where, ("group_size",))
    fmt = _field(qc, "checkpoint_format", where, ("gptq", "gptq_v2"), "gptq")
    if qc.get("is_marlin_format"):
        raise ValueError(f"{where}: {_QC}.is_marlin_format is true; jpaged loads GPTQ's own "
                         "packing only")
    desc_act = bool(qc.get("desc_act", False))
    offset = 1 if fmt == "gptq" else 0  # v1 stores each zero point less one
    per = 32 // bits

    def check(m: str, k: int, n: int, group: int) -> _IntLinear:
        what = f" (GPTQ, {bits}-bit, group {gs}, {m}: {k} in, {n} out)"
        if k % per or n % per:
            raise ValueError(f"{where}: {m} ({k} in, {n} out) does not pack {per} {bits}-bit "
                             "values a word")
        shapes = {"qweight": (k // per, n), "qzeros": (k // group, n // per),
                  "scales": (k // group, n)}
        for leaf, shape in shapes.items():
            reader.get(f"{m}.{leaf}", shape, "float" if leaf == "scales" else "int32",
                       what)
        if reader.has(f"{m}.g_idx") or desc_act:
            g_idx = np.asarray(reader.get(f"{m}.g_idx", (k,), "int32", what))
            if not np.array_equal(g_idx, np.arange(k) // group):
                raise reader.fail(f"{m}.g_idx", "reorders the input rows (desc_act / act-order "
                                  f"groups are not i // {group}); jpaged loads GPTQ without "
                                  "act-order only")

        def parts() -> tuple[np.ndarray, np.ndarray]:
            zeros = _unpack(reader.get(f"{m}.qzeros"), bits, 1).astype(np.int32) + offset
            return zeros, np.asarray(reader.get(f"{m}.scales"), np.float32)

        return _int_linear(group, bits, parts,
                           lambda: _unpack(reader.get(f"{m}.qweight"), bits, 0))

    return _int_modules("gptq", bits, gs, ("qweight", "qzeros", "scales", "g_idx"), check,
                        linears, reader, experts)


def _awq(qc: Mapping[str, Any], linears: Mapping[str, tuple[int, int]], reader: _Reader,
         experts: Mapping[str, tuple[int, int, int]]) -> dict[str, QuantSource]:
    where = reader.where
    _field(qc, "version", where, ("gemm", "GEMM"), "gemm")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {_QC}.bits = {bits!r} is not supported (AWQ GEMM is 4-bit)")
    _field(qc, "zero_point", where, (True,), True)
    gs = _group_size(qc, where, ("group_size", "q_group_size"))

    def check(m: str, k: int, n: int, group: int) -> _IntLinear:
        what = f" (AWQ, group {gs}, {m}: {k} in, {n} out)"
        if n % 8:
            raise ValueError(f"{where}: {m} has {n} outputs, not a multiple of AWQ's 8 a word")
        shapes = {"qweight": (k, n // 8), "qzeros": (k // group, n // 8),
                  "scales": (k // group, n)}
        for leaf, shape in shapes.items():
            reader.get(f"{m}.{leaf}", shape, "float" if leaf == "scales" else "int32",
                       what)

        def parts() -> tuple[np.ndarray, np.ndarray]:
            zeros = _unpack(reader.get(f"{m}.qzeros"), 4, 1, AWQ_ORDER).astype(np.int32)
            return zeros, np.asarray(reader.get(f"{m}.scales"), np.float32)

        return _int_linear(group, 4, parts,
                           lambda: _unpack(reader.get(f"{m}.qweight"), 4, 1, AWQ_ORDER))

    return _int_modules("awq", 4, gs, ("qweight", "qzeros", "scales"), check, linears, reader,
                        experts)


# ---------------------------------------------------------------------------------------------
# fp8: compressed-tensors and vLLM / transformers "fp8"


def _matches(name: str, patterns: list[Any], layer_class: str = "Linear") -> bool:
    """Whether a module matches a compressed-tensors target or ignore entry: its name, a
    "re:" regular expression of names, or its layer class."""
    for p in patterns:
        if not isinstance(p, str):
            continue
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p in (name, layer_class):
            return True
    return False


def _ct_targets(qc: Mapping[str, Any], where: str) -> list[Any]:
    """Targets of every config group, each group checked to be fp8 weights per tensor or per
    channel (ValueError naming the field otherwise)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: {_QC}.config_groups must be a non-empty object")
    fmt = qc.get("format")
    targets: list[Any] = []
    for gname, group in groups.items():
        prefix = f"{_QC}.config_groups.{gname}"
        if not isinstance(group, dict):
            raise ValueError(f"{where}: {prefix} must be an object")
        fmt = group.get("format", fmt)
        weights = group.get("weights")
        if weights is None:
            continue  # activations only: the weights stay as they are
        if not isinstance(weights, dict):
            raise ValueError(f"{where}: {prefix}.weights must be an object")
        prefix += ".weights"
        _field(weights, "type", where, ("float",), prefix=prefix)
        _field(weights, "num_bits", where, (8,), prefix=prefix)
        _field(weights, "strategy", where, ("tensor", "channel"), prefix=prefix)
        _field(weights, "symmetric", where, (True,), True, prefix=prefix)
        _field(weights, "dynamic", where, (False,), False, prefix=prefix)
        targets += group.get("targets") or []
    _field({"format": fmt}, "format", where, ("float-quantized", "naive-quantized", None))
    return targets


def _fp8(method: str, qc: Mapping[str, Any], linears: Mapping[str, tuple[int, int]],
         reader: _Reader, experts: Mapping[str, tuple[int, int, int]] | None = None
         ) -> dict[str, QuantSource]:
    where = reader.where
    if method == "compressed-tensors":
        targets = _ct_targets(qc, where)
        ignore = qc.get("ignore") or []
        expected = {m for m in linears if _matches(m, targets) and not _matches(m, ignore)}
        scale_leaves = ("weight_scale",)
    else:  # vLLM's / transformers' fp8: the tensors say which modules are quantized
        block = qc.get("weight_block_size")
        if block is not None:
            raise ValueError(f"{where}: {_QC}.weight_block_size = {block!r}: block-wise fp8 "
                             "(a scale per block of input rows) is not supported; jpaged's fp8 "
                             "keeps one scale per output channel")
        expected = None
        scale_leaves = ("weight_scale", "weight_scale_inv")
    # A layer's experts: one HF linear per expert (`...experts.{e}.w1` / `gate_proj`), each
    # checked as a linear is, stacked into one QuantExperts (float32 scales per expert).
    parts_of, expert_linears = _expert_linears(experts or {})
    if expected is not None and method == "compressed-tensors":
        expected |= {m for m in expert_linears if _matches(m, targets)
                     and not _matches(m, ignore)}
    modules: dict[str, QuantSource] = {}
    checked: dict[str, Callable[[], np.ndarray]] = {}  # expert linear -> its scales [1, N]
    for m, (k, n) in {**linears, **expert_linears}.items():
        name = f"{m}.weight"
        is_fp8 = reader.has(name) and np.dtype(reader.weights[name].dtype) == FP8
        if expected is not None and is_fp8 != (m in expected):
            if is_fp8:
                raise reader.fail(name, f"is F8_E4M3, but {_QC} leaves {m} unquantized "
                                  "(ignore / targets)")
            if reader.has(name):
                raise reader.fail(name, f"is {np.dtype(reader.weights[name].dtype)}, but "
                                  f"{_QC} quantizes {m} to fp8 (expected F8_E4M3)")
        if not is_fp8 and (expected is None or m not in expected):
            continue
        what = f" (fp8 {m}: {k} in, {n} out)"
        w = reader.get(name, (n, k), what=what)
        if np.dtype(w.dtype) != FP8:
            raise reader.fail(name, f"has dtype {np.dtype(w.dtype)}, expected F8_E4M3{what}")
        scale_name = next((f"{m}.{leaf}" for leaf in scale_leaves if reader.has(f"{m}.{leaf}")),
                          f"{m}.{scale_leaves[0]}")
        scale = reader.get(scale_name, None, "float", what)
        if tuple(scale.shape) not in ((), (1,), (1, 1), (n, 1)):
            raise reader.fail(scale_name, f"has shape {tuple(scale.shape)}, expected [] or [1] "
                              f"(per tensor) or [{n}, 1] (per output channel); block-wise fp8 "
                              "is not supported")

        def scales_of(scale_name: str = scale_name, n: int = n) -> np.ndarray:
            s = np.asarray(reader.get(scale_name), np.float32).reshape(1, -1)
            return np.ascontiguousarray(np.broadcast_to(s, (1, n)))

        if m in expert_linears:
            checked[m] = scales_of
            continue
        dtype = _scale_dtype(scales_of())

        def make(name: str = name, scales_of: Callable[[], np.ndarray] = scales_of,
                 dtype: str = dtype) -> QuantWeight:
            q = np.ascontiguousarray(np.asarray(reader.get(name)).T)
            return QuantWeight("fp8", q, scales_of().astype(dtype), None, 0)

        modules[m] = QuantSource(QuantLayout("fp8", k, False, dtype), make, name)
    for m, parts in parts_of.items():
        if not _all_or_none(parts, checked, reader, m, "F8_E4M3", "weight"):
            continue  # (a layer's experts unquantized: they load as float)

        def make_stack(parts: list[str] = parts) -> QuantWeight:
            q = np.stack([np.asarray(reader.get(f"{p}.weight")).T for p in parts])
            return QuantWeight("fp8", np.ascontiguousarray(q),
                               np.stack([checked[p]() for p in parts]), None, 1)

        modules[m] = QuantSource(QuantLayout("fp8", experts[m][1], False, "float32"),
                                 make_stack, f"{parts[0]}.weight")
    if not modules:
        raise ValueError(f"{where}: {_QC} says {method} fp8, but no linear weight of "
                         f"{reader.origin} is F8_E4M3")
    return modules
