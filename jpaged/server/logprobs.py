"""The logprobs JSON of responses: prompt_logprobs, legacy completions logprobs, chat logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jpaged.outputs import CompletionOutput, Logprob

# The least logprob a response carries, as vLLM writes it: a token a constraint (a grammar, a
# structured choice) masks out has logprob -inf, which JSON cannot hold (OpenAI documents
# -9999.0 as "very unlikely"). Every logprob a response serializes goes through json_logprob.
MIN_JSON_LOGPROB = -9999.0


def json_logprob(logprob: float) -> float:
    """A logprob as a response writes it: -inf (a masked token) becomes MIN_JSON_LOGPROB."""
    return max(logprob, MIN_JSON_LOGPROB)


def prompt_logprobs_json(plp: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    """vLLM's JSON of prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [None if e is None else {str(t): {"logprob": json_logprob(lp.logprob),
                                             "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in plp]


def _token_text(lp: Logprob, tok: int, tokenizer: Any, as_ids: bool = False) -> str:
    # vLLM's return_tokens_as_token_ids: "token_id:N" (for tokens that are not whole text).
    if as_ids:
        return f"token_id:{tok}"
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tok], False)


def legacy_logprobs(ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                    tokenizer: Any, offset: int, as_ids: bool = False) -> dict[str, Any]:
    """The legacy completions `logprobs` object of tokens `ids` with their entries (None: a
    token nothing scored, the prompt's first: null logprob and candidates), text starting at
    offset (as_ids: tokens written "token_id:N", vLLM's return_tokens_as_token_ids)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tok, entry in zip(ids, entries, strict=False):
        if entry is None:
            s = f"token_id:{tok}" if as_ids else tokenizer.decode([tok], False)
            lp, top = None, None
        else:
            s = _token_text(entry[tok], tok, tokenizer, as_ids)
            lp = json_logprob(entry[tok].logprob)
            top = {_token_text(x, t, tokenizer, as_ids): json_logprob(x.logprob)
                   for t, x in entry.items()}
        tokens.append(s)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_logprobs(c: CompletionOutput, tokenizer: Any, offset: int,
                        as_ids: bool = False) -> dict[str, Any] | None:
    """The legacy completions `logprobs` object for the tokens of `c` (None unless asked)."""
    if c.logprobs is None:
        return None
    return legacy_logprobs(c.token_ids, c.logprobs, tokenizer, offset, as_ids)


def chat_logprobs(c: CompletionOutput, tokenizer: Any, as_ids: bool = False, top_n: int = 0
                  ) -> dict[str, Any] | None:
    """The chat `logprobs` object ({"content": [...]}) for the tokens of `c`: each token's
    `top_logprobs` are its step's `top_n` most likely (-1: all the entry holds, the whole
    vocabulary; the sampled token, ranked in every entry, is among them only when it is one of
    them)."""
    if c.logprobs is None:
        return None

    def item(t: int, lp: Logprob) -> dict[str, Any]:
        s = _token_text(lp, t, tokenizer, as_ids)
        return {"token": s, "logprob": json_logprob(lp.logprob),
                "bytes": list(s.encode("utf-8"))}

    content = []
    for tok, entry in zip(c.token_ids, c.logprobs, strict=False):
        top = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None)
        if top_n >= 0:
            top = top[:top_n]
        content.append({**item(tok, entry[tok]), "top_logprobs": [item(t, lp)
                                                                  for _, t, lp in top]})
    return {"content": content}
