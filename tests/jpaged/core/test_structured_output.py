"""The grammar compiler and matchers of structured outputs (llguidance), on a byte-level
tokenizer: compiled once per spec, the compiler's message for a bad grammar, the packed mask
allows exactly what the grammar allows next, and a matcher follows the tokens it is fed;
objects take only their listed properties unless the engine's structured-outputs config says
vLLM's guidance backend; a schema moved into a larger one keeps its references."""

from __future__ import annotations

import numpy as np
import pytest

from jpaged.bench.fixtures import byte_tokenizer
from jpaged.config import EngineArgs, StructuredOutputsConfig
from jpaged.core.structured_output import GrammarCompiler, consume, mask_words, relocated
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
    ({"json": "[1]"}, "schema object"),
    ({"structural_tag": "x"}, "structural_tag is not valid JSON")])
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


def _keys_after_brace(gc: GrammarCompiler, so: StructuredOutputsParams) -> set[int]:
    """What may follow `{"` (a key's first character) under `so`."""
    m = gc.matcher(so)
    for ch in '{"':
        assert consume(m, ord(ch)) is None
    return _allowed(gc, m)


SCHEMA_K = {"type": "object", "properties": {"k": {"type": "boolean"}}}


def test_objects_allow_only_listed_properties_by_default():
    """vLLM's default backend (xgrammar, strict): an object schema listing properties and not
    saying additionalProperties takes no other key, nested ones and `$defs` alike; a
    free-form `{"type": "object"}`, or one that says additionalProperties, stays open; a
    property named "properties" is not taken for a schema."""
    gc = _compiler()
    closed = StructuredOutputsParams(json=SCHEMA_K, disable_any_whitespace=True)
    assert _keys_after_brace(gc, closed) == {ord("k")}
    nested = {"type": "object", "properties": {"k": {"$ref": "#/$defs/In"}},
              "required": ["k"], "$defs": {"In": SCHEMA_K}}
    m = gc.matcher(StructuredOutputsParams(json=nested, disable_any_whitespace=True))
    for ch in '{"k":{"':
        assert consume(m, ord(ch)) is None
    assert _allowed(gc, m) == {ord("k")}
    for open_schema in ({"type": "object"},
                        {**SCHEMA_K, "additionalProperties": True},
                        {**SCHEMA_K, "additionalProperties": {"type": "integer"}}):
        allowed = _keys_after_brace(gc, StructuredOutputsParams(json=open_schema,
                                                                disable_any_whitespace=True))
        assert {ord("k"), ord("x")} <= allowed, open_schema
    odd = {"type": "object", "properties": {"properties": {"type": "integer"}},
           "required": ["properties"]}
    m = gc.matcher(StructuredOutputsParams(json=odd, disable_any_whitespace=True))
    for ch in '{"properties":7}':
        assert consume(m, ord(ch)) is None, ch
    assert m.is_accepting()


def test_guidance_backend_config_keeps_objects_open_unless_disabled():
    """structured_outputs_config {"backend": "guidance"} (vLLM's guidance backend): objects
    that do not say additionalProperties take other keys; its disable_additional_properties,
    or a request's, closes them again."""
    tok = byte_tokenizer()
    lenient = GrammarCompiler(tok, 260, (tok.eos_token_id,),
                              StructuredOutputsConfig(backend="guidance"))
    so = StructuredOutputsParams(json=SCHEMA_K, disable_any_whitespace=True)
    assert {ord("k"), ord("x")} <= _keys_after_brace(lenient, so)
    per_request = StructuredOutputsParams(json=SCHEMA_K, disable_any_whitespace=True,
                                          disable_additional_properties=True)
    assert _keys_after_brace(lenient, per_request) == {ord("k")}
    closed = GrammarCompiler(tok, 260, (tok.eos_token_id,), StructuredOutputsConfig(
        backend="guidance", disable_additional_properties=True))
    assert _keys_after_brace(closed, so) == {ord("k")}
    no_ws = GrammarCompiler(tok, 260, (tok.eos_token_id,), StructuredOutputsConfig.parse(
        '{"backend": "guidance", "disable_any_whitespace": true}'))
    m = no_ws.matcher(StructuredOutputsParams(json=SCHEMA_K))
    consume(m, ord("{"))
    assert _allowed(no_ws, m) == {ord('"'), ord("}")}  # no whitespace, engine-wide


@pytest.mark.parametrize("value,match", [
    ({"backend": "xgrammar"}, r"backend must be one of \('auto', 'guidance'\)"),
    ({"backend": "outlines"}, "backend must be one of"),
    ({"disable_additional_properties": True}, "disable_additional_properties needs backend"),
    ({"disable_any_whitespace": True}, "disable_any_whitespace needs backend"),
    ({"backend": "guidance", "disable_any_whitespace": "yes"}, "must be true or false"),
    ({"reasoning_parser": "qwen3"}, r"unknown field\(s\) \['reasoning_parser'\]"),
    ("{not json", "structured_outputs_config is not valid JSON")])
def test_structured_outputs_config_is_validated_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsConfig.parse(value)
    with pytest.raises(ValueError, match=match):
        EngineArgs(structured_outputs_config=value).create_engine_config(512)


def test_relocated_rewrites_local_refs_only():
    """A schema moved under a pointer keeps its references: local ones ("#", "#/...") point
    under the pointer; external and anchor refs, and data that looks like a ref, stay."""
    schema = {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/A"}, "self": {"$ref": "#"},
        "b": {"anyOf": [{"$ref": "#/definitions/B"}, {"$ref": "other.json#/x"}]},
        "c": {"$ref": "#anchor"}, "d": {"enum": [{"$ref": "#/$defs/A"}]}},
        "$defs": {"A": {"items": {"$ref": "#/$defs/A"}}}}
    out = relocated(schema, "/items/properties/parameters")
    p = "#/items/properties/parameters"
    assert out["properties"]["a"] == {"$ref": p + "/$defs/A"}
    assert out["properties"]["self"] == {"$ref": p}
    assert out["properties"]["b"]["anyOf"] == [{"$ref": p + "/definitions/B"},
                                               {"$ref": "other.json#/x"}]
    assert out["properties"]["c"] == {"$ref": "#anchor"}
    assert out["properties"]["d"] == {"enum": [{"$ref": "#/$defs/A"}]}  # data, not a schema
    assert out["$defs"]["A"]["items"] == {"$ref": p + "/$defs/A"}
    assert schema["properties"]["a"] == {"$ref": "#/$defs/A"}  # the input is left as it was


TAG = {"structures": [{"begin": "<function=get_weather>", "end": "</function>", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
    "triggers": ["<function="]}


def _feed(m, text: str) -> bool:
    """Whether the matcher takes every byte of `text`."""
    return all(consume(m, b) is None for b in text.encode())


def test_a_structural_tag_is_free_text_until_its_trigger_then_its_schema():
    """vLLM's structural tag (its guidance backend's form): text goes free until a trigger;
    the structure the trigger begins must follow, its JSON under its schema (objects closed
    as a JSON request's), then its end; then free text again."""
    import json

    gc = _compiler()
    so = StructuredOutputsParams(structural_tag=json.dumps(TAG))
    assert _feed(gc.matcher(so), "Sure. <function=get_weather>{\"city\": \"Paris\"}</function>"
                                 " Done.")
    assert not _feed(gc.matcher(so), "Sure. <function=get_time>")  # no such structure
    assert not _feed(gc.matcher(so), '<function=get_weather>{"town": "Paris"}')  # schema
    assert not _feed(gc.matcher(so), '<function=get_weather>{\t"city"')  # JSON's whitespace
    m = gc.matcher(so)
    assert _feed(m, "no call at all") and EOS in _allowed(gc, m)


@pytest.mark.parametrize(("tag", "match"), [
    ("{oops", "not valid JSON"),
    ({"structures": [], "triggers": ["<f"]}, "structures must be a non-empty list"),
    ({**TAG, "triggers": []}, "triggers must be a non-empty list"),
    ({**TAG, "triggers": ["<tool"]}, r"structures\[0\].begin '<function=get_weather>' starts "
                                     "with none of the triggers"),
    ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]},
     r"structures\[0\] must be"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format' form"),
])
def test_a_bad_structural_tag_is_refused_by_name(tag, match):
    import json

    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(structural_tag=tag if isinstance(tag, str) else json.dumps(tag))
