"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's `vllm.lora.request`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for one request: a unique name, a positive integer id, and the PEFT
    adapter directory it is read from (adapter_config.json, adapter_model.safetensors).

    The name identifies the adapter everywhere: the engine keeps adapters by name, and the
    prefix cache keys blocks by it (two adapters never share cached KV, nor an adapter and
    the base model).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must name the "
                             "adapter's directory")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of `lora_name`."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of `lora_path`."""
        return self.lora_path
