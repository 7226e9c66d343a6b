"""Random-weight models at real families' shape ratios, for `pagoda bench throughput --model DIR --compare hf`:
`python -m benchmarks.family_models OUT_DIR mistral llama phi3 gemma2`.

Each is a fraction of its family's width and depth (named below) with SmolLM2's 49,152-token vocabulary, and
gets the embedded model's tokenizer files (through its HF copy, pagoda/bench/hf_copy.py), so the bench's
prompts tokenize as they do for the embedded model.
"""
from __future__ import annotations

import argparse
import glob
import shutil
from pathlib import Path

import torch

from pagoda.bench.hf_copy import ensure_hf_copy
from pagoda.model.default_model import default_model_path

COMMON = dict(vocab_size=49152, max_position_embeddings=4096, initializer_range=0.02, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)


def build(name: str) -> torch.nn.Module:
    import transformers as tf

    if name in ("mistral", "llama"):  # Mistral-7B v0.1 / Llama: hidden 4096, 32 heads, 8 KV, MLP 14336 (window 4096)
        shape = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, **COMMON)
        if name == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=128, **shape))
        return tf.LlamaForCausalLM(tf.LlamaConfig(**shape))
    if name == "phi3":  # Phi-3-mini-128k: hidden 3072, 32 heads of 96, MLP 8192, LongRoPE
        half = 96 // 2
        rope = {"type": "longrope", "short_factor": [1.0 + 0.02 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)]}
        return tf.Phi3ForCausalLM(tf.Phi3Config(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                                                num_attention_heads=8, num_key_value_heads=8, rope_scaling=rope,
                                                original_max_position_embeddings=1024, pad_token_id=None, **COMMON))
    if name == "gemma2":  # Gemma 2 2B: hidden 2304, 8 heads of 256, 4 KV, MLP 9216, window 4096, soft-caps 50/30
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(hidden_size=576, intermediate_size=2304, num_hidden_layers=6,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                                    query_pre_attn_scalar=128, sliding_window=128, pad_token_id=0,
                                                    **COMMON))
    raise ValueError(f"unknown family {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("families", nargs="+", choices=["mistral", "llama", "phi3", "gemma2"])
    args = ap.parse_args()
    tokenizer = ensure_hf_copy(default_model_path())
    for name in args.families:
        torch.manual_seed(0)
        model, dest = build(name), args.out / name
        model.save_pretrained(dest, safe_serialization=True)
        for f in glob.glob(f"{tokenizer}/tok*") + glob.glob(f"{tokenizer}/special*"):
            shutil.copy(f, dest)
        print(f"{dest}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
