"""The quantized linear and embedding modules, and turning a built model's layers into them.

A model is built as usual (nnx.Linear, nnx.Embed); a quantization plan then swaps the modules
it names for `QuantLinear` / `QuantEmbed` of the same shapes, whose Params hold the quantized
arrays (models/quant.py). HF names follow the module paths, so a quantized checkpoint maps as
any other: `<module>.qweight`, `.scales`, `.mins`, `.bias`, laid out as the device holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from .linear_ops import matmul_precision, one_row_as_two
from .moe import QuantExperts, expert_matrices, expert_tensor_names
from .quant import QuantWeight, quant_logits, quant_matmul, quant_rows, quantize_fp8

_VALUE_DTYPES = {"int4": np.uint8, "int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}


@dataclass(frozen=True)
class QuantLayout:
    """How one module's weight is stored: kind, group size (along K), whether it has mins,
    and the dtype of its scales and mins."""

    kind: str
    group_size: int
    has_min: bool
    scale_dtype: str


def _zeros(shape: tuple[int, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def _quantized_params(k: int, n: int, layout: QuantLayout, k_axis: int, what: str
                      ) -> tuple[nnx.Param, nnx.Param, nnx.Param | None]:
    """(qweight, scales, mins or None) Params of a [K, N] (k_axis 0) or [N, K] (k_axis 1)
    matrix quantized along K; ValueError when the group size does not divide K (`what`)."""
    if k % layout.group_size:
        raise ValueError(f"group size {layout.group_size} does not divide the {what} {k}")
    values = k // 2 if layout.kind == "int4" else k
    groups = k // layout.group_size

    def shape(along_k: int) -> tuple[int, int]:
        return (along_k, n) if k_axis == 0 else (n, along_k)

    mins = _zeros(shape(groups), layout.scale_dtype) if layout.has_min else None
    return (_zeros(shape(values), _VALUE_DTYPES[layout.kind]),
            _zeros(shape(groups), layout.scale_dtype), mins)


class QuantLinear(nnx.Module):
    """x @ W (+ bias) with W [in, out] quantized; output in the model's dtype."""

    def __init__(self, n_in: int, n_out: int, layout: QuantLayout, bias: bool, dtype: Any):
        self.qweight, self.scales, self.mins = _quantized_params(n_in, n_out, layout, 0,
                                                                 "input size")
        self.kind, self.in_features, self.out_features = layout.kind, n_in, n_out
        self.dtype = jnp.dtype(dtype)
        self.bias = _zeros((n_out,), dtype) if bias else None

    def weight(self) -> QuantWeight:
        """The weight's arrays as they lie."""
        mins = None if self.mins is None else self.mins[...]
        return QuantWeight(self.kind, self.qweight[...], self.scales[...], mins)

    def product(self, x: jax.Array) -> jax.Array:
        """x @ W in float32, without the bias (the output head's logits)."""
        w = self.weight()

        def mm(x: jax.Array) -> jax.Array:
            return quant_matmul(x, w.q, w.scales, w.mins, self.kind, self.dtype,
                                matmul_precision(self.dtype))

        return one_row_as_two(mm, x)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.product(x)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


class QuantEmbed(nnx.Module):
    """A [vocab, hidden] table quantized along hidden: a lookup dequantizes only the rows it
    gathers; `attend` is the tied output head (logits against every row)."""

    def __init__(self, vocab: int, hidden: int, layout: QuantLayout, dtype: Any):
        self.qweight, self.scales, self.mins = _quantized_params(hidden, vocab, layout, 1,
                                                                 "hidden size")
        self.kind, self.num_embeddings, self.features = layout.kind, vocab, hidden
        self.dtype = jnp.dtype(dtype)

    def _mins(self) -> jax.Array | None:
        return None if self.mins is None else self.mins[...]

    def weight(self) -> QuantWeight:
        """The table's arrays as they lie: a [vocab, hidden] QuantWeight (k_axis 1)."""
        return QuantWeight(self.kind, self.qweight[...], self.scales[...], self._mins(), 1)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return quant_rows(self.qweight[...], self.scales[...], self._mins(), self.kind, ids,
                          self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """float32 logits [T, vocab] of hidden states [T, hidden]."""
        return quant_logits(h, self.qweight[...], self.scales[...], self._mins(), self.kind,
                            self.dtype, matmul_precision(self.dtype))


def _resolve(root: nnx.Module, path: str) -> tuple[Any, str]:
    """(parent, attribute or index) of the module at a dotted HF path."""
    *parents, leaf = path.split(".")
    obj: Any = root
    for part in parents:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj, leaf


def _twin(old: nnx.Module | nnx.Param, layout: QuantLayout, path: str) -> nnx.Module:
    """An abstract quantized module of `old`'s shapes (a layer's stacked experts: a
    QuantExperts)."""
    if isinstance(old, nnx.Param) and old.get_value().ndim == 3:  # [E, K, N] experts
        e, k, n = old.get_value().shape
        if layout.kind == "fp8" and (layout.group_size != k or layout.has_min):
            raise ValueError("fp8 experts take one scale per expert and output channel, not "
                             f"groups of {layout.group_size}")
        return nnx.eval_shape(lambda: QuantExperts(layout.kind, e, k, n, layout.group_size,
                                                   layout.has_min, layout.scale_dtype))
    if isinstance(old, nnx.Linear):
        bias = getattr(old, "bias", None) is not None
        return nnx.eval_shape(lambda: QuantLinear(old.in_features, old.out_features, layout,
                                                  bias, old.param_dtype))
    if isinstance(old, nnx.Embed):
        return nnx.eval_shape(lambda: QuantEmbed(old.num_embeddings, old.features, layout,
                                                 old.param_dtype))
    raise ValueError(f"{path!r} is a {type(old).__name__}; only linear layers and embeddings "
                     "can be quantized")


def apply_plan(model: nnx.Module, plan: dict[str, QuantLayout]) -> None:
    """Swap each module the plan names (HF path, e.g. `model.layers.0.mlp.up_proj`, or
    `model.embed_tokens`) for its quantized twin, abstract (nothing allocated), in place."""
    for path, layout in plan.items():
        try:
            parent, leaf = _resolve(model, path)
            old = getattr(parent, leaf)
        except (AttributeError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"quantized tensor {path!r} names no module of the model") from e
        try:
            setattr(parent, leaf, _twin(old, layout, path))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def fp8_plan(model: nnx.Module) -> dict[str, QuantLayout]:
    """`--quantization fp8` on an unquantized model: every decoder layer's linear, per output
    channel; the embeddings and lm_head stay in the model's dtype (vLLM's rule)."""
    plan = {}
    for path, node in nnx.iter_graph(model):
        names = [str(p) for p in path]
        if names[:2] != ["model", "layers"]:
            continue
        # A mixture of experts' router and shared-expert gate stay in the model's dtype (vLLM
        # keeps its gate unquantized); its experts go fp8 per expert and output channel.
        if isinstance(node, nnx.Linear) and names[-1] not in ("gate", "shared_expert_gate"):
            plan[".".join(names)] = QuantLayout("fp8", node.in_features, False, "float32")
    for path, (_, k, _) in expert_matrices(model).items():
        plan[path] = QuantLayout("fp8", k, False, "float32")
    return plan


@dataclass(frozen=True)
class QuantSource:
    """One module quantized from a checkpoint: its device layout, how to make its arrays, and
    the checkpoint tensor they come from (for error messages)."""

    layout: QuantLayout
    make: Callable[[], QuantWeight]
    source: str


class QuantTensors(Mapping[str, np.ndarray]):
    """A checkpoint's tensors, with each quantized module's `qweight`, `scales` (and `mins`)
    offered in the device layout, made when read (the module read last is kept, for its other
    arrays: one module's arrays on the host at a time); every other tensor as it is."""

    def __init__(self, weights: Mapping[str, np.ndarray], modules: dict[str, QuantSource]):
        self.weights = weights
        self.origin = getattr(weights, "origin", "<weights dict>")
        self._modules = modules
        self._derived = {f"{m}.{leaf}": m for m, mod in modules.items()
                         for leaf in ("qweight", "scales", "mins")
                         if leaf != "mins" or mod.layout.has_min}
        self._last: dict[str, QuantWeight] = {}

    def source_of(self, name: str) -> str:
        """The file a tensor (or the tensor it is made from) came from."""
        where = getattr(self.weights, "source_of", lambda _: self.origin)
        return where(self._modules[self._derived[name]].source if name in self._derived
                     else name)

    def _weight(self, module: str) -> QuantWeight:
        if module not in self._last:
            self._last.clear()
            try:
                w = self._modules[module].make()
            except ValueError as e:
                raise ValueError(f"cannot read quantized module {module!r} from "
                                 f"{self.origin}: {e}") from e
            w.check(module)
            self._last[module] = w
        return self._last[module]

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._derived:
            w = self._weight(self._derived[name])
            leaf = name.rsplit(".", 1)[1]
            return {"qweight": w.q, "scales": w.scales, "mins": w.mins}[leaf]
        return self.weights[name]

    def __contains__(self, name: object) -> bool:
        return name in self._derived or name in self.weights

    def __iter__(self) -> Iterator[str]:
        yield from self._derived
        yield from (n for n in self.weights if n not in self._derived)

    def __len__(self) -> int:
        return len(self._derived) + sum(1 for n in self.weights if n not in self._derived)


def _experts_source(weights: Mapping[str, np.ndarray], module: str
                    ) -> tuple[Callable[[], QuantWeight], str] | None:
    """How to make a stacked experts module's fp8 arrays from `weights`: its stacked float
    tensor [E, K, N] (a GGUF's, as the loader lays it out), or one HF [out, in] tensor per
    expert, each quantized per output channel; None when the checkpoint has neither."""
    if module in weights:
        def from_stack() -> QuantWeight:
            return _stack_fp8(list(np.asarray(weights[module])))
        return from_stack, module
    if expert_tensor_names(module, 0) is None:
        return None
    first = expert_tensor_names(module, 1)[0]
    count = 0  # the checkpoint's experts: as many as it has tensors for, from expert 0 on
    while first.replace(".experts.0.", f".experts.{count}.") in weights:
        count += 1
    if not count:
        return None
    parts = expert_tensor_names(module, count)
    return (lambda: _stack_fp8([np.asarray(weights[p]).T for p in parts])), parts[0]


def _stack_fp8(experts: list[np.ndarray]) -> QuantWeight:
    """Each [K, N] expert quantized per output channel (`quantize_fp8`), stacked (k_axis 1)."""
    qs = [quantize_fp8(w) for w in experts]
    return QuantWeight("fp8", np.stack([np.asarray(w.q) for w in qs]),
                       np.stack([np.asarray(w.scales) for w in qs]), None, 1)


def fp8_tensors(weights: Mapping[str, np.ndarray], plan: dict[str, QuantLayout]
                ) -> QuantTensors:
    """`weights` with each planned module's float `weight` ([out, in], HF) also offered as
    fp8 `qweight` [in, out] and per-channel `scales` [1, out] (`quantize_fp8`); a layer's
    stacked experts as `qweight` [E, in, out] and `scales` [E, 1, out]."""
    def make(module: str) -> Callable[[], QuantWeight]:
        return lambda: quantize_fp8(np.asarray(weights[f"{module}.weight"]).T)

    # (a module whose weight is missing offers nothing: the loader names the tensor it lacks)
    sources = {}
    for m, layout in plan.items():
        experts = _experts_source(weights, m)
        if experts is not None:
            sources[m] = QuantSource(layout, experts[0], experts[1])
        elif f"{m}.weight" in weights:
            sources[m] = QuantSource(layout, make(m), f"{m}.weight")
    return QuantTensors(weights, sources)


def check_quant_splits(model: nnx.Module, tensor_parallel_size: int) -> None:
    """Raise ValueError naming the module when tensor parallel would cut one of its groups
    (a row-split projection's input rows must split at group boundaries)."""
    from .sharding import ROW_SPLIT

    for path, node in nnx.iter_graph(model):
        names = [str(p) for p in path]
        if isinstance(node, QuantExperts) and names[-1] in ROW_SPLIT:  # [E, K, N] experts
            k, group = node.in_features, node.group_size
        elif isinstance(node, QuantLinear) and names[-1] in ROW_SPLIT:
            k = node.in_features
            group = k // node.scales.get_value().shape[0]
        else:
            continue
        if group < k and (k // tensor_parallel_size) % group:  # (one group: replicated)
            raise ValueError(
                f"{'.'.join(names)}: tensor_parallel_size={tensor_parallel_size} splits its "
                f"{k} input rows into {k // tensor_parallel_size}, which cuts its groups of "
                f"{group}")


def plan_of(model: nnx.Module) -> dict[str, QuantLayout]:
    """The quantization plan a model was built with (empty: none), e.g. for a checkpoint;
    layers stacked for a scan (models.llama.stack_layers) count their groups per layer."""
    plan = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QuantExperts):  # [(layers,) E, K or K / 2, N]
            plan[".".join(map(str, path))] = QuantLayout(
                node.kind, node.group_size, node.mins is not None,
                jnp.dtype(node.scales.get_value().dtype).name)
        if isinstance(node, QuantLinear | QuantEmbed):
            scales = node.scales.get_value()  # [(layers,) groups, N] or [V, groups]
            linear = isinstance(node, QuantLinear)
            k = node.in_features if linear else node.features
            plan[".".join(map(str, path))] = QuantLayout(
                node.kind, k // scales.shape[-2 if linear else -1], node.mins is not None,
                jnp.dtype(scales.dtype).name)
    return plan


def plan_to_json(plan: dict[str, QuantLayout]) -> dict[str, list[Any]]:
    """A plan as JSON-ready lists: module -> [kind, group_size, has_min, scale_dtype]."""
    return {m: [p.kind, p.group_size, p.has_min, p.scale_dtype] for m, p in plan.items()}


def plan_from_json(data: Any) -> dict[str, QuantLayout]:
    """Inverse of `plan_to_json` (ValueError on anything else)."""
    if not isinstance(data, dict):
        raise ValueError(f"a quantization plan is an object, got {type(data).__name__}")
    plan = {}
    for module, fields in data.items():
        if (not isinstance(fields, list) or len(fields) != 4 or fields[0] not in _VALUE_DTYPES
                or not isinstance(fields[1], int) or fields[1] < 1
                or fields[3] not in ("float16", "float32")):
            raise ValueError(f"quantization plan entry {module!r}: bad layout {fields!r}")
        plan[module] = QuantLayout(fields[0], fields[1], bool(fields[2]), fields[3])
    return plan
