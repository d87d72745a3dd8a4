"""LoRA adapters: PEFT's files read and checked against a model, and their product in a layer.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` as PEFT's
`save_pretrained` writes them: for each adapted linear of a decoder layer, `lora_A` [r, in] and
`lora_B` [out, r] (torch's [out, in] convention), and the linear computes
`x W^T + scaling * (x A^T) B^T` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with
`use_rslora`). `read_lora_adapter` turns them into this package's [in, out] convention, every
layer stacked, the scaling folded into B: `x @ a[layer] @ b[layer]` is the layer's addition.

The runner keeps `max_loras` adapters on the device at once, each padded to `max_lora_rank`,
side by side in one [L, in, S*R] and one [L, S*R, out] array per projection (`LoraBatch`).
A step's tokens each name a slot (or none), and a projection adds
`((x @ A) * mask) @ B` where `mask` keeps each token's own slot's R columns: two small GEMMs
that read every loaded adapter once, whatever the mix of adapters in the batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .config import ModelSpec
from .weights import load_safetensors

# The projections an adapter may target, by their name in a decoder layer (HF's).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's keys (base_model.model.model.layers...), or the same without PEFT's wrapper prefix.
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def lora_module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adaptable projection of one of `spec`'s decoder layers."""
    h, i = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_slot_bytes(spec: ModelSpec, max_loras: int, max_lora_rank: int, itemsize: int) -> int:
    """Device bytes of `max_loras` adapter slots of rank `max_lora_rank` (the runner's arrays)."""
    per_rank = sum(n_in + n_out for n_in, n_out in lora_module_shapes(spec).values())
    return spec.num_layers * max_loras * max_lora_rank * per_rank * itemsize


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights for every layer, in the model's [in, out] convention (float32).

    Invariant: for each module in `weights`, a is [num_layers, in, rank] and b is
    [num_layers, rank, out] with the scaling folded in; a layer the adapter does not
    target holds zeros. Modules it targets in no layer are absent.
    """

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    # Hash of the files read (config and weights): the adapter's identity beside its name, so
    # a directory rewritten and read again is another adapter (device slot, prefix cache).
    digest: str = ""

    @property
    def key(self) -> str:
        """The adapter's identity: its name and the digest of what was read."""
        return f"{self.name}@{self.digest}"

    @property
    def nbytes(self) -> int:
        """Host bytes of the adapter's arrays."""
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"LoRA adapter {directory}: {CONFIG_FILE} not found (a PEFT "
                                "adapter directory, as save_pretrained writes it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path}: not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: expected a JSON object")
    return config


def _check_config(config: dict, where: Path) -> tuple[int, float]:
    """(r, lora_alpha) of a PEFT config, refusing what this reader does not apply."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {where}: peft_type {peft_type!r} is not LORA")
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                      ("lora_bias", "LoRA biases")):
        if config.get(key):
            raise ValueError(f"LoRA adapter {where}: {key} ({what}) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {where}: bias {config['bias']!r} is not supported "
                         "(only 'none': the adapter trains no biases)")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {where}: modules_to_save {config['modules_to_save']!r} "
                         "(whole trained modules) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"LoRA adapter {where}: {key} (a rank or alpha per module) is not "
                             "supported")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if alpha is None:  # (peft would assume 8, vLLM refuses: no silent guess of the scaling)
        raise ValueError(f"LoRA adapter {where}: lora_alpha is missing (the scaling is "
                         "lora_alpha / r)")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"LoRA adapter {where}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"LoRA adapter {where}: lora_alpha must be a number, got {alpha!r}")
    return r, float(alpha)


def read_lora_adapter(path: str | Path, spec: ModelSpec, name: str, max_rank: int
                      ) -> LoraAdapter:
    """A PEFT LoRA adapter directory, checked against `spec` (FileNotFoundError or ValueError
    naming the file, key or field): its rank at most `max_rank`, only the decoder layers'
    projections adapted, every tensor of its projection's shape."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"LoRA adapter {name!r}: {path} is not a directory")
    config = _read_config(directory)
    r, alpha = _check_config(config, directory)
    if r > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: LoRA rank {r} is greater than "
                         f"max_lora_rank {max_rank} (raise --max-lora-rank)")
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        other = " (adapter_model.bin, a torch pickle, is not read: save with safetensors)" \
            if (directory / "adapter_model.bin").exists() else ""
        raise FileNotFoundError(f"LoRA adapter {directory}: {WEIGHTS_FILE} not found{other}")
    use_rslora = bool(config.get("use_rslora", False))
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    shapes = lora_module_shapes(spec)
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for key, arr in load_safetensors(weights_path).items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter {weights_path}: tensor {key!r} is not a decoder "
                             "layer projection's lora_A or lora_B (embeddings, lm_head and "
                             "other modules cannot be adapted)")
        layer, parent, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in shapes or _PARENT[module] != parent:
            raise ValueError(f"LoRA adapter {weights_path}: tensor {key!r} adapts "
                             f"{parent}.{module}; only {', '.join(LORA_MODULES)} can be adapted")
        if layer >= spec.num_layers:
            raise ValueError(f"LoRA adapter {weights_path}: tensor {key!r} is for layer {layer} "
                             f"but the model has {spec.num_layers} layers")
        if parent == "mlp" and spec.layer_is_sparse(layer):
            raise ValueError(f"LoRA adapter {weights_path}: tensor {key!r} adapts layer "
                             f"{layer}'s {module}, but that layer is a mixture of experts "
                             "(adapters on experts are not supported; attention projections "
                             "and dense layers' MLPs are)")
        n_in, n_out = shapes[module]
        want = (r, n_in) if which == "A" else (n_out, r)
        if tuple(arr.shape) != want:
            raise ValueError(f"LoRA adapter {weights_path}: tensor {key!r} has shape "
                             f"{tuple(arr.shape)}, expected {want} (rank {r}, the model's "
                             f"{module} is {n_in} -> {n_out})")
        found.setdefault(module, {}).setdefault(layer, {})[which] = arr
    if not found:
        raise ValueError(f"LoRA adapter {weights_path}: holds no lora_A/lora_B tensors")
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, layers in found.items():
        n_in, n_out = shapes[module]
        a = np.zeros((spec.num_layers, n_in, r), np.float32)
        b = np.zeros((spec.num_layers, r, n_out), np.float32)
        for layer, pair in layers.items():
            if set(pair) != {"A", "B"}:
                missing = "lora_B" if "A" in pair else "lora_A"
                raise ValueError(f"LoRA adapter {weights_path}: layer {layer}'s {module} has "
                                 f"no {missing} tensor")
            a_t, b_t = (np.asarray(pair[k], np.float32) for k in ("A", "B"))
            if not (np.isfinite(a_t).all() and np.isfinite(b_t).all()):
                raise ValueError(f"LoRA adapter {weights_path}: layer {layer}'s {module} "
                                 "holds non-finite values")
            a[layer] = a_t.T
            b[layer] = b_t.T * scaling
        weights[module] = (a, b)
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16)
    with open(weights_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return LoraAdapter(name, str(directory), r, weights, digest.hexdigest())


@jax.tree_util.register_dataclass
@dataclass
class LoraBatch:
    """The adapters a step applies: every slot's weights, and which slot each token uses.

    `weights[module]` is (A [L, in, S*R], B [L, S*R, out]) in the model's dtype, slot s in
    columns (rows) [s*R, (s+1)*R); `mask` is [T, S*R], 1 where the column belongs to the
    token's slot (a token with no adapter, or padding, is all 0), float32.
    """

    weights: dict[str, tuple[jax.Array, jax.Array]]
    mask: Float[Array, "T SR"]

    def delta(self, layer: int | jax.Array, module: str, x: Float[Array, "T n_in"]
              ) -> jax.Array | None:
        """What the tokens' adapters add to `module`'s output in `layer`, or None (no slot
        adapts the module)."""
        pair = self.weights.get(module)
        if pair is None:
            return None
        a, b = pair[0][layer], pair[1][layer]
        h = jnp.dot(x.astype(a.dtype), a, preferred_element_type=jnp.float32)
        return jnp.dot((h * self.mask).astype(b.dtype), b,
                       preferred_element_type=jnp.float32).astype(x.dtype)


def slot_mask(slots: Int[Array, " T"], num_slots: int, rank: int) -> jax.Array:
    """[T, S*R] float32 mask of each token's slot (-1: none) over the slots' columns."""
    col_slot = jnp.arange(num_slots * rank, dtype=jnp.int32) // rank
    return (slots[:, None] == col_slot[None, :]).astype(jnp.float32)


def add_delta(lora: LoraBatch | None, layer: int | jax.Array, module: str, x: jax.Array,
              y: jax.Array) -> jax.Array:
    """y plus `module`'s adapter delta of x (y itself without LoRA)."""
    if lora is None:
        return y
    d = lora.delta(layer, module, x)
    return y if d is None else y + d



class LoraCache:
    """Adapters read from disk, kept by name on the host (least recently used dropped past
    `capacity`); a name stands for the directory it was read from until `drop` frees it."""

    def __init__(self, spec: ModelSpec, max_rank: int, capacity: int) -> None:
        self.spec = spec
        self.max_rank = max_rank
        self.capacity = max(1, capacity)
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()
        # The directory of every name read, kept when the capacity drops its adapter (it is
        # read again from there), forgotten by `drop`.
        self._paths: dict[str, str] = {}
        self._pinned: set[str] = set()  # never dropped for room (LLMEngine.pin_lora)
        # The server's front end reads adapters on executor threads beside the engine loop.
        self._lock = threading.Lock()

    def get(self, name: str, path: str) -> LoraAdapter:
        """The adapter `name` (read from `path` unless held); ValueError or FileNotFoundError
        naming the problem when it cannot be read or `name` was read from another path."""
        path = str(Path(path).expanduser())
        with self._lock:
            known = self._paths.get(name)
            if known is not None and known != str(path):
                raise ValueError(f"LoRA adapter name {name!r} is already used for {known}; "
                                 f"{path} needs a name of its own")
            adapter = self._adapters.get(name)
            if adapter is None:
                adapter = read_lora_adapter(path, self.spec, name, self.max_rank)
                self._paths[name] = str(path)
                self._adapters[name] = adapter
            self._adapters.move_to_end(name)
            spare = [n for n in self._adapters if n not in self._pinned and n != name]
            while len(self._adapters) > self.capacity and spare:  # least recent unpinned first
                del self._adapters[spare.pop(0)]
            return adapter

    def pin(self, name: str) -> bool:
        """Keep `name`'s host copy whatever the capacity; False when none is held."""
        with self._lock:
            if name not in self._adapters:
                return False
            self._pinned.add(name)
            return True

    def drop(self, name: str) -> bool:
        """Forget adapter `name`: its host copy and its directory (the name may then be read
        from any; requests holding the old adapter keep it); False when none was held."""
        with self._lock:
            self._pinned.discard(name)
            self._paths.pop(name, None)
            return self._adapters.pop(name, None) is not None

    def __contains__(self, name: object) -> bool:
        return name in self._adapters
