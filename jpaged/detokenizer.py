"""Incremental detokenization: a request's text grows by O(new tokens) work per step.

Decoding a request's whole output on every step is quadratic in its length. Here each update
decodes only a short window (vLLM's prefix/read offsets): the tokens already turned into text
since the previous emission (`ids[prefix:read]`, the context) and the same window extended by
the new tokens (`ids[prefix:]`); the difference is the new text. Both decodes start at the same
token, so a decoder that strips a leading space at the start of a decode strips it from both.
While the window's text ends in U+FFFD (a multi-byte character split across byte-level or
byte-fallback tokens) nothing is emitted and the window grows until the character completes; a
final update emits whatever is left, as a full decode would.

Where the tokenizer is backed by HF `tokenizers` (every tokenizer jpaged builds), its Rust
`DecodeStream` runs the same window algorithm in one call per token instead of two decodes; a
final update with a character still incomplete falls back to one full decode.

Where that tokenizer's decoder is byte-level BPE alone (GPT-2, Llama 3, SmolLM2: a decode is the
UTF-8 decode of the tokens' bytes, concatenated), the text of a token whose bytes are whole
characters is the same wherever it stands: it is looked up in a table shared by every request
(filled as tokens are first seen), a dict read instead of a ~1 µs Rust call. A token that is part
of a character waits, with those after it, until their bytes decode whole (one decode of the
waiting tokens), then the table goes on.

The text itself lives in a `TextBuffer`: appending a token's piece and reading the newest
characters (a DELTA output, a stop-string search) cost O(piece) however long the text is; only
reading the whole text costs O(len).

A request's output continues its prompt, and some decoders change the start of a decode
(Llama 2 / Mistral's SentencePiece decoders strip the first token's leading space): the
"stream" and "window" methods are primed with the prompt's last tokens (`prompt_context`, as
vLLM primes its decoder), so "▁is" after a prompt reads " is", as the prompt plus the output
reads. Byte-level decoders change nothing at a decode's start and take no context.

Invariant: `text` == decode(context + ids[:read_offset]) less decode(context) for the ids seen
so far (the plain decode of ids[:read_offset] without a context), and `text` never ends in a
half-made character unless the update was final.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Tokens a character may still be waiting for: UTF-8 characters are at most 4 bytes, one token
# each in the worst case (byte fallback). A longer run that still ends in U+FFFD never becomes
# text (a model emitting invalid bytes), so it is emitted as the full decode shows it instead of
# re-decoding an ever longer window each step.
MAX_PENDING_TOKENS = 8
_UNSEEN = object()  # a token not yet in the piece table
# tokenizer -> {skip_special_tokens: piece table} (see byte_level_pieces)
_PIECE_TABLES: weakref.WeakKeyDictionary[Any, dict[bool, dict[int, str | None]]] = (
    weakref.WeakKeyDictionary())


class TextBuffer:
    """Append-only text: amortized O(1) append, O(k) reads of k characters anywhere.

    A Python str grows by copying itself (`s += piece` is O(len(s))): a 100k-character output
    paid ~6 µs per token for it. Short texts stay a str (the cheapest while small); past
    `SMALL` characters they move into an `io.StringIO`, whose buffer grows geometrically.
    """

    __slots__ = ("_s", "_io", "length")
    SMALL = 4096

    def __init__(self, text: str = "") -> None:
        self._s = text  # the text while short (None once in _io)
        self._io: io.StringIO | None = None
        self.length = len(text)
        if self.length > self.SMALL:
            self._spill()

    def _spill(self) -> None:
        self._io = io.StringIO(self._s)
        self._s = None

    def append(self, piece: str) -> None:
        """Add `piece` at the end."""
        sio = self._io
        if sio is None:
            text = self._s = self._s + piece
            n = self.length = len(text)
            if n > self.SMALL:
                self._spill()
        else:
            sio.seek(self.length)
            sio.write(piece)
            self.length += len(piece)

    def slice(self, start: int, end: int | None = None) -> str:
        """text[start:end] (0 <= start), in O(end - start)."""
        if end is None or end > self.length:
            end = self.length
        if self._io is None:
            return self._s[start:end]
        if end <= start:
            return ""
        self._io.seek(start)
        return self._io.read(end - start)

    def find(self, sub: str, start: int) -> int:
        """text.find(sub, start) (0 <= start), in O(len - start)."""
        if self._io is None:
            return self._s.find(sub, start)
        k = self.slice(start).find(sub)
        return k if k < 0 else start + k

    def value(self) -> str:
        """The whole text (O(len))."""
        return self._s if self._io is None else self._io.getvalue()


def byte_level_pieces(tokenizer: Any, skip_special_tokens: bool) -> dict[int, str | None] | None:
    """The shared token -> text table of a byte-level BPE tokenizer (None for any other).

    An entry is the token's text when its bytes are whole UTF-8 characters, else None (part of
    a character). Filled lazily by `IncrementalDetokenizer`; one table per tokenizer and
    `skip_special_tokens`, dropped with the tokenizer.
    """
    backend = getattr(tokenizer, "backend", None)
    if _ByteLevel is None or type(getattr(backend, "decoder", None)) is not _ByteLevel:
        return None
    try:
        tables = _PIECE_TABLES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable or not hashable: no shared table
        return None
    return tables.setdefault(bool(skip_special_tokens), {})


def prompt_context(tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool
                   ) -> list[int]:
    """The prompt's last tokens that an output's decode continues (vLLM's choice): the whole
    prompt up to 4 tokens, else the shortest suffix of 4 to 23 tokens that decodes without a
    half-made character (else the last 4)."""
    ids = list(prompt_ids)
    if len(ids) <= 4:
        return ids
    for k in range(4, min(len(ids), 23) + 1):
        tail = ids[-k:]
        if REPLACEMENT_CHAR not in tokenizer.decode(tail, skip_special_tokens=skip_special_tokens):
            return tail
    return ids[-4:]


class IncrementalDetokenizer:
    """Text of one growing token list; `update` returns the newly completed text.

    `method`: "pieces" (byte-level tokenizers), "stream" (`DecodeStream`) or "window" (two
    decodes per update); None picks the first the tokenizer allows, in that order.
    `prompt_ids`: the prompt the output continues (its last tokens prime the stream and window
    methods, so a decoder that strips a decode's leading space keeps the output's).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 method: str | None = None, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0  # first token of the decode window (context)
        self.read_offset = 0  # tokens already turned into `text`
        self.buf = TextBuffer()
        backend = getattr(tokenizer, "backend", None)
        has_stream = _DecodeStream is not None and hasattr(backend, "decode_batch")
        pieces = byte_level_pieces(tokenizer, skip_special_tokens)
        allowed = {"pieces": pieces is not None, "stream": has_stream, "window": True}
        if method is None:
            method = next(m for m, ok in allowed.items() if ok)
        elif not allowed.get(method, False):
            raise ValueError(f"detokenizer method {method!r} is not available for this "
                             f"tokenizer (allowed: {[m for m, ok in allowed.items() if ok]})")
        self.method = method
        self._pieces = pieces if method == "pieces" else None
        self._pending: list[int] = []  # pieces: tokens of a character not yet complete
        self._backend = backend if method == "stream" else None
        # The prompt tokens the output's decode continues (none for byte-level pieces).
        self._context = ([] if method == "pieces" or not prompt_ids else
                         prompt_context(tokenizer, prompt_ids, skip_special_tokens))
        self._stream = self._new_stream() if method == "stream" else None
        self._fed = 0  # tokens given to the stream / the piece table

    def _new_stream(self) -> Any:
        """A DecodeStream that has stepped through the context (its text dropped)."""
        stream = _DecodeStream(skip_special_tokens=self.skip_special_tokens)
        for t in self._context:
            stream.step(self._backend, t)
        return stream

    def _decode_from(self, ids: Sequence[int], start: int) -> str:
        """decode(ids[start:]), after the context when the window starts at the output's
        first token (two such decodes share their start, so their difference is exact)."""
        if start or not self._context:
            return self._decode(ids[start:])
        return self._decode([*self._context, *ids])

    @property
    def text(self) -> str:
        """The text so far (O(len); `buf` reads parts of it)."""
        return self.buf.value()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, ids: Sequence[int], final: bool = False) -> None:
        """`update` without building its return value (the engine reads `buf` instead)."""
        pieces = self._pieces
        if pieces is None:
            self.update(ids, final)
            return
        # The piece table, here rather than in a method of its own: this runs per request per
        # step. Invariant: the text is the decode of ids[:read_offset]; `pending` holds
        # ids[read_offset:_fed], the start of a character (empty almost always). A byte-level
        # decode is the UTF-8 decode of the concatenated bytes, so text can be cut after any
        # whole character and each part decoded alone.
        n = len(ids)
        if n < self._fed:  # the list was replaced: start over
            self._fed = self.read_offset = 0
            self._pending = []
            self.buf = TextBuffer()
        buf, pending = self.buf, self._pending
        for i in range(self._fed, n):
            t = ids[i]
            piece = pieces.get(t, _UNSEEN)
            if piece is _UNSEEN:
                piece = self._piece(t)
            if piece is not None and not pending:
                if piece:
                    buf.append(piece)
                self.read_offset = i + 1
                continue
            pending.append(t)
            text = self._decode(pending)
            # Whole once the bytes no longer end inside a character; a run that cannot
            # complete (invalid bytes) is shown as the decode shows it after a bound.
            if not text.endswith(REPLACEMENT_CHAR) or len(pending) > MAX_PENDING_TOKENS:
                buf.append(text)
                pending.clear()
                self.read_offset = i + 1
        self._fed = n
        if final and pending:  # an incomplete character: as a full decode shows it
            buf.append(self._decode(pending))
            pending.clear()
            self.read_offset = n

    def update(self, ids: Sequence[int], final: bool = False) -> str:
        """Feed the whole token list (it only grows); return the text it adds.

        `final`: no more tokens will come, so a trailing partial character is emitted as the
        full decode has it (U+FFFD).
        """
        if self._pieces is not None:
            old = self.buf.length
            self.feed(ids, final)
            return self.buf.slice(old)
        if self._stream is not None:
            return self._update_stream(ids, final)
        if len(ids) < self.read_offset:  # the list was replaced: start over
            self.prefix_offset = self.read_offset = 0
            self.buf = TextBuffer()
        if len(ids) == self.read_offset and not final:
            return ""
        prefix_text = self._decode_from(ids[:self.read_offset], self.prefix_offset)
        new_text = self._decode_from(ids, self.prefix_offset)
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. special tokens skipped: nothing to show yet
        if new_text.endswith(REPLACEMENT_CHAR) and not final and (
                len(ids) - self.read_offset <= MAX_PENDING_TOKENS):
            return ""  # wait for the rest of the character
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.buf.append(delta)
        return delta

    def _piece(self, token: int) -> str | None:
        """The table entry of `token`, made on first sight (None: part of a character)."""
        text = self._decode([token])
        piece = None if REPLACEMENT_CHAR in text else text
        self._pieces[token] = piece
        return piece

    def _update_stream(self, ids: Sequence[int], final: bool) -> str:
        if len(ids) < self._fed:  # the list was replaced: start over
            self._stream = self._new_stream()
            self._fed = self.read_offset = 0
            self.buf = TextBuffer()
        buf = self.buf
        old = buf.length
        step, backend = self._stream.step, self._backend
        for i in range(self._fed, len(ids)):
            piece = step(backend, ids[i])
            if piece:
                buf.append(piece)
                self.read_offset = i + 1
        self._fed = len(ids)
        if final and self.read_offset < len(ids):  # an incomplete character: as a full decode
            ctx = self._decode_from([], 0)
            self.buf = TextBuffer(self._decode_from(ids, 0)[len(ctx):])
            self.read_offset = len(ids)
            return self.buf.slice(old)
        if len(ids) - self.read_offset > MAX_PENDING_TOKENS:
            self._flush_stuck(ids)
        return self.buf.slice(old)

    def _flush_stuck(self, ids: Sequence[int]) -> None:
        """Emit a pending run that can no longer complete; go on with the window algorithm.

        (A fresh DecodeStream cannot be given the context tokens without emitting them again,
        so a request that emits invalid bytes continues on the two-decode window, whose
        pending run is bounded the same way.)
        """
        ctx = max(0, self.read_offset - 4)  # context, as the window algorithm decodes
        before = self._decode_from(ids[:self.read_offset], ctx)
        after = self._decode_from(ids, ctx)
        self.buf.append(after[len(before):])
        self._stream = None
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)


try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the two-decode window
    _DecodeStream = None
try:
    from tokenizers.decoders import ByteLevel as _ByteLevel
except ImportError:  # pragma: no cover - tokenizers not installed
    _ByteLevel = None
