"""The server's LoRA adapters: vLLM's --lora-modules, and its runtime load/unload endpoints.

A request selects an adapter by naming it as its `model`; answers then carry that name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jpaged.lora_request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the endpoints


def parse_lora_module(value: str | Mapping[str, Any], lora_id: int) -> LoRARequest:
    """One --lora-modules entry: `name=path`, or JSON {"name", "path", "base_model_name"}
    (ValueError naming the entry otherwise)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"--lora-modules entry {value!r} is not JSON: {e}") from None
    if isinstance(value, Mapping):
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str):
            raise ValueError(f"--lora-modules entry {dict(value)!r} must hold a string name and "
                             "path (and optionally base_model_name)"
                             + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
        name, path, base = value["name"], value["path"], value.get("base_model_name")
    elif isinstance(value, str) and "=" in value:
        name, path = value.split("=", 1)
        base = None
    else:
        raise ValueError(f"--lora-modules entry {value!r} must be name=path or JSON "
                         '{"name": ..., "path": ...}')
    if not name or not path:
        raise ValueError(f"--lora-modules entry {value!r}: the name and the path must be "
                         "non-empty")
    return LoRARequest(name, lora_id, path, base_model_name=base)


def parse_lora_modules(values: Sequence[str | Mapping[str, Any]] | None) -> list[LoRARequest]:
    """Every --lora-modules entry, ids from 1, names unique (ValueError otherwise)."""
    modules: list[LoRARequest] = []
    for i, value in enumerate(values or ()):
        module = parse_lora_module(value, i + 1)
        if any(m.lora_name == module.lora_name for m in modules):
            raise ValueError(f"--lora-modules names {module.lora_name!r} twice")
        modules.append(module)
    return modules


def runtime_updating_allowed(flag: bool | None) -> bool:
    """The load/unload endpoints are served: the flag, else vLLM's environment variable."""
    if flag is not None:
        return flag
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")
