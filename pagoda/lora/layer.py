"""The batched LoRA op: each Linear with adapters adds scale * (x @ A^T) @ B^T to its rows, the A and B of
each row's adapter slot.

Every slot's A is one matrix [slots x width, in] and every slot's B one [slots x width, out], so a step's tokens,
whatever their adapters, take two matmuls a layer: h = x @ A_all^T holds each token's projection onto every
slot's rank columns, a mask keeps only its own slot's (none for a base-model token), and h @ B_all adds exactly its
own adapter's update. That is the torch path; with the C++ kernels, one op (kernels/cpu/lora.cpp) groups the
step's tokens by slot and computes only each token's own adapter, the same op the C++ decoder stack calls.

A Linear that fuses several HF projections (q|k|v, gate|up) keeps their updates in one slot as one pair:
A stacks the parts' A along the rank, and B places each part's B in its rows and its rank columns, so
x @ A^T @ B^T yields every part's update in its own rows. The scale is folded into B when a slot is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAMapping:
    """This step's tokens by adapter slot, set by the model runner before each forward."""
    token_slots: torch.Tensor | None = None  # [T] each token's slot, -1 for the base model; None: no adapter
    single: int | None = None                # the slot every token of the step uses, where there is one
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    def set(self, row_slots: list[int], query_start: list[int], device: torch.device) -> None:
        """`row_slots`: each row's slot (-1: the base model); `query_start`: the rows' token offsets."""
        self._masks = {}
        if all(s < 0 for s in row_slots):
            self.token_slots, self.single = None, None
            return
        lengths = torch.tensor([b - a for a, b in zip(query_start, query_start[1:])])
        self.token_slots = torch.repeat_interleave(torch.tensor(row_slots), lengths).to(device)
        self.single = row_slots[0] if all(s == row_slots[0] for s in row_slots) else None

    def mask(self, num_slots: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots x width]: 1 in the columns of each token's own slot, 0 elsewhere (made once a step)."""
        key = (num_slots, width, dtype)
        if key not in self._masks:
            assert self.token_slots is not None
            own = self.token_slots.unsqueeze(1) == torch.arange(num_slots, device=self.token_slots.device)
            self._masks[key] = own.to(dtype).repeat_interleave(width, dim=1)
        return self._masks[key]

    def clear(self) -> None:
        self.token_slots, self.single, self._masks = None, None, {}


class LoRASlots:
    """One Linear's adapters: A [slots, width, in] and B^T [slots, width, out], width = parts x max rank, and where
    each slot's parts sit: [slots, parts, 4] of (first rank column, rank, first output row, rows), 0 rank where a
    part has none. The C++ op reads only those blocks of B^T (a fused Linear's B^T is mostly zeros)."""

    def __init__(self, num_slots: int, num_parts: int, max_rank: int, in_features: int, out_features: int,
                 mapping: LoRAMapping, kernel: bool, dtype: torch.dtype) -> None:
        """`kernel`: the C++ op runs (KernelPolicy.cpp), on slots in the model's `dtype` (the op's reads of A and B
        are most of its cost); the torch path keeps fp32, where torch's small matmuls are fastest on CPU."""
        width = num_parts * max_rank
        dtype = dtype if kernel and dtype in (torch.float32, torch.bfloat16) else torch.float32
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype)
        self.bt = torch.zeros(num_slots, width, out_features, dtype=dtype)
        self.widths = torch.zeros(num_slots, dtype=torch.int32)  # rank columns each slot fills (the rest are zero)
        self.parts = torch.zeros(num_slots, num_parts, 4, dtype=torch.int32)
        self.mapping = mapping
        self.kernel = kernel

    def stack_args(self) -> list[torch.Tensor]:
        """This Linear's adapters as the C++ decoder stack takes them (kernels/decoder_stack.py)."""
        return [self.a, self.bt, self.widths, self.parts]

    def write(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        """Fill `slot` with (first output row, A [r, in], B [rows, r], scale) of each part it updates."""
        self.clear(slot)
        col = 0
        for i, (row, a, b, scale) in enumerate(parts):
            r = a.shape[0]
            self.a[slot, col:col + r] = a
            self.bt[slot, col:col + r, row:row + b.shape[0]] = (b * scale).T
            self.parts[slot, i] = torch.tensor([col, r, row, b.shape[0]], dtype=torch.int32)
            col += r
        self.widths[slot] = col

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.widths[slot] = 0
        self.parts[slot].zero_()

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += each token's adapter update of x (in place; y is the base layer's fresh output)."""
        m = self.mapping
        if not m.active:
            return y
        if self.kernel and x.dtype == self.a.dtype and x.dim() == 2 and y.is_contiguous():
            torch.ops.pagoda.lora_add_(y, x.contiguous(), m.token_slots, self.a, self.bt, self.widths, self.parts)
            return y
        xs = x.to(self.a.dtype)
        if m.single is not None:  # one adapter for the whole step: its own columns only
            w = int(self.widths[m.single])
            if w:
                y += ((xs @ self.a[m.single, :w].T) @ self.bt[m.single, :w]).to(y.dtype)
            return y
        slots, width = self.a.shape[0], self.a.shape[1]
        h = xs @ self.a.view(slots * width, -1).T
        h *= m.mask(slots, width, h.dtype)
        y += (h @ self.bt.view(slots * width, -1)).to(y.dtype)
        return y
