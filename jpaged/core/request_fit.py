"""What a request needs of the pool and where it stands: the admission check and the
decoding test (both plain functions of a request, shared by the scheduler and its front ends)."""

from __future__ import annotations

from jpaged.core.kv_cache_groups import KVCacheLayout, blocks_needed
from jpaged.intmath import cdiv
from jpaged.request import Request

__all__ = ["check_request_fits", "is_decoding"]


def is_decoding(request: Request) -> bool:
    """True if the request has output and only its last sampled token lacks KV."""
    # num_tokens_with_placeholders - 1 == computed, and some output (known or on device).
    # Scheduler.schedule's partition has this test written out (per request per step): keep
    # the two the same.
    n = request.num_tokens_with_placeholders
    return request.num_computed_tokens == n - 1 and n > request.num_prompt_tokens


def check_request_fits(request: Request, max_model_len: int, block_size: int,
                       num_blocks: int, layout: KVCacheLayout | None = None,
                       chunk: int = 0) -> None:
    """ValueError if `request` could never run: its prompt, or its longest length in blocks
    (with KV cache groups: the blocks of every group, sliding ones bounded by their window
    plus a `chunk` of new tokens)."""
    rid = request.request_id
    n = request.num_prompt_tokens
    if n > max_model_len:
        raise ValueError(f"request {rid!r}: prompt of {n} tokens exceeds max_model_len "
                         f"({max_model_len})")
    # Longest length it can reach; the last sampled token is never computed.
    longest = max(max_model_len, n + 1)
    if request.max_tokens is not None:
        longest = min(longest, n + request.max_tokens)
    blocks = cdiv(longest - 1, block_size)
    if layout is not None:
        blocks = blocks_needed(longest - 1, layout, block_size, chunk)
    usable = num_blocks - 1  # block 0 is the null block
    if blocks > usable:
        raise ValueError(f"request {rid!r} may need {blocks} KV blocks but the pool has only "
                         f"{usable}; lower max_tokens/max_model_len or enlarge the pool")
