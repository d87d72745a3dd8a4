"""jpaged's own checkpoint format: an orbax checkpoint of the NNX parameters plus config files.

A converted directory OUT holds (written in this order; the manifest last, so a directory
without it is an interrupted conversion, never a checkpoint):

  params/                 orbax checkpoint (OCDBT, uncompressed, 4 MiB chunks) of
                          `nnx.state(model)` as a pure dict, jpaged's layout: one subtree per
                          decoder layer (model/layers/<i>/...), Linear kernels [in, out]
  tokenizer.json          the `tokenizers` backend, post-processor (BOS/EOS adding) included
  tokenizer_config.json   bos/eos/unk/pad tokens and the chat template (`Tokenizer.from_hf_dir`)
  config.json             an HF-style config of the spec (for tools that read only a config)
  jpaged_checkpoint.json  the marker: format version, architecture, stored dtype, the exact
                          ModelSpec, the source it was converted from and a tensor summary

Loading builds the model abstractly and restores every array straight into its target sharding
(each device reads only its own shard), cast to the requested dtype on the way. Format version
1 stored the decoder Params stacked on a leading layer axis (model/layers/...); such a
checkpoint still loads: each stacked array is restored, split into its layers on the device and
dropped before the next is read.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .build import LoadedModel, abstract_model, resolve_dtype
from .config import ModelSpec
from .quant_layers import (
    QuantLayout,
    apply_plan,
    check_quant_splits,
    plan_from_json,
    plan_of,
    plan_to_json,
)
from .sharding import make_mesh, param_shardings, plan_layout, vocab_splits
from .tokenizer import Tokenizer

MARKER = "jpaged_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "jpaged-orbax"
FORMAT_VERSION = 2
# Versions this jpaged reads: 1 = decoder Params stacked [num_layers, ...], 2 = one per layer.
READABLE_VERSIONS = (1, 2)
STACKED_VERSION = 1
CHUNK_BYTES = 4 * 2**20  # the largest stored chunk of any array
# Every name save_checkpoint writes; --overwrite removes exactly these and nothing else.
WRITTEN = (MARKER, PARAMS_DIR, "tokenizer.json", "tokenizer_config.json", "config.json")

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a directory holding a jpaged checkpoint marker."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / MARKER).is_file()


# ---------------------------------------------------------------------------- spec <-> JSON
def spec_to_json(spec: ModelSpec) -> dict[str, Any]:
    """Every ModelSpec field as JSON values (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def spec_from_json(fields: dict[str, Any]) -> ModelSpec:
    """The ModelSpec `spec_to_json` wrote, equal to the original (lists back to tuples)."""
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown ModelSpec fields {unknown}")
    return ModelSpec(**{k: _tuples(v) for k, v in fields.items()})


def hf_config(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """An HF transformers config.json for `spec` (ModelSpec.from_hf_config reads it back)."""
    cfg: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": _MODEL_TYPES[spec.architecture],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": list(spec.eos_token_ids),
        "torch_dtype": dtype,
    }
    if spec.labels:  # a sequence classifier: its score head's labels
        cfg.update(id2label={str(i): x for i, x in enumerate(spec.labels)},
                   label2id={x: i for i, x in enumerate(spec.labels)},
                   num_labels=spec.num_labels)
        if spec.problem_type is not None:
            cfg["problem_type"] = spec.problem_type
    if spec.rope_scaling is not None:
        cfg["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v
                               for k, v in spec.rope_scaling}
    if spec.architecture == "MixtralForCausalLM":
        cfg.update(num_local_experts=spec.num_experts,
                   num_experts_per_tok=spec.num_experts_per_tok)
    elif spec.is_moe:  # Qwen's names; a dense layer is listed in mlp_only_layers
        cfg.update(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                   moe_intermediate_size=spec.moe_intermediate_size,
                   norm_topk_prob=spec.norm_topk_prob,
                   shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                   qkv_bias=spec.attention_bias, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(spec.num_layers)
                                    if not spec.layer_is_sparse(i)])
    return cfg


# ---------------------------------------------------------------------------- tokenizer
def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json from which `Tokenizer.from_hf_dir` rebuilds it."""
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "unk_token": tokenizer.unk_token, "pad_token": tokenizer.pad_token,
        "chat_template": tokenizer.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                               encoding="utf-8")


def save_hf_dir(loaded: LoadedModel, out: Path) -> Path:
    """An HF model directory of a loaded model: config.json, model.safetensors (HF naming and
    layout; a tied lm_head not stored) and the tokenizer files."""
    from safetensors.numpy import save_file

    from .weights import export_weights

    out.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(loaded.model.dtype).name
    (out / "config.json").write_text(json.dumps(hf_config(loaded.spec, dtype), indent=2))
    save_tokenizer(loaded.tokenizer, out)
    weights = export_weights(loaded.model)
    if loaded.spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, str(out / "model.safetensors"))
    return out


# ---------------------------------------------------------------------------- save
def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"model/layers/mlp/up_proj/kernel": leaf}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"output directory {out} exists and is not empty; pass overwrite=True "
                "(--overwrite) to replace a checkpoint there, or choose another directory")
        for name in WRITTEN:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)


def save_checkpoint(loaded: LoadedModel, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write `loaded` (a LoadedModel) as a jpaged orbax checkpoint directory; return its path."""
    import orbax.checkpoint as ocp

    out = Path(out).expanduser().resolve()  # orbax wants an absolute path
    _prepare_out(out, overwrite)
    params = nnx.to_pure_dict(nnx.state(loaded.model))
    dtype = jnp.dtype(loaded.model.dtype).name
    t0 = time.perf_counter()
    # Uncompressed: loading is the point of this format, and zstd costs more to undo than the
    # extra bytes cost to read. The save is synchronous (returns once committed).
    # Chunks of at most CHUNK_BYTES: a process restoring its slice decodes only the chunks it
    # touches, one at a time, never a whole stacked array (one chunk would be all of it).
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save(out / PARAMS_DIR, params, save_args=save_args)
    save_s = time.perf_counter() - t0
    save_tokenizer(loaded.tokenizer, out)
    (out / "config.json").write_text(json.dumps(hf_config(loaded.spec, dtype), indent=2))
    tensors = {name: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name}
               for name, x in _flat(params).items()}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": loaded.spec.architecture,
        "dtype": dtype,
        "spec": spec_to_json(loaded.spec),
        "source": loaded.source,
        "generation_config": loaded.generation_config,
        "quantization": None if not (plan := plan_of(loaded.model)) else {
            "method": loaded.quantization, "plan": plan_to_json(plan)},
        "params": {
            "num_tensors": len(tensors),
            "num_params": sum(x.size for x in jax.tree.leaves(params)),
            "bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
            "save_s": round(save_s, 3),
            "tensors": tensors,
        },
    }
    # Written last: its presence means every other file is complete.
    (out / MARKER).write_text(json.dumps(manifest, indent=2))
    return out


# ---------------------------------------------------------------------------- load
def read_manifest(path: str | Path) -> dict[str, Any]:
    """The checked manifest of checkpoint directory `path` (ValueError naming what is wrong)."""
    path = Path(path).expanduser()
    file = path / MARKER
    if not file.is_file():
        raise FileNotFoundError(f"not a jpaged checkpoint: {file} not found")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"corrupt checkpoint manifest {file}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"corrupt checkpoint manifest {file}: 'format' is not {FORMAT!r}")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise ValueError(f"checkpoint {path} has format_version {version!r}; this jpaged reads "
                         f"versions {readable} (convert the source again: jpaged convert "
                         f"SOURCE {path} --overwrite)")
    for key in ("spec", "dtype", "architecture"):
        if key not in manifest:
            raise ValueError(f"corrupt checkpoint manifest {file}: no {key!r}")
    if not (path / PARAMS_DIR).is_dir():
        raise FileNotFoundError(f"checkpoint {path} has no parameters: {path / PARAMS_DIR} "
                                "not found")
    return manifest


def load_checkpoint(path: str | Path, dtype: Any = "auto",
                    tensor_parallel_size: int = 1, quantization: str | None = None
                    ) -> LoadedModel:
    """A LoadedModel from a jpaged checkpoint, params restored straight into their shardings.

    `dtype` is a name ('auto' | 'float32' | 'bfloat16' | 'float16') or a jnp dtype; arrays
    stored in another dtype are cast while they are read.
    """
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    path = Path(path).expanduser().resolve()
    manifest = read_manifest(path)
    try:
        spec = spec_from_json(manifest["spec"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"corrupt checkpoint manifest {path / MARKER}: spec: {e}") from e
    jdtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    method, plan = _stored_quantization(path, manifest, quantization)
    abstract = abstract_model(spec, jdtype)
    if plan:
        apply_plan(abstract, plan)
        if tensor_parallel_size > 1:
            check_quant_splits(abstract, tensor_parallel_size)
    graphdef, state = nnx.split(abstract)
    if tensor_parallel_size > 1:
        layout = plan_layout(spec, tensor_parallel_size)  # validates the size, then the devices
        shardings = param_shardings(state, make_mesh(tensor_parallel_size), layout,
                                    vocab_splits(spec, tensor_parallel_size))
    else:
        one = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, state)
    # Abstract target: shape, requested dtype and sharding per leaf; orbax reads each device's
    # shard of the stored array and casts it (no whole host copy, no reshard afterwards).
    target = nnx.to_pure_dict(jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings))
    stacked = manifest["format_version"] == STACKED_VERSION
    params_dir = path / PARAMS_DIR
    redo = f"; write it again with `jpaged convert SOURCE {path} --overwrite`"
    with ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(params_dir).item_metadata
        except Exception as e:  # orbax/tensorstore errors of a damaged directory
            raise ValueError(f"corrupt checkpoint parameters {params_dir}: "
                             f"{_orbax_reason(e)}{redo}") from e
        if meta is None or getattr(meta, "tree", None) is None:
            raise ValueError(f"corrupt checkpoint parameters {params_dir}: no parameter "
                             f"metadata (the directory is empty or incomplete){redo}")
        stored = meta.tree
        wanted = _stacked_target(target, spec.num_layers) if stacked else target
        _check_tree(path, _flat(stored), _flat(wanted))
        try:
            restored = ckptr.restore(params_dir, wanted)
        except Exception as e:
            raise ValueError(f"reading checkpoint parameters {params_dir} failed: "
                             f"{_orbax_reason(e)}{redo}") from e
    if stacked:
        restored = _unstack_layers(restored, target)
    nnx.replace_by_pure_dict(state, restored)
    model = nnx.merge(graphdef, state)
    tokenizer = Tokenizer.from_hf_dir(path)
    defaults = manifest.get("generation_config") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"corrupt checkpoint manifest {path / MARKER}: generation_config is "
                         "not an object")
    return LoadedModel(spec, model, tokenizer, str(path), method, defaults)


def _stored_quantization(path: Path, manifest: dict[str, Any], wanted: str | None
                         ) -> tuple[str | None, dict[str, QuantLayout]]:
    """(method, plan) a checkpoint was written with; ValueError when `wanted` names another
    method (a stored quantization is never redone) or the manifest's entry is damaged."""
    entry = manifest.get("quantization")
    if entry is None:
        if wanted is not None:
            raise ValueError(f"checkpoint {path} holds unquantized weights; quantization="
                             f"{wanted!r} applies when converting: jpaged convert SOURCE {path} "
                             f"--quantization {wanted} --overwrite")
        return None, {}
    try:
        method, plan = entry["method"], plan_from_json(entry["plan"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"corrupt checkpoint manifest {path / MARKER}: quantization: "
                         f"{e}") from e
    if wanted is not None and wanted != method:
        raise ValueError(f"checkpoint {path} is quantized with {method!r}; quantization="
                         f"{wanted!r} names another method (leave it out to load it as stored)")
    return method, plan


def _orbax_reason(e: Exception) -> str:
    """One line from an orbax / TensorStore error: its first sentence and the tensor it names,
    without the TensorStore spec it dumps (tens of lines)."""
    text = str(e) or type(e).__name__
    head = text.split(" See full TensorStore details")[0].splitlines()[0].strip()
    # The spec names the store's folder (absolute) and the array inside it (relative).
    tensors = [t for t in re.findall(r"'path': '([^']+?)/?'", text) if not t.startswith("/")]
    if tensors:
        head += f" (tensor {tensors[-1]})"
    return head[:300]


def _stacked_target(target: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Format version 1's tree: `target` with its per-layer subtrees model/layers/<i>/...
    replaced by one subtree whose leaves carry a leading num_layers axis (never split)."""
    from jax.sharding import NamedSharding, PartitionSpec

    def stack(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        s = x.sharding
        if isinstance(s, NamedSharding):
            s = NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
        return jax.ShapeDtypeStruct((num_layers, *x.shape), x.dtype, sharding=s)

    layers = target["model"]["layers"]
    first = layers[next(iter(layers))]
    return {**target, "model": {**target["model"], "layers": jax.tree.map(stack, first)}}


def _unstack_layers(restored: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """Split each stacked array of a version 1 tree into its layers, in the target shardings.

    One stacked array at a time: its slices are made, then it is dropped, so the transient
    device memory is one Param's stack beside its slices.
    """
    stacked = restored["model"].pop("layers")
    layers = target["model"]["layers"]
    out: dict[Any, Any] = {key: {} for key in layers}
    leaf_paths = [[k.key for k in p] for p, _ in jax.tree_util.tree_leaves_with_path(stacked)]
    for names in leaf_paths:
        parent = stacked
        for name in names[:-1]:
            parent = parent[name]
        array = parent.pop(names[-1])  # the tree no longer holds it once sliced
        for i, key in enumerate(layers):
            want = layers[key]
            for name in names:
                want = want[name]
            node = out[key]
            for name in names[:-1]:
                node = node.setdefault(name, {})
            node[names[-1]] = jax.device_put(array[i], want.sharding)
        del array
    restored["model"]["layers"] = out
    return restored


def _check_tree(path: Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """The stored tensors are exactly the model's, with the model's shapes."""
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise ValueError(f"checkpoint {path} lacks tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = [n for n in stored if n not in wanted]
    if extra:
        raise ValueError(f"checkpoint {path} holds tensor {extra[0]!r} the model does not have")
    for name, want in wanted.items():
        shape = tuple(stored[name].shape)
        if shape != tuple(want.shape):
            raise ValueError(f"tensor {name!r} in checkpoint {path} has shape {shape}, "
                             f"expected {tuple(want.shape)} for the spec in its manifest")
