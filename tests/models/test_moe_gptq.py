"""GPTQ and AWQ checkpoints of a mixture of experts load with their experts kept quantized:
tiny Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints whose every linear (attention, each
expert's, the dense MLP layer's, the shared expert's) is quantized here at group 32 and packed
by the formats' own descriptions (tests/models/test_hf_quant.py's packers) give the logits of
the float model holding the dequantized weights on each way of the grouped matmul; a layer
whose experts are not all packed alike is refused naming the tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from test_hf_quant import AWQ_ORDER, pack_along_cols, pack_along_rows
from tiny_models import jpaged_logits, make_hf_checkpoint, relative_error

from models import load_model
from models.moe import QuantExperts, experts_run_as
from models.quant_layers import QuantLinear, plan_of

pytest.importorskip("torch")

GROUP = 32
SEQS = [[256, 7, 99, 12, 150, 3, 42], [256, 1, 2]]
# Linears the producers quantize: attention, dense and shared-expert MLPs, every expert (Qwen's
# gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2); not the router or the shared
# expert's gate (one output), the embeddings or the head.
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.\d+\.w[123]\.weight$")
# name -> quantization_config (GPTQ v1 stores each zero point less one; AWQ GEMM is 4-bit).
CONFIGS = {
    "gptq4_sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                  "sym": True, "checkpoint_format": "gptq"},
    "gptq4_asym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                   "sym": False, "checkpoint_format": "gptq"},
    "gptq8_asym": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False,
                   "sym": False, "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": GROUP,
            "zero_point": True},
}
# An expert matrix whose one expert keeps float32 scales no float16 holds (gptq4_sym): its
# stack takes float32 scales and mins, the other stacks float16.
WIDE_SCALES = {"qwen3_moe": "model.layers.0.mlp.experts.3.up_proj",
               "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3",
               "qwen2_moe_even": "model.layers.0.mlp.experts.3.up_proj"}


def quantize(w: np.ndarray, name: str, scale_dtype: type = np.float16
             ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """HF weight [out, in] quantized per group of GROUP input rows as config `name` packs it:
    (the module's checkpoint tensors by leaf, the float weight [out, in] they stand for)."""
    qc = CONFIGS[name]
    bits, sym = qc["bits"], qc.get("sym", False)
    top = (1 << bits) - 1
    wt = w.T.astype(np.float64)  # [K, N]
    k, n = wt.shape
    g = wt.reshape(k // GROUP, GROUP, n)
    lo, hi = g.min(1), g.max(1)
    if sym:  # zero in the middle: w = (q - 2^(bits-1)) * s
        z = np.full((k // GROUP, n), 1 << (bits - 1))
        s = np.maximum(np.abs(lo), np.abs(hi)) / ((top - 1) / 2)
    else:
        s = (hi - lo) / top
        z = np.rint(-lo / np.maximum(s, 1e-12))
    s = np.maximum(s, 1e-4).astype(scale_dtype)
    if scale_dtype is np.float32:  # a scale one float16 step can't hold
        s = (s * np.float32(1 + 2.0 ** -20)).astype(np.float32)
    if qc["quant_method"] == "gptq" and not sym:
        z = np.clip(z, 1, top)  # v1 stores z - 1, so no zero point of 0
    z = np.clip(z, 0, top).astype(np.int64)
    sf = np.repeat(s.astype(np.float32), GROUP, 0)
    zf = np.repeat(z, GROUP, 0)
    q = np.clip(np.rint(wt / sf) + zf, 0, top).astype(np.int64)
    deq = ((q - zf).astype(np.float32) * sf).T
    if qc["quant_method"] == "awq":
        t = {"qweight": pack_along_cols(q, 4, AWQ_ORDER),
             "qzeros": pack_along_cols(z, 4, AWQ_ORDER), "scales": s}
    else:
        t = {"qweight": pack_along_rows(q, bits), "qzeros": pack_along_cols(z - 1, bits),
             "scales": s, "g_idx": (np.arange(k) // GROUP).astype(np.int32)}
    # (C order: safetensors.numpy writes an array's buffer as it lies)
    return {leaf: np.ascontiguousarray(v) for leaf, v in t.items()}, np.ascontiguousarray(deq)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (its float HF dir, its tensors), made once."""
    from safetensors.numpy import load_file

    made: dict[str, tuple[Path, dict[str, np.ndarray]]] = {}

    def get(kind: str) -> tuple[Path, dict[str, np.ndarray]]:
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            make_hf_checkpoint(kind, path)
            made[kind] = path, load_file(str(path / "model.safetensors"))
        return made[kind]

    return get


def quantized_tensors(kind: str, name: str, floats: dict[str, np.ndarray]
                      ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(checkpoint tensors of `floats` with every QUANTIZED linear packed as config `name`,
    the float tensors they stand for)."""
    packed, deq = {}, {}
    for t, w in floats.items():
        if not QUANTIZED.search(t):
            packed[t] = deq[t] = w
            continue
        module = t[:-len(".weight")]
        wide = name == "gptq4_sym" and module == WIDE_SCALES[kind]
        parts, deq[t] = quantize(w, name, np.float32 if wide else np.float16)
        packed.update({f"{module}.{leaf}": v for leaf, v in parts.items()})
    return packed, deq


def write_dir(src: Path, dst: Path, tensors: dict[str, np.ndarray], qc: dict | None) -> Path:
    """`src`'s HF dir (config, tokenizer) at `dst` with `tensors`, and `qc` as its
    quantization_config."""
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "model.safetensors"))
    if qc is not None:
        cfg = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


CASES = [("qwen3_moe", "gptq4_sym"), ("qwen3_moe", "gptq4_asym"), ("qwen3_moe", "awq"),
         ("mixtral", "gptq4_sym"), ("mixtral", "gptq4_asym"), ("mixtral", "awq"),
         ("qwen3_moe", "gptq8_asym"), ("qwen2_moe_even", "gptq4_asym")]


@pytest.mark.parametrize("kind,name", CASES)
def test_packed_experts_give_the_dequantized_models_logits(checkpoints, tmp_path, kind, name):
    """The experts load as QuantExperts of the format's kind (router and shared-expert gate in
    float, every other linear a QuantLinear) and the logits equal the float model's of the
    dequantized weights on the loop, the kernel (interpreted) and ragged_dot."""
    src, floats = checkpoints(kind)
    packed, deq = quantized_tensors(kind, name, floats)
    qc = CONFIGS[name]
    got = load_model(str(write_dir(src, tmp_path / "q", packed, qc)), dtype="float32")
    ref = load_model(str(write_dir(src, tmp_path / "f", deq, None)), dtype="float32")
    assert got.quantization == qc["quant_method"]
    kind_of = "int4" if qc["bits"] == 4 else "int8"
    experts = {".".join(map(str, p)): x for p, x in nnx.iter_graph(got.model)
               if isinstance(x, QuantExperts)}
    spec = got.spec
    sparse = sum(spec.layer_is_sparse(i) for i in range(spec.num_layers))
    assert len(experts) == 3 * sparse and {x.kind for x in experts.values()} == {kind_of}
    linears = {".".join(map(str, p)): x for p, x in nnx.iter_graph(got.model)
               if isinstance(x, nnx.Linear | QuantLinear)}
    for path, x in linears.items():
        want = QUANTIZED.search(path + ".weight") is not None
        assert isinstance(x, QuantLinear) == want, path
    plan = plan_of(got.model)
    layouts = {(p.kind, p.group_size, p.has_min) for m, p in plan.items() if m in experts}
    assert layouts == {(kind_of, GROUP, True)}
    if name == "gptq4_sym":  # float16 where every expert's scales and mins fit it exactly
        wide = WIDE_SCALES[kind].rsplit(".", 2)[0] + ".up_proj"
        dtypes = {m: plan[m].scale_dtype for m in experts}
        assert dtypes.pop(wide) == "float32" and set(dtypes.values()) == {"float16"}
    want = jpaged_logits(ref.model, SEQS)
    for impl in ("loop", "interpret", "xla"):
        with experts_run_as(impl):
            got_logits = jpaged_logits(got.model, SEQS)
        for a, b in zip(got_logits, want, strict=True):
            assert relative_error(a, b) < 1e-5, impl


# ---- bad input --------------------------------------------------------------------------------

L0 = "model.layers.0.mlp.experts"


def _drop(*names: str):
    def edit(t: dict[str, np.ndarray]) -> None:
        for n in names:
            del t[n]
    return edit


def _float_expert(module: str):
    """The expert's packed tensors replaced by its float weight."""
    def edit(t: dict[str, np.ndarray]) -> None:
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{module}.{leaf}", None)
        t[f"{module}.weight"] = np.zeros((32, 64), np.float32)  # up_proj: [32 out, 64 in]
    return edit


def _tensor(name: str, change):
    def edit(t: dict[str, np.ndarray]) -> None:
        t[name] = change(t[name])
    return edit


def _swap_rows(g: np.ndarray) -> np.ndarray:
    g = g.copy()
    g[[0, 40]] = g[[40, 0]]
    return g


BAD = {
    "gptq qweight missing": ("gptq4_asym", _drop(f"{L0}.3.up_proj.qweight"),
                             rf"lacks tensor '{L0}\.3\.up_proj\.qweight'"),
    "awq qweight missing": ("awq", _drop(f"{L0}.3.up_proj.qweight"),
                            rf"lacks tensor '{L0}\.3\.up_proj\.qweight'"),
    "gptq expert float": ("gptq4_asym", _float_expert(f"{L0}.5.up_proj"),
                          rf"tensor '{L0}\.5\.up_proj\.weight' in .* is not gptq-packed "
                          rf"\(qweight, qzeros, scales, g_idx\), but 15 of the 16 experts of "
                          rf"{L0} are"),
    "awq expert float": ("awq", _float_expert(f"{L0}.5.up_proj"),
                         rf"tensor '{L0}\.5\.up_proj\.weight' in .* is not awq-packed"),
    "expert absent": ("gptq4_asym", _drop(*(f"{L0}.7.down_proj.{leaf}" for leaf in
                                            ("qweight", "qzeros", "scales", "g_idx"))),
                      rf"lacks tensor '{L0}\.7\.down_proj\.qweight' \(15 of the 16 experts"),
    "expert scales shape": ("awq", _tensor(f"{L0}.2.down_proj.scales", lambda s: s[:, :32]),
                            rf"'{L0}\.2\.down_proj\.scales'.*has shape \(1, 32\), expected "
                            r"\(1, 64\)"),
    "expert g_idx reorders": ("gptq4_asym", _tensor(f"{L0}.4.gate_proj.g_idx", _swap_rows),
                              rf"'{L0}\.4\.gate_proj\.g_idx'.*reorders"),
    "expert out of range": ("gptq4_asym", lambda t: t.update(
        {f"{L0}.16.up_proj.qweight": t[f"{L0}.0.up_proj.qweight"]}),
        rf"'{L0}\.16\.up_proj\.qweight'.*names no linear layer"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_expert_tensors_are_refused_by_name(checkpoints, tmp_path, what):
    name, edit, match = BAD[what]
    src, floats = checkpoints("qwen3_moe")
    packed, _ = quantized_tensors("qwen3_moe", name, floats)
    edit(packed)
    path = write_dir(src, tmp_path / "bad", packed, CONFIGS[name])
    with pytest.raises(ValueError, match=match):
        load_model(str(path), dtype="float32")


def test_a_config_with_nothing_packed_is_refused(checkpoints, tmp_path):
    """quantization_config says GPTQ, but the tensors are the float checkpoint's."""
    src, floats = checkpoints("qwen3_moe")
    path = write_dir(src, tmp_path / "q", floats, CONFIGS["gptq4_asym"])
    with pytest.raises(ValueError, match=r"says gptq, but no linear of .* holds its packed "
                                         r"tensors \(qweight, qzeros, scales, g_idx\)"):
        load_model(str(path), dtype="float32")

