"""models/lora.py: PEFT adapters read as peft writes them, refused by name when they cannot be
applied, and the batched slot product equal to each token's own adapter."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf_llama_twin, tiny
from lora_fixtures import peft_logits, peft_model, write_peft_adapter
from safetensors.numpy import save_file

from models.lora import (
    LORA_MODULES,
    LoraBatch,
    LoraCache,
    lora_module_shapes,
    lora_slot_bytes,
    read_lora_adapter,
    slot_mask,
)


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    return hf_llama_twin(tiny(), tmp_path_factory.mktemp("hf-tiny"))


@pytest.fixture(scope="module")
def adapter_dir(hf_tiny, tmp_path_factory) -> Path:
    return write_peft_adapter(hf_tiny, tmp_path_factory.mktemp("lora") / "a", r=4, alpha=8,
                              seed=3)


def _keys(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize("rslora", [False, True])
def test_reads_peft_files_with_the_scaling_folded_into_b(hf_tiny, tmp_path, rslora):
    path = write_peft_adapter(hf_tiny, tmp_path / "a", r=4, alpha=8, seed=1, use_rslora=rslora,
                              targets=("q_proj", "down_proj"))
    spec = tiny().spec
    adapter = read_lora_adapter(path, spec, "a", max_rank=8)
    assert adapter.rank == 4 and set(adapter.weights) == {"q_proj", "down_proj"}
    scaling = 8 / math.sqrt(4) if rslora else 8 / 4
    raw = _keys(path)
    for layer in range(spec.num_layers):
        for module, parent in (("q_proj", "self_attn"), ("down_proj", "mlp")):
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            a_t, b_t = raw[f"{key}.lora_A.weight"], raw[f"{key}.lora_B.weight"]
            a, b = (x[layer] for x in adapter.weights[module])
            # x @ a @ b == scaling * x @ A^T @ B^T: the [in, out] product of peft's delta
            np.testing.assert_allclose(a @ b, scaling * (b_t @ a_t).T, rtol=1e-5, atol=1e-6)


def test_untargeted_layers_hold_zeros(hf_tiny, tmp_path):
    path = write_peft_adapter(hf_tiny, tmp_path / "a", r=2, alpha=2, layers_to_transform=[1])
    adapter = read_lora_adapter(path, tiny().spec, "a", max_rank=8)
    for a, b in adapter.weights.values():
        assert not a[0].any() and not b[0].any()
        assert a[1].any() and b[1].any()


def test_slot_product_is_each_tokens_own_adapter():
    """Two slots of rank 3 side by side: each token gets only its own slot's product."""
    rng = np.random.default_rng(0)
    n_in, n_out, rank, layers = 5, 7, 3, 2
    a = rng.standard_normal((layers, n_in, 2 * rank)).astype(np.float32)
    b = rng.standard_normal((layers, 2 * rank, n_out)).astype(np.float32)
    x = rng.standard_normal((4, n_in)).astype(np.float32)
    slots = np.array([0, -1, 1, 0], np.int32)
    lora = LoraBatch({"q_proj": (jnp.asarray(a), jnp.asarray(b))},
                     slot_mask(jnp.asarray(slots), 2, rank))
    got = np.asarray(lora.delta(1, "q_proj", jnp.asarray(x)))
    for t, s in enumerate(slots):
        want = (np.zeros(n_out) if s < 0 else
                x[t] @ a[1][:, s * rank:(s + 1) * rank] @ b[1][s * rank:(s + 1) * rank])
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
    assert lora.delta(1, "k_proj", jnp.asarray(x)) is None


def test_slot_bytes_count_every_projection():
    spec = tiny().spec
    per_rank = sum(i + o for i, o in lora_module_shapes(spec).values())
    assert set(lora_module_shapes(spec)) == set(LORA_MODULES)
    assert lora_slot_bytes(spec, 3, 16, 2) == spec.num_layers * 3 * 16 * per_rank * 2


def test_peft_reference_logits_change_with_the_adapter(hf_tiny, adapter_dir):
    """The fixture's adapter moves the logits (a test of the tests: a zero adapter would make
    every engine comparison below pass vacuously)."""
    ids = [1, 5, 9, 23]
    base = peft_logits(hf_tiny, ids)
    lora = peft_logits(peft_model(hf_tiny, adapter_dir), ids)
    assert np.abs(base - lora).max() > 0.1


def _copy_adapter(src: Path, dst: Path, config: dict | None = None,
                  tensors: dict[str, np.ndarray] | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors if tensors is not None else _keys(src),
              str(dst / "adapter_model.safetensors"))
    return dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _bad_cases(raw: dict[str, np.ndarray]) -> list[tuple[str, dict, dict | None, str]]:
    with_embed = {**raw, "base_model.model.model.embed_tokens.lora_embedding_A": raw[
        f"{Q0}.lora_A.weight"]}
    head = {**raw, "base_model.model.lm_head.lora_A.weight": raw[f"{Q0}.lora_A.weight"]}
    no_b = {k: v for k, v in raw.items() if k != f"{Q0}.lora_B.weight"}
    wrong = {**raw, f"{Q0}.lora_A.weight": np.zeros((4, 3), np.float32)}
    far = {**raw, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
           raw[f"{Q0}.lora_A.weight"]}
    nan = {**raw, f"{Q0}.lora_B.weight": np.full_like(raw[f"{Q0}.lora_B.weight"], np.nan)}
    other = {**raw, "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight":
             raw[f"{Q0}.lora_A.weight"]}
    return [
        ("dora", {"use_dora": True}, None, "use_dora"),
        ("bias", {"bias": "all"}, None, "bias 'all'"),
        ("modules_to_save", {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ("rank_pattern", {"rank_pattern": {"q_proj": 2}}, None, "rank_pattern"),
        ("rank", {"r": 0}, None, "r must be a positive integer"),
        ("alpha", {"lora_alpha": None}, None, "lora_alpha is missing"),
        ("peft_type", {"peft_type": "IA3"}, None, "peft_type 'IA3'"),
        ("embedding", {}, with_embed, "embed_tokens"),
        ("lm_head", {}, head, "lm_head"),
        ("no_b", {}, no_b, "no lora_B"),
        ("shape", {}, wrong, "has shape (4, 3)"),
        ("layer", {}, far, "layer 9"),
        ("nan", {}, nan, "non-finite"),
        ("module", {}, other, "rotary"),
        ("empty", {}, {}, "no lora_A/lora_B"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_refuses_what_it_cannot_apply_naming_it(adapter_dir, tmp_path, case):
    name, config, tensors, match = _bad_cases(_keys(adapter_dir))[case]
    path = _copy_adapter(adapter_dir, tmp_path / name, config, tensors)
    with pytest.raises(ValueError, match=re.escape(match)):
        read_lora_adapter(path, tiny().spec, name, max_rank=8)


def test_refuses_missing_files_and_a_rank_over_the_limit(adapter_dir, tmp_path):
    spec = tiny().spec
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        read_lora_adapter(tmp_path / "nowhere", spec, "x", 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json not found"):
        read_lora_adapter(tmp_path / "empty", spec, "x", 8)
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "adapter_config.json").write_text((adapter_dir / "adapter_config.json")
                                                  .read_text())
    (bin_only / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin"):
        read_lora_adapter(bin_only, spec, "x", 8)
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_lora_adapter(tmp_path / "badjson", spec, "x", 8)
    with pytest.raises(ValueError, match="LoRA rank 4 is greater than max_lora_rank 2"):
        read_lora_adapter(adapter_dir, spec, "x", 2)


def test_cache_keeps_a_name_to_its_directory_and_drops_least_recent(hf_tiny, adapter_dir,
                                                                    tmp_path):
    other = write_peft_adapter(hf_tiny, tmp_path / "b", r=2, alpha=2, seed=5)
    cache = LoraCache(tiny().spec, max_rank=8, capacity=1)
    first = cache.get("a", str(adapter_dir))
    assert cache.get("a", str(adapter_dir)) is first  # held: not read again
    with pytest.raises(ValueError, match="already used for"):
        cache.get("a", str(other))
    cache.get("b", str(other))
    assert "b" in cache and "a" not in cache  # capacity 1: the least recent went
    assert cache.get("a", str(adapter_dir)) is not first  # read again from its directory
    cache.get("b", str(other))  # the capacity dropped "a": its name still holds its directory
    with pytest.raises(ValueError, match="already used for"):
        cache.get("a", str(other))
    assert not cache.drop("a")  # no host copy held, but the name is freed
    assert cache.get("a", str(other)).path == str(other)


def test_reads_keys_without_peft_prefix_and_expands_home(adapter_dir, tmp_path, monkeypatch):
    """vLLM reads an adapter whose keys lack PEFT's `base_model.model.` wrapper, and a path
    under `~`; the weights read are the same, and so is the digest of the same files."""
    spec = tiny().spec
    ref = read_lora_adapter(adapter_dir, spec, "a", 8)
    bare = {k.removeprefix("base_model.model."): v for k, v in _keys(adapter_dir).items()}
    (tmp_path / "home").mkdir()
    path = _copy_adapter(adapter_dir, tmp_path / "home" / "bare", tensors=bare)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    got = read_lora_adapter("~/bare", spec, "a", 8)
    assert got.path == str(path) and set(got.weights) == set(ref.weights)
    for m, (a, b) in ref.weights.items():
        np.testing.assert_array_equal(got.weights[m][0], a)
        np.testing.assert_array_equal(got.weights[m][1], b)
    assert ref.digest == read_lora_adapter(adapter_dir, spec, "a", 8).digest
    assert got.digest != ref.digest  # other bytes: another adapter
