"""The engine flags of the `jpaged` commands, derived from EngineArgs (vLLM's add_cli_args idea).

Every EngineArgs field but `NOT_FLAGS` is one flag, so a field added there is a flag of every
engine command at once, and `--help` says what the field's docstring says:

- name: the field's, kebab-cased (`gpu_memory_utilization` -> `--gpu-memory-utilization`),
  plus a short name from `SHORT_NAMES` (`-m` for `--model`);
- type: the field's; `int | None` and the like take a value or stay unset (None); a boolean is
  `--name/--no-name` (`--enable-prefix-caching/--no-enable-prefix-caching`); a config a field
  takes as an object, a dict or JSON text (`--kv-transfer-config`) takes the JSON text, which
  EngineArgs parses, so its errors name the field;
- default: the field's default, shown in `--help`;
- help: the field's attribute docstring (jpaged/config.py), then the values config.py accepts
  where it lists them (`CHOICES`). Values are checked where the engine checks them
  (`EngineArgs.create_engine_config`), so a bad one reads the same from the CLI and the API.

`with_engine_flags` adds the flags to a command function; `engine_args` builds its EngineArgs.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from jpaged.config import (
    ATTENTION_BACKENDS,
    DTYPE_ALIASES,
    HASH_ALGOS,
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    EngineArgs,
)
from jpaged.pooling_params import RUNNERS

# EngineArgs fields that are no flag: code sets them (the data-parallel client gives each
# replica its rank, and `extra` carries fields to the replicas it starts).
NOT_FLAGS = frozenset({"data_parallel_rank", "extra"})
# vLLM's short names, where jpaged has the flag.
SHORT_NAMES: dict[str, str] = {"model": "-m", "tensor_parallel_size": "-tp",
                               "quantization": "-q", "nnodes": "-n", "node_rank": "-r"}
# The values config.py accepts for a string field, listed in its help (checked by the engine).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": (*MODEL_DTYPES, *DTYPE_ALIASES),
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATION_METHODS,
    "prefix_caching_hash_algo": HASH_ALGOS,
    "preemption_mode": PREEMPTION_MODES,
    "scheduling_policy": SCHEDULING_POLICIES,
    "runner": RUNNERS,
}
_SCALARS: tuple[type, ...] = (bool, int, float, str)
# Integer flags that also take "auto" (vLLM's), read as -1: the model's own limit.
AUTO_INTS = frozenset({"max_model_len"})
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_readable_int(value: str, auto: bool = False) -> int:
    """vLLM's human-readable integers: 1k = 1,000 and 1K = 1,024 (m/M, g/G, t/T likewise;
    decimals only with the decimal suffixes, 25.6k = 25,600), or a plain integer; with `auto`,
    "auto" is -1. A ValueError names the value."""
    value = value.strip()
    if auto and value.lower() == "auto":
        return -1
    m = _HUMAN_INT.fullmatch(value)
    if m is None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an integer (1000, 1k = 1000, 1K = 1024"
                             f"{', or auto' if auto else ''})") from None
    number, suffix = m.groups()
    if suffix.islower():
        return round(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(f"{value!r}: no decimals with the binary suffix {suffix} (did you "
                         f"mean {number}{suffix.lower()}?)")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def _int_parser(auto: bool) -> Callable[[Any], int]:
    """typer's parser of an integer flag (vLLM's human-readable form too)."""
    def parse(value: Any) -> int:
        return value if isinstance(value, int) else human_readable_int(str(value), auto)
    return parse


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass: {field: the string literal right below it}."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen build): the flags go without help
        return {}
    node = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    if not isinstance(node, ast.ClassDef):
        return docs
    for stmt, after in zip(node.body, node.body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: the EngineArgs field it sets, its value type, default and help."""

    field: str
    value_type: type  # bool, int, float or str
    optional: bool  # the field may be None: the flag may stay unset
    default: Any
    help: str

    @property
    def name(self) -> str:
        """The flag as written: `--block-size` for `block_size`."""
        return "--" + self.field.replace("_", "-")

    @property
    def declarations(self) -> tuple[str, ...]:
        """typer's option declarations: `--x/--no-x` for a boolean, else the name (+ short)."""
        if self.value_type is bool:
            return (f"{self.name}/--no-{self.name[2:]}",)
        short = SHORT_NAMES.get(self.field)
        return (self.name, short) if short else (self.name,)

    def parameter(self) -> inspect.Parameter:
        """The keyword parameter typer declares this flag from (an integer one also takes
        vLLM's human-readable form, 32k)."""
        hint: Any = self.value_type | None if self.optional else self.value_type
        extra = {"parser": _int_parser(self.field in AUTO_INTS)} \
            if self.value_type is int else {}
        option = typer.Option(*self.declarations, help=self.help, **extra)
        return inspect.Parameter(self.field, inspect.Parameter.KEYWORD_ONLY,
                                 default=self.default, annotation=Annotated[hint, option])


def _flag_type(name: str, hint: Any) -> tuple[type, bool]:
    """(the flag's value type, whether it may stay unset) for the type of field `name`."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    members = typing.get_args(hint) if union else (hint,)
    optional = type(None) in members
    members = tuple(m for m in members if m is not type(None))
    if len(members) == 1 and members[0] in _SCALARS and not (optional and members[0] is bool):
        return members[0], optional
    if len(members) > 1 and str in members:  # a config as an object, a dict or its JSON text
        return str, optional
    raise TypeError(f"EngineArgs.{name}: no flag for the type {hint!r}; give it one in "
                    f"{__name__}, or name it in NOT_FLAGS")


def _help(doc: str, choices: tuple[str, ...] | None, fields: re.Pattern[str]) -> str:
    """The flag's help: its field's docstring on one line, with the other fields it names
    written as their flags (`max_model_len` -> `--max-model-len`), then the values it takes."""
    text = fields.sub(lambda m: "--" + m.group(0).replace("_", "-"), " ".join(doc.split()))
    return " ".join(p for p in (text, f"One of: {', '.join(choices)}." if choices else "") if p)


def derive_engine_flags() -> dict[str, EngineFlag]:
    """Every engine flag, by field name, in EngineArgs' field order."""
    hints = typing.get_type_hints(EngineArgs)
    docs = field_docs(EngineArgs)
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name not in NOT_FLAGS]
    # Only names of two words or more: "model" or "seed" in a sentence is no flag.
    fields = re.compile(r"\b(?:" + "|".join(n for n in names if "_" in n) + r")\b")
    flags: dict[str, EngineFlag] = {}
    for f in dataclasses.fields(EngineArgs):
        if f.name in NOT_FLAGS:
            continue
        if f.default is dataclasses.MISSING:
            raise TypeError(f"EngineArgs.{f.name}: a flag needs a plain default; give it one, "
                            "or name it in NOT_FLAGS")
        typ, optional = _flag_type(f.name, hints[f.name])
        flags[f.name] = EngineFlag(f.name, typ, optional, f.default,
                                   _help(docs.get(f.name, ""), CHOICES.get(f.name), fields))
    return flags


ENGINE_FLAGS: dict[str, EngineFlag] = derive_engine_flags()


def with_engine_flags(*, only: Iterable[str] | None = None, exclude: Iterable[str] = ()
                      ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command function the engine flags (`only` these, or every one but `exclude`).

    The function takes `engine_flags: dict[str, Any]` (field name -> value) instead of one
    parameter per flag. typer reads the merged signature, so the flags parse and show in
    `--help` like the command's own options; `--model`, when among them, is listed first.
    """
    exclude = frozenset(exclude)
    names = list(only) if only is not None else [n for n in ENGINE_FLAGS if n not in exclude]
    unknown = sorted((set(names) | exclude) - set(ENGINE_FLAGS))
    if unknown:
        raise ValueError(f"not engine flags: {unknown}")
    flag_params = [ENGINE_FLAGS[n].parameter() for n in names]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.name != "engine_flags"]
        if clash := sorted({p.name for p in own} & set(names)):
            raise ValueError(f"{fn.__name__} declares engine flags itself: {clash}")
        params = sorted(own + flag_params, key=lambda p: p.name != "model")  # stable

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            flags = {n: kwargs.pop(n) for n in names}
            return fn(engine_flags=flags, **kwargs)

        del command.__wrapped__  # typer must read the merged signature, not fn's
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def engine_args(engine_flags: Mapping[str, Any], **overrides: Any) -> EngineArgs:
    """The EngineArgs of a command's engine flags, with `overrides` laid over them."""
    return EngineArgs(**{**engine_flags, **overrides})
