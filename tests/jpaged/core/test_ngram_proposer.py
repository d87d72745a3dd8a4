"""The n-gram (prompt lookup) proposer: longest suffix match, most recent occurrence, bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.ngram_proposer import NgramConfig, propose_ngram


def test_proposes_what_followed_the_most_recent_match():
    cfg = NgramConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6]
    # Suffix [5, 6] (and [x, 5, 6]: [2, 5, 6] never occurred); most recent earlier [5, 6] is at
    # 5: it was followed by 7, 1, 2.
    assert propose_ngram(toks, cfg) == [7, 1, 2]
    # The longest match wins over a more recent shorter one.
    toks = [1, 2, 3, 4, 9, 3, 4, 0, 2, 3, 4]
    assert propose_ngram(toks, cfg) == [9, 3, 4]  # [2, 3, 4] at 1, not [3, 4] at 5


def test_bounds_and_no_match():
    cfg = NgramConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=2)
    assert propose_ngram([1, 2, 3, 4], cfg) == []  # no 2-gram repeats
    assert propose_ngram([1, 2, 9, 1, 2], cfg) == [9, 1, 2]  # what follows, up to the end
    assert propose_ngram([1, 2, 9, 8, 7, 6, 1, 2], cfg, max_new=2) == [9, 8]
    assert propose_ngram([1, 2, 9, 1, 2], cfg, max_new=0) == []
    assert propose_ngram([7], cfg) == [] and propose_ngram([], cfg) == []
    # min 1: a single repeated token matches.
    assert propose_ngram([3, 8, 3], NgramConfig(2, 1, 1)) == [8, 3]


@pytest.mark.parametrize("kw,msg", [
    ({"num_speculative_tokens": 0, "prompt_lookup_max": 2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 0},
     "1 <= prompt_lookup_min"),
])
def test_bad_config_is_refused_by_name(kw, msg):
    with pytest.raises(ValueError, match=msg):
        NgramConfig(**kw)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(toks=st.lists(st.integers(0, 4), min_size=0, max_size=60), k=st.integers(1, 5),
       lo=st.integers(1, 3), extra=st.integers(0, 3))
def test_matches_a_brute_force_search(toks, k, lo, extra):
    """The module's rule: the longest matching suffix; what follows its latest earlier
    occurrence with k tokens after it, else its earliest (the oracle took the latest always,
    which the examples never told apart: [0, 7, 7, 7, 7, 7] with k 3 is [7, 7, 7])."""
    cfg = NgramConfig(k, lo + extra, lo)
    want: list[int] = []
    for n in range(min(cfg.prompt_lookup_max, len(toks) - 1), lo - 1, -1):
        starts = [s for s in range(len(toks) - n) if toks[s:s + n] == toks[len(toks) - n:]]
        if starts:
            whole = [s for s in starts if s + n + k <= len(toks)]
            s = (whole[-1] if whole else starts[0]) + n
            want = toks[s:s + k]
            break
    assert propose_ngram(np.asarray(toks, np.int32), cfg) == want


def test_a_loop_proposes_a_full_continuation():
    # The latest occurrence of [7, 7] overlaps the suffix and leaves one token after it; an
    # earlier one is followed by the whole proposal.
    cfg = NgramConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    assert propose_ngram([1, 7, 7, 7, 7, 7, 7], cfg) == [7, 7, 7]
    assert propose_ngram([1, 7, 7, 7], cfg) == [7]  # no occurrence with 3 after: the earliest
    assert propose_ngram([0, 7, 7, 7, 7, 7], NgramConfig(3, 2, 2)) == [7, 7, 7]


def test_speculative_max_model_len_stops_proposing_not_decoding():
    """vLLM's speculative_config.max_model_len: no proposal takes a request past it; the
    request itself decodes on to the engine's max_model_len."""
    from core_sim import make_request, make_scheduler

    from jpaged.config import SpeculativeConfig
    from jpaged.core.spec_proposer import Proposer

    sched = make_scheduler(64, block_size=4, max_model_len=128)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    req = make_request("a", prompt, max_tokens=50, stop_token_ids=[])
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, [3], first_rows=[0])  # 9 tokens: ... 1 2 3
    assert req.num_tokens == 9

    def proposal(limit):
        cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                prompt_lookup_max=3, prompt_lookup_min=2, max_model_len=limit)
        Proposer(cfg).propose([req])
        return req.spec_token_ids

    assert proposal(None) == [1, 2, 3, 1]
    assert proposal(12) == [1, 2]  # 9 tokens + 2 + the verified one = 12
    assert proposal(10) == []
    with pytest.raises(ValueError, match="max_model_len"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, max_model_len=0)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, draft_tensor_parallel_size=2)
    SpeculativeConfig(method="ngram", num_speculative_tokens=2, draft_tensor_parallel_size=1,
                      enforce_eager=True, parallel_drafting=False)  # vLLM's, accepted
