"""The weight stream loader (pagoda/model/weights.py): fusion once, float and packed parts, the fallback."""
from __future__ import annotations

import torch

from pagoda.model.args import ModelArgs
from pagoda.model.loader import resolve_model_files
from pagoda.model.registry import model_class
from pagoda.model.weights import LoadPlan, fused_target, is_linear_weight, load_weights
from pagoda.quantization.loading import quantize_stream
from pagoda.quantization.methods import quantize_weight


def fresh_model(path: str):
    files = resolve_model_files(path)
    args = ModelArgs.from_hf_config(files.hf_config)
    with torch.device("meta"):
        model = model_class(args)(args)
    return files, model.to_empty(device="cpu").float()


def test_fused_targets_and_linear_weights(tiny_llama):
    _, model = fresh_model(tiny_llama)
    assert fused_target(model, "model.layers.1.self_attn.k_proj") == ("layers.1.self_attn.qkv_proj", 1, 3)
    assert fused_target(model, "model.layers.0.mlp.up_proj") == ("layers.0.mlp.gate_up_proj", 1, 2)
    assert fused_target(model, "model.layers.0.mlp.down_proj") == ("layers.0.mlp.down_proj", 0, 1)
    assert is_linear_weight(model, "model.layers.0.self_attn.v_proj.weight")
    assert not is_linear_weight(model, "model.layers.0.input_layernorm.weight")
    assert not is_linear_weight(model, "model.embed_tokens.weight")
    assert not is_linear_weight(model, "lm_head.weight")  # the head is quantized once loaded, tied or not


def test_packed_parts_fuse_and_a_float_part_dequantizes_its_group(tiny_llama):
    files, model = fresh_model(tiny_llama)
    floats = dict(files.iter_weights(torch.float32))

    def stream(packed_parts):
        for name, w in floats.items():
            yield name, quantize_weight("int8", w) if any(f".{p}." in name for p in packed_parts) else w

    load_weights(model, LoadPlan(stream(["q_proj", "k_proj", "v_proj", "gate_proj"]), torch.float32), torch.float32)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.qkv_proj.qweight is not None and attn.qkv_proj.qweight.out_features == attn.qkv_proj.out_features
    q = quantize_weight("int8", floats["model.layers.0.self_attn.q_proj.weight"]).dequantize()
    torch.testing.assert_close(attn.qkv_proj.qweight.dequantize()[: q.shape[0]], q, rtol=0, atol=0)
    # gate packed but up float: the pair cannot be one PackedWeight, so gate is dequantized into the float weight
    assert mlp.gate_up_proj.qweight is None
    gate = quantize_weight("int8", floats["model.layers.0.mlp.gate_proj.weight"]).dequantize()
    up = floats["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(mlp.gate_up_proj.weight, torch.cat([gate, up]), rtol=0, atol=0)


def test_on_the_fly_transform_quantizes_only_linear_matrices(tiny_llama):
    files, model = fresh_model(tiny_llama)
    out = dict(quantize_stream(files.iter_weights(torch.float32), "int4", 32,
                               lambda name: is_linear_weight(model, name)))
    kinds = {name: type(w).__name__ for name, w in out.items()}
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == "PackedWeight"
    assert kinds["model.layers.0.post_attention_layernorm.weight"] == "Tensor"
    assert kinds["model.embed_tokens.weight"] == "Tensor"
