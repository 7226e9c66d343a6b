"""Write an INT4 checkpoint folder (the layout is summarised here).

- config.json: the model's HF config plus quantization_config {"quant_method": "pagoda", "method":
  "int4", "algorithm", "bits": 4, "group_size" (as requested), "desc_act"};
- model.safetensors: per quantized linear, under its unfused HF prefix, `.qweight` uint8 [N, K/2],
  `.scales` and `.zeros` fp32 [N, K/g] (g = effective_group_size(K, group_size)), `.bias` if any;
  every other tensor (embeddings, norms, lm_head unless tied) as a float tensor under its HF name;
- tokenizer.json + tokenizer_config.json (special tokens, chat template), so the folder stands alone.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from pagoda.quantization.int4_format import Int4Weight

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "generation_config.json")


def quantization_config(algorithm: str, group_size: int, desc_act: bool) -> dict[str, Any]:
    return {"quant_method": "pagoda", "method": "int4", "algorithm": algorithm, "bits": 4,
            "group_size": group_size, "desc_act": bool(desc_act)}


def checkpoint_tensors(float_state: dict[str, torch.Tensor], qweights: dict[str, Int4Weight],
                       tie_word_embeddings: bool, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The safetensors dict: quantized linears as qweight/scales/zeros, the rest as `dtype` floats."""
    out: dict[str, torch.Tensor] = {}
    for name, t in float_state.items():
        if name.endswith("rotary_emb.inv_freq") or (tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name.endswith(".weight") and name[: -len(".weight")] in qweights:
            continue
        out[name] = t.detach().to(dtype).contiguous()
    for prefix, q in qweights.items():
        out[f"{prefix}.qweight"] = q.qweight.to(torch.uint8).contiguous()
        out[f"{prefix}.scales"] = q.scales.float().contiguous()
        out[f"{prefix}.zeros"] = q.zeros.float().contiguous()
    return out


def save_tensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, leaving the file's mode as open() would (0666 less the umask): safetensors
    (0.8) writes through a temporary file and keeps its mode 0600, unreadable to anyone else."""
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)  # the only portable way to read it; set straight back
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_tokenizer_files(model_path: str | None, out_dir: str) -> None:
    """Copy an HF folder's tokenizer files; for a GGUF, write the tokenizer pagoda converts from it."""
    from pagoda.model.loader import resolve_model_files
    from pagoda.model.tokenizer import load_tokenizer

    files = resolve_model_files(model_path)
    if files.kind == "hf" and os.path.isfile(os.path.join(files.folder, "tokenizer.json")):
        for name in _TOKENIZER_FILES:
            src = os.path.join(files.folder, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out_dir, name))
        return
    tok = load_tokenizer(files)
    tok.backend.save(os.path.join(out_dir, "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                           "model_max_length": int(files.hf_config.get("max_position_embeddings", 2048))}
    cfg.update({k: v for k, v in tok.special_tokens.items() if k.endswith("_token")})
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


def write_checkpoint(out_dir: str, model_path: str | None, hf_config: dict[str, Any],
                     float_state: dict[str, torch.Tensor], qweights: dict[str, Int4Weight], algorithm: str,
                     group_size: int, desc_act: bool, dtype: torch.dtype = torch.float32) -> None:
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(hf_config)
    cfg["quantization_config"] = quantization_config(algorithm, group_size, desc_act)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    tied = bool(cfg.get("tie_word_embeddings", False))
    tensors = checkpoint_tensors(float_state, qweights, tied, dtype)
    save_tensors(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    write_tokenizer_files(model_path, out_dir)


def load_dequantized_state(folder: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every INT4 linear dequantized back to `<prefix>.weight` (fp32):
    what a float model loads to reproduce the quantized model's numerics."""
    from safetensors.torch import load_file

    raw = load_file(os.path.join(folder, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".qweight"):
            prefix = name[: -len(".qweight")]
            scales, zeros = raw[f"{prefix}.scales"], raw[f"{prefix}.zeros"]
            k = t.shape[1] * 2
            out[f"{prefix}.weight"] = Int4Weight(t, scales, zeros, k // scales.shape[1]).dequantize()
        elif not name.endswith((".scales", ".zeros")):
            out[name] = t.float()
    return out


def export_dequantized(folder: str, out_dir: str) -> None:
    """A plain float HF folder with the checkpoint's dequantized weights (for checks against float
    references, and for runtimes that cannot read the INT4 layout)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    save_tensors({k: v.contiguous() for k, v in load_dequantized_state(folder).items()},
                 os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy2(os.path.join(folder, name), os.path.join(out_dir, name))
