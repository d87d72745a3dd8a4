"""Host-side output state of user requests: n children, detokenized text, stop strings,
logprobs, and the RequestOutput each step hands back (full or DELTA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jpaged.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jpaged.request import Request, RequestStatus
from jpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class ChildState:
    """Output state of one sequence (a child of a request with n > 1)."""

    index: int
    request: Request
    sent_text_len: int = 0  # chars of `text` already handed out (DELTA) or seen (stop search)
    sent_tokens: int = 0  # output tokens already handed out (DELTA)
    cumulative_logprob: float = 0.0  # summed only where logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per output token when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None  # made on the first update that needs text
    stop_checked_len: int = 0  # chars of `text` already searched for stop strings
    # The text is detok's (`detok.buf`: reads of its newest part cost what they return, not
    # the text's length), cut here by a stop string (-1: not cut; set with finish_reason).
    cut: int = -1
    # Speculative decoding, in process: a step hands several tokens of one sequence, one update
    # each, while its request already holds them all. `seen`: output tokens this update covers
    # (-1: all); `token_cut`: output tokens kept when a stop string ended it (-1: all).
    seen: int = -1
    token_cut: int = -1
    finish_sent: bool = False  # a DELTA stream (n > 1) has carried its finish_reason


@dataclass(slots=True)
class RequestGroup:
    """A user request: its prompt, parameters and n children."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # SamplingParams.prompt_logprobs: the entries once the prompt is through (and whether a
    # DELTA stream has had them).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    # A pooling engine's request: its PoolingParams (its one internal token is never shown).
    pooling: Any = None
    # Fixed by the params (read per request per step): text wanted before the end; the
    # longest stop string.
    needs_text: bool = field(init=False)
    max_stop_len: int = field(init=False)
    # Characters a running request's shown text holds back: the start of a stop string that
    # may complete in a later step would otherwise be shown and then cut (vLLM's stop buffer).
    stop_hold: int = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.needs_text = p.detokenize and (bool(p.stop)
                                            or p.output_kind != RequestOutputKind.FINAL_ONLY)
        self.max_stop_len = max(map(len, p.stop)) if p.stop else 0
        self.stop_hold = 0 if p.include_stop_str_in_output else max(0, self.max_stop_len - 1)

    @property
    def finished(self) -> bool:
        """True once every child has a finish reason."""
        for c in self.children:  # a loop, not all(): this runs per request per step
            if c.finish_reason is None:
                return False
        return True


# A UTF-8 character is at most 4 bytes: at most 4 tokens (byte fallback) make one.
MAX_CHAR_TOKENS = 4


def _no_text(ids: list[int]) -> None:
    """The decoded_token of a logprob entry when the request asked for no text."""
    return None


def token_text(decode: Callable[[list[int]], str | None], token: int,
               context_of: Callable[[], list[int]]) -> str | None:
    """A logprob entry's decoded_token: the token's text, or where its bytes end inside a
    character, what it completes after `context_of()` (the tokens before it, oldest first,
    read only then): the whole character at the token that completes it (with the text of
    the partial tokens before it), "" while incomplete. (vLLM's correction decodes with one
    token before only; this one with up to 4, so every character shows whole.)"""
    text = decode([token])
    if not text or not text.endswith(REPLACEMENT_CHAR):
        return text
    context = context_of()
    for k in range(1, min(len(context), MAX_CHAR_TOKENS) + 1):
        ctx = context[-k:]
        full = decode([*ctx, token])
        if full.endswith(REPLACEMENT_CHAR):
            continue
        clean = k  # the context tokens before the partial ones the character spans
        while clean and decode([ctx[clean - 1]]).endswith(REPLACEMENT_CHAR):
            clean -= 1
        prefix = decode(ctx[:clean]) if clean else ""
        common = 0
        while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
            common += 1
        return full[common:]
    return ""


def record_logprobs(group: RequestGroup, child: ChildState, token: int, logprob: float,
                    row: int, result: Any, decode: Callable[[list[int]], str | None]) -> None:
    """Add a sampled token (row `row` of a StepResult) to the child's logprobs."""
    child.cumulative_logprob += logprob
    if child.logprobs is None:
        return
    if not group.params.detokenize:
        decode = _no_text
    logprobs = child.logprobs

    def context() -> list[int]:  # the sequence's tokens before this one (first keys)
        return [next(iter(e)) for e in logprobs[-MAX_CHAR_TOKENS:]]

    entry = {token: Logprob(logprob, int(result.ranks[row]), token_text(decode, token, context))}
    for j in range(group.params.logprobs or 0):
        cand = int(result.top_ids[row, j])
        entry.setdefault(cand, Logprob(float(result.top_logprobs[row, j]), j + 1,
                                       token_text(decode, cand, context)))
    child.logprobs.append(entry)


def update_child(group: RequestGroup, child: ChildState, tokenizer: Any,
                 stop_request: Callable[[str], None]) -> bool:
    """Refresh a child's text after new tokens; a stop string found calls stop_request(id).

    Returns True if its sequence is finished now (a stop string found here included).
    """
    req = child.request
    seen = child.seen
    finished = req.is_finished() and (seen < 0 or seen >= len(req.output_token_ids))
    if group.needs_text or (finished and group.params.detokenize):
        detok = child.detok or _new_detokenizer(group, child, tokenizer)
        if child.finish_reason is None:  # a stop string may have cut the text already
            ids = req.output_token_ids if seen < 0 else req.output_token_ids[:seen]
            # The token that stopped the request (EOS or one of stop_token_ids) is in the
            # token ids but not in the text, unless include_stop_str_in_output (as vLLM).
            if (finished and req.status is RequestStatus.FINISHED_STOPPED and ids
                    and ids[-1] in req.stop_token_ids
                    and not group.params.include_stop_str_in_output):
                ids = ids[:-1]
            detok.feed(ids, finished)
    if not finished:
        if group.max_stop_len:
            _check_stop_strings(child, group, stop_request)
            if child.finish_reason is not None:
                return req.is_finished()
        return False
    if child.finish_reason is None:
        child.finish_reason = req.finish_reason
        child.stop_reason = req.stop_reason
        if group.params.stop:  # a stop string the last text completes wins (vLLM's rule),
            _check_stop_strings(child, group, None)  # even over a stop token's own text
    return True


def finish_text(group: RequestGroup, child: ChildState, tokenizer: Any) -> None:
    """The whole text of a sequence that ends outside a step (an abort): every output token,
    a trailing partial character as a full decode shows it (none without detokenize)."""
    if not group.params.detokenize:
        return
    detok = child.detok or _new_detokenizer(group, child, tokenizer)
    detok.feed(child.request.output_token_ids, True)


def _new_detokenizer(group: RequestGroup, child: ChildState,
                     tokenizer: Any) -> IncrementalDetokenizer:
    """The child's detokenizer, made on the first update that needs text (primed with the
    prompt it continues)."""
    child.detok = IncrementalDetokenizer(tokenizer, group.params.skip_special_tokens,
                                         prompt_ids=group.prompt_token_ids)
    return child.detok


def _check_stop_strings(child: ChildState, group: RequestGroup,
                        stop_request: Callable[[str], None] | None) -> None:
    # Only text added since the last search can complete a stop string: search from the last
    # searched length, backed up by each stop string's length less one char (a match that
    # straddles the boundary). The final search (stop_request None) uses the same tail.
    # Called only before a stop string cut the text (child.cut < 0): its length is detok's.
    buf = child.detok.buf
    n = buf.length
    checked = child.stop_checked_len
    if n == checked:
        return  # no new text (e.g. a character still incomplete)
    seen = len(child.request.output_token_ids) if child.seen < 0 else child.seen
    if seen <= group.params.min_tokens:
        # No stop string ends a request before min_tokens outputs (as vLLM): this text is
        # passed over, but its last len(s) - 1 chars still start a later match of s.
        child.stop_checked_len = n
        return
    child.stop_checked_len = n
    # A match of s that ends in the new text starts at most len(s) - 1 chars before it (a
    # shorter window for a shorter string: text passed over under min_tokens stays passed).
    # The stop string that completes first wins, ties in list order (vLLM's rule): with
    # text tokens as characters it is the one that would have stopped generation.
    best = None
    p = group.params
    for s in p.stop:
        start = checked - len(s) + 1
        k = buf.find(s, start if start > 0 else 0)
        if k >= 0 and (best is None or k + len(s) < best[0] + len(best[1])):
            best = (k, s)
    if best is None:
        return
    k, s = best
    child.cut = k + (len(s) if p.include_stop_str_in_output else 0)
    child.token_cut = child.seen
    if stop_request is not None:
        stop_request(child.request.request_id)
    child.finish_reason = "stop"
    child.stop_reason = s


_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def prompt_logprobs_of(group: RequestGroup, decode: Callable[[list[int]], str | None]
                       ) -> list[dict[int, Logprob] | None] | None:
    """vLLM's prompt_logprobs of a group whose prompt has run (None until it has): None for
    the first token, then each prompt token's logprob and rank plus the top-k candidates."""
    ids = group.prompt_token_ids
    rows = group.children[0].request.prompt_logprob_rows
    if len(rows) < len(ids) - 1:
        return None
    k = group.params.prompt_logprobs or 0
    if not group.params.detokenize:
        decode = _no_text
    out: list[dict[int, Logprob] | None] = [None]
    for p in range(len(ids) - 1):
        lp, rank, top_ids, top_lps = rows[p]
        tok = ids[p + 1]
        def context(p: int = p) -> list[int]:  # the prompt's tokens before this one
            return ids[max(0, p + 1 - MAX_CHAR_TOKENS):p + 1]

        entry = {tok: Logprob(float(lp), int(rank), token_text(decode, tok, context))}
        for j in range(k):
            cand = int(top_ids[j])
            entry.setdefault(cand, Logprob(float(top_lps[j]), j + 1,
                                           token_text(decode, cand, context)))
        out.append(entry)
    return out


def num_output_tokens(child: ChildState) -> int:
    """The tokens a sequence has generated (those after a stop string left out)."""
    n = len(child.request.output_token_ids)
    return n if child.token_cut < 0 else min(n, child.token_cut)


def make_output(group: RequestGroup, finished: bool) -> RequestOutput | None:
    """The RequestOutput for this step (None while a FINAL_ONLY request runs).

    `finished`: group.finished, which the caller has at hand.
    """
    kind = group.params.output_kind
    if kind is _FINAL_ONLY and not finished:
        return None
    hold = group.stop_hold
    delta = kind is _DELTA
    # n > 1 streams (as vLLM's): a step's output carries only the sequences with something
    # new, and a finished one's finish once.
    only_new = delta and len(group.children) > 1
    outs = []
    for c in group.children:
        if only_new and c.finish_sent:
            continue
        out_ids = c.request.output_token_ids
        if c.token_cut >= 0:  # tokens of the same step after its stop string
            out_ids = out_ids[:c.token_cut]
        lps = c.logprobs
        detok = c.detok
        sent = c.sent_text_len
        # The detokenizer never leaves a half-made character in the text (a U+FFFD there is in
        # the full decode too); only a possible stop-string start is held back.
        end = 0 if detok is None else detok.buf.length
        if c.cut >= 0:
            if c.cut < end:
                end = c.cut
        elif hold and c.finish_reason is None:
            end -= hold
            if end < sent:
                end = sent
        start = sent if delta else 0
        text = "" if end <= start else detok.buf.slice(start, end)  # end > 0: detok is set
        c.sent_text_len = end
        if delta:
            ids, c.sent_tokens = out_ids[c.sent_tokens:], len(out_ids)  # only the new ones
            if lps is not None:
                lps = lps[len(lps) - len(ids):]
        else:
            ids = list(out_ids)
            if lps is not None:
                lps = list(lps)
        if only_new:
            if not ids and not text and c.finish_reason is None:
                continue
            c.finish_sent = c.finish_reason is not None
        # vLLM's: a cumulative logprob only where logprobs were asked for (else None).
        outs.append(CompletionOutput(c.index, text, ids,
                                     None if c.logprobs is None else c.cumulative_logprob, lps,
                                     c.finish_reason, c.stop_reason))
    if only_new and not outs and not finished:
        return None
    ftt = group.first_token_time
    metrics = ({"arrival_time": group.arrival_time} if ftt is None else
               {"arrival_time": group.arrival_time, "first_token_time": ftt})
    first = group.children[0].request
    plp = group.prompt_logprobs
    if plp is not None and delta:  # a stream carries them once
        plp, group.prompt_logprobs_sent = (None if group.prompt_logprobs_sent else plp), True
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                         finished, metrics, first.num_cached_tokens,
                         first.finished_kv_transfer_params if finished else None, plp)
