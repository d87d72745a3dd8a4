"""The suffix decoding proposer: local and global tries, bounds, probabilities, FIFO eviction."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.core.suffix_proposer import SuffixConfig, SuffixDraft, SuffixProposer


def _proposer(k: int, **kw) -> SuffixProposer:
    return SuffixProposer(SuffixConfig(num_speculative_tokens=k, **kw))


def _one(prompt: list[int], k: int, output: tuple[int, ...] = (), max_new: int | None = None,
         **kw) -> list[int]:
    """The proposal of a lone request with `prompt` and `output`."""
    sp = _proposer(k, **kw)
    sp.start_request("r", prompt)
    sp.extend("r", list(output))
    return sp.propose("r", max_new)


def _occurs(needle: list[int], hay: list[int]) -> bool:
    n = len(needle)
    return any(hay[s:s + n] == needle for s in range(len(hay) - n + 1))


def test_repetition_in_the_prompt_proposes_its_continuation():
    assert _one([1, 2, 3, 4, 5, 9, 1, 2, 3], k=3) == [4, 5, 9]
    assert _one([1, 2, 3, 4, 5, 9, 1, 2, 3], k=8) == [4, 5, 9]  # 3 matched: factor 1 -> 3
    # Nothing repeats (every suffix only matches itself): nothing to propose.
    assert _one([1, 2, 3, 4, 5], k=4) == []
    assert _one([], k=4) == [] and _one([7], k=4) == []


def test_output_copying_a_prompt_span_proposes_the_rest_of_it():
    span = list(range(100, 140))  # 40 tokens, longer than the tree depth
    prompt = [1, 2, 3, *span, 4, 5]
    sp = _proposer(8, suffix_decoding_max_tree_depth=24)
    sp.start_request("r", prompt)
    sp.extend("r", [9])
    for i in range(30):  # copy the span one token at a time, as decoding would
        sp.extend("r", [span[i]])
        draft = sp.propose_draft("r")
        want = span[i + 1:i + 1 + min(8, i + 1)]
        assert list(draft.tokens) == want and draft.source == "local", i
    # Deep into the copy the whole budget comes back, although the deepest match (23 tokens)
    # only has one token below it in a depth-24 tree: a shorter match serves it.
    assert sp.propose("r") == span[30:38]
    assert sp.propose("r", max_new=3) == span[30:33]


def test_proposal_length_bounds():
    prompt = [7, 1, 2, 3, 4, 5, 6, 8, 1, 2]  # only [1, 2] repeats: a 2-token match
    assert _one(prompt, k=4) == [3, 4]  # spec factor 1: at most 2
    assert _one(prompt, k=4, suffix_decoding_max_spec_factor=0.5) == [3]
    assert _one(prompt, k=4, suffix_decoding_max_spec_factor=0.4) == []
    assert _one(prompt, k=4, suffix_decoding_max_spec_factor=3.0) == [3, 4, 5, 6]
    assert _one(prompt, k=3, suffix_decoding_max_spec_factor=3.0) == [3, 4, 5]
    assert _one(prompt, k=4, max_new=1, suffix_decoding_max_spec_factor=3.0) == [3]
    assert _one(prompt, k=4, max_new=0) == [] and _one(prompt, k=4, max_new=-2) == []
    # The tree depth bounds match + proposal: depth 3 leaves 1 token below the 2-token match,
    # so the 1-token match (2 below it) serves.
    sp = _proposer(4, suffix_decoding_max_spec_factor=3.0, suffix_decoding_max_tree_depth=3)
    sp.start_request("r", prompt)
    assert sp.propose_draft("r") == SuffixDraft((3, 4), 1, 2.0, "local")


def test_min_token_prob_cuts_a_branching_path():
    # [5, 6, 1, 2] went on with 3 once and 4 once: the running probability halves there.
    prompt = [5, 6, 1, 2, 3, 8, 5, 6, 1, 2, 4, 8, 9, 5, 6]
    kw = {"k": 5, "suffix_decoding_max_spec_factor": 3.0}
    assert _one(prompt, suffix_decoding_min_token_prob=0.6, **kw) == [1, 2]
    # At 0.5 the tie goes to the smaller token, and the path goes on at probability 0.5.
    assert _one(prompt, suffix_decoding_min_token_prob=0.5, **kw) == [1, 2, 3, 8, 5]
    assert _one(prompt, suffix_decoding_min_token_prob=0.0, **kw) == [1, 2, 3, 8, 5]
    # The first step branches 2:1 ([1, 2] went on with 3, 3, 4).
    prompt = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 4, 7, 1, 2]
    assert _one(prompt, k=2, suffix_decoding_min_token_prob=0.6) == [3, 7]
    assert _one(prompt, k=2, suffix_decoding_min_token_prob=0.7) == []
    sp = _proposer(2, suffix_decoding_min_token_prob=0.6)
    sp.start_request("r", prompt)
    assert sp.propose_draft("r") == SuffixDraft((3, 7), 2, 2 / 3 + 2 / 3 * 1.0, "local")


def test_a_finished_response_serves_a_later_request():
    sp = _proposer(4, suffix_decoding_max_spec_factor=3.0)
    sp.start_request("a", [100, 101, 102])
    sp.extend("a", [1, 2, 3, 4, 5, 6])
    assert sp.num_active() == 1 and sp.num_cached_responses() == 0
    sp.stop_request("a")
    assert sp.num_active() == 0 and sp.num_cached_responses() == 1
    sp.start_request("b", [200, 1, 2])
    draft = sp.propose_draft("b")
    assert draft == SuffixDraft((3, 4, 5, 6), 2, 4.0, "global")
    # The prompt of "a" was not cached: only its output.
    sp.start_request("c", [300, 100, 101])
    assert sp.propose("c") == []
    # A surer global path beats a branching local one.
    sp.start_request("d", [1, 2, 9, 1, 2, 8, 1, 2])
    assert sp.propose_draft("d") == SuffixDraft((3, 4, 5, 6), 2, 4.0, "global")
    sp.stop_request("d", cache_response=False)
    # With the global tree off nothing is cached.
    off = _proposer(4, suffix_decoding_max_cached_requests=0)
    off.start_request("a", [1])
    off.extend("a", [1, 2, 3])
    off.stop_request("a")
    assert off.num_cached_responses() == 0 and off.global_path_counts() == {}


def _brute_counts(responses: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """{path: occurrences summed over `responses`} for every path of 1..depth tokens."""
    out: dict[tuple[int, ...], int] = {}
    for r in responses:
        for s in range(len(r)):
            for e in range(s + 1, min(s + depth, len(r)) + 1):
                out[tuple(r[s:e])] = out.get(tuple(r[s:e]), 0) + 1
    return out


def _cache(sp: SuffixProposer, req_id: str, output: list[int]) -> None:
    sp.start_request(req_id, [999])
    sp.extend(req_id, output)
    sp.stop_request(req_id)


def test_eviction_leaves_the_tree_of_the_remaining_responses():
    rng = np.random.default_rng(7)
    responses = [rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist() for _ in range(9)]
    responses.append(responses[2][:10])  # shared paths, so evictions must keep some counts
    for depth in (1, 3, 24):
        sp = _proposer(3, suffix_decoding_max_cached_requests=3,
                       suffix_decoding_max_tree_depth=depth)
        for i, r in enumerate(responses):
            _cache(sp, f"r{i}", r)
            kept = responses[max(0, i - 2):i + 1]
            assert sp.num_cached_responses() == len(kept)
            fresh = _proposer(3, suffix_decoding_max_tree_depth=depth)
            for j, r2 in enumerate(kept):
                _cache(fresh, f"f{j}", r2)
            assert sp.global_path_counts() == fresh.global_path_counts() == _brute_counts(
                kept, depth)


def test_stop_without_caching_leaves_the_global_tree_unchanged():
    sp = _proposer(3)
    _cache(sp, "a", [1, 2, 3, 1, 2])
    before = sp.global_path_counts()
    sp.start_request("b", [4, 5])
    sp.extend("b", [1, 2, 3, 6, 6])
    sp.stop_request("b", cache_response=False)
    assert sp.global_path_counts() == before and sp.num_cached_responses() == 1
    sp.start_request("c", [1])
    sp.stop_request("c")  # no output: nothing to cache
    assert sp.global_path_counts() == before and sp.num_cached_responses() == 1


def test_bad_input_is_refused_by_name():
    sp = _proposer(2)
    sp.start_request("a", [1, 2])
    with pytest.raises(ValueError, match="'a'"):
        sp.start_request("a", [3])
    for call in (lambda: sp.extend("zz", [1]), lambda: sp.propose("zz"),
                 lambda: sp.propose_draft("zz"), lambda: sp.stop_request("zz"),
                 lambda: sp.local_path_counts("zz")):
        with pytest.raises(KeyError, match="'zz'"):
            call()
    sp.stop_request("a")
    with pytest.raises(KeyError, match="'a'"):
        sp.propose("a")
    sp.start_request("a", [1])  # a stopped id may start again


@pytest.mark.parametrize("kw,field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_max_spec_factor": 0.0}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_max_spec_factor": float("nan")}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_min_token_prob": -0.1}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
])
def test_bad_config_is_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SuffixConfig(**{"num_speculative_tokens": 2, **kw})


def _brute_draft(seq: list[int], responses: list[list[int]], cfg: SuffixConfig,
                 max_new: int | None) -> SuffixDraft:
    """The module doc's algorithm by counting occurrences directly, no trie."""
    depth = cfg.suffix_decoding_max_tree_depth
    cap = cfg.num_speculative_tokens if max_new is None else min(cfg.num_speculative_tokens,
                                                                 max_new)

    def follows(path: list[int], texts: list[list[int]]) -> dict[int, int]:
        """{next token: count} over the occurrences of `path` in `texts` followed by one."""
        if len(path) >= depth:
            return {}
        nxt: dict[int, int] = {}
        for t in texts:
            for s in range(len(t) - len(path)):
                if t[s:s + len(path)] == path:
                    nxt[t[s + len(path)]] = nxt.get(t[s + len(path)], 0) + 1
        return nxt

    def occurrences(path: list[int], texts: list[list[int]]) -> int:
        return sum(t[s:s + len(path)] == path for t in texts for s in range(len(t)))

    best = SuffixDraft((), 0, 0.0, "")
    if cap <= 0:
        return best
    for source, texts in (("local", [seq]), ("global", responses)):
        for n in range(min(len(seq), depth - 1), 0, -1):
            path = seq[len(seq) - n:]
            if not follows(path, texts):
                continue
            bound = min(cap, int(cfg.suffix_decoding_max_spec_factor * n + 1e-9), depth - n)
            out: list[int] = []
            prob, score = 1.0, 0.0
            while len(out) < bound:
                nxt = follows(path, texts)
                if not nxt:
                    break
                tok = min(nxt, key=lambda t: (-nxt[t], t))
                denom = sum(nxt.values()) if source == "local" else occurrences(path, texts)
                prob *= nxt[tok] / denom
                if prob < cfg.suffix_decoding_min_token_prob:
                    break
                out.append(tok)
                score += prob
                path = path + [tok]
            if score > best.score:
                best = SuffixDraft(tuple(out), n, score, source)
    return best


def test_random_requests_match_a_brute_force_search():
    rng = np.random.default_rng(1234)
    checked = nonempty = 0
    trials = 40
    for _trial in range(trials):
        cfg = SuffixConfig(
            num_speculative_tokens=int(rng.integers(1, 6)),
            suffix_decoding_max_tree_depth=int(rng.integers(2, 9)),
            suffix_decoding_max_cached_requests=int(rng.integers(0, 4)),
            suffix_decoding_max_spec_factor=float(rng.choice([0.5, 1.0, 2.0, 3.0])),
            suffix_decoding_min_token_prob=float(rng.choice([0.0, 0.1, 0.4, 0.7])))
        sp = SuffixProposer(cfg)
        vocab = int(rng.integers(2, 6))
        cached: list[list[int]] = []
        for r in range(4):
            req = f"t{r}"
            seq = rng.integers(0, vocab, size=int(rng.integers(0, 20))).tolist()
            sp.start_request(req, seq)
            num_prompt = len(seq)
            for _step in range(8):
                new = rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
                if seq and rng.random() < 0.5:  # copy an earlier span, as outputs do
                    s = int(rng.integers(0, len(seq)))
                    new = seq[s:s + int(rng.integers(1, 5))]
                sp.extend(req, new)
                seq = seq + new
                assert sp.local_path_counts(req) == _brute_counts(
                    [seq], cfg.suffix_decoding_max_tree_depth)
                max_new = None if rng.random() < 0.5 else int(rng.integers(0, 6))
                draft = sp.propose_draft(req, max_new)
                assert draft == _brute_draft(seq, cached, cfg, max_new)
                checked += 1
                if not draft.tokens:
                    continue
                nonempty += 1
                n, toks = draft.match_len, list(draft.tokens)
                assert len(toks) <= min(cfg.num_speculative_tokens,
                                        cfg.suffix_decoding_max_tree_depth - n,
                                        int(cfg.suffix_decoding_max_spec_factor * n + 1e-9))
                assert max_new is None or len(toks) <= max_new
                # The match and its proposal occurred together: earlier in the request's
                # tokens, or in one cached response.
                texts = [seq] if draft.source == "local" else cached
                assert any(_occurs(seq[len(seq) - n:] + toks, t) for t in texts)
            if rng.random() < 0.7:
                sp.stop_request(req)
                if cfg.suffix_decoding_max_cached_requests and len(seq) > num_prompt:
                    cached = (cached + [seq[num_prompt:]])[
                        -cfg.suffix_decoding_max_cached_requests:]
            else:
                sp.stop_request(req, cache_response=False)
            assert sp.global_path_counts() == _brute_counts(
                cached, cfg.suffix_decoding_max_tree_depth)
    assert checked == trials * 4 * 8 and nonempty > checked // 3


def test_clear_cache_empties_the_global_tree():
    sp = SuffixProposer(SuffixConfig(num_speculative_tokens=4))
    sp.start_request("a", [1, 2])
    sp.extend("a", [3, 4, 5, 6])
    sp.stop_request("a")
    sp.start_request("b", [9, 3, 4])
    assert sp.propose("b") == [5, 6]
    sp.clear_cache()
    assert sp.num_cached_responses() == 0 and sp.global_path_counts() == {}
    assert sp.propose("b") == []
