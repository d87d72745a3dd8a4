"""vLLM's own scheduler tests of speculative decoding (tests/v1/core/ of vllm-project/vllm),
rewritten against jpaged's scheduler and KV cache manager.

Each test names the vLLM test it answers. Where jpaged differs on purpose the test asserts
jpaged's behaviour and its docstring says what vLLM does and why jpaged does otherwise. The
shared differences: jpaged's step has a row cap (`max_rows`: a request with k proposals is
k + 1 rows, and proposals only take the rows `max_num_seqs` requests leave), its runner
samples every verified position and the scheduler itself keeps the accepted prefix (vLLM's
rejection sampler hands the scheduler only the kept tokens), and its acceptance counters are
the scheduler's running totals (`Scheduler.spec_decode`) rather than a per-step
`SpecDecodingStats` in the step's output.
"""

from __future__ import annotations

import pytest
from core_sim import make_request

from jpaged.bench.fixtures import byte_tokenizer
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.block_hash import BlockHasher
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.sched_output import PLACEHOLDER_TOKEN
from jpaged.core.scheduler import Scheduler, SchedulerOutput
from jpaged.core.structured_output import GrammarCompiler
from jpaged.core.structured_output_manager import StructuredOutputManager
from jpaged.intmath import cdiv
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import StructuredOutputsParams

EOS = 999
NOT_SAMPLED = -1  # the row of a prompt chunk that samples nothing


def scheduler(num_blocks: int = 256, *, block_size: int = 4, max_num_seqs: int = 8,
              budget: int = 256, max_model_len: int = 256, max_rows: int | None = None
              ) -> Scheduler:
    """A scheduler whose steps have room for proposals: `max_rows` rows (default 4 a request,
    as a BucketPlan with num_speculative_tokens=3 gives)."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=max_model_len, enable_chunked_prefill=True)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    return Scheduler(sc, cc, num_blocks, max_rows=4 * max_num_seqs if max_rows is None
                     else max_rows)


def apply(sched: Scheduler, out: SchedulerOutput, rows: dict[str, list[int]],
          rows_out: list[int] | None = None) -> list[Request]:
    """update_from_output by row, as the engine calls it: each scheduled request's rows
    (1 + its proposals; NOT_SAMPLED for a prompt chunk left out of `rows`), in step order."""
    flat: list[int] = []
    first: list[int] = []
    for sr in out.scheduled:
        first.append(len(flat))
        got = rows.get(sr.request.request_id, [NOT_SAMPLED])
        assert len(got) == 1 + len(sr.spec_token_ids), sr.request.request_id
        flat.extend(got)
    return sched.update_from_output(out, flat, rows_out, first_rows=first)


def decoding(sched: Scheduler, reqs: list[Request], first_token: int = 7) -> None:
    """Add `reqs` and run their prompts: each ends with one output, `first_token`."""
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert all(sr.sample for sr in out.scheduled) and len(out.scheduled) == len(reqs)
    apply(sched, out, {r.request_id: [first_token] for r in reqs})
    for r in reqs:
        assert r.output_token_ids == [first_token]
        assert r.num_computed_tokens == r.num_tokens - 1


def slots(kvm: KVCacheManager, rid: str) -> int:
    """Token slots the request's table covers (its full blocks and its last one's fill)."""
    table = kvm.get_blocks(rid)[0]
    return (len(table) - 1) * kvm.block_size + table[-1].num_tokens if table else 0


def assert_drained(sched: Scheduler) -> None:
    kvm = sched.kv_cache_manager
    kvm.check_invariants()
    assert kvm.num_free_blocks == kvm.block_pool.num_blocks - 1


# -- scheduling and counting proposals -----------------------------------------------------------


@pytest.mark.parametrize(("spec_tokens", "kept", "expected"), [
    ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),  # every proposal accepted
    ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),  # the second one rejected
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),  # two requests
    ([[1]], [[1, 2]], (1, 1, 1, [1])),  # one proposal
    ([[]], [[5]], (0, 0, 0, [0])),  # none
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),  # two, both rejected
])
def test_schedule_spec_decoding_stats(spec_tokens, kept, expected):
    """vLLM: test_schedule_spec_decoding_stats. A decode's proposals are scheduled with its
    input token (1 + k tokens, all counted in the step's tokens, the proposals listed apart)
    and the counters take drafts, proposed and accepted tokens, and accepted by position.

    Ported as is, but: the step needs room for the proposal rows (`max_rows`; vLLM has no row
    cap, jpaged's step shapes do); the verifying step returns a token for every position and
    the scheduler finds the accepted prefix (vLLM's sampler returns only the kept tokens: here
    the rows after the first rejection are filler); a step with no proposals counts nothing
    (vLLM: its stats are None; jpaged's running totals stay 0)."""
    n = len(spec_tokens)
    sched = scheduler(max_num_seqs=n, max_rows=n * 4)
    reqs = [make_request(str(i), [i], max_tokens=16) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert out.num_scheduled_tokens == n
    assert [(sr.num_tokens, sr.spec_token_ids) for sr in out.scheduled] == [(1, [])] * n
    apply(sched, out, {r.request_id: [0] for r in reqs})
    for r, spec in zip(reqs, spec_tokens, strict=True):
        r.spec_token_ids = list(spec)
        assert (r.num_computed_tokens, r.num_tokens) == (1, 2)  # the prompt; prompt + output
        assert r.num_tokens_with_spec == 2 + len(spec)
    assert sched.spec_decode.num_drafts == 0  # nothing verified yet

    out = sched.schedule()
    assert out.num_scheduled_tokens == n + sum(map(len, spec_tokens))
    for sr, spec in zip(out.scheduled, spec_tokens, strict=True):
        assert sr.num_tokens == 1 + len(spec) and sr.spec_token_ids == spec
        assert sr.token_ids == [0, *spec] and sr.sample
    rows = {}
    for r, spec, keep in zip(reqs, spec_tokens, kept, strict=True):
        rows[r.request_id] = keep + [0] * (len(spec) + 1 - len(keep))  # filler past the reject
    apply(sched, out, rows)

    stats = sched.spec_decode
    drafts, proposed, accepted, per_pos = expected
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (
        drafts, proposed, accepted)
    assert stats.accepted_per_pos[:len(per_pos)] == per_pos
    metrics = stats.as_metrics(len(per_pos))
    assert metrics["spec_decode_num_accepted_tokens_per_pos"] == per_pos
    for r, keep in zip(reqs, kept, strict=True):
        assert r.output_token_ids == [0, *keep]  # the accepted proposals, then the target's
        # Rolled back to the verified tokens: the last one (the target's own) lacks KV.
        assert r.num_computed_tokens == r.num_tokens - 1 == 1 + len(keep)
        assert r.spec_token_ids == []
        assert sched.kv_cache_manager.num_blocks_held(r.request_id) == cdiv(
            r.num_computed_tokens, sched.block_size)
    sched.kv_cache_manager.check_invariants()


def test_spec_decoding_stats_empty_output():
    """vLLM: test_spec_decoding_stats_empty_output (a request whose verifying step came back
    with no tokens, an abort or an error, must not count -1 accepted proposals).

    jpaged's steps come back by row, so "no tokens for a request" is either a request ended
    between its schedule and its tokens (its rows are dropped: nothing counted, nothing
    appended, its blocks already freed) or a row list too short for the step, which is
    refused before any request changes. Before the fix a short list raised IndexError
    midway, with the requests before it already advanced."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=16)
    decoding(sched, [a])
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.spec_token_ids == [1, 2, 3]
    sched.abort_requests("a")
    assert apply(sched, out, {"a": [1, 2, 3, 4]}) == []
    s = sched.spec_decode
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (0, 0, 0)
    assert a.output_token_ids == [7]
    assert_drained(sched)

    # A row list too short for the step: refused, nothing applied.
    b, c = make_request("b", [1, 2, 3], 16), make_request("c", [4, 5, 6], 16)
    decoding(sched, [b, c])
    b.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert [len(x.spec_token_ids) for x in out.scheduled] == [3, 0]  # rows 0..3, then 4
    with pytest.raises(ValueError, match="5 rows"):
        sched.update_from_output(out, [1, 2], first_rows=[0, 4])
    assert (b.num_computed_tokens, c.num_computed_tokens) == (3, 3)
    assert b.output_token_ids == c.output_token_ids == [7]
    assert sched.spec_decode.num_drafts == 0
    apply(sched, out, {"b": [1, 2, 3, 4], "c": [9]})  # the right rows still apply
    assert b.output_token_ids == [7, 1, 2, 3, 4] and c.output_token_ids == [7, 9]


def test_no_spec_tokens_scheduled_for_prefill_chunks():
    """vLLM: test_no_spec_tokens_scheduled_for_prefill_chunks. Proposals set on a request
    still in its prompt are ignored: its next chunk is the rest of the prompt (30 tokens, not
    30 + 3), none of them verified; once it decodes, they ride along (1 + 3).

    A bug fixed here: jpaged scheduled 33 tokens, the last 3 as proposals after the prompt
    chunk (and would have rolled the request back to 1 + accepted tokens past the chunk's
    start). The engine's proposer never sets them on a prompt; the scheduler now enforces it."""
    sched = scheduler(budget=50)
    req = make_request("a", list(range(80)), max_tokens=8)
    sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled[0].num_tokens == 50 and not out.scheduled[0].sample
    apply(sched, out, {})

    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.num_tokens == 30 and sr.spec_token_ids == [] and sr.token_ids == list(
        range(50, 80))
    assert req.spec_token_ids == []
    assert sched.kv_cache_manager.num_blocks_held("a") == cdiv(80, sched.block_size)
    apply(sched, out, {"a": [42]})
    assert req.num_computed_tokens == 80 and req.output_token_ids == [42]

    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.num_tokens == 4 and sr.spec_token_ids == [1, 2, 3]
    assert sr.token_ids == [42, 1, 2, 3]


# -- stops among the verified tokens -------------------------------------------------------------


def test_stop_via_update_from_output_eos():
    """vLLM: test_stop_via_update_from_output, case 1 (EOS). A request sampling EOS stops; a
    request beside it verifying a proposal keeps the accepted one and the target's token.
    Ported as is (vLLM fills the scheduler's state by hand; here the prompts run first)."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=10, eos_token_ids=(EOS,))
    b = make_request("b", [4, 5, 6], max_tokens=10, eos_token_ids=(EOS,))
    decoding(sched, [a, b])
    b.spec_token_ids = [10]
    out = sched.schedule()
    assert [(x.num_tokens, x.spec_token_ids) for x in out.scheduled] == [(1, []), (2, [10])]
    apply(sched, out, {"a": [EOS], "b": [10, 11]})
    assert a.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7, EOS]
    assert sched.running == [b] and b.output_token_ids == [7, 10, 11]
    assert sched.kv_cache_manager.num_blocks_held("a") == 0


def test_stop_via_update_from_output_stop_token():
    """vLLM: test_stop_via_update_from_output, case 2 (a stop token among the accepted
    proposals). The request keeps the tokens up to the stop token, which is its stop_reason;
    the target's token after it is dropped, and its blocks go back. Ported as is."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=10, stop_token_ids=[42, 43])
    b = make_request("b", [4, 5, 6], max_tokens=10, stop_token_ids=[42, 43])
    decoding(sched, [a, b])
    a.spec_token_ids, b.spec_token_ids = [10, 42], [13]
    out = sched.schedule()
    assert [x.num_tokens for x in out.scheduled] == [3, 2]
    rows: list[int] = []
    changed = apply(sched, out, {"a": [10, 42, 12], "b": [13, 14]}, rows)
    assert changed == [a, a, b, b] and rows == [0, 1, 3, 4]  # nothing of row 2 (after 42)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == 42
    assert a.output_token_ids == [7, 10, 42]
    assert sched.running == [b] and b.output_token_ids == [7, 13, 14]
    assert sched.spec_decode.num_accepted_tokens == 3  # 10, 42 and 13
    sched.abort_requests("b")
    assert_drained(sched)


def test_stop_via_update_from_output_max_tokens():
    """vLLM: test_stop_via_update_from_output, case 3 (max_tokens). vLLM schedules every
    proposal and cuts the outputs to max_tokens when they come back; jpaged schedules only
    the proposals whose verification the request can use (k + 1 tokens within max_tokens),
    so no slot, row or token of budget goes to a position it would discard. The request
    still ends FINISHED_LENGTH with exactly max_tokens outputs.

    A bug fixed here: the scheduler took every proposal it was given (the engine's proposer
    cuts them to the room left, the scheduler did not), 3 here where 1 can be used."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=3)
    b = make_request("b", [4, 5, 6], max_tokens=3)
    decoding(sched, [a, b])
    a.spec_token_ids = [10, 11, 12]  # 2 outputs left: one proposal and the target's token
    out = sched.schedule()
    assert [(x.num_tokens, x.spec_token_ids) for x in out.scheduled] == [(2, [10]), (1, [])]
    assert slots(sched.kv_cache_manager, "a") == 5  # no slot past the last output
    apply(sched, out, {"a": [10, 11], "b": [13]})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 10, 11]
    assert sched.running == [b] and b.output_token_ids == [7, 13]


def test_stop_via_update_from_output_ignore_eos():
    """vLLM: test_stop_via_update_from_output, case 4 (ignore_eos). An accepted EOS proposal
    does not end a request that ignores EOS: it keeps every verified token. Ported as is."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=10, ignore_eos=True, eos_token_ids=(EOS,))
    decoding(sched, [a])
    a.spec_token_ids = [EOS, 10]
    out = sched.schedule()
    apply(sched, out, {"a": [EOS, 10, 11]})
    assert a.status is RequestStatus.RUNNING and a.output_token_ids == [7, EOS, 10, 11]


def test_proposals_never_pass_max_model_len():
    """vLLM: no test of its own; test_stop_via_update_from_output (case 3) is the nearest,
    and vLLM's schedule() caps a running request's new tokens at max_model_len - 1 -
    num_computed_tokens, which drops proposals past the model's length. jpaged caps them at
    its length limit the same way (k + 1 new tokens within max_model_len).

    A bug fixed here: the proposals got slots past max_model_len, and schedule() raised
    ValueError from the KV cache manager in the middle of the step."""
    sched = scheduler(max_model_len=12)
    a = make_request("a", list(range(1, 9)), max_tokens=None)  # 8 + 1 tokens of 12
    decoding(sched, [a])
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.spec_token_ids == [1, 2] and sr.num_tokens == 3
    assert slots(sched.kv_cache_manager, "a") == 11  # positions 0..10 of 12
    apply(sched, out, {"a": [1, 2, 3]})
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_tokens == 12
    assert_drained(sched)


# -- where jpaged schedules proposals differently ------------------------------------------------


@pytest.mark.parametrize("with_prefill_chunk", [False, True])
def test_spec_decode_padding_first_decode_step(with_prefill_chunk):
    """vLLM: test_spec_decode_padding_first_decode_step, and with a prefill chunk in the step
    test_spec_decode_padding_skipped_with_prefill_in_batch (test_spec_decode_padding_skipped_
    for_diffusion has no counterpart: jpaged has no diffusion models).

    vLLM pads a request taking its first decode step (its prompt a prefix-cache hit but the
    last token) with -1 drafts to 1 + num_speculative_tokens tokens, so a decode batch stays
    uniform for its CUDA graphs (not when a prefill chunk makes the batch mixed anyway).
    jpaged never pads: a verifying request is expanded into one row per position and the step
    padded to a bucket of rows by the runner, so the request gets exactly its own tokens (1)
    and no proposal slots, with or without a prefill chunk beside it."""
    sched = scheduler(block_size=16, budget=64)
    prompt = list(range(33))
    r1 = make_request("r1", prompt, max_tokens=16)
    decoding(sched, [r1], first_token=100)
    r1.spec_token_ids = [1, 2, 3]
    r2 = make_request("r2", prompt, max_tokens=16)
    if with_prefill_chunk:
        long = make_request("long", list(range(500, 600)), max_tokens=16)
        sched.add_request(long)
        out = sched.schedule()  # r1 verifies; "long" starts its prompt
        apply(sched, out, {"r1": [1, 2, 3, 4]})
        assert long.num_computed_tokens < long.num_prompt_tokens
        r1.spec_token_ids = [5, 6, 7]
    sched.add_request(r2)
    out = sched.schedule()
    got = {x.request.request_id: x for x in out.scheduled}
    assert got["r1"].spec_token_ids == r1.spec_token_ids and got["r1"].num_tokens == 4
    x = got["r2"]
    assert x.start_pos == 32 and x.num_tokens == 1 and x.spec_token_ids == []
    assert x.token_ids == [32]  # its own last prompt token, nothing padded
    assert PLACEHOLDER_TOKEN not in x.token_ids
    if with_prefill_chunk:
        assert "long" in got and got["long"].spec_token_ids == []


def test_async_spec_placeholders_cleared_for_unscheduled_reqs():
    """vLLM (test_async_scheduler.py): test_async_spec_placeholders_cleared_for_unscheduled_
    reqs. A budget too small for every request trims the proposals from the tail, and a
    request the step leaves out loses its proposals: the next step schedules it without them.

    jpaged differs on purpose in the async half: vLLM's async scheduler gives every decode
    -1 draft slots the device fills; jpaged runs a proposing step synchronously (a proposal
    follows the request's last token, which must be on the host: docs/spec_decode.md), so
    proposals carry no placeholders. A bug fixed here: a request the budget left out of a
    step kept its proposals past that step (vLLM clears them)."""
    sched = scheduler(budget=2)
    a, b = make_request("a", [1], max_tokens=8), make_request("b", [2], max_tokens=8)
    decoding(sched, [a, b])
    a.spec_token_ids, b.spec_token_ids = [5, 6], [5, 6]
    out = sched.schedule()
    # a: its input token and one proposal fill the budget; b is left out.
    assert [(x.request, x.spec_token_ids) for x in out.scheduled] == [(a, [5])]
    assert b.spec_token_ids == []
    assert slots(sched.kv_cache_manager, "a") == 3
    apply(sched, out, {"a": [5, 9]})
    out = sched.schedule()
    assert [(x.request.request_id, x.num_tokens, x.spec_token_ids) for x in out.scheduled] == [
        ("a", 1, []), ("b", 1, [])]


def test_async_decode_never_carries_proposals():
    """vLLM (test_async_scheduler.py): test_async_spec_placeholders_cleared_for_unscheduled_
    reqs, the async half. vLLM schedules proposals for a decode whose input token is still on
    the device (as -1 placeholders the worker fills). jpaged does not speculate in an
    overlapped step: a decode fed on device verifies nothing (any proposals set on it are
    dropped, its one row keeps its placeholder input), and a step verifying proposals cannot
    be advanced before its tokens are known.

    A bug fixed here: such a decode was scheduled with 1 + k tokens but only its k proposals
    as token ids (its input token is not on the host)."""
    sched = scheduler()
    a = make_request("a", [1, 2, 3], max_tokens=8)
    decoding(sched, [a])
    out = sched.schedule()
    sched.update_after_schedule(out)  # dispatched: its token is on device
    assert a.num_output_placeholders == 1
    a.spec_token_ids = [4, 5]
    nxt = sched.schedule()
    (sr,) = nxt.scheduled
    assert (sr.num_tokens, sr.token_ids, sr.spec_token_ids) == (1, [PLACEHOLDER_TOKEN], [])
    assert a.spec_token_ids == []
    sched.update_after_schedule(nxt)
    apply(sched, out, {"a": [8]})
    apply(sched, nxt, {"a": [9]})
    assert a.output_token_ids == [7, 8, 9] and a.num_computed_tokens == a.num_tokens - 1

    a.spec_token_ids = [4, 5]  # its last token is on the host again: verified synchronously
    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == [4, 5]
    with pytest.raises(ValueError, match="cannot be advanced"):
        sched.update_after_schedule(out)


# -- the KV cache and the constraints ------------------------------------------------------------


def test_allocate_with_lookahead():
    """vLLM (test_kv_cache_utils.py): test_allocate_with_lookahead. Proposal slots take
    blocks with the request's new tokens: 3 tokens + 2 slots need cdiv(5, 4) = 2 blocks, 3 + 4
    need cdiv(7, 4) = 2.

    jpaged has no separate lookahead count: the proposals are `Request.spec_token_ids`, their
    slots are new tokens of allocate_slots (the scheduler asks for 1 + k), and a slot no
    proposal stands for is refused (vLLM's EAGLE reserves blind lookahead slots; no jpaged
    method needs them). After verification `trim` gives back the blocks of rejected slots."""
    bs = 4
    for n, blocks in ((2, 2), (4, 2)):
        m = KVCacheManager(bs, 10, 100, False)
        r = make_request("0", [1, 2, 3], max_tokens=16)
        r.spec_token_ids = list(range(10, 10 + n))
        assert len(m.allocate_slots(r, 3 + n)) == blocks
        assert slots(m, "0") == 3 + n and m.num_blocks_held("0") == blocks
        r.num_computed_tokens = 3  # every proposal rejected: the known tokens stay
        r.spec_token_ids = []
        assert m.trim(r) == 1 and m.num_blocks_held("0") == cdiv(3, bs)
        m.check_invariants()

    m = KVCacheManager(bs, 10, 100, True)
    r = make_request("1", [1, 2, 3], max_tokens=16)
    r.set_block_hasher(BlockHasher(bs))
    r.spec_token_ids = [10, 11]
    with pytest.raises(ValueError, match="known tokens"):
        m.allocate_slots(r, 3 + 3)  # a slot beyond the proposals


def test_update_from_output_caps_tokens_when_grammar_invalidates_spec_drafts():
    """vLLM (test_ghsa_invalid_spec_tokens.py): test_update_from_output_caps_tokens_when_
    grammar_invalidates_spec_drafts. With a structured output, proposals its grammar refuses
    must never reach the grammar or the request.

    jpaged differs on purpose: vLLM keeps the step's shape, replacing refused drafts by -1
    and capping the accepted tokens at the valid prefix when they come back; jpaged cuts the
    proposals before the schedule at the first token the grammar refuses
    (StructuredOutputManager.check_proposals), so a refused one is never scheduled, and each
    verified position samples under the grammar advanced past the proposals before it."""
    vocab = 260
    tok = byte_tokenizer()
    compiler = GrammarCompiler(tok, vocab, (tok.eos_token_id,))
    so = StructuredOutputManager(lambda: compiler, vocab)
    sched = scheduler()
    req = make_request("g", [1, 2, 3], max_tokens=16,
                       structured_outputs=StructuredOutputsParams(choice=["abcd", "x"]))
    so.track([req], so.add_requests([req]))
    a, b, c, d, z = map(ord, "abcdz")
    decoding(sched, [req], first_token=a)
    assert so.accept_tokens([req], [0], [a]) == []

    req.spec_token_ids = [b, c, z, z]
    so.check_proposals([req])
    assert req.spec_token_ids == [b, c]  # cut before the first refused token
    out = sched.schedule()
    (sr,) = out.scheduled
    assert sr.spec_token_ids == [b, c] and sr.num_tokens == 3
    masks = so.token_masks(out.scheduled)
    assert masks.shape[0] == 3  # one row a verified position, none for the cut proposals
    rows: list[int] = []
    updated = apply(sched, out, {"g": [b, c, d]}, rows)
    assert req.output_token_ids == [a, b, c, d]
    assert so.accept_tokens(updated, rows, [b, c, d]) == []  # only grammar-valid tokens
    assert sched.spec_decode.num_accepted_tokens == 2
