"""How a model's parameters split over a 1-D tensor-parallel mesh (axis 'tp'), Megatron style.

The loaders place every parameter straight into this plan, and the engine's `TensorParallel`
(jpaged/runner/parallel.py) uses the same functions, so a model loaded here needs no reshard.

  q_proj, gate_proj, up_proj   split by output columns  -> each device owns heads / N, ffn / N
                               (a layer's stacked experts [E, hidden, width]: every expert's
                               width / N; the router and shared-expert gate replicated)
  k_proj, v_proj               split by columns when N <= kv_heads, else replicated
  o_proj, down_proj            split by input rows (their biases replicated)
  embed_tokens, lm_head        split by vocabulary when N divides it, else replicated
  everything else (norms)      replicated

The rules are rank-relative (they split the last or the second-to-last axis), so they hold
whether a parameter has a leading stacked-layer axis or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelSpec

AXIS = "tp"

# Decoder Params split Megatron style; everything else replicated.
_COLUMN_SPLIT = ("q_proj", "gate_proj", "up_proj")  # kernel [L, in, out], bias [L, out]
_KV_PROJ = ("k_proj", "v_proj")  # column split only when the KV heads themselves split
ROW_SPLIT = ("o_proj", "down_proj")  # kernel [L, in, out] split on `in`; bias replicated


def check_device_count(tensor_parallel_size: int) -> None:
    """Raise ValueError when tensor_parallel_size exceeds the devices JAX sees."""
    devices = jax.devices()
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} devices "
            f"but only {len(devices)} {devices[0].platform} device(s) exist; on CPU, "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices")


def _widths(spec: ModelSpec) -> dict[str, int]:
    """Every feed-forward width a device splits: the dense MLP's, the experts' and the shared
    expert's (0: the model has none)."""
    return {"intermediate_size": spec.intermediate_size,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size}


def _fits(spec: ModelSpec, n: int) -> bool:
    kv = spec.num_kv_heads
    return (spec.num_heads % n == 0 and (kv % n == 0 or n % kv == 0)
            and all(w % n == 0 for w in _widths(spec).values()))


def valid_tp_sizes(spec: ModelSpec) -> list[int]:
    """Every tensor_parallel_size the model's head counts and FFN width allow."""
    return [n for n in range(1, spec.num_heads + 1) if _fits(spec, n)]


@dataclass(frozen=True)
class TPLayout:
    """How a model's heads split over `size` devices."""

    size: int
    num_heads: int
    num_kv_heads: int

    @property
    def kv_replicas(self) -> int:
        """Copies of each KV head in the pool (1 unless size > num_kv_heads)."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def kv_shards(self) -> int:
        """Distinct ways the KV heads are split: each device's pool is 1/kv_shards of tp=1's."""
        return min(self.size, self.num_kv_heads)

    @property
    def stored_kv_heads(self) -> int:
        """KV heads of the pool array (num_kv_heads x kv_replicas)."""
        return self.num_kv_heads * self.kv_replicas


def plan_layout(spec: ModelSpec, tensor_parallel_size: int) -> TPLayout:
    """Validate tensor_parallel_size against the model's heads; raise a ValueError naming both."""
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    if not _fits(spec, n):
        why = []
        if spec.num_heads % n:
            why.append(f"{spec.num_heads} query heads do not split {n} ways")
        if spec.num_kv_heads % n and n % spec.num_kv_heads:
            why.append(f"{spec.num_kv_heads} KV heads neither split {n} ways nor divide {n}")
        why += [f"{name}={w} does not split {n} ways"
                for name, w in _widths(spec).items() if w % n]
        raise ValueError(
            f"tensor_parallel_size={n} does not fit the model ({spec.num_heads} query heads, "
            f"{spec.num_kv_heads} KV heads): {'; '.join(why)}. tensor_parallel_size values "
            f"that work: {', '.join(map(str, valid_tp_sizes(spec)))}")
    return TPLayout(n, spec.num_heads, spec.num_kv_heads)


def vocab_splits(spec: ModelSpec, tensor_parallel_size: int) -> bool:
    """True when the embedding and lm_head rows split by vocabulary (N divides it evenly)."""
    return spec.vocab_size % tensor_parallel_size == 0


def make_mesh(tensor_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh ('tp',) over the first tensor_parallel_size devices (of `devices` if given)."""
    if devices is None:
        check_device_count(tensor_parallel_size)
        devices = jax.devices()
    elif len(devices) < tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs "
                         f"{tensor_parallel_size} devices; {len(devices)} were given")
    return Mesh(np.array(list(devices)[:tensor_parallel_size]), (AXIS,))


def _names(path: tuple[Any, ...]) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_spec(path: tuple[Any, ...], ndim: int, layout: TPLayout, split_vocab: bool,
               shape: Sequence[int] | None = None) -> P:
    """PartitionSpec of one parameter leaf, from its module path and rank (and its shape,
    which tells a quantized weight's one per-channel scale row, replicated, from groups)."""
    names = [n for n in _names(path) if n != "value"]
    module = next((n for n in reversed(names) if n.endswith("_proj")), None)
    is_bias = "bias" in names
    if module in ROW_SPLIT and names[-1] in ("scales", "mins") and shape is not None \
            and shape[-2] == 1:  # one group spans every input row (fp8 per channel)
        return P()
    column = module in _COLUMN_SPLIT or (module in _KV_PROJ and layout.kv_replicas == 1)
    if column:  # kernel [L, in, out] / bias [L, out]: split `out`
        return P(*([None] * (ndim - 1)), AXIS)
    if module in ROW_SPLIT and not is_bias:  # kernel [L, in, out]: split `in`
        return P(*([None] * (ndim - 2)), AXIS, None)
    if split_vocab and names[-2:] == ["lm_head", "kernel"]:  # [hidden, vocab]
        return P(None, AXIS)
    if split_vocab and names[-2:] == ["embed_tokens", "embedding"]:  # [vocab, hidden]
        return P(AXIS, None)
    return P()


def param_shardings(params: Any, mesh: Mesh, layout: TPLayout, split_vocab: bool) -> Any:
    """A NamedSharding over `mesh` for every leaf of an nnx parameter State."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, x.ndim, layout, split_vocab,
                                                        x.shape)),
        params)
