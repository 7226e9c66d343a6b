"""GPTQ and AWQ: they must beat RTN on reconstruction error, AWQ's folding must be exact in float,
and `pagoda quantize` must write the checkpoint layout of pagoda/quantization/checkpoint.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pagoda.bench.datasets import CORPUS_DIR
from pagoda.quantization.awq import (
    apply_scale,
    awq_layer_quantizer,
    fake_quantize,
    rtn_with_clip,
    scale_groups,
    search_clip,
    search_scale,
)
from pagoda.quantization.calibration import (
    LayerInputs,
    calibration_windows,
    capture_first_layer_inputs,
    decoder_layers,
    load_hf_float_model,
)
from pagoda.quantization.checkpoint import load_dequantized_state
from pagoda.quantization.gptq import HessianAccumulator, gptq_layer_quantizer, gptq_quantize
from pagoda.quantization.int4_format import effective_group_size, quantize_int4_rtn

CALIB_TEXT = str(CORPUS_DIR / "GPL-2")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _structured_inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    """Correlated activations (low rank + noise) with a few outlier channels, as in real LLMs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 16, generator=g) @ torch.randn(16, k, generator=g) + 0.3 * torch.randn(t, k, generator=g)
    x[:, :6] *= 20
    return x


def test_gptq_with_identity_hessian_is_rtn():
    w = torch.randn(48, 256) * 0.05
    q = gptq_quantize(w, torch.eye(256), group_size=64)
    rtn = quantize_int4_rtn(w, 64)
    assert torch.equal(q.codes(), rtn.codes())
    torch.testing.assert_close(q.scales, rtn.scales)
    torch.testing.assert_close(q.zeros, rtn.zeros)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_linear_outputs(act_order):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    x = _structured_inputs(2048, 256)
    acc = HessianAccumulator(256)
    for chunk in x.split(500):
        acc.add(chunk)
    q = gptq_quantize(w, acc.hessian(), group_size=64, act_order=act_order)
    assert q.scales.shape == (96, 4) and q.qweight.shape == (96, 128) and q.qweight.dtype == torch.uint8
    ref = x @ w.T
    err_gptq = (x @ q.dequantize().T - ref).pow(2).mean()
    err_rtn = (x @ quantize_int4_rtn(w, 64).dequantize().T - ref).pow(2).mean()
    assert err_gptq < 0.5 * err_rtn, (err_gptq, err_rtn)


def test_awq_scale_and_clip_beat_rtn_on_outlier_channels():
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    x = _structured_inputs(2048, 256, seed=1)
    ref = x @ w.T
    err_rtn = (x @ fake_quantize(w, 64).T - ref).pow(2).mean()
    s, alpha = search_scale(x, x.abs().mean(0), [w], 64)
    assert alpha > 0
    err_scaled = (x @ (fake_quantize(w * s, 64) / s).T - ref).pow(2).mean()
    bound = search_clip(x / s, w * s, 64)
    err_clipped = (x @ (rtn_with_clip(w * s, 64, bound).dequantize() / s).T - ref).pow(2).mean()
    assert err_scaled < 0.8 * err_rtn, (err_scaled, err_rtn)
    assert err_clipped <= err_scaled * 1.01


@pytest.fixture(scope="module")
def smollm_layer_inputs():
    """SmolLM2 (the default model) in fp32 with real calibration activations at layer 2's input."""
    from pagoda.quantization.calibration import load_calibration_ids

    model, _ = load_hf_float_model(None)
    ids = load_calibration_ids(None, CALIB_TEXT, num_samples=4, seq_len=128)
    inputs = capture_first_layer_inputs(model, ids, batch_size=4)
    for layer in decoder_layers(model)[:2]:
        inputs = LayerInputs(inputs.run(layer), inputs.kwargs)
    return model, inputs


@pytest.mark.slow  # ~1-2 min on 2 busy cores
def test_gptq_and_awq_beat_rtn_on_a_smollm_layer(smollm_layer_inputs):
    """The point of the algorithms: on real calibration data, the quantized layer's outputs are closer
    to the float layer's than with round-to-nearest."""
    import copy

    model, inputs = smollm_layer_inputs
    layer = decoder_layers(model)[2]
    ref = torch.cat(inputs.run(layer))
    errors = {}
    for name, quantizer in (("rtn", None), ("gptq", gptq_layer_quantizer(128)),
                            ("gptq_act_order", gptq_layer_quantizer(128, act_order=True)),
                            ("awq", awq_layer_quantizer(128)), ("awq_gptq", awq_layer_quantizer(128, gptq=True))):
        q_layer = copy.deepcopy(layer)
        if quantizer is None:
            for path in LINEARS:
                lin = q_layer.get_submodule(path)
                lin.weight.data.copy_(quantize_int4_rtn(lin.weight.data, effective_group_size(
                    lin.in_features, 128)).dequantize())
        else:
            assert set(quantizer(2, q_layer, inputs)) == set(LINEARS)
        errors[name] = (torch.cat(inputs.run(q_layer)) - ref).pow(2).mean().item()
    print("layer-2 output MSE:", errors)
    for name in ("gptq", "gptq_act_order", "awq", "awq_gptq"):
        assert errors[name] < 0.9 * errors["rtn"], errors
    # Per linear, AWQ+GPTQ keeps GPTQ's rounding only where it lowers the output error of AWQ's own.
    assert errors["awq_gptq"] <= 1.02 * errors["awq"], errors


def test_awq_folding_keeps_the_float_model(tmp_path):
    """Scaling W columns by s and folding 1/s into the norm / previous linear is exact in float
    (MHA model, so the o_proj <- v_proj fold is exercised too)."""
    from tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "mha", "llama", num_key_value_heads=4)
    model, _ = load_hf_float_model(str(path))
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        g = torch.Generator().manual_seed(1)
        for layer in decoder_layers(model):
            groups = scale_groups(layer)
            assert [grp.prev for grp in groups] == ["input_layernorm", "self_attn.v_proj",
                                                   "post_attention_layernorm", "mlp.up_proj"]
            for grp in groups:
                k = layer.get_submodule(grp.linears[0]).in_features
                apply_scale(layer, grp, torch.rand(k, generator=g) * 3 + 0.2)
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert not torch.equal(decoder_layers(model)[0].input_layernorm.weight, torch.ones(64))


def test_awq_skips_o_proj_scale_under_gqa(tiny_llama):
    model, _ = load_hf_float_model(tiny_llama)  # 4 heads, 2 KV heads
    assert [grp.prev for grp in scale_groups(decoder_layers(model)[0])] == [
        "input_layernorm", "post_attention_layernorm", "mlp.up_proj"]


def test_calibration_windows_spread_over_the_text():
    w = calibration_windows(list(range(1000)), num_samples=4, seq_len=100)
    assert w.shape == (4, 100) and w[0, 0] == 0 and w[-1, -1] == 999
    assert calibration_windows(list(range(250)), num_samples=8, seq_len=100).shape == (2, 100)
    with pytest.raises(ValueError):
        calibration_windows(list(range(50)), 4, 100)


@pytest.mark.parametrize("method,extra", [("gptq", ["--act-order"]), ("awq", []), ("awq", ["--awq-gptq"]),
                                          ("rtn", [])])
def test_quantize_command_writes_the_checkpoint_format(tiny_llama_byte_tokenizer, tmp_path, method, extra):
    from pagoda.entrypoints.cli import main

    out = tmp_path / f"ck_{method}"
    argv = ["quantize", str(tiny_llama_byte_tokenizer), "--method", method, "--calib", CALIB_TEXT,
            "--out", str(out), "--num-samples", "4", "--seq-len", "64", *extra]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "pagoda", "method": "int4", "algorithm": method, "bits": 4,
                                          "group_size": 128, "desc_act": method == "gptq"}
    assert cfg["hidden_size"] == 64 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (out / "tokenizer.json").is_file()
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    float_model, _ = load_hf_float_model(str(tiny_llama_byte_tokenizer))
    float_state = float_model.state_dict()
    for i in range(2):
        for path in LINEARS:
            prefix = f"model.layers.{i}.{path}"
            n, k = float_state[f"{prefix}.weight"].shape
            g = effective_group_size(k, 128)  # 64 for K=64 (q/k/v/gate/up), 128 for down (K=128)
            assert f"{prefix}.weight" not in tensors
            qweight = tensors[f"{prefix}.qweight"]
            assert qweight.dtype == torch.uint8 and qweight.shape == (n, k // 2)
            for part in ("scales", "zeros"):
                assert tensors[f"{prefix}.{part}"].dtype == torch.float32
                assert tensors[f"{prefix}.{part}"].shape == (n, k // g)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert tensors[f"model.layers.{i}.{norm}.weight"].dtype == torch.float32
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert name in tensors

    # The dequantized checkpoint stands in for the float model: logits close to the float ones on text.
    deq, _ = load_hf_float_model(str(tiny_llama_byte_tokenizer))
    deq.load_state_dict(load_dequantized_state(str(out)))
    ids = torch.tensor(list((CORPUS_DIR / "Apache-2.0").read_bytes()[:256])).reshape(2, 128)
    with torch.no_grad():
        ref, got = float_model(ids).logits, deq(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.75, rel  # int4 on a tiny random-weight model: RTN gives ~0.5 here
    if method == "awq":  # the norm weights carry the folded scales
        assert not torch.allclose(tensors["model.layers.0.input_layernorm.weight"],
                                  float_state["model.layers.0.input_layernorm.weight"])
    assert os.path.getsize(out / "model.safetensors") < os.path.getsize(
        next(Path(tiny_llama_byte_tokenizer).glob("*.safetensors")))


def test_llm_loads_the_checkpoint_like_its_dequantized_float_copy(tiny_llama_byte_tokenizer, tmp_path):
    """LLM(DIR) runs the INT4 checkpoint with the same numerics as a float model holding its dequantized
    weights (up to the loader also quantizing lm_head with RTN)."""
    from pagoda import LLM
    from pagoda.entrypoints.cli import main
    from pagoda.eval.perplexity import perplexity
    from pagoda.quantization.checkpoint import export_dequantized

    out = tmp_path / "ck"
    assert main(["quantize", str(tiny_llama_byte_tokenizer), "--method", "awq", "--calib", CALIB_TEXT,
                 "--out", str(out), "--num-samples", "4", "--seq-len", "64"]) == 0
    export_dequantized(str(out), str(tmp_path / "deq"))
    ids = list((CORPUS_DIR / "GPL-3").read_bytes()[:400])
    ppl = {}
    for name in ("ck", "deq"):
        llm = LLM(str(tmp_path / name), dtype="float32", kv_cache_memory="64MiB")
        ppl[name] = perplexity(llm, ids, 128, 64).perplexity
    assert ppl["ck"] == pytest.approx(ppl["deq"], rel=0.05), ppl
