"""Incremental detokenization: at every prefix of a long output the text is what a full decode
gives (held back only while a multi-byte character is incomplete), never a half-made character,
and the text work per token does not grow with the output."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from jpaged.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TextBuffer
from models.tokenizer import Tokenizer

TEXT = ("Zürich, 東京 and São Paulo 🙂🎉 — naïve façade ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 الْعَرَبِيَّة "
        "Ελληνικά 한국어 x² ≠ ∞ … ") * 12


class CountingTokenizer:
    """A tokenizer whose decode counts the ids it is given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: a few words, <0xNN> byte fallback, Metaspace spaces."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", "▁and", "▁São", "a", "e", "i", "o", "r", "n", "t", "▁Z", "ü", "h", "c"]:
        vocab.setdefault(w, len(vocab))
    backend = Backend(BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>")


def _tokenizers():
    from helpers import embedded

    return [("smollm2 byte-level BPE", embedded().tokenizer),
            ("byte fallback", byte_fallback_tokenizer())]


@pytest.mark.parametrize("method", ["pieces", "stream", "window"])
@pytest.mark.parametrize("which", [0, 1], ids=["byte-level", "byte-fallback"])
def test_every_prefix_matches_a_full_decode(which, method):
    name, tok = _tokenizers()[which]
    if method == "pieces" and which == 1:  # only byte-level decoders have a piece table
        with pytest.raises(ValueError, match="'pieces' is not available"):
            IncrementalDetokenizer(tok, method="pieces")
        return
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 500, name
    final = tok.decode(ids)
    assert final == TEXT.rstrip() or final.strip() == TEXT.strip()  # the tokenizer round-trips
    # Without a `backend` (a wrapper) the detokenizer runs its own window algorithm.
    detok = IncrementalDetokenizer(CountingTokenizer(tok) if method == "window" else tok,
                                   method=None if method == "window" else method)
    assert detok.method == method
    pieces = []
    held_back = 0
    for n in range(1, len(ids) + 1):
        pieces.append(detok.update(ids[:n]))
        full = tok.decode(ids[:n])
        # Never a half-made character: what was emitted stays a prefix of the final text.
        assert final.startswith(detok.text), (name, n)
        if full.endswith(REPLACEMENT_CHAR):  # the prefix ends inside a character: wait
            held_back += 1  # (a byte-fallback decode turns its whole byte run into U+FFFD)
        else:  # nothing incomplete: nothing held back
            assert detok.text == full, (name, n)
    assert held_back > 0, "the text has split characters: some prefixes must wait"
    assert "".join(pieces) == detok.text == final
    assert REPLACEMENT_CHAR not in detok.text


def test_the_fastest_method_the_tokenizer_allows_is_the_default():
    assert IncrementalDetokenizer(_tokenizers()[0][1]).method == "pieces"
    assert IncrementalDetokenizer(_tokenizers()[1][1]).method == "stream"
    assert IncrementalDetokenizer(CountingTokenizer(_tokenizers()[0][1])).method == "window"


def test_piece_table_is_shared_and_keeps_whole_characters_only():
    """One table per tokenizer and skip flag; a token that is part of a character maps to
    None and is never shown alone."""
    from helpers import embedded

    tok = embedded().tokenizer
    ids = tok.encode("ok 東京 ok", add_special_tokens=False)
    a, b = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    assert a._pieces is b._pieces
    assert IncrementalDetokenizer(tok, skip_special_tokens=False)._pieces is not a._pieces
    a.update(ids)
    assert a.text == tok.decode(ids)
    partial = [t for t in ids if REPLACEMENT_CHAR in tok.decode([t])]
    assert partial and all(a._pieces[t] is None for t in partial)
    assert all(a._pieces[t] == tok.decode([t]) for t in ids if t not in partial)


@pytest.mark.parametrize("method", ["pieces", "stream"])
def test_final_update_emits_an_incomplete_tail_as_a_full_decode_does(method):
    from helpers import embedded

    tok = embedded().tokenizer
    ids = tok.encode("ok 東京", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    detok = IncrementalDetokenizer(tok, method=method)
    assert REPLACEMENT_CHAR not in detok.update(ids[:cut])
    detok.update(ids[:cut], final=True)
    assert detok.text == tok.decode(ids[:cut]) and detok.text.endswith(REPLACEMENT_CHAR)


def test_text_work_per_token_stays_constant():
    from helpers import embedded

    tok = CountingTokenizer(embedded().tokenizer)
    ids = tok.inner.encode(TEXT * 4, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
    # A full decode per step would decode n(n+1)/2 ids (~8 million here).
    assert tok.decoded < 12 * len(ids), (tok.decoded, len(ids))
    assert detok.text == tok.inner.decode(ids)


@pytest.mark.parametrize("method", ["pieces", "stream"])
def test_special_tokens_skipped_or_kept(method):
    from helpers import embedded

    tok = embedded().tokenizer
    eos = tok.eos_token_id
    ids = tok.encode("Hello there", add_special_tokens=False) + [eos]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, method=method)
        for n in range(1, len(ids) + 1):
            detok.update(ids[:n])
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("method", ["pieces", "stream", "window"])
def test_a_byte_run_that_never_completes_is_emitted_not_held(method):
    """Invalid UTF-8 (a model emitting lone continuation bytes) never completes a character:
    after MAX_PENDING_TOKENS it is shown as a full decode shows it, and the work per token
    stays bounded instead of re-decoding an ever longer window."""
    from helpers import embedded

    from jpaged.detokenizer import MAX_PENDING_TOKENS

    tok = embedded().tokenizer
    bad = next(i for i in range(200, tok.vocab_size)
               if tok.decode([i] * 3) == REPLACEMENT_CHAR * 3)
    good = tok.encode("The paged cache", add_special_tokens=False)
    ids = good + [bad] * 300 + tok.encode(" works", add_special_tokens=False)
    counting = CountingTokenizer(tok)
    detok = (IncrementalDetokenizer(counting) if method == "window" else
             IncrementalDetokenizer(tok, method=method))
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
        if n == len(good) + MAX_PENDING_TOKENS + 2:
            assert detok.text.startswith("The paged cache" + REPLACEMENT_CHAR)
    # Pieces of an invalid run may show more U+FFFD than the full decode (a known limit).
    middle = detok.text[len("The paged cache"):-len(" works")]
    assert detok.text.startswith("The paged cache") and detok.text.endswith(" works")
    assert middle and set(middle) == {REPLACEMENT_CHAR}
    if method == "window":  # linear: a held window would decode ~n^2/2 = 45,000+ ids here
        assert counting.decoded < 40 * len(ids), counting.decoded


@pytest.mark.parametrize("small", [0, 16, TextBuffer.SMALL])
def test_text_buffer_reads_what_a_str_would(small, monkeypatch):
    """Appends, reads of any range and searches from any start equal a plain str's, before
    and after the text moves from a str into the StringIO (multi-byte and astral characters
    included)."""
    monkeypatch.setattr(TextBuffer, "SMALL", small)
    rng = np.random.default_rng(small)
    alphabet = ["a", " ", "é", "日本", "🙂", "\n", "xyz"]
    buf, ref = TextBuffer(), ""
    for step in range(600):
        piece = "".join(rng.choice(alphabet, int(rng.integers(0, 4))))
        buf.append(piece)
        ref += piece
        assert buf.length == len(ref)
        a = int(rng.integers(0, len(ref) + 1))
        b = int(rng.integers(a, len(ref) + 2))
        assert buf.slice(a, b) == ref[a:b] and buf.slice(a) == ref[a:]
        for sub in ("日本", "a ", "🙂\n", "é", "zz"):  # found or not, from any start
            assert buf.find(sub, a) == ref.find(sub, a)
        if step % 97 == 0:
            assert buf.value() == ref
    assert (buf._io is not None) == (len(ref) > small)
    assert TextBuffer(ref).value() == ref


@pytest.mark.parametrize("method", ["stream", "window"])
def test_output_continues_the_prompt_with_a_space_stripping_decoder(method):
    """A Llama-2-style decoder strips the leading space of a decode: primed with the prompt's
    last tokens (as vLLM primes its decoder), an output's text is what the prompt plus output
    decode to past the prompt's text, so "▁and" after a prompt reads " and"."""
    tok = byte_fallback_tokenizer()
    tid = tok.backend.token_to_id
    prompt = [tid("▁Z"), tid("ü"), tid("r"), tid("i"), tid("c"), tid("h")]
    out = [tid("▁and"), tid("▁São"), *tok.encode(" 🙂", add_special_tokens=False),
           tid("▁and")]
    assert tok.decode(out[:1]) == "and"  # the plain decode strips the token's space
    want = tok.decode(prompt + out)[len(tok.decode(prompt)):]
    assert want == " and São 🙂 and"
    wrapped = CountingTokenizer(tok) if method == "window" else tok
    detok = IncrementalDetokenizer(wrapped, prompt_ids=prompt,
                                   method=None if method == "window" else method)
    assert detok.method == method
    for n in range(1, len(out) + 1):
        detok.update(out[:n])
        assert want.startswith(detok.text), n
    detok.update(out, final=True)
    assert detok.text == want
    # Without the prompt, the plain decode of the output's ids.
    bare = IncrementalDetokenizer(tok, method="stream")
    bare.update(out, final=True)
    assert bare.text == tok.decode(out) == want[1:]


def test_the_engine_primes_the_detokenizer_with_the_prompt():
    import dataclasses

    from helpers import make_llm, tiny

    from jpaged import SamplingParams

    tok = byte_fallback_tokenizer()
    t = tok.backend.token_to_id("▁and")
    llm = make_llm(dataclasses.replace(tiny(), tokenizer=tok), max_model_len=64,
                   max_num_seqs=2, max_num_batched_tokens=32, num_gpu_blocks_override=16,
                   block_size=8)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[t])
    c = llm.generate("São", p)[0].outputs[0]
    assert c.token_ids == [t] * 3 and c.text == " and and and"
