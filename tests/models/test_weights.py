"""Checkpoint loading: safetensors (single, sharded, bf16), GGUF (permutation, quantized),
and clear errors for missing, truncated and mismatched files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tiny_models import jpaged_logits, random_weights, tiny_spec, write_gguf, write_hf_dir

from models import load_model
from models.loader import build_model
from models.weights import (
    export_weights,
    load_gguf,
    load_hf_dir_weights,
    load_safetensors,
    permute_qk,
    unpermute_qk,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec():
    return tiny_spec()


@pytest.fixture(scope="module")
def weights(spec):
    return random_weights(spec)


@pytest.fixture
def hf_dir(tmp_path, spec, weights):
    return write_hf_dir(tmp_path / "hf", spec, weights)


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ---- q/k permutation ------------------------------------------------------------------------

@pytest.mark.parametrize("n_head,head_dim,cols", [(4, 16, 64), (3, 64, 576), (2, 8, 1)])
def test_qk_permutation_inverse_is_exact(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    p = permute_qk(w, n_head)
    # llama.cpp interleaves each head's halves: row 2i+j of a head is HF row j*hd/2 + i.
    half = head_dim // 2
    for h in range(n_head):
        for i in range(half):
            for j in range(2):
                assert np.array_equal(p[h * head_dim + 2 * i + j], w[h * head_dim + j * half + i])
    assert np.array_equal(unpermute_qk(p, n_head), w)
    assert np.array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    bias = w[:, 0].copy()  # 1-D tensors (q/k bias) use the same row order
    assert np.array_equal(unpermute_qk(permute_qk(bias, n_head), n_head), bias)


# ---- GGUF -----------------------------------------------------------------------------------

def test_gguf_round_trip_restores_hf_weights_and_logits(tmp_path, spec, weights):
    path = write_gguf(tmp_path / "tiny.gguf", spec, weights, quantize=("mlp.",))
    got_spec, got, meta = load_gguf(path)
    assert got_spec == spec
    assert meta["general.architecture"] == "llama"
    assert set(got) == set(weights)
    for name, ref in weights.items():
        if "mlp." in name:  # Q8_0: equal to gguf's own quantize -> dequantize
            q = gguf.GGMLQuantizationType.Q8_0
            ref = gguf.quants.dequantize(gguf.quants.quantize(ref, q), q)
        assert got[name].shape == ref.shape and np.array_equal(got[name], ref), name
    # Logits through the GGUF path equal those of the same weights from safetensors.
    from_gguf = load_model(str(path), dtype="float32")
    from_hf = build_model(spec, got, np.float32)
    exported = export_weights(from_hf)  # assign then export is the identity
    assert all(np.array_equal(exported[n], got[n]) for n in got) and set(exported) == set(got)
    seqs = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    pairs = zip(jpaged_logits(from_gguf.model, seqs), jpaged_logits(from_hf, seqs), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    tok = from_gguf.tokenizer
    assert tok.encode("<s> tt") == [256, 258, ord("t")] and tok.eos_token_id == 257
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"


def test_gguf_tied_model_has_no_output_tensor(tmp_path):
    spec = tiny_spec(tie_word_embeddings=True)
    w = random_weights(spec, seed=3)
    assert "lm_head.weight" not in w
    got_spec, got, _ = load_gguf(write_gguf(tmp_path / "tied.gguf", spec, w))
    assert got_spec.tie_word_embeddings and "lm_head.weight" not in got


@pytest.mark.parametrize("keep", [3, 20, 200, 2_000, -64])
def test_truncated_gguf_raises_value_error_naming_file(tmp_path, spec, weights, keep):
    path = write_gguf(tmp_path / "cut.gguf", spec, weights)
    size = path.stat().st_size
    _truncate(path, keep if keep > 0 else size + keep)
    with pytest.raises(ValueError, match="cut.gguf"):
        load_gguf(path)
    with pytest.raises(ValueError, match="cut.gguf"):
        load_model(str(path))


def test_gguf_unknown_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon.*supported: llama"):
        load_gguf(tmp_path / "falcon.gguf")


# ---- safetensors ----------------------------------------------------------------------------

def test_sharded_checkpoint_loads_like_single_file(tmp_path, hf_dir, weights):
    single = load_hf_dir_weights(hf_dir)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((hf_dir / name).read_bytes())
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(sharded / file))
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    got = load_hf_dir_weights(sharded)
    assert set(got) == set(single) == set(weights)
    for name in weights:
        assert np.array_equal(got[name], single[name])
        assert got.source_of(name).endswith(weight_map[name])
    seqs = [[5, 6, 7, 8]]
    a = jpaged_logits(load_model(str(sharded), dtype="float32").model, seqs)[0]
    b = jpaged_logits(load_model(str(hf_dir), dtype="float32").model, seqs)[0]
    assert np.array_equal(a, b)
    # An index naming a tensor its shard lacks is an error naming both.
    weight_map["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model\.extra\.weight.*model-00001-of-00002"):
        load_hf_dir_weights(sharded)


def test_bfloat16_safetensors_are_read(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    save_file({"x": x.astype(ml_dtypes.bfloat16), "y": x[0]}, str(tmp_path / "b.safetensors"))
    got = load_safetensors(tmp_path / "b.safetensors")
    assert got["x"].dtype == ml_dtypes.bfloat16 and np.array_equal(got["x"].astype(np.float32), x)
    assert np.array_equal(got["y"], x[0])


@pytest.mark.parametrize("keep", [4, 30, -100])
def test_truncated_safetensors_raises_value_error_naming_file(hf_dir, keep):
    path = hf_dir / "model.safetensors"
    _truncate(path, keep if keep > 0 else path.stat().st_size + keep)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(hf_dir))


def test_shape_mismatch_names_tensor_and_file(hf_dir, weights):
    bad = dict(weights)
    bad["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    save_file(bad, str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*"
                                         r"model\.safetensors.*\(8, 64\)"):
        load_model(str(hf_dir))


def test_missing_tensor_is_named_and_extra_tensors_are_ignored(hf_dir, weights):
    extra = dict(weights)
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(extra, str(hf_dir / "model.safetensors"))
    load_model(str(hf_dir))  # unknown tensors are fine
    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    save_file(missing, str(hf_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.norm\.weight'"):
        load_model(str(hf_dir))


# ---- missing paths and bad arguments --------------------------------------------------------

def test_missing_paths_raise_file_not_found(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match="nowhere/model.gguf"):
        load_model(str(tmp_path / "nowhere" / "model.gguf"))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model("no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(empty))
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(hf_dir))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_safetensors(tmp_path / "gone.safetensors")
    with pytest.raises(FileNotFoundError, match="missing-dir"):
        load_hf_dir_weights(tmp_path / "missing-dir")


def test_hub_failure_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        assert "*.safetensors" in kwargs["allow_patterns"]
        raise ConnectionError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match="owner/some-model.*Hugging Face Hub.*network unreachable"):
        load_model("owner/some-model")


def test_bad_dtype_is_rejected(hf_dir):
    with pytest.raises(ValueError, match="dtype.*int8"):
        load_model(str(hf_dir), dtype="int8")


def test_runtime_never_imports_torch(tmp_path, spec, weights, hf_dir):
    gguf_path = write_gguf(tmp_path / "t.gguf", spec, weights)
    code = (
        "import sys, models\n"
        f"a = models.load_model({str(gguf_path)!r}, dtype='float32')\n"
        f"b = models.load_model({str(hf_dir)!r}, dtype='bfloat16')\n"
        "a.tokenizer.apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("changes", [
    {}, {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
    {"architecture": "Gemma3ForCausalLM", "tie_word_embeddings": True}], ids=lambda c: str(
        c.get("architecture", "LlamaForCausalLM")))
def test_abstract_model_has_a_random_inits_structure_shapes_and_dtypes(changes):
    """The loaders build the model for its shapes with a stand-in for nnx.Rngs (fast): the
    module graph, every parameter's shape and dtype are those of a real random init."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.loader import abstract_model
    from models.registry import get_model_class

    spec = tiny_spec(**changes)
    real = nnx.eval_shape(lambda: get_model_class(spec.architecture)(
        spec, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    (g1, s1), (g2, s2) = nnx.split(real), nnx.split(abstract_model(spec, jnp.bfloat16))
    assert g1 == g2
    pairs = jax.tree.leaves(jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype),
                                         s1, s2))
    assert pairs and all(pairs)


def test_layers_stacked_for_the_cpu_scan_export_as_the_model_was_loaded(spec, weights):
    """The engine's CPU twin (models.llama.stack_layers) holds each Param once, [layers, ...]:
    exporting it gives every layer's HF tensors, as the per-layer model does (it used to write
    the stacked arrays under one name, and HF filled the layers it missed with random values)."""
    from models.llama import ScannedLayers, stack_layers

    model = build_model(spec, weights, np.float32)
    stacked = stack_layers(model)
    assert isinstance(stacked.model.layers, ScannedLayers)
    got = export_weights(stacked)
    assert set(got) == set(weights)
    assert all(np.array_equal(got[n], weights[n]) for n in weights)
