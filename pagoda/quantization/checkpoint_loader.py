"""Load a saved INT4 checkpoint folder (the format in pagoda/quantization/int4_format.py's docs and
config.json's quantization_config) into the INT4 linear op.

Every quantized linear is stored under its HF unfused prefix as `.qweight` / `.scales` / `.zeros`;
q/k/v and gate/up are concatenated along output rows at load (the format is per row, so fusing is
exact). The float lm_head is quantized (INT8 per channel, see methods.lm_head_method), as the in-memory
`quantization="int4"` path does, so both run the same weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagoda.kernels.quant_linear import PackedWeight
from pagoda.model.errors import warn_nonfinite
from pagoda.model.loader import ModelFiles
from pagoda.quantization.int4_format import Int4Weight, check_group_size
from pagoda.quantization.methods import int4_to_packed

_PARTS = ("qweight", "scales", "zeros")


def check_checkpoint_config(qc: Any, method: str | None, source: str) -> None:
    if not isinstance(qc, dict) or qc.get("quant_method") != "pagoda" or qc.get("method") != "int4":
        raise ValueError(f"{source!r}: unsupported quantization_config {qc!r} (pagoda loads its own int4 "
                         "checkpoints: quant_method 'pagoda', method 'int4')")
    if qc.get("bits", 4) != 4:
        raise ValueError(f"{source!r}: quantization_config bits={qc.get('bits')!r}, only 4 is supported")
    if method not in (None, "int4"):
        raise ValueError(f"quantization {method!r} cannot apply to {source!r}: it is a saved int4 checkpoint")


def checkpoint_weights(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """The checkpoint as a weight stream: each quantized linear's parts as one PackedWeight under its HF
    name, the other tensors as fp32."""
    from safetensors import safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {}
    for path in files.weight_files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                prefix, _, kind = name.rpartition(".")
                t = f.get_tensor(name)
                warn_nonfinite(t, name, path)  # scales, zeros and float weights; codes are integers
                if kind in _PARTS:
                    parts.setdefault(prefix, {})[kind] = t
                elif not name.endswith("rotary_emb.inv_freq"):
                    yield name, t.float()
    for prefix, t in parts.items():
        missing = [p for p in _PARTS if p not in t]
        if missing:
            raise ValueError(f"{files.source!r}: {prefix} lacks {', '.join(missing)}")
        q, s, z = t["qweight"], t["scales"], t["zeros"]
        n, k = q.shape[0], q.shape[1] * 2
        if q.dtype != torch.uint8 or s.shape != z.shape or s.dim() != 2 or s.shape[0] != n or k % s.shape[1]:
            raise ValueError(f"{files.source!r}: {prefix} has malformed int4 tensors "
                             f"(qweight {tuple(q.shape)} {q.dtype}, scales {tuple(s.shape)}, zeros {tuple(z.shape)})")
        check_group_size(k, k // s.shape[1])
        yield prefix + ".weight", int4_to_packed(Int4Weight(q.contiguous(), s.float(), z.float(), k // s.shape[1]))


def checkpoint_group_size(files: ModelFiles) -> int:
    return int(files.hf_config["quantization_config"].get("group_size", 128))
