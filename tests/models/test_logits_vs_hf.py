"""jpaged logits equal HF transformers' (PyTorch float32) on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import TINY_CONFIGS, hf_logits, jpaged_logits, make_hf_checkpoint, relative_error

from models import load_model
from models.config import SUPPORTED_ARCHITECTURES
from models.registry import MODEL_REGISTRY

torch = pytest.importorskip("torch")

TOL = 1e-3  # max abs error relative to max(1, max |logit|)


def test_registry_matches_supported_architectures():
    assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_tiny_model_logits_match_hf(kind, tmp_path):
    hf = make_hf_checkpoint(kind, tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    assert loaded.spec.architecture == hf.config.architectures[0]
    assert loaded.source == str(tmp_path)
    rng = np.random.default_rng(1)
    # Two sequences of different lengths in one flattened batch, plus trailing padding.
    seqs = [rng.integers(0, 256, size=n).tolist() for n in (13, 6)]
    ours = jpaged_logits(loaded.model, seqs, pad_to=24)
    refs = hf_logits(hf, seqs)
    for o, r in zip(ours, refs, strict=True):
        assert o.dtype == np.float32 and o.shape == r.shape
        err = relative_error(o, r)
        print(f"{kind}: max|logit|={np.abs(r).max():.2f} relative max abs err={err:.2e}")
        assert err <= TOL


def test_bfloat16_model_is_close(tmp_path):
    hf = make_hf_checkpoint("qwen3_qk_norm", tmp_path)
    loaded = load_model(str(tmp_path), dtype="bfloat16")
    seqs = [list(range(40, 60))]
    (ours,) = jpaged_logits(loaded.model, seqs)
    (ref,) = hf_logits(hf, seqs)
    assert ours.dtype == np.float32
    assert relative_error(ours, ref) < 0.1  # bf16 weights and activations: loose bound
