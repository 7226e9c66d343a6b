"""Batched multi-LoRA: PEFT adapters made here with peft, served by Pagoda, checked against transformers + peft."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from pagoda import LLM, SamplingParams
from pagoda.kernels.cpu_extension import kernel_available
from pagoda.lora import LoRARequest

pytest.importorskip("peft")

MAX_NEW = 8
PROMPTS = [[1, 17, 42, 99, 3, 250, 7, 11, 300, 5, 64, 128, 200, 9, 33, 77],
           [1, 5, 6, 7, 8, 400, 401],
           [1, 100, 200, 300, 400, 500, 12, 13, 14],
           [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11]]
# (rank, lora_alpha, use_rslora, target modules): every projection, attention only, MLP and o_proj.
ADAPTERS = {
    "all": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv": (4, 8, True, ["q_proj", "v_proj"]),
    "mlp": (16, 32, False, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def make_adapter(model_dir: str, out: Path, rank: int, alpha: int, rslora: bool, targets: list[str],
                 seed: int) -> str:
    """A PEFT LoRA adapter of `model_dir` with random, non-zero A and B (peft starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                                                  target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(out, safe_serialization=True)
    return str(out)


def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers (+ peft) fp32 greedy continuations, no EOS."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model = model.eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    """(model folder, {adapter name: LoRARequest}, {adapter name or None: HF+peft tokens for each prompt})."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    kw = {"attention_bias": True} if request.param == "qwen2" else {}
    model = str(build_tiny_model(root / "model", request.param, **kw))
    loras, expected = {}, {None: peft_greedy(model, None, PROMPTS)}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        path = make_adapter(model, root / name, *spec, seed=i + 1)
        loras[name] = LoRARequest(name, i + 1, path)
        expected[name] = peft_greedy(model, path, PROMPTS)
    return model, loras, expected


def _llm(model: str, tokenizer: str, **kw) -> LLM:
    return LLM(model, tokenizer=tokenizer, dtype="float32", enable_lora=True, max_lora_rank=16, **kw)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_alone_matches_transformers_peft(family, default_gguf):
    model, loras, expected = family
    llm = _llm(model, default_gguf, max_loras=1)
    for name, lora in loras.items():
        assert expected[name] != expected[None]  # the adapter changes what the model writes
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)) == expected[name], name


def test_one_batch_mixing_three_adapters_and_the_base_matches_each_alone(family, default_gguf):
    model, loras, expected = family
    llm = _llm(model, default_gguf, max_loras=4)
    names = [None, "all", "qv", "mlp"] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    assert _tokens(outs) == [expected[n][i % len(PROMPTS)] for i, n in enumerate(names)]


needs_kernels = pytest.mark.skipif(not kernel_available(), reason="the C++ LoRA op needs the CPU kernels")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_op_adds_each_tokens_own_adapter_whatever_shares_the_call(dtype):
    """The op against float64 matmuls, with odd sizes (vector tails), fused slots of two parts (each part's B in its
    own rows and rank columns), an empty slot and base-model tokens; a token's update is the same bits alone and
    among the others."""
    gen = torch.Generator().manual_seed(0)
    slots_n, wd, d_in, d_out, tokens = 4, 12, 37, 53, 19
    # (first rank column, rank, first output row, rows) of each slot's parts: the layout LoRASlots.write makes.
    layout = [[(0, 6, 0, 20), (6, 6, 20, 33)], [(0, 5, 3, 50), (0, 0, 0, 0)], [(0, 0, 0, 0)] * 2,
              [(0, 3, 0, 17), (3, 5, 17, 36)]]
    parts = torch.tensor(layout, dtype=torch.int32)
    widths = parts[:, :, :2].sum(-1).max(-1).values.int()  # each slot's last rank column
    a = torch.zeros(slots_n, wd, d_in)
    bt = torch.zeros(slots_n, wd, d_out)
    for s, slot_parts in enumerate(layout):
        for c, r, o, n in slot_parts:
            a[s, c:c + r] = torch.randn(r, d_in, generator=gen)
            bt[s, c:c + r, o:o + n] = torch.randn(r, n, generator=gen)
    a, bt = a.to(dtype), bt.to(dtype)
    token_slots = torch.randint(-1, slots_n, (tokens,), generator=gen)
    token_slots[:4] = torch.tensor([0, 1, -1, 3])
    x = torch.randn(tokens, d_in, generator=gen).to(dtype)
    y0 = torch.randn(tokens, d_out, generator=gen).to(dtype)
    y = y0.clone()
    torch.ops.pagoda.lora_add_(y, x, token_slots, a, bt, widths, parts)
    want = y0.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            want[t] += (x[t].double() @ a[s].double().T) @ bt[s].double()
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 5e-2}
    torch.testing.assert_close(y.double(), want.to(dtype).double(), **tol)
    assert torch.equal(y[token_slots < 0], y0[token_slots < 0])
    assert torch.equal(y[token_slots == 2], y0[token_slots == 2])  # an empty slot adds nothing
    for t in range(tokens):
        alone = y0[t:t + 1].clone()
        torch.ops.pagoda.lora_add_(alone, x[t:t + 1], token_slots[t:t + 1], a, bt, widths, parts)
        assert torch.equal(alone[0], y[t]), t


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_stack_adds_adapters_as_the_layers_do(family, default_gguf, dtype):
    """A step with adapter rows runs in the C++ decoder stack, with exactly the layer-by-layer path's results."""
    model, loras, _ = family
    llm = LLM(model, tokenizer=default_gguf, dtype=dtype, enable_lora=True, max_lora_rank=16, max_loras=4)
    net = llm.engine.runner.model
    names = [None, "all", "qv", "mlp"]
    requests = [loras[n] if n else None for n in names]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)

    def run() -> tuple[list, set[str]]:
        with torch.profiler.profile() as prof:
            outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=requests)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], {e.key for e in prof.key_averages()}

    if net.stack is None:
        pytest.skip("no decoder stack on this build")
    fused, ops = run()
    assert "pagoda::decoder_stack" in ops  # the stack calls the LoRA op inside, not through the dispatcher
    net.stack = None
    reference, ops = run()
    assert "pagoda::decoder_stack" not in ops and "pagoda::lora_add_" in ops
    assert fused == reference


def test_more_adapters_than_slots_wait_and_evict_least_recently_used(family, default_gguf):
    model, loras, expected = family
    llm = _llm(model, default_gguf, max_loras=2)
    names = ["all", "qv", "mlp", None, "qv"]
    outs = llm.generate([PROMPTS[0]] * len(names), GREEDY, use_tqdm=False,
                        lora_request=[loras[n] if n else None for n in names])
    assert _tokens(outs) == [expected[n][0] for n in names]
    assert len(llm.engine.lora.resident()) == 2


def test_prefix_cache_hits_never_cross_adapters(family, default_gguf):
    model, loras, _ = family
    llm = _llm(model, default_gguf, max_loras=2, block_size=4)
    stats = llm.engine.kv.stats
    prompt = PROMPTS[0]  # 16 tokens: 3 full blocks may be reused
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], one, use_tqdm=False, lora_request=loras["all"])
    hits = stats.hits
    llm.generate([prompt], one, use_tqdm=False, lora_request=loras["qv"])
    llm.generate([prompt], one, use_tqdm=False)
    assert stats.hits == hits  # neither the other adapter nor the base model reuses its blocks
    llm.generate([prompt], one, use_tqdm=False, lora_request=loras["all"])
    assert stats.hits == hits + 12  # the same adapter does


def test_lora_on_an_int8_base_adds_its_update(tiny_llama, default_gguf, tmp_path):
    """int8 weights shift the logits a little (near-ties may flip), so the first position's logprobs are
    compared: int8 + adapter sits near float + adapter (which matches peft above), far from int8 alone."""
    lora = LoRARequest("a", 1, make_adapter(tiny_llama, tmp_path / "a", *ADAPTERS["all"], seed=1))
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)

    def logprobs(llm: LLM, lora: LoRARequest | None) -> list[dict[int, float]]:
        outs = llm.generate(PROMPTS, first, use_tqdm=False, lora_request=lora)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    want = logprobs(_llm(tiny_llama, default_gguf), lora)
    int8 = _llm(tiny_llama, default_gguf, quantization="int8")
    got, base = logprobs(int8, lora), logprobs(int8, None)
    for w, g in zip(want, got):
        top = max(w, key=w.get)
        assert abs(g[top] - w[top]) < 0.15
    assert [max(g, key=g.get) for g in got] != [max(b, key=b.get) for b in base]


# ---- adapters that cannot be served: a ValueError that names the adapter ---------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory, default_gguf):
    root = tmp_path_factory.mktemp("lora_errors")
    model = str(build_tiny_model(root / "model", "llama"))
    adapter = make_adapter(model, root / "good", 8, 16, False, ["q_proj", "down_proj"], seed=3)
    return _llm(model, default_gguf, max_loras=1), root, Path(adapter)


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _expect_error(llm: LLM, path: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad-one", 7, str(path)))


def test_rank_above_max_lora_rank_is_refused(small, default_gguf):
    llm, _, adapter = small
    strict = LLM(llm.engine.config.model, tokenizer=default_gguf, dtype="float32", enable_lora=True, max_lora_rank=4)
    _expect_error(strict, adapter, r"'bad-one'.*rank 8 .*max_lora_rank 4")


def test_pickled_adapter_is_refused_by_name(small):
    llm, root, adapter = small
    bad = _copy(adapter, root / "pickled")
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    _expect_error(llm, bad, r"'bad-one'.*adapter_model.bin")


def test_target_module_the_model_lacks_is_refused(small):
    llm, root, adapter = small
    bad = _copy(adapter, root / "layer9")
    tensors = load_file(bad / "adapter_model.safetensors")
    save_file({k.replace("layers.1.", "layers.9."): v for k, v in tensors.items()}, bad / "adapter_model.safetensors")
    _expect_error(llm, bad, r"'bad-one'.*no module 'model.layers.9")


def test_shape_mismatch_and_corrupt_files_are_refused(small):
    llm, root, adapter = small
    bad = _copy(adapter, root / "shape")
    tensors = load_file(bad / "adapter_model.safetensors")
    save_file({k: (v[:, :32].contiguous() if "lora_A" in k else v) for k, v in tensors.items()},
              bad / "adapter_model.safetensors")
    _expect_error(llm, bad, r"'bad-one'.*maps 32 ->")
    corrupt = _copy(adapter, root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00not safetensors")
    _expect_error(llm, corrupt, r"'bad-one'.*cannot read")
    dora = _copy(adapter, root / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    _expect_error(llm, dora, r"'bad-one'.*DoRA")
    # the engine goes on serving the good adapter and the base model
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("ok", 1, str(adapter)))


def test_lora_request_without_enable_lora_is_refused(tiny_llama, default_gguf, small):
    _, _, adapter = small
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(adapter)))
