"""The grammar compiler and matchers of structured outputs (llguidance), on a byte-level
tokenizer: compiled once per spec, the compiler's message for a bad grammar, the packed mask
allows exactly what the grammar allows next, and a matcher follows the tokens it is fed."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.bench.fixtures import byte_tokenizer
from jpaged.core.structured_output import GrammarCompiler, consume, mask_words
from jpaged.sampling_params import StructuredOutputsParams

EOS = 257  # byte_tokenizer: 256 bytes, then <s>, </s>


def _compiler() -> GrammarCompiler:
    tok = byte_tokenizer()
    return GrammarCompiler(tok, 260, (tok.eos_token_id,))


def _allowed(gc: GrammarCompiler, m) -> set[int]:
    masks = np.zeros((2, mask_words(gc.vocab_size)), np.int32)
    gc.fill_masks([(m, 1)], masks)
    assert (masks[0] == 0).all()  # only the named row is written
    bits = np.unpackbits(masks[1].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_choice_mask_and_matcher_follow_the_grammar():
    gc = _compiler()
    so = StructuredOutputsParams(choice=["yes", "no"])
    m = gc.matcher(so)
    assert _allowed(gc, m) == {ord("y"), ord("n")}
    assert consume(m, ord("n")) is None
    assert _allowed(gc, m) == {ord("o")}
    assert consume(m, ord("o")) is None
    assert _allowed(gc, m) == {EOS} and m.is_stopped()
    # A second request gets a fresh matcher from the one compiled grammar.
    assert gc.num_cached == 1
    assert _allowed(gc, gc.matcher(StructuredOutputsParams(choice=["yes", "no"]))) == {
        ord("y"), ord("n")}
    assert gc.num_cached == 1
    assert consume(gc.matcher(so), ord("x")) is not None  # a token the grammar refuses


def test_json_schema_regex_and_disable_any_whitespace():
    gc = _compiler()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = gc.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert _allowed(gc, m) == {ord("{")}
    consume(m, ord("{"))
    assert _allowed(gc, m) == {ord('"')}  # no whitespace allowed before the key
    flexible = gc.matcher(StructuredOutputsParams(json=schema))
    consume(flexible, ord("{"))
    assert {ord('"'), ord(" ")} <= _allowed(gc, flexible)
    r = gc.matcher(StructuredOutputsParams(regex=r"[0-9]{2}"))
    assert _allowed(gc, r) == set(range(ord("0"), ord("9") + 1))
    for ch in "42":
        assert consume(r, ord(ch)) is None
    assert _allowed(gc, r) == {EOS}


def test_bad_grammars_raise_the_compilers_message():
    gc = _compiler()
    with pytest.raises(ValueError, match="regex does not compile"):
        gc.compile(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="json does not compile"):
        gc.compile(StructuredOutputsParams(json={"type": "object", "properties": {
            "a": {"type": "no-such-type"}}}))
    with pytest.raises(ValueError, match="grammar does not compile"):
        gc.compile(StructuredOutputsParams(grammar="start: undefined_rule\n"))
    assert gc.num_cached == 0


@pytest.mark.parametrize("kw,match", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "schema object"), ({"structural_tag": "x"}, "not supported")])
def test_params_are_validated_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kw)


def test_gbnf_grammar_and_additional_properties():
    gc = _compiler()
    g = gc.matcher(StructuredOutputsParams(grammar='root ::= "a" | "b"'))
    assert _allowed(gc, g) == {ord("a"), ord("b")}
    closed = gc.matcher(StructuredOutputsParams(
        json={"type": "object", "properties": {"k": {"type": "boolean"}}},
        disable_any_whitespace=True, disable_additional_properties=True))
    for ch in '{"':
        consume(closed, ord(ch))
    assert _allowed(gc, closed) == {ord("k")}  # no other key may start


def test_a_grammar_no_token_can_start_is_refused():
    """The host bench's word tokenizer (tokens spelled with a byte-level space but no byte-level
    pre-tokenizer) is read literally: no token can write a digit, and the request is refused
    instead of ending at once with EOS."""
    from jpaged.bench.host import word_tokenizer

    tok = word_tokenizer()
    gc = GrammarCompiler(tok, 258, (tok.eos_token_id,))
    with pytest.raises(ValueError, match="no token of this model's vocabulary"):
        gc.compile(StructuredOutputsParams(regex="[0-9]{3}"))
    assert gc.num_cached == 0
