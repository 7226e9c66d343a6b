"""Model loading: GGUF weights/config vs transformers, safetensors folders, error paths."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from pagoda.model.args import ModelArgs
from pagoda.model.default_model import default_model_path
from pagoda.model.loader import ModelFiles, resolve_model_files


@pytest.fixture(scope="module")
def gguf_files() -> ModelFiles:
    return resolve_model_files(None)


@pytest.fixture(scope="module")
def hf_gguf_model():
    """The default GGUF loaded by transformers (slow: ~10-20 s, once per module)."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model


def test_default_model_path_exists() -> None:
    p = default_model_path()
    assert os.path.isfile(p) and p.endswith(".gguf")


def test_gguf_header_matches_gguf_reader(gguf_files: ModelFiles) -> None:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(gguf_files.source)
    ours = gguf_files._gguf
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert int(t.tensor_type) == info.qtype
        assert int(t.data_offset) == info.offset
        assert tuple(int(d) for d in t.shape) == info.dims
    assert ours.fields["llama.block_count"] == reader.fields["llama.block_count"].contents()
    assert ours.fields["tokenizer.chat_template"] == reader.fields["tokenizer.chat_template"].contents()


def test_gguf_weights_equal_transformers(gguf_files: ModelFiles, hf_gguf_model) -> None:
    ref = hf_gguf_model.state_dict()
    t0 = time.perf_counter()
    ours = dict(gguf_files.iter_weights(torch.float32))
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"GGUF weight load too slow: {elapsed:.1f}s"  # loose: CI boxes are shared
    assert "lm_head.weight" not in ours  # tied
    expected = {k for k in ref if k != "lm_head.weight"}
    assert set(ours) == expected
    for name, t in ours.items():
        r = ref[name]
        assert t.dtype == torch.float32 and t.shape == r.shape, name
        assert torch.allclose(t, r, rtol=0, atol=1e-6), name


def test_gguf_weights_dtype(gguf_files: ModelFiles) -> None:
    it = gguf_files.iter_weights(torch.bfloat16)
    name, t = next(it)
    it.close()
    assert t.dtype == torch.bfloat16


def test_gguf_config_matches_transformers(gguf_files: ModelFiles, hf_gguf_model) -> None:
    hc = hf_gguf_model.config
    ours = gguf_files.hf_config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(hc, key), key
    assert ours["rms_norm_eps"] == pytest.approx(hc.rms_norm_eps, rel=1e-6)
    theta = getattr(hc, "rope_theta", None) or (hc.rope_parameters or {}).get("rope_theta")
    assert ours["rope_theta"] == pytest.approx(theta)
    assert ours["head_dim"] == getattr(hc, "head_dim", hc.hidden_size // hc.num_attention_heads)
    args = ModelArgs.from_hf_config(ours)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim) == (30, 9, 3, 64)
    assert args.tie_word_embeddings and args.vocab_size == 49152


def _tiny(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("kind,shard", [("llama", False), ("qwen2", False), ("llama", True)])
def test_safetensors_roundtrip(tmp_path, kind: str, shard: bool) -> None:
    model = _tiny(kind)
    kw = {"max_shard_size": "20KB"} if shard else {}
    model.save_pretrained(tmp_path, **kw)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    mf = resolve_model_files(str(tmp_path))
    assert mf.kind == "hf" and (len(mf.weight_files) > 1) == shard
    args = ModelArgs.from_hf_config(mf.hf_config)
    assert args.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    ours = dict(mf.iter_weights(torch.float32))
    ref = model.state_dict()
    tied = mf.hf_config.get("tie_word_embeddings", False)
    expected = {k for k in ref if not (tied and k == "lm_head.weight") and not k.endswith("inv_freq")}
    assert set(ours) == expected
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ours
    for name, t in ours.items():
        assert torch.equal(t, ref[name]), name
    half = dict(mf.iter_weights(torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_missing_path(tmp_path) -> None:
    p = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_files(p)


def test_folder_without_config(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_files(str(tmp_path))


def test_folder_without_safetensors(tmp_path) -> None:
    _tiny("llama").config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model_files(str(tmp_path))


def test_invalid_json_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        resolve_model_files(str(tmp_path))


def test_config_missing_keys(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ValueError, match="missing"):
        resolve_model_files(str(tmp_path))


def test_bin_only_folder_refused(tmp_path) -> None:
    _tiny("llama").config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="unpickle"):
        resolve_model_files(str(tmp_path))


def test_unsupported_file(tmp_path) -> None:
    p = tmp_path / "weights.npz"
    p.write_bytes(b"x")
    with pytest.raises(ValueError, match="unsupported"):
        resolve_model_files(str(p))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model_files(str(bad))


def test_a_hub_id_loads_from_the_local_hub_cache_and_a_missing_one_says_how_to_get_it(tiny_llama, tmp_path):
    """transformers' offline layout (models--org--name/refs/main -> snapshots/<commit>/...), in a scratch cache."""
    import shutil
    import subprocess
    import sys

    snap = tmp_path / "hub" / "models--someorg--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_llama, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0123abcd")
    code = ("import sys\nfrom pagoda.model.loader import resolve_model_files\n"
            "print(resolve_model_files('someorg/tiny-llama').source)\n"
            "try:\n    resolve_model_files('someorg/not-here')\nexcept FileNotFoundError as e:\n    print(e)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found, missing = out.stdout.strip().splitlines()
    assert found == str(snap)
    assert "hf download someorg/not-here --local-dir DIR" in missing and "GiB free" in missing
