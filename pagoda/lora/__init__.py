"""Batched multi-LoRA: PEFT adapters of the served model, several (and none) in one batch."""
from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
