"""`pagoda quantize MODEL --gguf TYPE --out FILE.gguf`: write a model as a GGUF that llama.cpp and Pagoda's GGUF
loader both read.

The source is an HF folder (safetensors) of a dense Llama, Mistral, Qwen2 or Qwen3, or a GGUF (re-quantized: its
metadata as it is, its tensors dequantized). Tensors get llama.cpp's names (gguf_loader's table, read backwards),
and a Llama's Q and K rows llama.cpp's rotary permutation. gguf-py quantizes the types it can (GGUF_PY_TYPES);
the K-quant and IQ presets are made by llama.cpp's quantizer from an F16 file written first.
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Types gguf-py quantizes itself, by llama.cpp's names.
GGUF_PY_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
# Types whose token embedding and output matrix are kept in Q8_0: those two are the most sensitive to rounding.
_BELOW_8_BITS = ("Q5_1", "Q5_0", "Q4_1", "Q4_0")
_EDGE_TENSORS = ("token_embd.weight", "output.weight")
# HF architecture -> llama.cpp's: the dense families Pagoda's GGUF loader maps back.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}


@dataclass
class GGUFSource:
    """What a GGUF is written from: llama.cpp's architecture name, a writer of its metadata, and its tensors
    (llama.cpp names, float32, in llama.cpp's layout)."""

    arch: str
    add_metadata: Callable[[Any], None]
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]


@dataclass
class ExportSummary:
    path: str
    tensor_types: Counter[str] = field(default_factory=Counter)
    size_bytes: int = 0

    def line(self) -> str:
        types = ", ".join(f"{n} {t}" for t, n in self.tensor_types.most_common())
        return f"wrote {self.path}: {types} ({self.size_bytes / 2**20:.1f} MiB)"


def tensor_type(name: str, shape: tuple[int, ...], qtype: str) -> Any:
    """The GGMLQuantizationType a tensor is stored in when the file's type is `qtype`: norms, biases and other
    1-D tensors in F32; the embedding and output matrix in Q8_0 below 8 bits; rows the type's block does not
    divide in F16 (as llama.cpp falls back)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as T

    if len(shape) < 2:
        return T.F32
    chosen = T.Q8_0 if name in _EDGE_TENSORS and qtype in _BELOW_8_BITS else T[qtype]
    return chosen if shape[-1] % GGML_QUANT_SIZES[chosen][0] == 0 else T.F16


def hf_source(files: Any) -> GGUFSource:
    """The GGUF of an HF model (a pagoda.model.loader.ModelFiles of kind "hf")."""
    from pagoda.model.args import ModelArgs
    from pagoda.model.gguf_loader import hf_to_gguf_name, permute_qk
    from pagoda.quantization.gguf_vocab import add_vocab

    args = ModelArgs.from_hf_config(files.hf_config)
    arch = ARCHITECTURES.get(args.architecture)
    if arch is None or args.moe is not None:
        raise ValueError(f"GGUF export writes {', '.join(ARCHITECTURES)} (dense); {files.source} is "
                         f"{args.architecture}{' with experts' if args.moe else ''}")
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ValueError(f"GGUF export does not write rope_scaling {kind!r} (default and linear only)")

    def add_metadata(w: Any) -> None:
        import gguf

        w.add_name(Path(files.source).name)
        w.add_context_length(args.max_position_embeddings)
        w.add_embedding_length(args.hidden_size)
        w.add_block_count(args.num_layers)
        w.add_feed_forward_length(args.intermediate_size)
        w.add_head_count(args.num_heads)
        w.add_head_count_kv(args.num_kv_heads)
        w.add_rope_dimension_count(args.head_dim)
        if args.head_dim != args.hidden_size // args.num_heads:  # Qwen3's head_dim set apart
            w.add_key_length(args.head_dim)
            w.add_value_length(args.head_dim)
        w.add_rope_freq_base(args.rope_theta)
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_layer_norm_rms_eps(args.rms_norm_eps)
        w.add_vocab_size(args.vocab_size)
        add_vocab(w, files.folder, args.vocab_size)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        import torch

        for hf, t in files.iter_weights(torch.float32):
            name = hf_to_gguf_name(hf, arch)
            if name is None:
                raise ValueError(f"{files.source}: tensor {hf!r} has no llama.cpp name for arch {arch!r}")
            a = t.numpy()
            if arch == "llama" and ".attn_q." in name:
                a = permute_qk(a, args.num_heads)
            elif arch == "llama" and ".attn_k." in name:
                a = permute_qk(a, args.num_kv_heads)
            yield name, a

    return GGUFSource(arch, add_metadata, tensors)


def gguf_source(path: str) -> GGUFSource:
    """A GGUF's metadata as it is (less the file type, which the new file states) and its tensors dequantized."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    skipped = ("general.architecture", "general.file_type", "general.alignment")

    def add_metadata(w: Any) -> None:
        for key, f in reader.fields.items():
            if key.startswith("GGUF.") or key in skipped:
                continue
            vtype = f.types[0]
            w.add_key_value(key, f.contents(), vtype, f.types[-1] if vtype == GGUFValueType.ARRAY else None)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for t in reader.tensors:
            yield t.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    return GGUFSource(reader.fields["general.architecture"].contents(), add_metadata, tensors)


def write_gguf(source: GGUFSource, out: str, qtype: str) -> None:
    """Write `source` to `out` with gguf-py, each tensor in tensor_type(name, shape, qtype)."""
    import gguf
    from gguf.quants import quantize

    # Tensors spill to a temporary file as they come (the header, written first, needs them all): memory stays
    # at a few tensors, not the whole model.
    w = gguf.GGUFWriter(out, source.arch, use_temp_file=True)
    source.add_metadata(w)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    for name, a in source.tensors():
        t = tensor_type(name, a.shape, qtype)
        w.add_tensor(name, quantize(np.ascontiguousarray(a, dtype=np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_types(path: str, matrices_only: bool = False) -> Counter[str]:
    """How many tensors of each type the GGUF at `path` holds (only its 2-D ones with `matrices_only`)."""
    from gguf.constants import GGMLQuantizationType

    from pagoda.model.gguf_loader import GGUFFile

    return Counter(GGMLQuantizationType(i.qtype).name for i in GGUFFile(path).tensors.values()
                   if not matrices_only or len(i.dims) == 2)


def export_gguf(model: str | None, out: str, qtype: str, llama_python: str | None = None) -> ExportSummary:
    """The whole command: `model` (HF folder, .gguf, or None for the embedded default) written to `out` in
    `qtype`, a gguf-py type or a llama.cpp preset; the file is published only once it is whole."""
    from pagoda.model.loader import resolve_model_files
    from pagoda.quantization.llama_quantizer import PRESETS, llama_quantize, quantizer_python

    if qtype not in GGUF_PY_TYPES and qtype not in PRESETS:
        raise ValueError(f"unknown GGUF type {qtype!r}: gguf-py writes {', '.join(GGUF_PY_TYPES)}; llama.cpp's "
                         f"quantizer makes {', '.join(p for p in PRESETS if p not in GGUF_PY_TYPES)}")
    by_llama = qtype not in GGUF_PY_TYPES
    python = quantizer_python(llama_python) if by_llama else None  # before any writing: say at once what is missing
    files = resolve_model_files(model)
    source = gguf_source(files.source) if files.kind == "gguf" else hf_source(files)
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pagoda-gguf-", dir=folder) as tmp:
        part = os.path.join(tmp, "out.gguf")
        if by_llama:
            f16 = os.path.join(tmp, "f16.gguf")
            write_gguf(source, f16, "F16")
            llama_quantize(f16, part, qtype, python)
        else:
            write_gguf(source, part, qtype)
        os.replace(part, out)
    return ExportSummary(out, tensor_types(out), os.path.getsize(out))
