"""The paged engine on the embedded model equals HF transformers' greedy generate, token for
token, with and without memory pressure and chunked prefill; no block leaks."""

from __future__ import annotations

import pytest
from helpers import embedded, hf_greedy, hf_llama_twin, make_llm

from jpaged import SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# The embedded model's steps running are this module's time, not its compiles.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimized_compiles")]
MAX_TOKENS = 10
PARAGRAPH = ("The paged KV cache splits the keys and values of every sequence into fixed-size "
             "blocks. A block table maps each logical block to a physical block in a pool, so "
             "memory is allocated on demand and freed the moment a request finishes. ")


def _prompts(tok) -> list[list[int]]:
    """Mixed lengths, chat-templated and raw, from a few tokens up to ~800."""
    chat = [
        "What is the capital of France?",
        "Summarize in one sentence:\n" + PARAGRAPH * 14,
    ]
    raw = ["Hello, my name is", "Once upon a time, " + PARAGRAPH * 4]
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]),
                      add_special_tokens=False) for c in chat]
    ids += [tok.encode(r) for r in raw]
    return ids


@pytest.fixture(scope="module")
def prompts():
    return _prompts(embedded().tokenizer)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_llama_twin(embedded(), tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def hf_outputs(prompts, hf_model):
    eos = embedded().spec.eos_token_ids
    return [hf_greedy(hf_model, p, MAX_TOKENS, eos) for p in prompts]


def _run(llm, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_lengths_are_mixed(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 16 and 700 <= lengths[-1] <= 900, lengths


def test_greedy_equals_hf_generate(prompts, hf_outputs):
    llm = make_llm(max_model_len=1024, max_num_seqs=8)
    assert _run(llm, prompts) == hf_outputs
    m = llm.get_metrics()
    assert m["kv_cache_usage"] == 0.0 and m["num_requests_running"] == 0
    assert m["num_blocks_free"] == m["num_blocks_total"]


def test_tiny_pool_preempts_and_still_matches(hf_model):
    """Four ~30-55 token prompts, 12 new tokens each, in a pool of 9 usable blocks (a sequence
    needs up to 5): requests are admitted while blocks last, then decode growth forces
    recompute preemptions. (64-token chunks and 4 rows: few step shapes to compile.)"""
    tok = embedded().tokenizer
    prompts = [tok.encode(f"Story {i}: " + PARAGRAPH[: 120 + 90 * i]) for i in range(4)]
    eos = embedded().spec.eos_token_ids
    want = [hf_greedy(hf_model, p, 12, eos) for p in prompts]
    llm = make_llm(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                   num_gpu_blocks_override=10, enable_prefix_caching=False)
    assert _run(llm, prompts, max_tokens=12) == want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0
    assert m["kv_cache_usage"] == 0.0 and m["num_blocks_free"] == m["num_blocks_total"]


def test_chunked_prefill_equals_unchunked(prompts, hf_outputs):
    llm = make_llm(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=128)
    assert _run(llm, prompts) == hf_outputs
    assert llm.get_metrics()["kv_cache_usage"] == 0.0


def test_chat_answers_paris():
    llm = make_llm(max_model_len=512, max_num_seqs=4)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    # OpenAI-style text parts are the same prompt; other content is refused by name.
    parts = [{"type": "text", "text": "What is the capital "},
             {"type": "text", "text": "of France?"}]
    again = llm.chat([{"role": "user", "content": parts}],
                     SamplingParams(temperature=0.0, max_tokens=24))
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="content must be a string"):
        llm.chat([{"role": "user", "content": 5}])
    # The assistant's last message continued, not a new turn.
    cont = llm.chat([{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "The capital of France is"}],
                    SamplingParams(temperature=0.0, max_tokens=4),
                    add_generation_prompt=False, continue_final_message=True)
    assert "Paris" in cont[0].outputs[0].text
    assert cont[0].prompt.endswith("The capital of France is")


def test_gpu_sampling_path_draws_the_cpu_paths_tokens():
    """The sampler a GPU compiles (16-way searches, filtering rows drawn from their
    candidates), run here on the real model through the runner, draws the very tokens of
    XLA:CPU's whole-row bisection for seeded requests with top-k, top-p and min-p. (Short
    prompts: the sampler sees the real model's logits whatever the prompt's length.)"""
    tok = embedded().tokenizer
    prompts = [tok.encode(t) for t in ("Hello, my name is", "The capital of France is",
                                       "Once upon a time,", "A paged KV cache")]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1, max_tokens=12),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2, max_tokens=12),
              SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=12),
              SamplingParams(temperature=1.2, top_k=5, seed=4, max_tokens=12)]
    runs = []
    for gpu_path in (False, True):
        llm = make_llm(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
        llm.llm_engine.runner.wide_search = gpu_path  # read when the step is traced
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    assert all(len(t) == 12 for t in runs[0])
