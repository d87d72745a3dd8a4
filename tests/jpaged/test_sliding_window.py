"""Sliding-window and soft-capped models through the paged engine: greedy tokens equal HF
transformers' (eager attention, float32) with prompts longer than the window and decoding past
it, through chunked prefill, preemption and prefix-cache hits across a window boundary."""

from __future__ import annotations

import pytest
from helpers import hf_cases, make_llm
from helpers import hf_greedy as hf_generate

from jpaged import SamplingParams
from jpaged.core.kv_cache_groups import blocks_needed, kv_cache_layout

torch = pytest.importorskip("torch")

NEW_TOKENS = 12
# Windows 4 (Gemma 3, Gemma 2, Mistral) and 5 (Qwen2) against 4-token blocks: a window of one
# block, and one that is not a multiple of the block size; prompts span many windows.
BLOCK = 4
# A pool of this many blocks where memory pressure is not the point: enough for 4 sequences of
# 64 tokens in every group, and small (the default 256 MiB would be ~10^5 blocks to set up).
POOL = 256


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    return hf_generate(hf, prompt, NEW_TOKENS)


KINDS = ["gemma3", "gemma2", "mistral_sliding", "qwen2_sliding_upper_layers"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> (kind, loaded model, prompts, HF's greedy tokens), built once per kind.
    cases.hf[kind] is HF's model, for references on other prompts."""
    get = hf_cases(tmp_path_factory, 5, NEW_TOKENS)

    def by_kind(kind: str) -> tuple:
        _, loaded, ps, want = get(kind)
        return kind, loaded, ps, want

    by_kind.hf = get.hf
    return by_kind


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(llm, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_with_chunked_prefill(cases, kind):
    kind, loaded, ps, want = cases(kind)
    assert any(w is not None for w in loaded.spec.layer_windows), kind
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8,  # 8-token chunks: prompts cross windows mid-chunk
                   num_gpu_blocks_override=POOL)
    assert tokens(llm, ps) == want


# (kind, hybrid, swap). Mistral with groups (every layer slides) never preempts at this pool:
# its hybrid run is test_greedy_tokens_equal_hf_with_chunked_prefill's.
PRESSURE_CASES = [("gemma3", True, False), ("gemma3", True, True), ("gemma3", False, False),
                  ("mistral_sliding", False, False)]


@pytest.mark.parametrize("kind,hybrid,swap", PRESSURE_CASES)
def test_greedy_tokens_equal_hf_under_preemption_and_prefix_hits(cases, kind, hybrid, swap):
    kind, loaded, ps, want = cases(kind)
    # A pool a little larger than one sequence of up to 41 tokens needs (14 blocks of 4 tokens
    # with one group; with groups, what kv_cache_groups.blocks_needed says plus 3) for 5
    # sequences: requests are preempted (recompute) and resumed; then the same prompts again
    # hit the prefix cache.
    layout = kv_cache_layout(loaded.spec.layer_windows, hybrid=hybrid)
    blocks = blocks_needed(41, layout, BLOCK, 32) + 3 if layout.is_hybrid else 14
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=5,
                   max_num_batched_tokens=32, num_gpu_blocks_override=blocks,
                   enable_prefix_caching=True, disable_hybrid_kv_cache_manager=not hybrid,
                   **(dict(preemption_mode="swap", kv_offloading_size=0.01) if swap else {}))
    assert tokens(llm, ps) == want
    metrics = llm.llm_engine.get_metrics()
    assert metrics["num_preemptions"] > 0, metrics
    kv = llm.llm_engine.scheduler.kv_cache_manager
    assert (kv.num_freed_out_of_window > 0) == hybrid
    if swap:  # preempted requests' window blocks went to the host tier and came back
        assert metrics["num_swapped_out"] > 0 and metrics["num_swapped_in"] > 0, metrics
    kv.check_invariants()
    shared = [ps[0] + p for p in ps[1:3]]  # a shared 4+-block prefix, then a different tail
    # The reference is HF's greedy run of the same prompts (no second engine to compile).
    assert tokens(llm, shared) == [hf_greedy(cases.hf[kind], p) for p in shared]
    assert llm.llm_engine.get_metrics()["prefix_cache_hits"] > 0


def test_hybrid_groups_show_in_cache_state_events_metrics_and_plots(cases):
    """A hybrid engine mid-run: cache_state has one table per group (sliding ones null behind
    the window), KV events name their group, metrics count groups and freed blocks, the block
    table plot draws a row per group."""
    from jpaged.kv_events import CacheIndex
    from jpaged.viz import plot_block_tables

    kind, loaded, ps, want = cases("gemma3")
    layout = kv_cache_layout(loaded.spec.layer_windows)
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8, enable_prefix_caching=True,
                   num_gpu_blocks_override=POOL,
                   kv_events_config={"enable_kv_cache_events": True})
    engine = llm.llm_engine
    batches = []
    engine.subscribe_kv_events(batches.append)
    for i, p in enumerate(ps[:2]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    seen_null = False
    while engine.has_unfinished_requests():
        engine.step()
        state = engine.cache_state()
        assert [g["sliding_window"] for g in state["kv_cache_groups"]] == [
            g.sliding_window for g in layout.groups]
        for entry in state["requests"].values():
            tables = entry["block_tables"]
            assert len(tables) == layout.num_groups and tables[0] == entry["block_table"]
            for g, spec in enumerate(layout.groups):
                if spec.sliding_window is None:
                    assert 0 not in tables[g]
                elif 0 in tables[g]:  # freed positions: a run at the front only
                    seen_null = True
                    z = tables[g].count(0)
                    assert tables[g][:z] == [0] * z, tables[g]
        if seen_null and state["requests"]:
            plot_block_tables(state)  # one row per (request, group); nulls drawn as freed
    assert seen_null
    metrics = engine.get_metrics()
    assert metrics["num_kv_cache_groups"] == layout.num_groups
    assert metrics["num_blocks_freed_out_of_window"] > 0
    events = [e for b in batches for e in b.events]
    groups = {e.group for e in events if hasattr(e, "group")}
    assert groups == set(range(layout.num_groups)), groups
    index = CacheIndex()
    for b in batches:
        index.apply_batch(b)
    assert index.blocks["GPU"] == set(engine.scheduler.kv_cache_manager.block_pool.cached_blocks)


def test_hybrid_groups_through_the_pallas_kernels(cases):
    """The Pallas kernels (interpret mode) read each layer's group table, stale ids behind the
    window included, and give HF's greedy tokens (the tests above run the CPU's XLA path)."""
    kind, loaded, ps, want = cases("gemma3")
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=4,
                   max_num_batched_tokens=8, attention_backend="pallas",
                   num_gpu_blocks_override=POOL)
    assert llm.llm_engine.ops.name == "pallas"
    assert tokens(llm, ps[:2]) == want[:2]
    assert llm.llm_engine.get_metrics()["num_blocks_freed_out_of_window"] > 0


def test_prompt_logprobs_are_complete_when_the_prefix_is_cached(cases):
    # The hybrid manager takes prefix hits a window needs; a request asking for prompt
    # logprobs takes none, so every prompt position is scored, as on a cold cache.
    kind, loaded, ps, _ = cases("gemma3")
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=96, num_gpu_blocks_override=POOL,
                   enable_prefix_caching=True)
    assert llm.llm_engine.get_metrics()["num_kv_cache_groups"] > 1
    prompt = {"prompt_token_ids": ps[0] + ps[1]}
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)
    cold = llm.generate([prompt], scoring, use_tqdm=False)[0]
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    warm = llm.generate([prompt], scoring, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0

    def rounded(out):
        return [None if e is None else {t: round(lp.logprob, 4) for t, lp in e.items()}
                for e in out.prompt_logprobs]

    assert len(warm.prompt_logprobs) == len(prompt["prompt_token_ids"])
    assert rounded(warm) == rounded(cold)


def test_speculative_decoding_keeps_hf_tokens_across_windows(cases):
    """Proposals verified and rolled back in a hybrid KV cache (a window of one block): the
    sliding group frees blocks behind its window while rejected tails are trimmed."""
    kind, loaded, ps, want = cases("gemma3")
    llm = make_llm(loaded, block_size=BLOCK, max_model_len=64, max_num_seqs=16,
                   max_num_batched_tokens=32, num_gpu_blocks_override=POOL,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    assert tokens(llm, ps) == want
    m = llm.llm_engine.get_metrics()
    assert m["num_kv_cache_groups"] > 1 and m["spec_decode_num_drafts"] > 0
    llm.llm_engine.core.scheduler.kv_cache_manager.check_invariants()
