"""An HF folder's tokenizer as GGUF metadata, the way llama.cpp's converter writes a byte-level BPE vocabulary:
tokenizer.ggml.model "gpt2", the pre-tokenizer's name, tokens with their types, merges, special token ids, the
add-BOS flag and the chat template.

Both readers of the file rebuild the tokenizer from these keys alone: llama.cpp, and transformers (which Pagoda's
tokenizer loader uses for a .gguf). Only byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2) is written; a
sentencepiece vocabulary (tokenizer.model, Llama 2 and Mistral) is refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The split regexes of tokenizer.json's pre-tokenizers that llama.cpp knows, by its name for them (llama-vocab.cpp).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE_TOKENIZERS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def pre_tokenizer_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for the way tokenizer.json splits text before its merges:
    a known split regex, or GPT-2's own regex inside ByteLevel (with single digits split first: SmolLM's)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    for s in steps:
        if s.get("type") == "Split":
            regex = (s.get("pattern") or {}).get("Regex")
            if regex in SPLIT_PRE_TOKENIZERS:
                return SPLIT_PRE_TOKENIZERS[regex]
            raise ValueError(f"tokenizer.json splits text by a regex llama.cpp has no name for: {regex!r}")
    byte_level = next((s for s in steps if s.get("type") == "ByteLevel"), None)
    if byte_level is not None and byte_level.get("use_regex", True):
        digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
        if kinds == ["ByteLevel"] or (digits and len(kinds) == 2):
            return "smollm" if digits else "gpt-2"
    raise ValueError(f"tokenizer.json's pre-tokenizer ({' + '.join(map(str, kinds))}) has no llama.cpp name")


def add_vocab(writer: Any, folder: str | Path, vocab_size: int) -> None:
    """Write the tokenizer of HF folder `folder` into gguf.GGUFWriter `writer`, padded to the model's
    `vocab_size` rows (unused ids as [PAD<i>], as llama.cpp's converter does)."""
    import gguf

    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        kind = "a sentencepiece tokenizer.model" if (folder / "tokenizer.model").is_file() else "no tokenizer.json"
        raise ValueError(f"{folder} has {kind}; GGUF export writes byte-level BPE vocabularies (tokenizer.json)")
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path} is not a byte-level BPE tokenizer (a sentencepiece-style vocabulary); "
                         "GGUF export writes byte-level BPE vocabularies only")
    names = {i: tok for tok, i in model["vocab"].items()}
    added = {t["id"]: t for t in tj.get("added_tokens") or []}
    ids = set(names) | set(added)
    if max(ids) >= vocab_size:
        raise ValueError(f"{path} has token id {max(ids)}, past the model's vocab_size {vocab_size}")
    tokens, types = [], []
    T = gguf.TokenType
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(T.CONTROL if added[i].get("special") else T.USER_DEFINED)
        elif i in names:
            tokens.append(names[i])
            types.append(T.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(T.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tj))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # Merges, bos/eos/pad ids (tokenizer_config.json, then config.json), add_bos_token and the chat template.
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
