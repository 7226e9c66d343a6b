"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` identifies the adapter among the resident ones (positive, unique per adapter);
    `lora_path` is a PEFT folder (adapter_config.json + adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be positive")
