"""`jpaged convert`: a jpaged orbax checkpoint gives back the source's spec, weights, tokenizer
and greedy tokens, at tensor_parallel_size 1 and 3, and bad checkpoints fail clearly."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import embedded, make_llm, tiny, tiny_model_dir, xla_flags

from jpaged import LLM, SamplingParams
from models.checkpoint import MARKER, PARAMS_DIR, save_checkpoint
from models.config import ModelSpec
from models.loader import check_model_source, load_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("convert_tp_worker.py")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TINY_ARGS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
                 num_gpu_blocks_override=24)
EMBEDDED_ARGS = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                     num_gpu_blocks_override=16)
TEXTS = ["Hello, my name is", "The capital of France is", "1234567 + 89 = ?",
         "<|im_start|>user\nhi<|im_end|>", "naïve café — 東京 🙂", "  spaces\n\ttabs  "]


def _params(loaded) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(loaded.model)))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def _jpaged(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jpaged.cli", *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_checkpoint(tiny(), tmp_path_factory.mktemp("convert") / "tiny")


@pytest.fixture(scope="module")
def embedded_ckpt(tmp_path_factory, embedded_path) -> Path:
    return save_checkpoint(embedded(), tmp_path_factory.mktemp("convert") / "smollm2")


# ------------------------------------------------------------------ the tiny random model
def test_tiny_round_trip_keeps_spec_weights_and_files(tiny_ckpt):
    src = tiny()
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == sorted(
        [MARKER, PARAMS_DIR, "config.json", "tokenizer.json", "tokenizer_config.json"])
    manifest = json.loads((tiny_ckpt / MARKER).read_text())
    assert manifest["format_version"] == 2 and manifest["dtype"] == "float32"
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["source"] == src.source
    tensors = manifest["params"]["tensors"]
    assert tensors["model/layers/1/self_attn/q_proj/kernel"]["shape"] == [64, 64]  # per layer
    assert not any(name.startswith("model/layers/self_attn") for name in tensors)
    # The HF-style config.json describes the same model (tools that read only a config).
    assert ModelSpec.from_hf_config(json.loads((tiny_ckpt / "config.json").read_text())) == src.spec
    check_model_source(str(tiny_ckpt))

    out = load_model(str(tiny_ckpt), "float32")
    assert out.spec == src.spec and out.source == str(tiny_ckpt)
    a, b = _params(src), _params(out)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_tiny_greedy_tokens_through_llm(tiny_ckpt):
    prompts = ["Hello there", "abc", "The quick brown fox jumps"]
    want = make_llm(tiny(), **TINY_ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = LLM(model=str(tiny_ckpt), dtype="float32", **TINY_ARGS).generate(
        prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_load_in_another_dtype_casts(tiny_ckpt):
    src = _params(tiny())
    out = load_model(str(tiny_ckpt), "bfloat16")
    assert out.model.dtype == np.dtype("bfloat16")
    for name, x in _params(out).items():
        assert x.dtype == np.dtype("bfloat16"), name
        np.testing.assert_array_equal(x, src[name].astype(x.dtype), err_msg=name)


# ------------------------------------------------------------------ the embedded model
@pytest.mark.slow
def test_embedded_round_trip_tokens_and_tokenizer(embedded_ckpt):
    src = embedded()
    # LLM(model=OUT) loads through load_model: the marker is seen before config.json.
    llm = LLM(model=str(embedded_ckpt), dtype="float32", **EMBEDDED_ARGS)
    out = llm.llm_engine.loaded
    assert out.spec == src.spec
    prompts = ["The capital of France is", "def fib(n):"]
    want = make_llm(src, **EMBEDDED_ARGS).generate(prompts, GREEDY, use_tqdm=False)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]

    a, b = src.tokenizer, out.tokenizer
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template",
                 "bos_token_id", "eos_token_id", "pad_token_id", "vocab_size", "all_special_ids"):
        assert getattr(b, attr) == getattr(a, attr), attr
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert b.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert b.decode(ids, skip_special_tokens=skip) == a.decode(ids, skip)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[4]}]
    assert b.apply_chat_template(chat) == a.apply_chat_template(chat)


@pytest.mark.slow
def test_embedded_tensor_parallel_3_from_the_checkpoint(embedded_ckpt, tmp_path):
    # A copy in format version 1's stacked layout loads into the same sharded per-layer model.
    stacked = tmp_path / "stacked"
    shutil.copytree(embedded_ckpt, stacked)
    _write_stacked_v1(stacked)
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"),
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(WORKER), str(embedded_ckpt), str(stacked)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["num_devices"] == 4
    assert facts["tp3"]["tokens"] == facts["tp1"]["tokens"]
    assert facts["stacked_tp3"]["tokens"] == facts["tp1"]["tokens"]
    assert facts["stacked_tp3"]["q_proj"] == facts["tp3"]["q_proj"]
    whole, split = facts["tp1"]["q_proj"], facts["tp3"]["q_proj"]
    assert whole["shard_bytes"] == [whole["global_bytes"]]
    # Restored straight into the mesh: each of 3 devices holds a third of q_proj's columns.
    assert split["shard_devices"] == [0, 1, 2]
    assert split["shard_bytes"] == [split["global_bytes"] // 3] * 3
    # (A CPU engine holds the layers stacked: a leading layer axis, split the same way.)
    assert all(s == [*split["global_shape"][:-1], split["global_shape"][-1] // 3]
               for s in split["shard_shapes"])
    assert split["runner_same_sharding"] and whole["runner_same_sharding"]


# ------------------------------------------------------------------ the command line
def test_cli_convert_refuses_a_non_empty_out_until_overwrite(tmp_path):
    out = tmp_path / "ckpt"
    r = _jpaged("convert", str(tiny_model_dir()), str(out), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(out.resolve())
    assert json.loads((out / MARKER).read_text())["dtype"] == "bfloat16"

    r = _jpaged("convert", str(tiny_model_dir()), str(out))
    assert r.returncode == 2
    assert "not empty" in r.stderr and str(out) in r.stderr and "--overwrite" in r.stderr
    r = _jpaged("convert", str(tiny_model_dir()), str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / MARKER).read_text())["dtype"] == "float32"
    # `--model OUT` through the CLI: tests/jpaged/runner/test_multiprocess.py serves one.


def test_cli_convert_bad_inputs(tmp_path):
    r = _jpaged("convert", str(tiny_model_dir()), str(tmp_path / "x"), "--dtype", "int8")
    assert r.returncode == 2 and "--dtype" in r.stderr
    r = _jpaged("convert", str(tmp_path / "missing.gguf"), str(tmp_path / "y"))
    assert r.returncode == 2 and "GGUF file not found" in r.stderr
    assert not (tmp_path / "y").exists()
    r = _jpaged("convert", str(tiny_model_dir()), str(tmp_path / "z"), "--quantization", "gguf")
    assert r.returncode == 2 and "quantization='gguf' runs a GGUF file" in r.stderr


def test_cli_convert_quantized_gguf_loads_back_quantized(tmp_path, embedded_path):
    out = tmp_path / "q"
    r = _jpaged("convert", "embedded", str(out), "--quantization", "gguf")
    assert r.returncode == 0, r.stderr
    assert ", gguf;" in r.stdout
    manifest = json.loads((out / MARKER).read_text())
    assert manifest["quantization"]["method"] == "gguf"
    assert manifest["quantization"]["plan"]["model.layers.0.mlp.up_proj"] == [
        "int4", 32, True, "float16"]  # Q4_1
    back = load_model(str(out))
    assert back.quantization == "gguf"
    assert _params(back).keys() == _params(load_model(None, quantization="gguf")).keys()


# ------------------------------------------------------------------ bad checkpoints
@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "copy"))


def _edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads((path / MARKER).read_text())
    for key, value in changes.items():
        if key.startswith("spec_"):
            manifest["spec"][key[5:]] = value
        else:
            manifest[key] = value
    (path / MARKER).write_text(json.dumps(manifest))


def test_refuses_a_non_empty_output_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        save_checkpoint(tiny(), out)
    save_checkpoint(tiny(), out, overwrite=True)
    save_checkpoint(tiny(), out, overwrite=True)  # over its own checkpoint
    assert (out / "notes.txt").read_text() == "keep me"  # only the checkpoint's files replaced
    assert load_model(str(out), "float32").spec == tiny().spec


def test_corrupt_manifest(ckpt_copy):
    (ckpt_copy / MARKER).write_text("{not json")
    for load in (check_model_source, lambda p: load_model(p, "float32")):
        with pytest.raises(ValueError, match="corrupt checkpoint manifest .*jpaged_checkpoint"):
            load(str(ckpt_copy))


def test_format_version_mismatch(ckpt_copy):
    _edit_manifest(ckpt_copy, format_version=99)
    with pytest.raises(ValueError, match=r"format_version 99.*reads versions 1 and 2 .*"
                                         r"jpaged convert SOURCE .* --overwrite"):
        load_model(str(ckpt_copy), "float32")


def _write_stacked_v1(ckpt: Path) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: the decoder Params stacked on a
    leading layer axis under model/layers/..., the manifest saying version 1."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(ckpt / PARAMS_DIR)
    layers = params["model"]["layers"]
    keys = sorted(layers, key=int)
    params["model"]["layers"] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]),
                                             *[layers[k] for k in keys])
    shutil.rmtree(ckpt / PARAMS_DIR)
    with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save(ckpt / PARAMS_DIR, params)
    _edit_manifest(ckpt, format_version=1)


def test_stacked_version_1_checkpoint_still_loads(ckpt_copy):
    _write_stacked_v1(ckpt_copy)
    out = load_model(str(ckpt_copy), "float32")
    a, b = _params(tiny()), _params(out)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_missing_params(ckpt_copy):
    shutil.rmtree(ckpt_copy / PARAMS_DIR)
    with pytest.raises(FileNotFoundError, match="has no parameters"):
        check_model_source(str(ckpt_copy))


def _load_error(path: Path) -> str:
    """load_model's ValueError for `path`, read in a process of its own: when one array's read
    fails, orbax leaves the reads of the others pending, and their coroutines, collected
    unawaited whenever the garbage collector next runs, would be reported as warnings against
    whichever test of this process runs then."""
    code = ("import sys\nfrom models.loader import load_model\ntry:\n"
            "    load_model(sys.argv[1], 'float32')\nexcept ValueError as e:\n"
            "    print(e)\n    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_damaged_parameter_files_give_one_line_naming_the_tensor(ckpt_copy, tmp_path):
    """A truncated data file: one line naming the tensor and the re-convert command, none of
    TensorStore's spec dump. An emptied parameters folder: said so, not an AttributeError."""
    data = max((f for f in (ckpt_copy / PARAMS_DIR).rglob("*") if f.is_file()
                and f.parent.name == "d"), key=lambda f: f.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])
    msg = _load_error(ckpt_copy)
    assert "TensorStore(" not in msg and "\n" not in msg and len(msg) < 600, msg
    assert "jpaged convert SOURCE" in msg and str(ckpt_copy) in msg, msg
    assert re.search(r"\(tensor [\w.]+\)", msg) or "corrupt checkpoint parameters" in msg, msg
    empty = Path(shutil.copytree(ckpt_copy, tmp_path / "empty"))
    for f in list((empty / PARAMS_DIR).iterdir()):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    assert re.search("corrupt checkpoint parameters .*(empty or incomplete|jpaged convert)",
                     _load_error(empty))


def test_shape_mismatch_names_the_tensor(ckpt_copy):
    _edit_manifest(ckpt_copy, spec_vocab_size=301)
    with pytest.raises(ValueError, match=r"tensor 'lm_head/kernel' in checkpoint .* has shape "
                                         r"\(64, 300\), expected \(64, 301\)"):
        load_model(str(ckpt_copy), "float32")


def test_bad_spec_in_manifest(ckpt_copy):
    _edit_manifest(ckpt_copy, spec_num_heads="four")
    with pytest.raises(ValueError, match="corrupt checkpoint manifest.*num_heads"):
        load_model(str(ckpt_copy), "float32")
