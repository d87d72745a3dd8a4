"""StructuredOutputManager, the token constraints beside the scheduler: which requests it
holds, when a step's sampling must wait for the step in flight, the masks of a step's rows
(a grammar, bad words by vLLM's rule), and advancing the grammars past sampled tokens."""

from __future__ import annotations

import numpy as np

from jpaged.bench.fixtures import byte_tokenizer
from jpaged.core.sched_output import ScheduledRequest
from jpaged.core.structured_output import GrammarCompiler
from jpaged.core.structured_output_manager import StructuredOutputManager
from jpaged.request import Request
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 260


def manager() -> StructuredOutputManager:
    tok = byte_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB, (tok.eos_token_id,))
    return StructuredOutputManager(lambda: compiler, VOCAB)


def request(rid: str, **sp) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, **sp))


def row(req: Request, sample: bool = True) -> ScheduledRequest:
    return ScheduledRequest(req, 0, 3, [1, 2, 3], [[1]], sample)


def allowed(masks: np.ndarray, i: int) -> set[int]:
    bits = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def test_masks_deferral_and_advancing_follow_grammars_and_bad_words():
    so = manager()
    plain = request("plain")
    choice = request("choice", structured_outputs=StructuredOutputsParams(choice=["ab", "c"]))
    one = request("one", bad_words_token_ids=((ord("x"),),))
    two = request("two", bad_words_token_ids=((ord("y"), ord("z")),))
    reqs = [plain, choice, one, two]
    so.track(reqs, so.add_requests(reqs))
    assert set(so.matchers) == {"choice"} and set(so.bad_words) == {"one", "two"}

    # A one-token bad word gives the same mask every step: no deferral for it alone.
    assert not so.needs_deferral([row(plain), row(one)])
    assert so.needs_deferral([row(plain), row(two)]) and so.needs_deferral([row(choice)])
    assert not so.needs_deferral([row(choice, sample=False)])
    assert so.token_masks([row(plain)]) is None

    masks = so.token_masks([row(plain), row(choice), row(one), row(two)])
    assert allowed(masks, 0) == set(range(VOCAB))
    assert allowed(masks, 1) == {ord("a"), ord("c")}
    assert allowed(masks, 2) == set(range(VOCAB)) - {ord("x")}
    assert allowed(masks, 3) == set(range(VOCAB))  # "y" not yet written: "z" still allowed
    two.append_output_token(ord("y"))
    assert so.banned(two) == [ord("z")]

    choice.append_output_token(ord("a"))
    assert so.accept_tokens([choice], [0], [ord("a")]) == []
    assert allowed(so.token_masks([row(choice)]), 0) == {ord("b")}
    # A token the grammar refuses (another constraint overrode its mask): named for abort.
    choice.append_output_token(ord("q"))
    assert so.accept_tokens([choice], [0], [ord("q")]) == [0]
    assert "outside the request's structured output" in choice.stop_reason
    assert "choice" not in so.matchers

    # Sync (a multi-process mesh): only while a constraint needs the previous token.
    held = {r.request_id: r for r in reqs}
    assert so.needs_sync(held, whole_steps=True)  # "two"'s word of two tokens
    assert not so.needs_sync(held, whole_steps=False)
    so.prune({"one": one})
    assert not so.matchers and set(so.bad_words) == {"one"} and so.active
    assert not so.needs_sync({"one": one}, whole_steps=True)
