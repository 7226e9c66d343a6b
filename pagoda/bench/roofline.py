"""The machine's limits (matmul rate, memory read bandwidth) and a model's cost per token.

Efficiency = achieved / limit. Batched generation is compared with the matmul rate (FLOP/s), batch-1
decode with the read bandwidth, since one decode step must read every weight once.

Model cost counts weights only: 2 FLOPs per non-embedding parameter per token through the model, plus
2 * hidden * vocab for the LM head where a token is sampled. Attention's score/value products grow
with context and are left out, so the FLOP figures are a slight lower bound (a few % at 512 tokens
for SmolLM2-135M).
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

from pagoda.model.args import ModelArgs


@dataclass
class Roofline:
    dtype: str
    matmul_flops: float      # FLOP/s, best of a few large GEMMs
    read_bandwidth: float    # bytes/s, best of a few sums over a large tensor

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)

    def describe(self) -> str:
        return (f"roofline ({self.dtype}, {torch.get_num_threads()} threads): matmul "
                f"{self.matmul_flops / 1e9:.0f} GFLOP/s, memory read {self.read_bandwidth / 1e9:.1f} GB/s")


# ---- measurement ---------------------------------------------------------------------------------
def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best-of-`reps` FLOP/s of an n x n x n GEMM (after one warm-up): the faster of torch's and, where the C++
    kernels run `dtype`, Pagoda's own panel GEMM (its AMX tiles on CPUs that have them, which torch's oneDNN is
    capped below in this process: process_env.py). The roofline is the best matmul this process can run."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    candidates = [lambda: torch.mm(a, b)]
    packed = _panel_weight(b)
    if packed is not None:
        candidates.append(lambda: torch.ops.pagoda.packed_linear(a, packed, None))
    best = float("inf")
    for run in candidates:
        run()  # warm-up: thread pool start, kernel selection, AMX tile state
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _panel_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in Pagoda's panel layout where this process loaded the C++ kernels and they take it, else None."""
    from pagoda.kernels.cpu_extension import loaded_build

    if loaded_build() is None:
        return None
    from pagoda.kernels.linear import panel_pack

    return panel_pack(weight)


def measure_read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Best-of-`reps` bytes/s of a sum over an fp32 tensor of `nbytes` (far larger than any cache)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # warm-up: pages are touched by ones(), this settles the reduction kernel
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best


def measure_roofline(dtype: torch.dtype) -> Roofline:
    """Measure both limits for `dtype` in this process (a few seconds)."""
    return Roofline(str(dtype).removeprefix("torch."), measure_matmul_flops(dtype), measure_read_bandwidth())


# ---- model cost ----------------------------------------------------------------------------------
def non_embedding_params(args: ModelArgs) -> int:
    """Parameters a token passes through between the embedding and the LM head (linears, biases, norms); in a
    mixture-of-experts layer, the router and the top-k experts it chooses (the active parameters)."""
    h, d = args.hidden_size, args.head_dim
    q, kv = args.num_heads * d, args.num_kv_heads * d
    attn = h * q + 2 * h * kv + q * h
    if args.attention_bias:
        attn += q + 2 * kv
    mlp = 3 * h * args.intermediate_size  # gate, up, down
    norms = 2 * h + (2 * d if args.qk_norm else 0)
    moe = args.moe
    sparse = sum(moe.sparse_layers) if moe is not None else 0
    sparse_mlp = moe.num_experts * h + moe.top_k * 3 * h * moe.intermediate_size if moe is not None else 0
    return args.num_layers * (attn + norms) + (args.num_layers - sparse) * mlp + sparse * sparse_mlp + h  # + final norm


def lm_head_params(args: ModelArgs) -> int:
    return args.hidden_size * args.vocab_size


def flops_per_token(args: ModelArgs, sampled: bool) -> int:
    """FLOPs for one token through the model; `sampled` adds the LM head (only sampled positions need it)."""
    return 2 * (non_embedding_params(args) + (lm_head_params(args) if sampled else 0))


def request_flops(args: ModelArgs, prompt_len: int, output_len: int) -> int:
    """FLOPs to serve one request: every prompt token, then each output token but the last fed back;
    the LM head runs once per output token (the last prompt position yields the first one)."""
    passes = prompt_len + output_len - 1
    return passes * flops_per_token(args, sampled=False) + output_len * 2 * lm_head_params(args)


def workload_flops(args: ModelArgs, lengths: Iterable[tuple[int, int]]) -> int:
    """Total FLOPs of (prompt_len, output_len) pairs."""
    return sum(request_flops(args, p, o) for p, o in lengths)


def decode_weight_bytes(args: ModelArgs, dtype: torch.dtype) -> int:
    """Weight bytes one batch-1 decode step reads: all non-embedding weights plus the LM head
    (the embedding lookup reads a single row, which is negligible)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (non_embedding_params(args) + lm_head_params(args)) * elem


def efficiency(achieved: float, limit: float) -> float:
    """achieved / limit, 0 where the limit is unknown."""
    return achieved / limit if limit > 0 else 0.0
