"""MTP speculation (method "mtp") with the multi-token prediction layer of a GLM-4.5 checkpoint: its drafts are
those of transformers' own Glm4Moe decoder layer under vLLM's MTP formula, computed from the whole history; the
target's output is unchanged with chains and trees, through chunked prefill, prefix hits and preemption; a
checkpoint without the layer is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_glm4_moe, build_tiny_model, greedy_tokens, record_proposals

from pagoda import LLM, SamplingParams

BLOCK = 4
TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"
PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 33)), [1, 2, 3]]


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> str:
    return str(build_tiny_glm4_moe(tmp_path_factory.mktemp("glm_mtp")))


def mtp_config(tree: str | None, k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": 5 if tree else k, "adaptive": False,
            "speculative_token_tree": tree}


def reference_chain(model_dir: str, tokens: list[int], k: int) -> list[int]:
    """The k greedy MTP drafts after `tokens` (the last one sampled, not yet computed), from scratch with
    transformers: the target's normed states at positions 0..n-2, then its MTP layer (layers.N, loaded into a
    model one layer deeper) over every position at once, as vLLM's DeepSeek/GLM MTP computes it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    n_layers, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    deeper = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=n_layers + 1,
                                                  attn_implementation="eager").eval()
    w = {k.removeprefix(f"model.layers.{n_layers}."): v for k, v in load_file(Path(model_dir) / "model.safetensors")
         .items() if k.startswith(f"model.layers.{n_layers}.")}

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    layer, embed = deeper.model.layers[n_layers], target.model.embed_tokens
    with torch.no_grad():
        states = target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]  # [n - 1, H]
        inputs = list(tokens[1:])  # position p reads the token at p + 1
        drafts: list[int] = []
        for _ in range(k):
            t = len(inputs)
            emb = embed(torch.tensor(inputs))
            emb[0] = 0.0  # position 0's embedding is masked (vLLM)
            x = torch.cat([rms(emb, w["enorm.weight"]), rms(states, w["hnorm.weight"])], dim=-1) @ w["eh_proj.weight"].T
            pos = torch.arange(t)[None]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
            out = layer(x[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=deeper.model.rotary_emb(x[None], pos))
            out = out[0] if isinstance(out, tuple) else out
            last = out[0, -1]
            token = int((rms(last, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T).argmax())
            drafts.append(token)
            inputs.append(token)
            states = torch.cat([states, last[None]])
    return drafts


def test_mtp_drafts_are_transformers_mtp_layer_from_the_whole_history(glm, default_gguf):
    """Every chain the engine proposes (chunked prefill, three sequences, k = 3, catch-up after each step over
    the accepted positions) equals the drafts computed from scratch by transformers' layers."""
    llm = LLM(glm, tokenizer=default_gguf, dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              speculative_config=mtp_config(None))
    seen = record_proposals(llm.engine.speculator.drafter)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    for i, (tokens, k, drafts) in enumerate(seen[::3]):
        assert drafts == reference_chain(glm, tokens, k), f"proposal {i} at length {len(tokens)}"


@pytest.mark.parametrize("tree, quantization", [(None, None), (TREE, None), (None, "int8")],
                         ids=["chain", "tree", "int8-layer"])
def test_mtp_leaves_greedy_output_unchanged(glm, default_gguf, tree, quantization):
    """Chunked prefill in blocks of 4, prefix hits on the second pass, and a pool small enough to preempt; the MTP
    layer as stored, or quantized as it loads (speculative_config.quantization)."""
    cfg = json.loads((Path(glm) / "config.json").read_text())
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * BLOCK * cfg["head_dim"] * 4
    kw = dict(tokenizer=default_gguf, dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              enable_prefix_caching=True, kv_cache_memory=24 * per_block)
    want = greedy_tokens(LLM(glm, **kw), PROMPTS, 24)
    llm = LLM(glm, **kw, speculative_config={**mtp_config(tree), "quantization": quantization})
    head = llm.engine.speculator.drafter.head
    assert (head.eh_proj.qweight is None) == (quantization is None)
    for _ in range(2):
        assert greedy_tokens(llm, PROMPTS, 24) == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_mtp_is_refused_without_mtp_layers(glm, default_gguf, tmp_path):
    llama = build_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with MTP layers.*LlamaForCausalLM"):
        LLM(str(llama), tokenizer=default_gguf, speculative_config=mtp_config(None))
    # A GLM config that names an MTP layer its file lacks: the target loads, the drafter names what is missing.
    stripped = build_tiny_glm4_moe(tmp_path / "stripped", mtp=False)
    cfg = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    LLM(str(stripped), tokenizer=default_gguf)
    with pytest.raises(ValueError, match=r"the MTP layer is missing \d+ weight\(s\), e\.g\. \['layers\.3\."):
        LLM(str(stripped), tokenizer=default_gguf, speculative_config=mtp_config(None))


def test_an_mtp_layer_storing_its_own_embedding_uses_the_targets(glm, default_gguf, tmp_path):
    """DeepSeek-V3's layout stores a copy of the embedding in the MTP layer: it is checked, not loaded twice."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "with_embed"
    shutil.copytree(glm, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    want = greedy_tokens(LLM(glm, tokenizer=default_gguf, dtype="float32"), PROMPTS, 12)
    llm = LLM(str(folder), tokenizer=default_gguf, dtype="float32", speculative_config=mtp_config(None))
    assert greedy_tokens(llm, PROMPTS, 12) == want
    head = llm.engine.speculator.drafter.head
    assert not any("embed" in name for name, _ in head.named_parameters())
