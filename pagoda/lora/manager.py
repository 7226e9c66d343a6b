"""LoRAManager: a fixed number of adapter slots in the model's Linears, filled on demand, least recently used
idle slot replaced first. A request pins its slot from admission to finish, so a running request's adapter
is never swapped out under it; a request whose adapter finds every slot pinned waits (the engine holds it).
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import LoRAConfig
from pagoda.layers.linear import Linear
from pagoda.lora.adapter import TARGETS, LoRAAdapter, read_adapter
from pagoda.lora.layer import LoRAMapping, LoRASlots
from pagoda.lora.request import LoRARequest
from pagoda.model.weights import fused_target


@dataclass
class _Resident:
    request: LoRARequest
    key: str   # the adapter's digest (prefix cache key)
    pins: int = 0


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, kernel: bool, dtype: torch.dtype) -> None:
        """`kernel`: the C++ LoRA op may run (KernelPolicy.cpp); `dtype`: the model's compute dtype."""
        if not hasattr(model, "packed_modules"):
            raise ValueError(f"{type(model).__name__} does not take LoRA adapters")
        self.model = model
        self.max_rank = config.max_lora_rank
        self.num_slots = config.max_loras
        self.mapping = LoRAMapping()
        self.slots: dict[str, LoRASlots] = {}  # module path -> its Linear's slots
        for path, m in model.named_modules():
            leaf = path.rpartition(".")[2]
            if isinstance(m, Linear) and leaf in TARGETS and re.fullmatch(r"layers\.\d+\.(self_attn|mlp)\.\w+", path):
                parts = len(model.packed_modules.get(leaf, (leaf,)))
                m.lora = self.slots[path] = LoRASlots(self.num_slots, parts, self.max_rank, m.in_features,
                                                      m.out_features, self.mapping, kernel, dtype)
        model.bind_lora(self.mapping)
        self._resident: dict[int, tuple[int, _Resident]] = {}  # lora_int_id -> (slot, its state)
        self._lru: OrderedDict[int, int | None] = OrderedDict((s, None) for s in range(self.num_slots))

    # ---- adapters into slots -------------------------------------------------------------------
    def check(self, request: LoRARequest) -> LoRAAdapter:
        """Read an adapter and check it against the model; ValueError naming it otherwise. Touches no slot."""
        adapter = read_adapter(request.lora_name, request.lora_path, self.max_rank)
        self._placement(adapter)
        return adapter

    def _placement(self, adapter: LoRAAdapter) -> dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]]:
        """Module path -> the parts its slot gets (first row, A, B, scale)."""
        placed: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        for module, lora in adapter.modules.items():
            path, index, count = fused_target(self.model, module)
            slots = self.slots.get(path)
            if slots is None:
                raise ValueError(f"LoRA adapter {adapter.name!r}: the model has no module {module!r}")
            out_rows = slots.bt.shape[2]
            rows = self.model.part_rows(path.rpartition(".")[2], out_rows) if count > 1 else [out_rows]
            if lora.a.shape[1] != slots.a.shape[2] or lora.b.shape[0] != rows[index]:
                raise ValueError(f"LoRA adapter {adapter.name!r}: {module!r} maps {lora.a.shape[1]} -> "
                                 f"{lora.b.shape[0]} features; the model's is {slots.a.shape[2]} -> {rows[index]}")
            placed.setdefault(path, []).append((sum(rows[:index]), lora.a, lora.b, lora.scale))
        return placed

    def acquire(self, request: LoRARequest) -> int | None:
        """Pin `request`'s adapter in a slot (loading it there if it is not resident) and return the slot;
        None when every slot is pinned. ValueError for an adapter that cannot be served."""
        entry = self._resident.get(request.lora_int_id)
        if entry is not None and entry[1].request.lora_path != request.lora_path:
            if entry[1].pins:
                raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} "
                                 f"already names {entry[1].request.lora_name!r} at another path")
            self._evict(request.lora_int_id)
            entry = None
        if entry is None:
            slot = next((s for s in self._lru if not self._pinned(s)), None)
            if slot is None:
                return None
            adapter = self.check(request)
            placed = self._placement(adapter)
            self._evict_slot(slot)
            for path, slots in self.slots.items():
                if path in placed:
                    slots.write(slot, placed[path])
                else:
                    slots.clear(slot)
            entry = (slot, _Resident(request, adapter.key))
            self._resident[request.lora_int_id] = entry
        slot, state = entry
        state.pins += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        """A request using `slot` finished."""
        for s, state in self._resident.values():
            if s == slot and state.pins:
                state.pins -= 1
                return

    def key(self, slot: int) -> str:
        """The digest of the adapter in `slot` (prefix cache entries of different adapters never meet)."""
        return next(state.key for s, state in self._resident.values() if s == slot)

    def resident(self) -> list[str]:
        return [state.request.lora_name for _, state in self._resident.values()]

    def _pinned(self, slot: int) -> bool:
        return any(s == slot and state.pins for s, state in self._resident.values())

    def _evict_slot(self, slot: int) -> None:
        for lora_id, (s, _) in list(self._resident.items()):
            if s == slot:
                self._evict(lora_id)

    def _evict(self, lora_id: int) -> None:
        slot, _ = self._resident.pop(lora_id)
        for slots in self.slots.values():
            slots.clear(slot)
