"""SamplingParams: how one request is sampled and when it stops (names follow vLLM)."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class RequestOutputKind(IntEnum):
    """What a streaming consumer receives per step."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _check(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


# Typed before the range checks, so a wrong type is a ValueError naming the field, not a
# TypeError from a comparison. numpy scalars are accepted and stored as Python numbers.
_REAL_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
# truncate_prompt_tokens keeps the prompt's last tokens ("left": its start is cut, vLLM's
# default) or its first ones ("right").
TRUNCATION_SIDES = ("left", "right")
# vLLM's least temperature above 0 (a lower one is raised to it: dividing logits by less
# overflows float32 and gives inf / nan probabilities).
MIN_TEMPERATURE = 0.01

logger = logging.getLogger("jpaged")


def _coerce_types(sp: SamplingParams) -> None:
    for name in _REAL_FIELDS:
        v = getattr(sp, name)
        _check(isinstance(v, numbers.Real) and not isinstance(v, bool), name, "a number", v)
        setattr(sp, name, float(v))
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = getattr(sp, name)
        if v is None and name in _OPTIONAL_INT_FIELDS:
            continue
        _check(isinstance(v, numbers.Integral) and not isinstance(v, bool), name,
               "an integer" + (" or None" if name in _OPTIONAL_INT_FIELDS else ""), v)
        setattr(sp, name, int(v))
    _check(sp.stop is None or isinstance(sp.stop, str | list | tuple), "stop",
           "a string or a list of strings", sp.stop)
    _check(sp.stop_token_ids is None or isinstance(sp.stop_token_ids, list | tuple),
           "stop_token_ids", "a list of integers", sp.stop_token_ids)


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's form (vLLM's class and fields; exactly one kind is set):
    a JSON schema (dict or JSON text), a regex, a choice among strings, a grammar (Lark, or
    GBNF when it defines rules with `::=`), any JSON object, or a structural tag (JSON text
    of {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}: free text,
    where each trigger starts one of the structures, its JSON following its schema)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in _SO_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("StructuredOutputsParams must set exactly one of json, regex, "
                             "choice, grammar, json_object, structural_tag (got "
                             f"{set_kinds or 'none'})")
        if self.structural_tag is not None:
            structural_tags(self.structural_tag)  # a ValueError naming what is wrong
        if self.json is not None:
            if isinstance(self.json, str):
                import json as _json

                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}"
                                     ) from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise ValueError("StructuredOutputsParams.json must be a JSON schema object, "
                                 f"got {type(schema).__name__}")
        if self.regex is not None:
            _check(isinstance(self.regex, str) and self.regex != "", "structured_outputs.regex",
                   "a non-empty string", self.regex)
        if self.choice is not None:
            _check(isinstance(self.choice, list | tuple) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", "a non-empty list of non-empty strings",
                   self.choice)
            self.choice = list(self.choice)
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar.strip() != "",
                   "structured_outputs.grammar", "a non-empty string", self.grammar)

    @property
    def kind(self) -> str:
        """Which constraint is set: 'json', 'regex', 'choice', 'grammar', 'json_object' or
        'structural_tag'."""
        return next(k for k in _SO_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """One string per distinct compiled grammar."""
        import json as _json

        value = getattr(self, self.kind)
        return _json.dumps([self.kind, value, self.disable_any_whitespace,
                            self.disable_additional_properties, self.whitespace_pattern],
                           sort_keys=True, default=str)


# vLLM's former name of the same class.
GuidedDecodingParams = StructuredOutputsParams


def structural_tags(spec: str | dict[str, Any]) -> list[tuple[str, str, dict[str, Any], str]]:
    """(trigger, begin, schema, end) of each structure of a structural tag (vLLM's form, JSON
    text or a dict: {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]},
    each begin starting with one of the triggers); a ValueError names what is wrong."""
    import json as _json

    name = "StructuredOutputsParams.structural_tag"
    if isinstance(spec, str):
        try:
            spec = _json.loads(spec)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(spec).__name__}")
    if "format" in spec and "structures" not in spec:
        raise ValueError(f"{name}: the 'format' form is xgrammar's; jpaged takes vLLM's "
                         "{'structures': [...], 'triggers': [...]} form")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(
            isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}.structures must be a non-empty list")
    out = []
    for i, s in enumerate(structures):
        where = f"{name}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(
                s.get("end"), str) or not isinstance(s.get("schema"), dict):
            raise ValueError(f"{where} must be {{'begin': str, 'schema': {{...}}, 'end': str}}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{where}.begin {s['begin']!r} starts with none of the triggers "
                             f"{triggers}")
        out.append((trigger, s["begin"], s["schema"], s["end"]))
    return out


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request; validated on construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # vLLM's; as with vLLM's fast (Rust) tokenizers, which are the only kind jpaged loads, it
    # changes nothing: special tokens are joined as the tokenizer's decoder joins them.
    spaces_between_special_tokens: bool = True
    # vLLM's detokenize: False gives token ids only (text "", logprob entries without
    # decoded_token) and saves the host's detokenization; stop strings then cannot be used.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token constraints (vLLM's names): add logit_bias[id] to that token's logit (OpenAI's
    # [-100, 100]); sample only among allowed_token_ids.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Keep only k of the prompt's tokens (-1: max_model_len - 1 of them), as vLLM:
    # truncation_side "left" (the default) keeps the last ones, "right" the first ones.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # The output's form: JSON schema, regex, choice or grammar (a packed token mask per step).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's bad_words: words the output may not contain (each as its tokens, with and without a
    # leading space); a word's last token is banned where the output ends with its others.
    bad_words: list[str] | None = None
    # vLLM's extra_args: arguments for extensions; "kv_transfer_params" is read by the KV
    # connector (disaggregated prefill/decode; the OpenAI API's kv_transfer_params field).
    extra_args: dict[str, Any] | None = None
    # vLLM's names for what jpaged refuses, as vLLM V1 does: best_of other than n, and
    # per-request logits processors (Python per token, outside the jitted step).
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    # Filled by the engine: the tokenizer's EOS ids (stop unless ignore_eos), and bad_words as
    # token sequences.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        _coerce_types(self)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(self.output_kind in set(RequestOutputKind.__members__.values())
               and not isinstance(self.output_kind, bool), "output_kind",
               "a RequestOutputKind (0 cumulative, 1 delta, 2 final only)", self.output_kind)
        self.output_kind = RequestOutputKind(self.output_kind)  # members compare by identity
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(0.0 <= self.temperature < math.inf, "temperature", ">= 0 and finite",
               self.temperature)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's floor (below it: inf/nan)
            logger.warning("SamplingParams.temperature %g is below %g: %g is used (0 is "
                           "greedy)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and (self.top_k in (-1, 0) or self.top_k >= 1),
               "top_k", "-1 (disabled) or >= 1", self.top_k)
        if self.top_k == 0:  # vLLM treats 0 as disabled too
            self.top_k = -1
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]",
               self.frequency_penalty)
        _check(0.0 < self.repetition_penalty < math.inf, "repetition_penalty", "> 0 and finite",
               self.repetition_penalty)
        _check(self.max_tokens is None
               or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", "an integer >= 1 or None", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0",
               self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "<= max_tokens",
                   self.min_tokens)
        # -1: every token of the vocabulary (vLLM's; the engine's max_logprobs must allow it).
        _check(self.logprobs is None or self.logprobs >= -1, "logprobs",
               ">= 0, -1 (the whole vocabulary) or None", self.logprobs)
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
               ">= 0, -1 (the whole vocabulary) or None", self.prompt_logprobs)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "non-empty strings", self.stop)
        _check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids), "stop_token_ids", "non-negative integers",
               self.stop_token_ids)
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.seed is not None:
            _check(isinstance(self.seed, int) and -2**63 <= self.seed < 2**63, "seed",
                   "a 64-bit signed integer or None (vLLM's range)", self.seed)
        _check(self.truncate_prompt_tokens is None or (
            isinstance(self.truncate_prompt_tokens, int) and not isinstance(
                self.truncate_prompt_tokens, bool) and (self.truncate_prompt_tokens == -1
                                                        or self.truncate_prompt_tokens >= 1)),
            "truncate_prompt_tokens", "-1, an integer >= 1 or None", self.truncate_prompt_tokens)
        _check(self.truncation_side in TRUNCATION_SIDES, "truncation_side",
               f"one of {TRUNCATION_SIDES}", self.truncation_side)
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.logit_bias), "logit_bias",
                "a dict of non-negative token ids to numbers", self.logit_bias)
            _check(all(isinstance(v, int | float) and not isinstance(v, bool)
                       and -100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                   "logit_bias", "values in [-100, 100]", self.logit_bias)
        if self.allowed_token_ids is not None:
            _check(isinstance(self.allowed_token_ids, list | tuple) and len(
                self.allowed_token_ids) > 0 and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.allowed_token_ids), "allowed_token_ids",
                "a non-empty list of non-negative token ids", self.allowed_token_ids)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list | tuple) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                "a list of non-empty strings", self.bad_words)
            self.bad_words = list(self.bad_words)
        _check(isinstance(self.detokenize, bool), "detokenize", "True or False", self.detokenize)
        _check(isinstance(self.spaces_between_special_tokens, bool),
               "spaces_between_special_tokens", "True or False",
               self.spaces_between_special_tokens)
        _check(self.detokenize or not self.stop, "stop",
               "empty when detokenize is False (stop strings are found in the text)", self.stop)
        _check(self.best_of is None or self.best_of == self.n, "best_of",
               f"None or n ({self.n}): returning the n best of more samples is not supported "
               "(as in vLLM V1)", self.best_of)
        _check(not self.logits_processors, "logits_processors",
               "empty: per-request logits processors are not supported (as in vLLM V1); "
               "logit_bias, allowed_token_ids, bad_words and structured_outputs run in the "
               "jitted sampler", self.logits_processors)
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "a StructuredOutputsParams or None", self.structured_outputs)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args",
               "a dict or None", self.extra_args)
        if self.extra_args:
            kvp = self.extra_args.get("kv_transfer_params")
            _check(kvp is None or isinstance(kvp, dict), "extra_args['kv_transfer_params']",
                   "a dict or None", kvp)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields changed."""
        import dataclasses

        return dataclasses.replace(self, **changes)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`; the server's `use_beam_search`):
    `beam_width` beams, `max_tokens` steps; `temperature` only draws each step's sampled token
    (the beams follow the raw logprobs, as in vLLM); `length_penalty` the score's exponent.
    `include_stop_str_in_output` is vLLM's field, kept for its signature: beams end only at EOS
    or length, never at a stop string."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, allowed: str) -> None:
            if not cond:
                raise ValueError(f"BeamSearchParams.{name} must be {allowed}, got "
                                 f"{getattr(self, name)!r}")

        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1, name,
                 "an integer >= 1")
            setattr(self, name, int(v))
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            need(isinstance(v, numbers.Real) and not isinstance(v, bool)
                 and math.isfinite(float(v)), name, "a finite number")
            setattr(self, name, float(v))
        need(self.temperature >= 0, "temperature", ">= 0")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), name, "True or False")
