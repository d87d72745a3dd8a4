"""Benchmark workloads and the theory the prefix benchmark is checked against."""

import os

from helpers import tiny

from jpaged.bench.workloads import shared_prefix_prompts, theoretical_prefix_hits


def test_theoretical_hits_count_full_shared_blocks_only():
    a = list(range(40))
    b = list(range(35)) + [99, 98]  # shares 35 tokens with a: 2 full blocks of 16
    c = list(range(40))  # identical to a: all but the last token, 39 -> 2 full blocks
    assert theoretical_prefix_hits([a], 16) == 0
    assert theoretical_prefix_hits([a, b], 16) == 32
    assert theoretical_prefix_hits([a, b, c], 16) == 64
    assert theoretical_prefix_hits([list(range(32)), list(range(32))], 16) == 16  # last recomputed


def test_shared_prefix_prompts_share_the_system_prompt():
    tok = tiny().tokenizer
    prompts = shared_prefix_prompts(tok, 200, 5)
    assert len(prompts) == 5 and len({tuple(p) for p in prompts}) == 5
    assert len(os.path.commonprefix(prompts)) >= 200
