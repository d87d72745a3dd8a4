"""Structured outputs on the host: grammars compiled once per spec (llguidance), one matcher per
request, and the packed next-token bitmask of a step's constrained rows.

Why llguidance (docs/benchmarks.md, "Structured outputs"): measured on this CPU against
xgrammar with the embedded tokenizer and the twenty schemas of jpaged/bench/schemas.py, it
compiles a schema ~15x faster (0.45 ms against 6.8 ms, median), fills a mask as fast (6.5 µs
against 8.9 µs, median), and needs no other package, where xgrammar's bitmask is a torch tensor.

A mask row holds ceil(V / 32) int32 words, bit j of word i allowing token 32 i + j (llguidance's
and vLLM's layout); the jitted sampler unpacks it (jpaged/runner/sampler.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jpaged.config import StructuredOutputsConfig
from jpaged.sampling_params import StructuredOutputsParams, structural_tags

# Distinct grammars kept compiled (their pristine matchers); least recently used dropped first.
GRAMMAR_CACHE_SIZE = 256


def mask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


def forbid(mask_row: np.ndarray, tokens: Any) -> None:
    """Clear the bits of `tokens` in one packed int32 mask row (in place)."""
    bits = mask_row.view(np.uint32)
    for t in tokens:
        bits[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def grammar_source(so: StructuredOutputsParams,
                   config: StructuredOutputsConfig | None = None) -> str:
    """The llguidance grammar of a StructuredOutputsParams (not yet checked), under the
    engine's structured-outputs defaults `config` (None: vLLM's defaults). The one place a
    grammar is built: offline LLM and server requests alike."""
    import llguidance as llg

    config = config or StructuredOutputsConfig()
    matcher = llg.LLMatcher
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        if so.disable_additional_properties or not config.open_objects:
            schema = closed_objects(schema)
        return matcher.grammar_from_json_schema(json.dumps(schema),
                                                defaults=_json_options(so, config))
    if so.json_object:
        return matcher.grammar_from_json_schema('{"type": "object"}',
                                                defaults=_json_options(so, config))
    if so.regex is not None:
        return matcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        alts = " | ".join(json.dumps(c) for c in so.choice)  # Lark string literals
        return matcher.grammar_from_lark(f"start: {alts}\n")
    if so.grammar is not None:
        src = so.grammar
        if _looks_like_gbnf(src):
            from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

            try:
                src = gbnf_to_lark(src)
            except GbnfToLarkError as e:
                raise ValueError(f"GBNF: {e}") from None
            except Exception as e:
                # Its rule checks raise a bare Exception (a rule used but never defined, one
                # defined twice, no root rule): the grammar's fault, so a ValueError as any
                # other bad grammar (a 400 naming the field), never a server error.
                raise ValueError(f"GBNF: {e}") from None
        return matcher.grammar_from_lark(src)
    if so.structural_tag is not None:
        # llguidance's own structural tags: free text (lazy lexemes) until a trigger, then the
        # structure it begins (its JSON under the same whitespace rules), then free text.
        tags = [llg.StructTag(trigger=trigger, begin=begin, end=end, grammar=_tag_schema(
                    schema, so, config)) for trigger, begin, schema, end
                in structural_tags(so.structural_tag)]
        return llg.StructTag.to_grammar(tags)
    raise ValueError("StructuredOutputsParams names no constraint")


def _tag_schema(schema: dict[str, Any], so: StructuredOutputsParams,
                config: StructuredOutputsConfig) -> dict[str, Any]:
    """A structural tag's schema under a JSON request's rules: objects closed, the same
    whitespace (llguidance reads its options from the schema's "x-guidance")."""
    if so.disable_additional_properties or not config.open_objects:
        schema = closed_objects(schema)
    return {**schema, "x-guidance": _json_options(so, config)}


# Whitespace allowed between JSON tokens unless the request says otherwise: one space, or a
# line break and up to 16 spaces of indentation (pretty-printed JSON, four levels deep).
# Unbounded whitespace (vLLM's default) let the embedded model write blank lines until
# max_tokens in 1 of 3 samples at temperature 0.7; tabs of indentation (up to 32 allowed at
# first) filled a 200-token answer in 1 of 32.
JSON_WHITESPACE = r" ?(\n {0,16})?"


def _json_options(so: StructuredOutputsParams, config: StructuredOutputsConfig
                  ) -> dict[str, Any]:
    # No whitespace with disable_any_whitespace (vLLM's flag, per request or engine-wide), else
    # the request's pattern, else JSON_WHITESPACE.
    if so.disable_any_whitespace or config.disable_any_whitespace:
        return {"whitespace_flexible": False}
    return {"whitespace_flexible": True,
            "whitespace_pattern": so.whitespace_pattern or JSON_WHITESPACE}


# JSON schema keywords whose value is one subschema, a list of them, or a map of names to them
# (draft 2020-12 and the earlier drafts' spellings). Every other keyword's value is data
# (enum, const, default, examples, ...) or a scalar, never walked as a schema.
_ONE_SCHEMA = ("items", "additionalItems", "unevaluatedItems", "contains", "not", "if", "then",
               "else", "additionalProperties", "unevaluatedProperties", "propertyNames",
               "contentSchema")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
               "dependencies")


def map_schemas(schema: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of JSON schema `schema` with `fn` applied to every schema object in it, the
    innermost first (only where a keyword holds schemas: a property named "properties" or an
    enum value holding "$ref" is not taken for one). `schema` itself is left untouched."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or not a schema
    out = dict(schema)
    for k in _ONE_SCHEMA:
        if isinstance(out.get(k), dict):
            out[k] = map_schemas(out[k], fn)
    for k in _SCHEMA_LIST:
        if isinstance(out.get(k), list):
            out[k] = [map_schemas(s, fn) for s in out[k]]
    for k in _SCHEMA_MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: map_schemas(s, fn) for name, s in out[k].items()}
    return fn(out)


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists
    `properties` (or `patternProperties`) and says neither `additionalProperties` nor
    `unevaluatedProperties`: vLLM's default (xgrammar's strict mode) and its guidance backend's
    disable_additional_properties. A free-form object (`{"type": "object"}`) stays open."""
    def close(node: dict[str, Any]) -> dict[str, Any]:
        if (("properties" in node or "patternProperties" in node)
                and "additionalProperties" not in node and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        return node

    return map_schemas(schema, close)


def relocated(schema: Any, pointer: str) -> Any:
    """`schema` made to sit at JSON pointer `pointer` (e.g. "/items/properties/parameters") of
    a larger schema: its local references ("#", "#/$defs/X", "#/properties/a", ...) are
    rewritten to point under `pointer`, so they still resolve to its own definitions there
    (external refs and "#anchor" refs are left as they are)."""
    def move(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = "#" + pointer + ref[1:]
        return node

    return map_schemas(schema, move)


def _looks_like_gbnf(src: str) -> bool:
    # GBNF (llama.cpp, vLLM's "grammar" examples) defines rules with "::="; Lark with ":".
    return "::=" in src


class GrammarCompiler:
    """Compiles StructuredOutputsParams into llguidance matchers for one tokenizer.

    Thread-safe: the server compiles on executor threads while the engine thread takes
    matchers. `compile` raises ValueError with the compiler's own message; `matcher` returns a
    fresh matcher for one request (a copy of the cached pristine one).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig | None = None) -> None:
        self._tokenizer = tokenizer
        # The engine's defaults: fixed for the compiler's life, so cached grammars stay right.
        self.config = config or StructuredOutputsConfig()
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._executor: Any = None

    def _llt(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance as llg

            backend = getattr(self._tokenizer, "backend", None)
            if backend is None or not hasattr(backend, "to_str"):
                raise ValueError("structured outputs need a tokenizer backed by the `tokenizers` "
                                 "library (this model's tokenizer is not)")
            self._ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self._eos or None)
        return self._ll_tokenizer

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The pristine matcher of `so` (compiled once, then cached); ValueError naming the
        compiler's complaint when the grammar, schema or regex is invalid."""
        import llguidance as llg

        key = so.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            llt = self._llt()
        try:
            source = grammar_source(so, self.config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {so.kind} is invalid: {e}") from None
        m = llg.LLMatcher(llt, source, log_level=0)  # drops the GIL while it compiles
        if m.is_error():
            raise ValueError(f"structured_outputs: {so.kind} does not compile: "
                             f"{m.get_error()}")
        if not m.is_accepting() and not self._starts(m):
            raise ValueError(f"structured_outputs: no token of this model's vocabulary can "
                             f"start the {so.kind} (its tokenizer's tokens may not be read as "
                             "text)")
        with self._lock:
            self._cache[key] = m
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def _starts(self, m: Any) -> bool:
        """Whether the matcher's first mask allows a token other than EOS."""
        mask = np.zeros((1, mask_words(self.vocab_size)), np.int32)
        self.fill_masks([(m, 0)], mask)
        forbid(mask[0], [t for t in self._eos if 0 <= t < self.vocab_size])
        return bool(mask.any())

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request."""
        return self.compile(so).deep_copy()

    def fill_masks(self, matchers: list[tuple[Any, int]], out: np.ndarray) -> None:
        """Rows `out[i]` of the next-token bitmask of each (matcher, i), in parallel threads."""
        import llguidance as llg
        import llguidance.numpy as lln

        if self._executor is None:
            self._executor = llg.LLExecutor()
        lln.fill_next_token_bitmask_par(self._executor, matchers, out)

    @property
    def num_cached(self) -> int:
        """Grammars held compiled."""
        return len(self._cache)


def consume(matcher: Any, token: int) -> str | None:
    """Advance a request's matcher past its sampled token; the error when the token broke the
    grammar (it cannot, when the token was sampled under the matcher's own mask)."""
    if matcher.is_stopped():  # the grammar had ended: only EOS was allowed, nothing to check
        return None
    if not matcher.consume_token(token):
        return matcher.get_error() or f"token {token} is not allowed by the grammar"
    return None


def make_grammar_compiler(tokenizer: Any, eos_token_ids: Sequence[int], vocab_size: int,
                          config: StructuredOutputsConfig | None) -> GrammarCompiler:
    """The GrammarCompiler of a model: its EOS ids (and the tokenizer's own EOS) end a grammar."""
    eos = tuple(eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos = eos + (tokenizer.eos_token_id,)
    return GrammarCompiler(tokenizer, vocab_size, eos, config)
