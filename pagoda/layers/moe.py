"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, GLM-4.5): a router picks each token's top-k experts, and
the token's output is the routing-weighted sum of those experts' SwiGLU MLPs (GLM-4.5: plus its shared experts').

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


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's router as GLM-4.5 has it: `n_group` groups of experts, the best `topk_group` searched, the
    chosen weights multiplied by `scale` (routed_scaling_factor)."""

    n_group: int
    topk_group: int
    scale: float


def route_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                  g: GroupedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids [T, k]) as transformers' Glm4MoeTopkRouter computes them: sigmoid scores
    in fp32; the choice ranks scores + `bias` (e_score_correction_bias) within the `topk_group` groups whose two
    best biased scores sum highest; the weights are the chosen experts' unbiased scores, renormalized to sum to
    one (`renormalize`: norm_topk_prob) and scaled."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    t, e = choice.shape
    groups = choice.view(t, g.n_group, e // g.n_group)
    best = groups.topk(2, dim=-1).values.sum(dim=-1) if e // g.n_group > 1 else groups[..., 0]
    keep = torch.zeros_like(best).scatter_(1, best.topk(g.topk_group, dim=-1).indices, 1.0)
    choice = choice.masked_fill(keep.repeat_interleave(e // g.n_group, dim=1) == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * g.scale, ids


class Expert(nn.Module):
    """One expert's SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused as in LlamaMLP. Routed experts run
    in the experts op or moe_reference; GLM-4.5's shared experts (one MLP n_shared_experts times an expert's
    width) run as a module, every token, unweighted."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = silu_and_mul

    def bind_ops(self, cpp: bool) -> None:
        self.act = silu_and_mul if cpp else silu_and_mul_torch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    __call__ = forward


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
                 round_weights: bool = False, grouped: GroupedRouting | None = None,
                 shared_intermediate: int = 0) -> None:
        """`round_weights`: round the routing weights to the activations' dtype before scaling (Qwen3-MoE's
        router casts them to the logits' dtype; Mixtral's keeps fp32). `grouped`: GLM-4.5's sigmoid routing
        (route_grouped), its per-expert bias loaded as gate.e_score_correction_bias. `shared_intermediate`: the
        width of the shared experts' MLP (0: none)."""
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        if grouped is not None:  # loaded as a weight (a parameter), never trained
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_experts = Expert(hidden_size, shared_intermediate) if shared_intermediate else None
        self.top_k = top_k
        self.renormalize = renormalize
        self.round_weights = round_weights
        self.grouped = grouped
        self.act = silu_and_mul  # moe_reference's activation, where the C++ experts op does not run (bind_ops)
        self.op: ExpertsOp | None = None
        self.router_fp32: tuple[torch.Tensor, torch.Tensor] | None = None  # grouped routing's weight and bias

    def bind_ops(self, cpp: bool) -> None:
        """At the model's prepare(): the C++ kernel (`cpp`: its KernelPolicy's choice) or torch's twin."""
        self.act = silu_and_mul if cpp else silu_and_mul_torch

    def prepare_experts(self, policy: KernelPolicy) -> None:
        """After the experts' Linears chose their kernels: gather them for the C++ op under `policy`."""
        self.op = ExpertsOp.build(list(self.experts)) if policy.cpp else None
        if self.grouped is not None:  # transformers routes in fp32: cast the router once, not every step
            self.router_fp32 = (self.gate.weight.detach().float(), self.gate.e_score_correction_bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped is not None:
            weight, bias = self.router_fp32 or (self.gate.weight.float(), self.gate.e_score_correction_bias.float())
            weights, ids = route_grouped(F.linear(x.float(), weight), bias, self.top_k, self.renormalize,
                                         self.grouped)
        else:
            weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        if self.op is not None and x.dim() == 2 and x.device.type == "cpu" \
                and x.dtype in (torch.float32, torch.bfloat16):
            out = self.op(x, ids, weights)
        else:
            out = moe_reference(x, ids, weights, self.experts, self.act)  # type: ignore[arg-type]
        return out if self.shared_experts is None else out + self.shared_experts(x)

    __call__ = forward  # no hooks: skip nn.Module.__call__ (~300 calls a decode step)
