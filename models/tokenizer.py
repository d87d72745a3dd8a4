"""Tokenizer: a `tokenizers` backend plus special tokens and a sandboxed jinja chat template.

Built from an HF dir (tokenizer.json + tokenizer_config.json) or from GGUF metadata (a
byte-level BPE vocabulary with merges, or a SentencePiece one with scores, and token types).
Needs neither torch nor transformers.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

# GGUF token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split rules by GGUF `tokenizer.ggml.pre`; None = GPT-2's own ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# Pre types that split every digit on its own before the GPT-2 regex (StarCoder-style vocabularies).
_DIGIT_PRE_TYPES = {"smollm", "starcoder", "refact"}


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:  # whitespace/control bytes get code points from 256 up, in byte order
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_level_backend() -> Backend:
    """A 258-token byte-level tokenizer: the 256 bytes (ids 0-255), then <s> and </s>.

    No merges. It stands in where no real tokenizer exists (random-weight models, tests); ids
    it does not know decode to nothing.
    """
    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    backend = Backend(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True),
                                AddedToken("</s>", special=True)])
    return backend


def _render_tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled in a sandbox with the helpers HF templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _render_tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def message_text(content: Any, kinds: tuple[str, ...] = ("text",)) -> str:
    """A chat message's content as plain text: a string, a list of text parts (of `kinds`:
    OpenAI chat's {"type": "text", "text": ...}; a "refusal" part's text is its `refusal`),
    joined, or None (empty); anything else is a ValueError naming the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of text parts, got "
                         f"{type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind in kinds else None
        if not isinstance(text, str):
            raise ValueError(f"only text content parts are supported ({', '.join(kinds)}), "
                             f"got type {kind!r} at part {j}")
        parts.append(text)
    return "".join(parts)


def template_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` as chat templates read them (vLLM's rule for
    HF templates): each call's JSON `arguments` string parsed to an object (empty: {}). A
    malformed call, or arguments that are not JSON, is a ValueError naming it."""
    import json

    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{j}] must be {{'type': 'function', 'function': "
                             "{'name': ..., 'arguments': '...'}}")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise ValueError(f"tool_calls[{j}].function.arguments is not JSON: "
                                 f"{args[:80]!r}") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


class Tokenizer:
    """Text <-> token ids, special tokens and chat template of one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.chat_template = chat_template

    # ---- ids -------------------------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string (byte-level spelling for BPE), or None."""
        return self._id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if any."""
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if any."""
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if any."""
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special token (bos/eos/unk/pad and added special tokens)."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        for tok in (self.bos_token, self.eos_token, self.unk_token, self.pad_token):
            if (i := self._id(tok)) is not None:
                ids.add(i)
        return sorted(ids)

    # ---- text ------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are always kept whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of two texts as one sequence, as the tokenizer joins a pair (HF's
        `tokenizer(text, text_pair)`: its post-processor's separators, else the two in turn)."""
        return self.backend.encode(text, pair, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of ids (byte-level spelling for BPE vocabularies)."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    # ---- chat ------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return bool(self.chat_template)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template or "")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, continue_final_message: bool = False, **extra: Any
    ) -> str:
        """The prompt string for `messages` rendered by the model's chat template (or the
        given one); `extra` reaches the template as variables. continue_final_message (as HF
        transformers): the text ends where the last message's content does, open for the
        model to continue it."""
        if chat_template is None and not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass a plain prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "set")
        template = (self._compiled_template if chat_template is None
                    else compile_chat_template(chat_template))
        context = dict(
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            unk_token=self.unk_token or "", pad_token=self.pad_token or "",
        )
        context.update(extra)
        text = template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )
        if continue_final_message:
            last = messages[-1].get("content") if messages else None
            if not isinstance(last, str) or not last.strip() or last.strip() not in text:
                raise ValueError("continue_final_message needs a final message with text "
                                 "that the chat template renders")
            text = text[:text.rindex(last.strip()) + len(last.strip())]
        return text

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From tokenizer.json, tokenizer_config.json and an optional chat_template.jinja."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_file}")
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as e:
            raise ValueError(f"invalid tokenizer file {tok_file}: {e}") from e
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (path / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it here
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None and (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=template,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Tokenizer from GGUF `tokenizer.ggml.*` metadata: llama.cpp's 'gpt2' (byte-level BPE)
        or 'llama' (SentencePiece BPE with byte fallback, as Gemma's)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
            )
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = _gguf_byte_level_backend(metadata, tokens, types)
            add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        else:
            backend = _gguf_sentencepiece_backend(metadata, tokens, types)
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
            add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))

        def name(key: str) -> str | None:
            return _token_at(metadata, tokens, key)

        bos, eos = name("bos_token_id"), name("eos_token_id")
        _set_bos_eos_processor(
            backend, bos if add_bos else None,
            eos if metadata.get("tokenizer.ggml.add_eos_token") else None,
        )
        return cls(backend, bos_token=bos, eos_token=eos, unk_token=name("unknown_token_id"),
                   pad_token=name("padding_token_id"),
                   chat_template=metadata.get("tokenizer.chat_template"))


def _gguf_byte_level_backend(metadata: dict[str, Any], tokens: list[str],
                             types: list[int]) -> Backend:
    """llama.cpp 'gpt2': byte-level BPE from the vocabulary and its merges."""
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    spelling = byte_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        # Vocabularies are stored in the byte alphabet; respell any token that is not.
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode())
        vocab[key] = i
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("GGUF tokenizer.ggml.merges entries must be 'left right'")
    backend = Backend(BPE(vocab=vocab, merges=pairs, dropout=None, fuse_unk=False,
                          continuing_subword_prefix="", end_of_word_suffix=""))
    backend.pre_tokenizer = _gguf_pre_tokenizer(
        metadata.get("tokenizer.ggml.pre", "default"),
        bool(metadata.get("tokenizer.ggml.add_space_prefix", False)),
    )
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; a "control" token outside the byte alphabet
    # is a converter mislabel and would add a new id, so it is skipped.
    backend.add_special_tokens([
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, types, strict=True)
        if kind_ == _CONTROL and set(tok) <= alphabet
    ])
    backend.add_tokens([
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_ in zip(tokens, types, strict=True)
        if kind_ == _USER_DEFINED and tok in vocab
    ])
    return backend


_SPACE = "\u2581"  # SentencePiece's visible space


def _gguf_sentencepiece_backend(metadata: dict[str, Any], tokens: list[str],
                                types: list[int]) -> Backend:
    """llama.cpp 'llama' (SentencePiece BPE) as transformers' GemmaTokenizer builds it.

    Spaces become "▁" before the model; the text is not split further, and BPE merges the
    adjacent pair whose union is the best-ranked token, falling back to the <0xNN> byte tokens
    for characters outside the vocabulary. A GGUF stores no merges, so they are derived: one per
    way of cutting a token into two tokens, ranked by the token's place in the file for Gemma
    (its scores put the user-defined whitespace runs last, though SentencePiece matches them
    first) and by its score otherwise (llama.cpp's SPM rule). Control tokens are special and
    user-defined ones ("\n\n", ...) are matched whole, as llama.cpp does.
    """
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        raise ValueError("GGUF SentencePiece vocabularies with add_space_prefix (a space "
                         "prepended to the text, Llama 2 style) are not supported yet")
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    if not len(scores) == len(types) == len(tokens):
        raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores "
                         f"and {len(types)} token types")
    # Runs of spaces are stored as real spaces; the text they must match has "▁" for each.
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(spelled)}  # a repeated string keeps its last id
    by_place = str(metadata.get("general.architecture", "")).startswith("gemma")
    rank = {tok: (i if by_place else -scores[i]) for tok, i in vocab.items()}
    backend = Backend(BPE(vocab=vocab, merges=_derived_merges(vocab, rank), dropout=None,
                          fuse_unk=True, byte_fallback=True,
                          unk_token=_token_at(metadata, tokens, "unknown_token_id")))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([
        AddedToken(tok, special=True, normalized=False)
        for tok, kind_ in zip(tokens, types, strict=True) if kind_ == _CONTROL
    ])
    backend.add_tokens([
        AddedToken(tok, special=False, normalized=False)
        for tok, kind_ in zip(tokens, types, strict=True)
        if kind_ == _USER_DEFINED and tok in vocab
    ])
    return backend


def _derived_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) of two tokens whose concatenation is a token, best-ranked result
    first; cuts of one token with the longer left part first."""
    found: list[tuple[float, int, str, str]] = []
    for tok, r in rank.items():
        for cut in range(len(tok) - 1, 0, -1):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((r, -cut, left, right))
    found.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in found]


def _token_at(metadata: dict[str, Any], tokens: list[str], key: str) -> str | None:
    idx = metadata.get(f"tokenizer.ggml.{key}")
    return None if idx is None or not 0 <= idx < len(tokens) else tokens[idx]


def _gguf_pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre in _DIGIT_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GGUF_PRE_SPLITS:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2 rules", stacklevel=3)
    split = _GGUF_PRE_SPLITS.get(pre)
    if split is None:
        return byte_level
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
    ])


def _set_bos_eos_processor(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Post-processor adding BOS/EOS when `encode(add_special_tokens=True)`."""
    if bos is None and eos is None:
        return
    pre = [bos] if bos else []
    post = [eos] if eos else []
    single = [*(f"{t}:0" for t in pre), "$A:0", *(f"{t}:0" for t in post)]
    pair = [*single, *(f"{t}:1" for t in pre), "$B:1", *(f"{t}:1" for t in post)]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, backend.token_to_id(t)) for t in {*pre, *post}],
    )
