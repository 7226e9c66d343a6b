"""`pagoda quantize MODEL --gguf TYPE`: the GGUF it writes from a tiny random Llama loads in Pagoda to the HF
weights (Q and K rows included, which llama.cpp permutes), runs HF's greedy tokens, carries the tokenizer, and holds
gguf-py's own rounding for the quantized types; llama.cpp's presets come from its quantizer (slow, where the peer
is installed)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from tiny_models import build_tiny_model, greedy_tokens, hf_greedy, save_bpe_tokenizer

from pagoda.model.gguf_loader import gguf_hf_config
from pagoda.model.loader import resolve_model_files
from pagoda.quantization.gguf_export import export_gguf, tensor_types
from pagoda.quantization.llama_quantizer import QuantizerUnavailable, quantizer_python

PROMPTS = ["This License applies to any program", "the GNU General Public License"]


def rewrite_weights(folder: Path, fn) -> None:  # noqa: ANN001
    """Replace every tensor of `folder`'s model.safetensors by fn(name, tensor)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    save_file({k: fn(k, v).contiguous() for k, v in weights.items()}, path, metadata={"format": "pt"})


def tiny_llama_with_tokenizer(folder: Path, arch: str = "llama", **overrides) -> Path:
    """A tiny random Llama (or `arch`) with a trained byte-level BPE tokenizer, its weights rounded to fp16 (so an
    F16 GGUF holds them exactly and HF runs the same numbers)."""
    build_tiny_model(folder, arch, **overrides)
    save_bpe_tokenizer(folder)
    rewrite_weights(folder, lambda _, t: t.half().float())
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("gguf_export") / "llama")


@pytest.fixture(scope="module")
def f16(model: Path) -> str:
    out = str(model.parent / "f16.gguf")
    export_gguf(str(model), out, "F16")
    return out


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def loaded(path: str) -> dict[str, torch.Tensor]:
    return dict(resolve_model_files(path).iter_weights(torch.float32))


def prompt_ids(folder: Path) -> list[list[int]]:
    from pagoda.model.tokenizer import load_tokenizer

    tok = load_tokenizer(str(folder))
    return [tok.encode(p) for p in PROMPTS]


def test_f16_gguf_loads_every_hf_weight_exactly_q_and_k_rows_included(model: Path, f16: str) -> None:
    ours, ref = loaded(f16), hf_weights(model)
    assert ours.keys() == ref.keys()
    for name, w in ref.items():
        assert torch.equal(ours[name], w), name
    assert tensor_types(f16) == {"F16": 16, "F32": 5}


def test_gguf_metadata_gives_the_hf_config(model: Path, f16: str) -> None:
    cfg = json.loads((model / "config.json").read_text())
    ours = gguf_hf_config(resolve_model_files(f16)._gguf)
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == cfg[key], key
    assert ours["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])
    assert ours["rope_theta"] == cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))


def test_f16_gguf_generates_the_hf_greedy_tokens(model: Path, f16: str) -> None:
    from pagoda import LLM

    ids = prompt_ids(model)
    llm = LLM(f16, dtype="float32", kv_cache_memory="32MiB")
    assert greedy_tokens(llm, ids, 12) == hf_greedy(str(model), ids, 12)


@pytest.mark.parametrize("arch,overrides", [("qwen2", {"tie_word_embeddings": True}), ("qwen3", {})],
                         ids=["qwen2-tied-biases", "qwen3-qk-norm-head-dim"])
def test_qwen_ggufs_load_the_hf_weights_and_generate_its_greedy_tokens(tmp_path: Path, arch: str,
                                                                        overrides: dict) -> None:
    """Qwen2 (q/k/v biases, a tied head: no output.weight) and Qwen3 (q/k norms, head_dim apart from hidden / heads:
    attention.key_length), whose rows llama.cpp keeps in HF's order."""
    from pagoda import LLM

    folder = tiny_llama_with_tokenizer(tmp_path / arch, arch, **overrides)
    out = str(tmp_path / f"{arch}.gguf")
    export_gguf(str(folder), out, "F16")
    ours = loaded(out)
    for name, w in hf_weights(folder).items():
        if name != "lm_head.weight" or not overrides.get("tie_word_embeddings"):
            assert torch.equal(ours[name], w), name
    ids = prompt_ids(folder)
    assert greedy_tokens(LLM(out, dtype="float32", kv_cache_memory="32MiB"), ids, 8) == hf_greedy(str(folder), ids, 8)


def test_gguf_tokenizer_encodes_as_the_hf_folder_and_keeps_specials_and_template(model: Path, f16: str) -> None:
    from pagoda.model.tokenizer import load_tokenizer

    hf, ours = load_tokenizer(str(model)), load_tokenizer(f16)
    for text in [*PROMPTS, "héllo wörld 123 <|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines  "]:
        assert ours.encode(text) == hf.encode(text), text
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat)


@pytest.mark.parametrize("qtype", ["BF16", "Q8_0", "Q4_0"])
def test_quantized_gguf_holds_gguf_py_rounding_of_the_hf_weights(model: Path, tmp_path: Path, qtype: str) -> None:
    """Each matrix loads as gguf-py's quantize-then-dequantize of the HF matrix (rounding runs along rows, so the
    Q/K row permutation commutes with it); embedding and output stay Q8_0 below 8 bits."""
    out = str(tmp_path / f"{qtype}.gguf")
    export_gguf(str(model), out, qtype)
    ours = loaded(out)
    for name, w in hf_weights(model).items():
        kind = T.Q8_0 if qtype == "Q4_0" and name in ("model.embed_tokens.weight", "lm_head.weight") else T[qtype]
        want = w if w.ndim == 1 else torch.from_numpy(dequantize(quantize(w.numpy(), kind), kind))
        assert torch.equal(ours[name], want), name
    edges = 2 if qtype == "Q4_0" else 0
    assert tensor_types(out) == {"F32": 5, qtype: 16 - edges, **({"Q8_0": edges} if edges else {})}


def test_q8_0_gguf_generates_the_greedy_tokens_of_its_dequantized_weights(model: Path, tmp_path: Path) -> None:
    from pagoda import LLM

    out = str(tmp_path / "q8.gguf")
    export_gguf(str(model), out, "Q8_0")
    ref = tmp_path / "dequantized"
    ref.mkdir()
    for f in model.iterdir():
        (ref / f.name).write_bytes(f.read_bytes())
    rewrite_weights(ref, lambda _, t: t if t.ndim == 1 else torch.from_numpy(
        dequantize(quantize(t.numpy(), T.Q8_0), T.Q8_0)))
    ids = prompt_ids(model)
    llm = LLM(out, dtype="float32", kv_cache_memory="32MiB")
    assert greedy_tokens(llm, ids, 12) == hf_greedy(str(ref), ids, 12)


def test_a_gguf_requantizes_with_its_metadata_kept(f16: str, tmp_path: Path) -> None:
    from gguf import GGUFReader

    out = str(tmp_path / "q8.gguf")
    export_gguf(f16, out, "Q8_0")
    src, dst = GGUFReader(f16), GGUFReader(out)
    kept = {k for k in src.fields if not k.startswith("GGUF.")}
    for key in kept - {"general.file_type"}:
        assert dst.fields[key].contents() == src.fields[key].contents(), key
    assert dst.fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    f16_weights = loaded(f16)
    for name, w in loaded(out).items():
        want = f16_weights[name] if w.ndim == 1 else torch.from_numpy(
            dequantize(quantize(f16_weights[name].numpy(), T.Q8_0), T.Q8_0))
        assert torch.equal(w, want), name


def test_a_preset_without_llama_cpp_fails_in_one_line_naming_the_install(model: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    from pagoda.entrypoints.cli import main

    out = tmp_path / "x.gguf"
    assert main(["quantize", str(model), "--gguf", "Q4_K_M", "--out", str(out), "--llama-python",
                 str(tmp_path / "no-python")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "install-peers.sh llama" in err and not out.exists()
    with pytest.raises(ValueError, match="gguf-py writes"):
        export_gguf(str(model), str(out), "Q7_Z")


def llama_cpp_python() -> str | None:
    try:
        return quantizer_python()
    except QuantizerUnavailable:
        return None


@pytest.mark.slow
@pytest.mark.skipif(llama_cpp_python() is None,
                    reason="llama_cpp is not importable (bash scripts/install-peers.sh llama)")
def test_q4_k_m_by_llama_cpp_loads_in_pagoda_and_llama_cpp_runs_the_f16_file_as_hf(tmp_path: Path) -> None:
    """Rows of 256 so that the K-quants apply; llama.cpp's greedy tokens on the F16 file are HF's, which checks the
    metadata, the tokenizer and the Q/K permutation from llama.cpp's side."""
    import subprocess

    from pagoda import LLM

    folder = tiny_llama_with_tokenizer(tmp_path / "llama256", hidden_size=256, intermediate_size=512)
    q4km, f16 = str(tmp_path / "q4km.gguf"), str(tmp_path / "f16.gguf")
    export_gguf(str(folder), q4km, "Q4_K_M")
    assert tensor_types(q4km, matrices_only=True)["Q4_K"] > 0
    ids = prompt_ids(folder)
    got = greedy_tokens(LLM(q4km, dtype="float32", kv_cache_memory="32MiB"), ids, 8)
    assert [len(g) for g in got] == [8, 8]

    export_gguf(str(folder), f16, "F16")
    script = ("import json, sys, llama_cpp\n"
              "llm = llama_cpp.Llama(sys.argv[1], n_ctx=128, n_threads=2, verbose=False)\n"
              "out = []\n"
              "for ids in json.loads(sys.argv[2]):\n"
              "    llm.reset()\n"
              "    gen = llm.generate(ids, top_k=1, temp=0.0)\n"
              "    out.append([next(gen) for _ in range(8)])\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([llama_cpp_python(), "-c", script, f16, json.dumps(ids)], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": ""})
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == hf_greedy(str(folder), ids, 8)
