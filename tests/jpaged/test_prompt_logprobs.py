"""prompt_logprobs on the embedded SmolLM2, as vLLM returns them: None for the first token,
then each prompt token's logprob and rank plus the top-k. A greedy continuation fed back as a
prompt scores its own tokens as generation did; HF transformers' log-softmax agrees on hidden
prompts; a chunked prefill gives what one chunk gives; a request that asks for them takes no
prefix-cache hit, and one that does not still does."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import embedded, hf_llama_twin, make_llm

from jpaged.sampling_params import SamplingParams

# The embedded model's steps running are this module's time, not its compiles.
pytestmark = pytest.mark.usefixtures("optimized_compiles")


@pytest.fixture(scope="module")
def llm():
    # 64-token steps: a prompt over 64 tokens is prefilled in chunks.
    return make_llm(max_model_len=512, max_num_batched_tokens=64)


def test_a_greedy_continuation_scores_as_generation_did_chunked_too(llm):
    prompt = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
              "The story should be about a hundred words long and end happily.")
    g = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, logprobs=0,
                                              ignore_eos=True),
                     use_tqdm=False)[0]
    c = g.outputs[0]
    ids = g.prompt_token_ids + list(c.token_ids)
    assert len(ids) > 64  # several prefill chunks
    p = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    plp = p.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    n0 = len(g.prompt_token_ids)
    for j, t in enumerate(c.token_ids):
        entry = plp[n0 + j]
        assert abs(entry[t].logprob - c.logprobs[j][t].logprob) < 1e-3, (j, t)
        assert entry[t].rank == 1  # greedy: the argmax
        assert len(entry) in (3, 4) and entry[t].decoded_token
    for entry, tok in zip(plp[1:], ids[1:], strict=True):  # ranks match the top-k order
        ranks = sorted(lp.rank for t, lp in entry.items() if t != tok)
        assert ranks == [1, 2, 3][:len(ranks)] or entry[tok].rank <= 3


def test_hf_log_softmax_agrees_on_hidden_prompts(llm, tmp_path):
    import torch

    hf = hf_llama_twin(embedded(), tmp_path)
    tok = llm.get_tokenizer()
    texts = ["Paris is the capital of France.", "def add(a, b):\n    return a + b\n",
             "1, 2, 3, 5, 8, 13, 21"]
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for text, out in zip(texts, outs, strict=True):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        want = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1),
                                                  torch.tensor(ids[1:])].numpy()
        got = np.array([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:],
                                                      strict=True)])
        np.testing.assert_allclose(got, want, atol=1e-3)


def test_no_prefix_cache_hit_for_prompt_logprobs_requests(llm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert [None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()}
            for e in again.prompt_logprobs] == [
        None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()}
        for e in first.prompt_logprobs]
    plain = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None


def test_too_many_prompt_logprobs_is_refused_by_name(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(["x"], SamplingParams(prompt_logprobs=21), use_tqdm=False)


def test_decoded_tokens_of_split_characters(llm):
    """As vLLM's logprobs: a token whose bytes end inside a character has decoded_token ""
    and the token that completes the character has all of it, so the decoded tokens join to
    the text (prompt and sampled alike), never a U+FFFD."""
    from jpaged.output_processor import REPLACEMENT_CHAR

    prompt = "我很欣赏你的作品。请继续写一首关于大海的诗"
    tok = llm.get_tokenizer()
    ids = tok.encode(prompt)
    assert sum(tok.decode([t]).endswith(REPLACEMENT_CHAR) for t in ids) >= 4
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                                                prompt_logprobs=2, ignore_eos=True))[0]
    plp = out.prompt_logprobs
    got = [plp[i][t].decoded_token for i, t in enumerate(ids) if i > 0]
    # Entries start at the second token; one that completes a character the first token
    # began carries that character whole.
    first = tok.decode(ids[:1])
    want = prompt if first.endswith(REPLACEMENT_CHAR) else prompt[len(first):]
    assert "".join(got) == want and "" in got
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in got)
    c = out.outputs[0]
    sampled = [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    if REPLACEMENT_CHAR not in c.text:  # the output's characters all complete
        assert "".join(sampled) == c.text
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in sampled)
