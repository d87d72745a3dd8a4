"""HF checkpoints that carry a quantization_config (GPTQ, AWQ, fp8 from compressed-tensors and
vLLM / transformers) load quantized: tiny checkpoints packed here by hand from each format's
description load with their weights equal to the format's floats, logits equal to the float
model of those weights, the quantized bytes on the device, and every bad input refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from tiny_models import (
    hf_config_dict,
    jpaged_logits,
    random_weights,
    relative_error,
    save_byte_tokenizer,
    tiny_spec,
    write_hf_dir,
)

from models import load_model
from models.quant import dequantize
from models.quant_layers import QuantLinear, plan_of

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", BF16: "BF16", FP8: "F8_E4M3",
       np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SEQS = [[256, 5, 77, 3, 140, 9, 12, 33]]


def save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A .safetensors file written from the format: u64 header length, JSON header, bytes."""
    header: dict[str, dict] = {}
    blobs, at = [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": _ST[np.dtype(arr.dtype)], "shape": list(arr.shape),
                        "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


# ---- packers written from the formats' descriptions ------------------------------------------

def pack_along_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight: [K, N] -> int32 [K * bits / 32, N]; value i of a word at bits bits*i."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), np.uint32)
    for i in range(per):
        out |= q[i::per].astype(np.uint32) << np.uint32(bits * i)
    return out.view(np.int32)


def pack_along_cols(q: np.ndarray, bits: int, order: tuple[int, ...] | None = None
                    ) -> np.ndarray:
    """[G, N] -> int32 [G, N * bits / 32]: GPTQ's qzeros (value i at bits bits*i), or AWQ's
    (nibble i holds column order[i] of each 8)."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((q.shape[0], q.shape[1] // per), np.uint32)
    for i in range(per):
        out |= (q[:, order[i]::per].astype(np.uint32) & np.uint32((1 << bits) - 1)) \
            << np.uint32(bits * i)
    return out.view(np.int32)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _grouped(a: np.ndarray, group: int) -> np.ndarray:
    return np.repeat(a, group, axis=0)


def int_case(fmt: str, m: str, k: int, n: int, rng: np.random.Generator, cfg: dict
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Checkpoint tensors of module `m` ([k in, n out]) in GPTQ or AWQ form, and the float
    weight [n, k] they stand for: w = (q - z) * s."""
    bits, gs = cfg["bits"], cfg["group_size"]
    group = k if gs == -1 else gs
    top = (1 << bits) - 1
    q = rng.integers(0, top + 1, (k, n))
    s = rng.uniform(0.004, 0.04, (k // group, n)).astype(np.float16)
    if cfg.get("sym"):
        z = np.full(s.shape, 1 << (bits - 1))
    elif cfg.get("checkpoint_format", "gptq") == "gptq" and fmt == "gptq":
        z = rng.integers(1, top + 2, s.shape)  # v1 stores z - 1: true zeros 1..2^bits
    else:
        z = rng.integers(0, top + 1, s.shape)
    w = ((q - _grouped(z, group)).astype(np.float32)
         * _grouped(s.astype(np.float32), group)).T
    if fmt == "awq":
        t = {"qweight": pack_along_cols(q, 4, AWQ_ORDER),
             "qzeros": pack_along_cols(z, 4, AWQ_ORDER), "scales": s}
    else:
        stored = z - 1 if cfg.get("checkpoint_format", "gptq") == "gptq" else z
        t = {"qweight": pack_along_rows(q, bits), "qzeros": pack_along_cols(stored, bits),
             "scales": s, "g_idx": (np.arange(k) // group).astype(np.int32)}
    return {f"{m}.{leaf}": v for leaf, v in t.items()}, np.ascontiguousarray(w)


def fp8_case(scale_shape: str, scale_name: str, scale_dtype: np.dtype, m: str, k: int, n: int,
             rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """fp8 tensors of module `m`: weight F8_E4M3 [n, k], a scale per tensor or per channel and
    a static input scale; w = q * scale."""
    q = np.clip(rng.standard_normal((n, k)) * 60, -448, 448).astype(FP8)
    shape = {"scalar": (), "one": (1,), "channel": (n, 1)}[scale_shape]
    scale = rng.uniform(0.0005, 0.003, shape).astype(np.float32).astype(scale_dtype)
    w = q.astype(np.float32) * scale.astype(np.float32)
    return ({f"{m}.weight": q, f"{m}.{scale_name}": scale,
             f"{m}.input_scale": np.array([0.02], np.float32)}, w)


def _qc_fp8_ct(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False, "group_size": None},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                      "dynamic": False, "symmetric": True}}}}


# name -> (quantization_config, how each module is packed)
CASES = {
    "gptq4_v1_sym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                      "sym": True, "checkpoint_format": "gptq"}, "gptq"),
    "gptq4_v1_asym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                       "sym": False}, "gptq"),
    "gptq4_v2_channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                          "sym": False, "checkpoint_format": "gptq_v2"}, "gptq"),
    # GPTQ with the output head quantized too (vLLM's `lm_head` flag; vocab a multiple of 8)
    "gptq4_lm_head": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                       "sym": False, "lm_head": True}, "gptq"),
    "gptq8_v1": ({"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False,
                  "sym": False, "checkpoint_format": "gptq"}, "gptq"),
    "awq": ({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32,
             "zero_point": True}, "awq"),
    "ct_fp8_channel": (_qc_fp8_ct("channel"), ("channel", "weight_scale", BF16)),
    "ct_fp8_tensor": (_qc_fp8_ct("tensor"), ("one", "weight_scale", np.dtype(np.float32))),
    "vllm_fp8": ({"quant_method": "fp8", "activation_scheme": "static",
                  "ignored_layers": ["lm_head"]}, ("scalar", "weight_scale", np.dtype(np.float32))),
    "hf_fp8_per_tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic",
                           "weight_block_size": None, "modules_to_not_convert": ["lm_head"]},
                          ("one", "weight_scale_inv", np.dtype(np.float32))),
}


def case_spec(name: str):
    """The tiny model of CASES[name] (a vocabulary GPTQ can pack when its head is quantized)."""
    return tiny_spec(vocab_size=304) if CASES[name][0].get("lm_head") else tiny_spec()


def quantized_modules(name: str) -> list[str]:
    """The modules CASES[name] quantizes: every decoder projection, and the head with `lm_head`."""
    spec = case_spec(name)
    return ([f"model.layers.{layer}.{p}" for layer in range(spec.num_layers) for p in PROJ]
            + (["lm_head"] if CASES[name][0].get("lm_head") else []))


def make_case(path: Path, name: str, seed: int = 0) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """A quantized HF dir for CASES[name]: (dir, its checkpoint tensors, the float weights
    every tensor stands for)."""
    qc, how = CASES[name]
    spec = case_spec(name)
    floats = random_weights(spec, seed)
    rng = np.random.default_rng(seed + 1)
    modules = quantized_modules(name)
    tensors = {n: v for n, v in floats.items() if n.removesuffix(".weight") not in modules}
    for m in modules:
        n, k = floats[f"{m}.weight"].shape
        if isinstance(how, str):
            t, w = int_case(how, m, k, n, rng, qc)
        else:
            t, w = fp8_case(*how, m, k, n, rng)
        tensors.update(t)
        floats[f"{m}.weight"] = w
    return write_quantized(path, spec, tensors, qc), tensors, floats


def write_quantized(path: Path, spec, tensors: dict[str, np.ndarray], qc: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf_config_dict(spec),
                                                  "quantization_config": qc}))
    save_safetensors(path / "model.safetensors", tensors)
    save_byte_tokenizer(path)
    return path


def _module(model: nnx.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(tree)))


# ---- loading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_loads_exactly(tmp_path, case):
    path, _, floats = make_case(tmp_path / "q", case)
    got = load_model(str(path), "float32")
    method = CASES[case][0]["quant_method"]
    assert got.quantization == method and plan_of(got.model)
    ref = load_model(str(write_hf_dir(tmp_path / "f", case_spec(case), floats)), "float32")
    q_bytes = f_bytes = 0
    for m in quantized_modules(case):
        mod = _module(got.model, m)
        assert isinstance(mod, QuantLinear), m
        w = mod.weight()
        # (a) the device's arrays dequantize to the format's floats, bit for bit
        deq = np.asarray(dequantize(w.q, w.scales, w.mins, w.kind, jnp.float32))
        assert np.array_equal(deq, floats[f"{m}.weight"].T), m
        q_bytes += _nbytes(mod)
        f_bytes += _nbytes(_module(ref.model, m))
    # The head stays float unless the checkpoint quantized it (GPTQ's `lm_head`).
    assert isinstance(_module(got.model, "lm_head"), QuantLinear) == bool(
        CASES[case][0].get("lm_head"))
    # (c) the device holds the quantized bytes (int8 with float32 scales and mins: 0.31x)
    assert q_bytes < 0.33 * f_bytes, (q_bytes, f_bytes)
    assert _nbytes(got.model) < _nbytes(ref.model) - 0.6 * f_bytes
    # (b) logits equal those of the float model of the same weights
    for a, b in zip(jpaged_logits(got.model, SEQS), jpaged_logits(ref.model, SEQS), strict=True):
        assert relative_error(a, b) < 1e-5, case


def test_layouts_are_the_narrowest_lossless(tmp_path):
    """Symmetric GPTQ (zero 8: min -8 * scale) keeps float16 scales; asymmetric zeros need
    float32 mins; fp8 with bfloat16 scales keeps them exact in float16; int8 for 8 bits."""
    want = {"gptq4_v1_sym": ("int4", 32, "float16"), "gptq4_v1_asym": ("int4", 32, "float32"),
            "gptq4_v2_channel": ("int4", 64, "float32"), "gptq8_v1": ("int8", 32, "float32"),
            "ct_fp8_channel": ("fp8", 64, "float16")}
    from models.build import abstract_model
    from models.hf_quant import hf_quantized
    from models.weights import load_hf_dir_weights

    for case, (kind, group, dtype) in want.items():
        path, _, _ = make_case(tmp_path / case, case)
        cfg = json.loads((path / "config.json").read_text())
        plan, tensors = hf_quantized(cfg, load_hf_dir_weights(path),
                                     abstract_model(tiny_spec(), jnp.float32), "cfg")
        layout = plan["model.layers.0.self_attn.q_proj"]
        assert (layout.kind, layout.group_size, layout.scale_dtype) == (kind, group, dtype)
        assert len(plan) == 14 and "lm_head" not in plan
        assert "model.layers.0.mlp.up_proj.qweight" in tensors
        assert tensors["model.layers.0.mlp.up_proj.qweight"].dtype == {
            "int4": np.uint8, "int8": np.int8, "fp8": FP8}[kind]


def test_unquantized_dir_with_fp8_still_quantizes_at_load(tmp_path):
    spec = tiny_spec()
    path = write_hf_dir(tmp_path / "hf", spec, random_weights(spec))
    got = load_model(str(path), "float32", quantization="fp8")
    assert got.quantization == "fp8" and plan_of(got.model)
    assert load_model(str(path), "float32").quantization is None


def test_fp8_at_load_names_the_module_with_a_nan_weight(tmp_path):
    spec = tiny_spec()
    weights = random_weights(spec)
    weights["model.layers.1.mlp.up_proj.weight"][5, 3] = np.nan  # [out, in]: channel 5
    path = write_hf_dir(tmp_path / "hf", spec, weights)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*NaN or inf values "
                                         r"in 1 of its 96 output channels \(first: channel 5\)"):
        load_model(str(path), "float32", quantization="fp8")


def test_fp8_checkpoint_with_quantization_fp8_loads_its_own(tmp_path):
    path, _, _ = make_case(tmp_path / "q", "vllm_fp8")
    got = load_model(str(path), "float32", quantization="fp8")
    assert got.quantization == "fp8"
    w = _module(got.model, "model.layers.1.mlp.down_proj").weight()
    assert w.kind == "fp8" and w.scales.shape == (1, 64)


# ---- bad input --------------------------------------------------------------------------------

L0 = "model.layers.0"


def _drop(name: str):
    def edit(qc: dict, t: dict) -> None:
        del t[name]
    return edit


def _set(**fields):
    def edit(qc: dict, t: dict) -> None:
        qc.update(fields)
    return edit


def _tensor(name: str, value):
    def edit(qc: dict, t: dict) -> None:
        t[name] = value(t[name])
    return edit


def _weights(**fields):
    def edit(qc: dict, t: dict) -> None:
        qc["config_groups"]["group_0"]["weights"].update(fields)
    return edit


def _reordered(g: np.ndarray) -> np.ndarray:
    g = g.copy()
    g[[0, 40]] = g[[40, 0]]
    return g


BAD = {
    "unknown method": ("gptq4_v1_asym", _set(quant_method="bitsandbytes"),
                       r"quant_method 'bitsandbytes' is not a format jpaged loads"),
    "gptq bits": ("gptq4_v1_asym", _set(bits=3), r"quantization_config\.bits = 3"),
    "awq bits": ("awq", _set(bits=8), r"quantization_config\.bits = 8"),
    "group size": ("gptq4_v1_asym", _set(group_size=48),
                   r"group_size 48 does not divide the input size 64"),
    "awq group size": ("awq", _set(group_size=40), r"group_size 40 does not divide"),
    "scales shape": ("gptq4_v1_asym",
                     _tensor(f"{L0}.mlp.up_proj.scales", lambda s: s[:1]),
                     rf"'{L0}\.mlp\.up_proj\.scales'.*shape \(1, 96\), expected \(2, 96\)"),
    "awq scales shape": ("awq", _tensor(f"{L0}.mlp.down_proj.scales", lambda s: s.T),
                         rf"'{L0}\.mlp\.down_proj\.scales'.*has shape"),
    "fp8 scale shape": ("ct_fp8_channel",
                        _tensor(f"{L0}.self_attn.k_proj.weight_scale", lambda s: s[:4]),
                        rf"'{L0}\.self_attn\.k_proj\.weight_scale'.*shape \(4, 1\)"),
    "missing qzeros": ("gptq4_v1_asym", _drop(f"{L0}.self_attn.v_proj.qzeros"),
                       rf"lacks tensor '{L0}\.self_attn\.v_proj\.qzeros'"),
    "missing qweight": ("awq", _drop(f"{L0}.self_attn.v_proj.qweight"),
                        rf"lacks tensor '{L0}\.self_attn\.v_proj\.qweight'"),
    "missing weight_scale": ("ct_fp8_tensor", _drop(f"{L0}.mlp.gate_proj.weight_scale"),
                             rf"lacks tensor '{L0}\.mlp\.gate_proj\.weight_scale'"),
    "missing fp8 weight": ("ct_fp8_tensor", _drop(f"{L0}.mlp.gate_proj.weight"),
                           rf"lacks tensor '{L0}\.mlp\.gate_proj\.weight'"),
    "qweight dtype": ("gptq4_v1_sym",
                      _tensor(f"{L0}.mlp.up_proj.qweight", lambda q: q.astype(np.float32)),
                      rf"'{L0}\.mlp\.up_proj\.qweight'.*dtype float32, expected int32"),
    "g_idx reorders": ("gptq4_v1_asym", _tensor(f"{L0}.mlp.down_proj.g_idx", _reordered),
                       rf"'{L0}\.mlp\.down_proj\.g_idx'.*reorders"),
    "desc_act without g_idx": ("gptq4_v1_asym", lambda qc, t: (
        qc.update(desc_act=True), t.pop(f"{L0}.mlp.up_proj.g_idx")),
        rf"lacks tensor '{L0}\.mlp\.up_proj\.g_idx'"),
    "gptq format": ("gptq4_v1_asym", _set(checkpoint_format="marlin"),
                    r"checkpoint_format = 'marlin' is not supported"),
    "awq version": ("awq", _set(version="gemv"), r"quantization_config\.version = 'gemv'"),
    "awq no zero point": ("awq", _set(zero_point=False), r"quantization_config\.zero_point"),
    "fp8 block-wise": ("hf_fp8_per_tensor", _set(weight_block_size=[128, 128]),
                       r"weight_block_size = \[128, 128\]: block-wise fp8"),
    "ct int weights": ("ct_fp8_channel", _weights(type="int", num_bits=4),
                       r"config_groups\.group_0\.weights\.type = 'int' is not supported"),
    "ct group strategy": ("ct_fp8_channel", _weights(strategy="group"),
                          r"weights\.strategy = 'group' is not supported"),
    "ct format": ("ct_fp8_channel", _set(format="pack-quantized"),
                  r"quantization_config\.format = 'pack-quantized'"),
    "ct ignored but fp8": ("ct_fp8_channel", _set(ignore=["lm_head", f"{L0}.mlp.up_proj"]),
                           rf"'{L0}\.mlp\.up_proj\.weight'.*leaves {L0}\.mlp\.up_proj "
                           "unquantized"),
    "packed non-linear": ("gptq4_v1_asym", lambda qc, t: t.update(
        {"model.norm.qweight": np.zeros((8, 64), np.int32)}),
        r"'model\.norm\.qweight'.*names no linear layer"),
    "not an object": ("awq", lambda qc, t: (qc.clear(), qc.update(x=1)),
                      r"quantization_config\.quant_method is missing"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_checkpoint_is_refused_naming_the_field_or_tensor(tmp_path, what):
    case, edit, match = BAD[what]
    qc = json.loads(json.dumps(CASES[case][0]))
    _, tensors, _ = make_case(tmp_path / "ok", case)
    edit(qc, tensors)
    path = write_quantized(tmp_path / "bad", tiny_spec(), tensors, qc)
    with pytest.raises(ValueError, match=match):
        load_model(str(path), "float32")


@pytest.mark.parametrize("case", ["gptq4_v1_sym", "awq", "ct_fp8_channel"])
def test_quantization_naming_another_method_is_refused(tmp_path, case):
    path, _, _ = make_case(tmp_path / "q", case)
    method = CASES[case][0]["quant_method"]
    with pytest.raises(ValueError, match=rf"quantized with '{method}'.*quantization='fp8' "
                                         "names another method"):
        load_model(str(path), "float32", quantization="fp8")
