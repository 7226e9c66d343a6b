"""The batched LoRA op: each Linear with adapters adds scale * (x @ A^T) @ B^T to its rows, the A and B of
each row's adapter slot (punica's SGMV on GPU: rows grouped by slot, one pair of matmuls per group).

A Linear that fuses several HF projections (q|k|v, gate|up) keeps their updates in one slot as one pair:
A stacks the parts' A along the rank, and B places each part's B in its rows and its rank columns, so
x @ A^T @ B^T yields every part's update in its own rows. The scale is folded into B when a slot is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAMapping:
    """This step's tokens grouped by adapter slot, set by the model runner before each forward."""
    # (slot, indices of its tokens in the flat batch; None: every token of the step)
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, row_slots: list[int], query_start: list[int], device: torch.device) -> None:
        """`row_slots`: each row's slot (-1: the base model); `query_start`: the rows' token offsets."""
        used = sorted({s for s in row_slots if s >= 0})
        if not used:
            self.groups = []
            return
        if len(used) == 1 and all(s == used[0] for s in row_slots):
            self.groups = [(used[0], None)]
            return
        lengths = torch.tensor([b - a for a, b in zip(query_start, query_start[1:])])
        token_slots = torch.repeat_interleave(torch.tensor(row_slots), lengths)
        self.groups = [(s, (token_slots == s).nonzero().squeeze(1).to(device)) for s in used]

    def clear(self) -> None:
        self.groups = []


class LoRASlots:
    """One Linear's adapters: A [slots, width, in] and B [slots, out, width], width = parts x max rank."""

    def __init__(self, num_slots: int, width: int, in_features: int, out_features: int, dtype: torch.dtype,
                 mapping: LoRAMapping) -> None:
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype)
        self.width = [0] * num_slots  # rank columns each slot fills (the rest are not computed)
        self.mapping = mapping

    def write(self, slot: int, parts: list[tuple[int, torch.Tensor, torch.Tensor, float]]) -> None:
        """Fill `slot` with (first output row, A [r, in], B [rows, r], scale) of each part it updates."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        col = 0
        for row, a, b, scale in parts:
            r = a.shape[0]
            self.a[slot, col:col + r] = a
            self.b[slot, row:row + b.shape[0], col:col + r] = b * scale
            col += r
        self.width[slot] = col

    def clear(self, slot: int) -> None:
        self.width[slot] = 0

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y += each token's adapter update of x (in place; y is the base layer's fresh output)."""
        for slot, idx in self.mapping.groups:
            w = self.width[slot]
            if w == 0:  # the adapter leaves this layer as it is
                continue
            a, b = self.a[slot, :w], self.b[slot, :, :w]
            if idx is None:
                y += ((x.to(a.dtype) @ a.T) @ b.T).to(y.dtype)
            else:
                xs = x.index_select(0, idx).to(a.dtype)
                y.index_add_(0, idx, ((xs @ a.T) @ b.T).to(y.dtype))
        return y
