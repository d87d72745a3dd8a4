"""The real Gemma 3 270M (extra `gemma3`; skipped without it, as on CI) through the paged
engine: greedy tokens equal HF transformers' Gemma3ForCausalLM (eager, float32) holding the
same dequantized weights, for prompts of 600-1500 tokens (past the 512-token window of its
sliding layers), 32 new tokens each, with chunked prefill cutting prompts mid-window."""

from __future__ import annotations

import pytest
from helpers import make_llm
from test_gemma3_gguf import _hf_model

from jpaged import SamplingParams
from models.gguf_loader import hf_config_from_gguf, read_gguf_tensors
from models.loader import GEMMA3_MODEL, gemma3_gguf_path, load_model

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

NEW_TOKENS = 32
COLORS = ("red", "green", "blue", "amber", "violet", "grey", "white")


def text_of(n_items: int) -> str:
    """A base-model prompt: a numbered inventory whose continuation the model can follow."""
    return " ".join(f"Item {i}: the {COLORS[i % 7]} box holds {(i * 7) % 13} stones."
                    for i in range(1, n_items + 1))


@pytest.fixture(scope="module")
def gemma():
    try:
        path = gemma3_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"Gemma 3 270M GGUF not available: {e}")
    loaded = load_model(GEMMA3_MODEL, dtype="float32")
    meta, tensors = read_gguf_tensors(path)
    hf = _hf_model(hf_config_from_gguf(meta, set(tensors.files)), tensors)
    return loaded, hf


def test_greedy_tokens_equal_hf_past_the_window(gemma):
    loaded, hf = gemma
    assert loaded.spec.layer_windows.count(512) == 15  # layers 5, 11 and 17 are global
    prompts = [loaded.tokenizer.encode(text_of(n)) for n in (48, 75, 110)]
    assert [600 <= len(p) <= 1500 for p in prompts] == [True] * 3, [len(p) for p in prompts]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    llm = make_llm(loaded, max_model_len=2048, max_num_seqs=3, max_num_batched_tokens=384)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
    print("continuation:", loaded.tokenizer.decode(got[0]))
