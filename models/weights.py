"""Checkpoint tensors (numpy, HF naming) and putting them into an NNX model. No torch."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from .config import ModelSpec
from .gguf_loader import load_gguf, permute_qk, unpermute_qk
from .moe import expert_tensor_names
from .tensors import TensorDict

__all__ = [
    "TensorDict", "load_safetensors", "load_hf_dir_weights", "load_gguf",
    "HFParam", "hf_param_table", "assign_weights", "place_weights", "export_weights",
    "permute_qk", "unpermute_qk",
]

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as memory-mapped, read-only numpy arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    try:  # the library validates the header and that offsets cover the file exactly
        with safe_open(str(path), framework="numpy") as f:
            names = list(f.keys())
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
    except Exception as e:  # SafetensorError, OSError, JSON errors
        raise ValueError(f"corrupt or truncated safetensors file {path}: {e}") from e
    if not names:
        return {}
    # numpy cannot read bf16/fp8 through safetensors' numpy backend, so map the bytes ourselves.
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    out: dict[str, np.ndarray] = {}
    for name in names:
        info = header[name]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        out[name] = data[start:end].view(dtype).reshape(info["shape"])
    return out


def load_hf_dir_weights(path: str | Path, spec: ModelSpec | None = None) -> TensorDict:
    """Tensors of an HF model dir from model.safetensors or a sharded index, HF naming."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    weights = TensorDict(str(path))
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"invalid safetensors index {index}: {e}") from e
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            for name, arr in load_safetensors(shard_path).items():
                weights[name] = arr
                weights.files[name] = str(shard_path)
        for name, shard in weight_map.items():
            if name not in weights:
                raise ValueError(
                    f"tensor {name!r} listed in {index} is missing from {path / shard}"
                )
        return weights
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {path} "
            "(only safetensors checkpoints are supported)"
        )
    for name, arr in load_safetensors(single).items():
        weights[name] = arr
        weights.files[name] = str(single)
    return weights


class HFParam(NamedTuple):
    """Where one HF tensor lives in the model: a Param and its layout."""

    param: nnx.Param
    transpose: bool  # HF stores the tensor transposed (nnx kernel [in, out] vs HF [out, in])

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of the tensor in HF naming and layout."""
        shape = tuple(self.param.get_value().shape)  # works on ShapeDtypeStructs too
        return shape[::-1] if self.transpose else shape


def hf_param_table(model: nnx.Module) -> dict[str, HFParam]:
    """HF tensor name -> HFParam(the model's Param, whether HF stores it transposed).

    Module attribute paths mirror HF names (decoder layer i is `model.layers.i`); nnx.Linear's
    `kernel` [in, out] is HF's `weight` [out, in] transposed, nnx.Embed's `embedding` is HF's
    `weight` as is. One entry per Param, in the model's graph order.
    """
    table: dict[str, HFParam] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        *prefix, leaf = (str(p) for p in path)
        transpose = leaf == "kernel"
        if leaf in ("kernel", "embedding"):
            leaf = "weight"
        table[".".join([*prefix, leaf])] = HFParam(node, transpose)
    return table


def _expert_tensors(name: str, shape: tuple[int, ...]) -> list[str] | None:
    """The checkpoint's per-expert tensor names of a stacked experts Param of `shape`
    ([E, in, out]), in expert order (`models.moe.expert_tensor_names`); None for other
    Params."""
    return expert_tensor_names(name, shape[-3]) if len(shape) >= 3 else None


def _checked_table(model: nnx.Module, weights: Mapping[str, np.ndarray], spec: ModelSpec
                   ) -> tuple[dict[str, HFParam], Callable[[str, HFParam], np.ndarray]]:
    """The model's HF table after checking the checkpoint has every tensor it needs, and a
    reader of one tensor that checks its shape and hands it back in the model's layout (a
    transposed view of a memory map reads nothing until sliced)."""
    model_spec = getattr(model, "spec", spec)
    if model_spec != spec:
        raise ValueError(f"model was built for {model_spec}, but weights are for {spec}")
    where = getattr(weights, "source_of", lambda _: "<weights dict>")
    origin = getattr(weights, "origin", "<weights dict>")
    table = hf_param_table(model)
    # A checkpoint holding a stacked tensor itself (jpaged's own) is read as it is.
    experts = {name: parts for name, entry in table.items() if name not in weights and
               (parts := _expert_tensors(name, entry.hf_shape()))}
    missing = [n for name in table for n in experts.get(name, [name]) if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"checkpoint {origin} lacks tensor {missing[0]!r}{more} needed by {spec.architecture}"
        )

    def checked(name: str, entry: HFParam) -> np.ndarray:
        if name in experts:  # [E, in, out] from each expert's [out, in] (one Param's bytes)
            want = entry.hf_shape()[-2:][::-1]
            parts = []
            for part in experts[name]:
                arr = weights[part]
                if tuple(arr.shape) != want:
                    raise ValueError(f"tensor {part!r} in {where(part)} has shape "
                                     f"{tuple(arr.shape)}, expected {want} for "
                                     f"{spec.architecture}")
                parts.append(arr.T)
            return np.stack(parts)
        arr = weights[name]
        if tuple(arr.shape) != entry.hf_shape():
            raise ValueError(
                f"tensor {name!r} in {where(name)} has shape {tuple(arr.shape)}, "
                f"expected {entry.hf_shape()} for {spec.architecture}"
            )
        return arr.T if entry.transpose else arr

    return table, checked


def assign_weights(model: nnx.Module, weights: Mapping[str, np.ndarray], spec: ModelSpec) -> None:
    """Copy checkpoint tensors into every Param of `model` (cast to the Param's dtype), in place.

    Every Param must have a tensor of the right shape; extra tensors (rotary inv_freq, a tied
    lm_head copy, ...) are ignored. Works on abstract models from `nnx.eval_shape` too.
    """
    table, checked = _checked_table(model, weights, spec)
    for name, entry in table.items():
        current = entry.param.get_value()  # jax.Array or ShapeDtypeStruct
        host = np.asarray(checked(name, entry))
        entry.param.set_value(jnp.asarray(host, dtype=current.dtype))


def place_weights(model: nnx.Module, weights: Mapping[str, np.ndarray], spec: ModelSpec,
                  sharding_of: Callable[[tuple[str, ...], int, tuple[int, ...]],
                                        jax.sharding.Sharding]) -> None:
    """Fill every Param of an abstract `model` straight into its sharding: each addressable
    device receives only its slice of each tensor.

    `sharding_of(param path, ndim, shape)` gives a Param's sharding. Tensors are read one at a time
    (lazy sources such as GGUF make one whole tensor at a time; safetensors memory maps read
    only the sliced bytes). Host memory at any moment: one tensor plus its distinct local
    slices.
    """
    table, checked = _checked_table(model, weights, spec)
    paths = {id(node): tuple(str(p) for p in path) for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.Param)}
    for name, entry in table.items():
        param = entry.param
        aval = param.get_value()
        shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
        sharding = sharding_of(paths[id(param)], len(shape), shape)
        index_of = sharding.addressable_devices_indices_map(shape)
        arr = checked(name, entry)
        # Devices holding the same slice (replicated axes) share one host buffer.
        bufs: dict[tuple, np.ndarray] = {}
        for index in index_of.values():
            key = _index_key(index, shape)
            if key not in bufs:
                bufs[key] = np.asarray(arr[tuple(slice(a, b) for a, b in key)], dtype)
        del arr  # the whole tensor goes before the next is made
        shards = []
        for device, index in index_of.items():
            shards.append(jax.device_put(bufs[_index_key(index, shape)], device))
            shards[-1].block_until_ready()
        del bufs  # host slices go once their devices hold them
        param.set_value(jax.make_array_from_single_device_arrays(shape, sharding, shards))


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A device's slice of an array as (start, stop) per axis."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


# The path of a ScannedLayers' Params: its one DecoderLayer, each Param [num_layers, ...].
_STACKED = ".layers.layer."


def export_weights(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's parameters as host numpy arrays in HF naming and layout (inverse of assign;
    a layer's stacked experts as one tensor per expert, as HF checkpoints hold them)."""
    out: dict[str, np.ndarray] = {}
    for name, entry in hf_param_table(model).items():
        host = np.asarray(entry.param[...])
        if _STACKED in name:  # layers stacked for a scan (models.llama.stack_layers): one each
            for i, one in enumerate(host):
                _export_one(out, name.replace(_STACKED, f".layers.{i}."), one, entry)
            continue
        _export_one(out, name, host, entry)
    return out


def _export_one(out: dict[str, np.ndarray], name: str, host: np.ndarray, entry: HFParam
                ) -> None:
    """One Param's tensors in HF layout: itself (transposed back), or one per expert."""
    parts = _expert_tensors(name, host.shape)
    if parts is not None:
        for part, one in zip(parts, host, strict=True):
            out[part] = np.ascontiguousarray(one.T)
        return
    out[name] = np.ascontiguousarray(host.T if entry.transpose else host)
