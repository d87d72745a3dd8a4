"""vLLM's bad_words on the embedded SmolLM2: a one-token word never appears, a word of
several tokens never completes (its last token is banned only after its others), both loops
agree, and malformed lists are refused by name."""

from __future__ import annotations

import pytest
from helpers import make_llm

from jpaged.sampling_params import SamplingParams

# The embedded model's steps running are this module's time, not its compiles.
pytestmark = pytest.mark.usefixtures("optimized_compiles")


@pytest.fixture(scope="module")
def llm():
    # The structured-output tests' engine arguments and optimization level: their compiled
    # steps are reused.
    return make_llm(max_model_len=512, max_num_seqs=64, max_num_batched_tokens=512)


def _contains(seq: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(word)]) == word for i in range(len(seq) - len(word) + 1))


def test_one_and_several_token_bad_words(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                                                  "France?"}],
                                     add_generation_prompt=True)
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    one = llm.generate([prompt], greedy.clone(bad_words=["Paris"]),
                       use_tqdm=False)[0].outputs[0]
    assert "Paris" not in one.text
    words = [tuple(tok.encode(w, add_special_tokens=False)) for w in ("Paris", " Paris")]
    assert not any(_contains(list(one.token_ids), w) for w in words)
    # " capital of France": three tokens; the first two may appear, the third never after them.
    phrase = "capital of France"
    several = llm.generate([prompt], greedy.clone(bad_words=[phrase]),
                           use_tqdm=False)[0].outputs[0]
    seqs = [tuple(tok.encode(p, add_special_tokens=False)) for p in (phrase, " " + phrase)]
    assert all(len(s) == 3 for s in seqs)
    assert not any(_contains(list(several.token_ids), s) for s in seqs)
    assert several.token_ids[:2] == plain.token_ids[:2]  # "The capital": untouched so far
    llm.llm_engine.set_async_scheduling(False)
    try:
        again = llm.generate([prompt], greedy.clone(bad_words=[phrase]),
                             use_tqdm=False)[0].outputs[0]
    finally:
        llm.llm_engine.set_async_scheduling(True)
    assert again.token_ids == several.token_ids


@pytest.mark.parametrize("value", [[""], "Paris", [3], ["  "]])
def test_malformed_bad_words_are_refused_by_name(value):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=value)
