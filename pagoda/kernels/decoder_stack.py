"""A model's decoder layers as one C++ op call for steps of a few rows (kernels/cpu/decoder_stack.cpp).

A decode step runs ~8 small ops per layer, and each op call from Python costs a few microseconds of
interpreter and dispatcher time that the work itself does not: milliseconds of a 30-layer step. The stack
runs the same kernels in one call, so its output is bit-identical to the layer-by-layer path, which
stays the path for larger steps (prefill), where the kernels differ and call overhead is amortized.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagoda.kernels.paged_attention import fused_attention_supported

if TYPE_CHECKING:
    from pagoda.kernels.paged_attention import AttentionMetadata

# One linear as the op takes it: [weight or codes, scales, offsets, bias], its format's code (linear_formats.py,
# the table cpu/linear_formats.h shares), group size, and the most rows the stack runs with it.
LinearArgs = tuple[list[torch.Tensor | None], int, int, int]


@dataclass
class DecoderStack:
    """Per-layer tensors in the op's flat order, gathered once when the weights are final."""

    norms: list[torch.Tensor]            # input and post-attention RMSNorm weight of each layer
    qk_norms: list[torch.Tensor]         # each layer's q and k head norm weights (Qwen3), or none
    linears: list[torch.Tensor | None]   # qkv, o, gate_up, down of each layer, 4 entries each
    formats: list[int]
    group_sizes: list[int]
    max_rows: int                        # steps up to this many rows run here
    eps: float
    attention: list                      # each layer's PagedAttention (caches are bound to it later)
    rope: torch.nn.Module                # RotaryEmbedding: its cos/sin tables
    windows: list[int]                   # each layer's sliding window (0: global), or none when no layer has one
    # Each linear's LoRA slots as [A, B^T, widths, parts] (None x 4 where it has none), in the linears' order;
    # empty without LoRA (bind_lora).
    lora: list[torch.Tensor | None] = field(default_factory=list)
    # The caches as lists, gathered on the first call after the runner binds them.
    _bound_cache: torch.Tensor | None = None
    _bound_dtype: torch.dtype | None = None
    _caches: tuple[list, list, list, list] = field(default_factory=lambda: ([], [], [], []))
    _attention_ok: bool = False
    _segments: dict[int, tuple] = field(default_factory=dict)  # the op's lists for the first n layers

    @staticmethod
    def build(norms: list[torch.Tensor], linears: list[LinearArgs | None], eps: float, attention: list,
              rope: torch.nn.Module, qk_norms: list[torch.Tensor] | None = None) -> DecoderStack | None:
        """None where some linear has no streaming kernel (the op would have nothing to call)."""
        if not attention or any(lin is None for lin in linears):
            return None
        windows = [a.window for a in attention]
        return DecoderStack(norms, qk_norms or [], [t for lin in linears for t in lin[0]], [lin[1] for lin in linears],
                            [lin[2] for lin in linears], min(lin[3] for lin in linears), eps, attention, rope,
                            windows if any(windows) else [])

    def bind_lora(self, per_linear: list[list[torch.Tensor] | None]) -> None:
        """Each linear's LoRA tensors (LoRASlots.stack_args), in the order of `linears`; None for one without."""
        self.lora = [t for args in per_linear for t in (args or (None,) * _LORA_ENTRIES)]
        self._segments.clear()

    def takes(self, x: torch.Tensor) -> bool:
        if x.shape[0] > self.max_rows or x.dim() != 2 or x.device.type != "cpu":
            return False
        a0 = self.attention[0]
        if a0.k_cache is not self._bound_cache or x.dtype != self._bound_dtype:  # first call, or caches re-bound
            self._caches = ([a.k_cache for a in self.attention], [a.v_cache for a in self.attention],
                            [a.k_scale for a in self.attention], [a.v_scale for a in self.attention])
            probe = torch.empty(0, (a0.num_heads + 2 * a0.num_kv_heads) * a0.head_dim, dtype=x.dtype)  # qkv rows
            self._attention_ok = fused_attention_supported(probe, a0.k_cache, a0.k_scale is not None) \
                and not any(a.softcap for a in self.attention)  # the op runs plain or windowed attention
            self._bound_cache, self._bound_dtype = a0.k_cache, x.dtype
            self._segments.clear()
        return self._attention_ok

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, num_layers: int,
                 lora_slots: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                 aux_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, running residual) of the first `num_layers` layers: the model applies its final
        norm to them. `lora_slots`: each token's adapter slot (-1: none), where the step has adapter rows
        (bind_lora). `aux_out` [T, len(capture) * hidden]: filled with the residual stream entering each layer of
        `capture`, side by side (EAGLE-3's states)."""
        seg = self._segments.get(num_layers)
        if seg is None:
            k, v, ks, vs = self._caches
            per, n = _LINEARS_PER_LAYER, num_layers
            seg = self._segments[n] = (
                k[:n], v[:n], ks[:n], vs[:n], self.norms[:2 * n], self.qk_norms[:2 * n],
                self.linears[:n * per * _ENTRIES], self.formats[:n * per], self.group_sizes[:n * per],
                self.windows[:n], self.lora[:n * per * _LORA_ENTRIES])
        k, v, ks, vs, norms, qk_norms, linears, formats, group_sizes, windows, lora = seg
        a0, rope = self.attention[0], self.rope
        return torch.ops.pagoda.decoder_stack(
            x, positions, rope.cos, rope.sin, meta.slot_mapping, meta.block_tables, meta.query_start_loc,
            meta.seq_lens, k, v, ks, vs, norms, qk_norms, linears, formats, group_sizes, windows, self.eps,
            a0.scale, a0.num_heads, a0.num_kv_heads, num_layers, lora_slots if lora else None, lora, meta.tree_mask,
            capture, aux_out)


# The op's flat per-layer order (decoder_stack.cpp): qkv, o, gate_up, down, each [weight, scales, offsets, bias].
_LINEARS_PER_LAYER = 4
_ENTRIES = 4
_LORA_ENTRIES = 4
