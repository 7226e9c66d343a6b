"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and the
token's output is the routing-weighted sum of those experts' SwiGLU MLPs.

Each expert holds two Linears (gate|up fused, and down), so a quantization method, a GGUF's blocks and the
kernel choice (Linear.prepare) reach experts as they reach any layer. With the C++ kernels the experts run
as one op (kernels/cpu/moe.cpp): tokens grouped by expert, each chosen expert's weights read once a step.
`moe_reference` is the same computation in torch, one expert at a time; it runs when the kernels are off,
and the op is tested against it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.fused_ops import silu_and_mul, silu_and_mul_torch
from pagoda.kernels.policy import KernelPolicy
from pagoda.layers.linear import Linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k]) from router logits [T, E], as transformers' Mixtral and
    Qwen3-MoE routers compute them: softmax over every expert in fp32, the top k, and (`renormalize`) the k
    weights divided by their sum, so they add up to one."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Expert(nn.Module):
    """One expert's SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused as in LlamaMLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)


@dataclass(frozen=True)
class ExpertsOp:
    """Every expert's two linears as torch.ops.pagoda.moe_experts takes them, gathered once at prepare()."""

    linears: list[torch.Tensor | None]  # per expert: gate_up's then down's [weight or codes, scales, offsets, bias]
    formats: list[int]                  # per linear: its format's code (kernels/linear_formats.py)
    group_sizes: list[int]
    max_rows: list[int]                 # per linear: rows up to which its few-row kernel runs (the op goes on above)

    @staticmethod
    def build(experts: list[Expert]) -> ExpertsOp | None:
        """None where some linear has no C++ kernel (the torch reference runs the block then)."""
        args = [lin.stack_args() for e in experts for lin in (e.gate_up_proj, e.down_proj)]
        if any(a is None for a in args):
            return None
        return ExpertsOp([t for a in args for t in a[0]], [a[1] for a in args],  # type: ignore[index]
                         [a[2] for a in args], [a[3] for a in args])  # type: ignore[index]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagoda.moe_experts(x.contiguous(), ids, weights, self.linears, self.formats,
                                            self.group_sizes, self.max_rows)


def moe_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Sequence[Expert],
                  act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t, one expert at a time in torch: each
    chosen expert runs once on the rows that chose it (index_select), its rows are scaled in fp32 into their
    (token, slot) rows, and a token's k rows are summed in slot order (the op's order: kernels/cpu/moe.cpp)."""
    t, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    contrib = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    flat_weights = weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        entries = order[start: start + n]
        start += n
        expert = experts[e]
        h = act(expert.gate_up_proj(x.index_select(0, entries // k)))
        y = expert.down_proj(h)
        contrib.index_copy_(0, entries, y.float() * flat_weights[entries, None])
    rows = contrib.view(t, k, -1)
    out = rows[:, 0].clone()
    for j in range(1, k):
        out += rows[:, j]
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Router + experts in place of a dense MLP. The router stays a float nn.Linear: routing decides which
    weights a token reads at all, and its matrix is tiny (E x hidden), so it is never quantized (as in
    llama.cpp, which keeps ffn_gate_inp in F32, and vLLM)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool,
                 round_weights: bool = False) -> None:
        """`round_weights`: round the routing weights to the activations' dtype before scaling (Qwen3-MoE's
        router casts them to the logits' dtype; Mixtral's keeps fp32)."""
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))
        self.top_k = top_k
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.act = silu_and_mul  # moe_reference's activation, where the C++ experts op does not run (bind_ops)
        self.op: ExpertsOp | None = None

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernel (`cpp`: its KernelPolicy's choice) or torch's twin."""
        self.act = silu_and_mul if cpp else silu_and_mul_torch

    def prepare_experts(self, policy: KernelPolicy) -> None:
        """After the experts' Linears chose their kernels: gather them for the C++ op under `policy`."""
        self.op = ExpertsOp.build(list(self.experts)) if policy.cpp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        if self.op is not None and x.dim() == 2 and x.device.type == "cpu" \
                and x.dtype in (torch.float32, torch.bfloat16):
            return self.op(x, ids, weights)
        return moe_reference(x, ids, weights, self.experts, self.act)  # type: ignore[arg-type]

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
