"""Tiny random-weight HF models built from a config, and the helpers the tests share to compare Pagoda with
transformers and to write those models as llama.cpp does (importable by tests; conftest names clash)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch


def build_tiny_model(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random-weight HF model (safetensors) to `path` and return it."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    common.update(overrides)
    torch.manual_seed(0)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
    elif arch == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's configs do
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=1000000.0, **{"head_dim": 32, **common}))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**phi3_longrope(common)))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path


def phi3_longrope(common: dict) -> dict:
    """A Phi-3 config's keys: LongRoPE with short and long factors that differ, pretraining context 64 (so
    test prompts sit on either side of it), 3/4 of each head rotated (Phi-4-mini); `common` overrides them."""
    kw = {"rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
          "pad_token_id": None, **common}
    half = int(kw["hidden_size"] // kw["num_attention_heads"] * kw["partial_rotary_factor"]) // 2
    kw.setdefault("rope_scaling", {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
                                   "long_factor": [1.0 + 1.5 * i for i in range(half)]})
    return kw


def build_tiny_moe(path: Path, arch: str, **overrides) -> Path:
    """Save a tiny random-weight mixture-of-experts model (safetensors): `arch` "mixtral" (8 experts of 96, top 2,
    2 layers) or "qwen3_moe" (8 experts of 64, top 2, renormalized; 3 layers, the middle one a dense MLP of 128;
    head_dim 32 apart from hidden / heads); `overrides` replace config keys."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, num_experts_per_tok=2)
    torch.manual_seed(0)
    if arch == "mixtral":
        cfg = MixtralConfig(**{**common, "intermediate_size": 96, "num_hidden_layers": 2, "num_local_experts": 8,
                               "rope_theta": 10000.0, **overrides})
        model = MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8,
                                "num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True,
                                "head_dim": 32, "rope_theta": 1000000.0, **overrides})
        model = Qwen3MoeForCausalLM(cfg)
    elif arch == "glm4_moe":
        return build_tiny_glm4_moe(path, **overrides)
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_glm4_moe(path: Path, mtp: bool = True, **overrides) -> Path:
    """A tiny random GLM-4.5 (Glm4Moe): 3 layers, the first dense; 8 experts of 32 in 2 groups, 1 group searched,
    top 2, renormalized and scaled by 2.5, a random e_score_correction_bias, one shared expert; q/k/v biases,
    q/k head norms, head_dim 32 with half rotated. With `mtp`, one MTP layer as GLM-4.5's checkpoints store it
    (layers.3: a sparse decoder layer, enorm, hnorm, eh_proj, shared_head.{norm,head}), which transformers skips."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
              first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
              use_qk_norm=True, num_nextn_predict_layers=1 if mtp else 0, **overrides)
    layers = kw["num_hidden_layers"]
    torch.manual_seed(0)
    # One more layer than the target's: its last is the MTP layer's decoder block.
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**kw, "num_hidden_layers": layers + 1}))
    with torch.no_grad():
        for layer in model.model.layers[kw["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    tensors = load_file(path / "model.safetensors")
    extra = f"model.layers.{layers}."
    tensors = {k: v for k, v in tensors.items() if mtp or not k.startswith(extra)}
    if mtp:
        h, v = kw["hidden_size"], kw["vocab_size"]
        g = torch.Generator().manual_seed(1)
        tensors |= {extra + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    extra + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    extra + "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
                    extra + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                    extra + "shared_head.head.weight": 0.2 * torch.randn(v, h, generator=g)}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def record_proposals(proposer: Any) -> list[tuple[list[int], int, list[int]]]:
    """Wrap a HeadProposer's propose() so that each draft it makes is appended, as (the sequence's tokens then,
    k, the proposals), to the returned list."""
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def recording(seqs, ks, trees=None):
        drafts, probs, parents = propose(seqs, ks, trees)
        seen.extend((list(s.token_ids), k, d) for s, k, d in zip(seqs, ks, drafts) if d)
        return drafts, probs, parents

    proposer.propose = recording
    return seen


# ---- the two sides of the comparisons ---------------------------------------------------------------------------


def greedy_tokens(llm: Any, prompts: list, max_new: int, n: int = 1) -> list[list[int]]:
    """Pagoda's greedy continuations of `prompts` (token id lists, or strings), `max_new` tokens each with EOS
    ignored, as hf_greedy runs; with `n` > 1, each prompt's n sequences one after another."""
    from pagoda import SamplingParams

    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    outs = llm.generate(prompts, SamplingParams(n=n, temperature=0, max_tokens=max_new, ignore_eos=True),
                        use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int,
              config: dict[str, Any] | None = None) -> list[list[int]]:
    """transformers' fp32 greedy continuations of `prompts`, `max_new` tokens each, with no EOS: HF then neither
    stops at it nor bans it (min_new_tokens would), as Pagoda's ignore_eos runs. `config`: attributes set on the
    loaded model's config before generating (e.g. sliding_window)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for key, value in (config or {}).items():
        setattr(model.config, key, value)
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def worst_prompt_logprob_error(model_dir: str, prompt: list[int], prompt_logprobs: list, top: int = 3) -> float:
    """The largest difference between Pagoda's `prompt_logprobs` (a request output's, asked for `top` or more) and
    transformers' fp32 log_softmax, over each position's `top` most likely tokens (by transformers) and its prompt
    token."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    worst = 0.0
    for pos in range(1, len(prompt)):
        entry = prompt_logprobs[pos]
        for tid in [*ref[pos - 1].topk(top).indices.tolist(), prompt[pos]]:
            worst = max(worst, abs(entry[tid].logprob - ref[pos - 1, tid].item()))
    return worst


def hf_argmax_agreement(model_dir: str, prompt: list[int], prompt_logprobs: list) -> float:
    """Teacher-forced argmax agreement: the share of `prompt`'s positions after the first whose rank-1 token in
    Pagoda's `prompt_logprobs` (a request output's) is transformers' fp32 argmax."""
    from transformers import AutoModelForCausalLM

    ours = [next(t for t, lp in entry.items() if lp.rank == 1) for entry in prompt_logprobs[1:]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, :-1].argmax(-1).tolist()
    return sum(a == b for a, b in zip(ours, ref)) / len(ref)


# ---- model folders and GGUF files --------------------------------------------------------------------------------


def variant(src: str | Path, dest: Path, **config: Any) -> str:
    """A copy of the model folder `src` at `dest` with some config.json values changed (the same weights)."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(cfg | config))
    return str(dest)


def with_architecture(src: str | Path, dest: Path, arch: str) -> str:
    """A copy of the model folder `src` at `dest` whose config.json names the architecture `arch`."""
    return variant(src, dest, architectures=[arch])


# llama.cpp's names for the tensors outside the layers, and for a Llama-style layer's modules (Qwen3's q/k norms).
GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def gguf_tensor_name(hf_name: str, layer: dict[str, str] = GGUF_LAYER, top: dict[str, str] = GGUF_TOP) -> str:
    """llama.cpp's name for the HF tensor `hf_name`: `top` maps whole names, `layer` a layer's module
    (model.layers.I.MODULE.LEAF -> blk.I.layer[MODULE].LEAF)."""
    if hf_name in top:
        return top[hf_name]
    i, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{i}.{layer[module]}.{leaf}"


def add_gguf_hparams(writer: Any, cfg: dict[str, Any]) -> None:
    """The metadata llama.cpp's converter writes for any of these models from its HF config: context length,
    widths, layers, heads and the RMSNorm epsilon."""
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def finish_gguf(writer: Any) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def seeded_samples_and_singles(llm: Any, prompts: list[list[int]], n: int = 3, seed: int = 7,
                               max_new: int = 16) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """(the n samples of each seeded request, each sample rerun alone): sample i of a request seeded s draws
    from seed s + i, so the two are equal exactly when forking (the siblings share the prompt's blocks,
    copy-on-write) changes nothing."""
    from pagoda import SamplingParams

    def run(k: int, s: int) -> list[list[list[int]]]:
        params = SamplingParams(n=k, temperature=0.8, top_k=50, seed=s, max_tokens=max_new, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[c.token_ids for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]

    singles = [run(1, seed + i) for i in range(n)]
    return run(n, seed), [[singles[i][p][0] for i in range(n)] for p in range(len(prompts))]


def save_byte_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    """A byte-level tokenizer.json (ids 0..255 fit any vocab >= 256), so text routes work on a tiny model; with
    `chat_template`, a tokenizer_config.json holding it."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    if chat_template is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))


def build_tiny_eagle3_head(path: Path, target: str | Path, draft_vocab_size: int | None = None, seed: int = 0) -> Path:
    """A random EAGLE-3 head for the HF model at `target`, in the published format; with `draft_vocab_size`
    below the target's, its draft vocabulary is every other token (d2t maps it)."""
    from pagoda.model.args import ModelArgs
    from pagoda.spec_decode.eagle3_head import Eagle3Config, save_head

    args = ModelArgs.from_hf_config(json.loads((Path(target) / "config.json").read_text()))
    vd = draft_vocab_size or args.vocab_size
    c = Eagle3Config.for_target(args, vd)
    h, q, kv, inter = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, \
        args.intermediate_size
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {"fc.weight": rnd(h, 3 * h), "midlayer.self_attn.q_proj.weight": rnd(q, 2 * h),
               "midlayer.self_attn.k_proj.weight": rnd(kv, 2 * h), "midlayer.self_attn.v_proj.weight": rnd(kv, 2 * h),
               "midlayer.self_attn.o_proj.weight": rnd(h, q), "midlayer.mlp.gate_proj.weight": rnd(inter, h),
               "midlayer.mlp.up_proj.weight": rnd(inter, h), "midlayer.mlp.down_proj.weight": rnd(h, inter),
               "midlayer.input_layernorm.weight": 1 + rnd(h), "midlayer.hidden_norm.weight": 1 + rnd(h),
               "midlayer.post_attention_layernorm.weight": 1 + rnd(h), "norm.weight": 1 + rnd(h),
               "lm_head.weight": rnd(vd, h)}
    draft_ids = torch.arange(vd) * (args.vocab_size // vd)
    tensors["d2t"] = draft_ids - torch.arange(vd)
    t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_head(path, c, tensors)
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_bpe_tokenizer(folder: Path, vocab_size: int = 400) -> None:
    """A byte-level BPE tokenizer.json with real merges (trained on a license text of the bench corpus), GPT-2's
    pre-tokenizer and ChatML's specials at ids 0-2 (the tiny models' bos 1 and eos 2), and a tokenizer_config.json
    naming them with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = Path(__file__).resolve().parents[1] / "pagoda" / "bench" / "corpus" / "GPL-3"
    tok.train_from_iterator([corpus.read_text()], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
