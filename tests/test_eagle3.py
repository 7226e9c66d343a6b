"""EAGLE-3: the target's captured states match transformers' hidden states and leave its output unchanged;
the head's incremental drafts (catch-up after every step, chains over paged KV) equal drafts computed from
the whole history at once; the head's file is checked as it loads."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_models import build_tiny_eagle3_head, build_tiny_model, record_proposals

from pagoda import LLM, SamplingParams
from pagoda.executor.model_runner import FlatBatch
from pagoda.spec_decode.eagle3_head import default_aux_layers
from pagoda.spec_decode.head_proposer import HeadProposer

BLOCK = 4


@pytest.fixture(scope="module")
def tiny6(tmp_path_factory) -> str:
    """Six layers, so the three captured layers (2, 3, 3) are not the first."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny6"), "llama", vocab_size=64, num_hidden_layers=6))


@pytest.fixture(scope="module")
def head6(tmp_path_factory, tiny6) -> str:
    return str(build_tiny_eagle3_head(tmp_path_factory.mktemp("head6"), tiny6, draft_vocab_size=32))


def test_captured_states_are_transformers_hidden_states(tiny6, default_gguf):
    from transformers import AutoModelForCausalLM

    ids = [3, 9, 27, 5, 44, 12, 7, 7, 30, 2, 61]
    layers = default_aux_layers(6)
    llm = LLM(tiny6, tokenizer=default_gguf, dtype="float32", block_size=BLOCK)
    aux, final = llm.engine.runner.hidden_states(ids, layers)
    logits = llm.engine.runner.model.compute_logits(final)
    hf = AutoModelForCausalLM.from_pretrained(tiny6, torch_dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)  # hidden_states[i]: entering layer i
    torch.testing.assert_close(aux, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 40], ids=["decoder-stack", "layer-by-layer"])
def test_capturing_leaves_the_target_bit_identical(tiny6, default_gguf, rows):
    llm = LLM(tiny6, tokenizer=default_gguf, dtype="bfloat16", block_size=BLOCK)
    model = llm.engine.runner.model
    ids = [(7 * i) % 64 for i in range(rows)]
    batch = FlatBatch(BLOCK)
    batch.add(ids, 0, list(range(-(-rows // BLOCK))))

    def run(layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        model.aux_layers, model.aux_hidden = layers, None
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.tensor(batch.positions), batch.metadata(torch.device("cpu")))
        return h, model.aux_hidden

    plain, none = run(())
    captured, aux = run((2, 3, 5))
    assert none is None and aux is not None and aux.shape == (rows, 3 * plain.shape[1])
    assert torch.equal(plain, captured)
    # The first captured stream is what layer 2 reads: the embedding after two layers, the same either way.
    model.aux_layers = ()
    assert torch.equal(aux, run((2, 3, 5))[1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_decoder_stack_captures_the_layer_by_layer_states(tiny6, default_gguf, dtype, monkeypatch):
    """The C++ stack writes the captured streams in its one call: the same bits as the layers run one by one."""
    from pagoda.kernels.decoder_stack import DecoderStack

    llm = LLM(tiny6, tokenizer=default_gguf, dtype=dtype, block_size=BLOCK)
    model = llm.engine.runner.model
    if model.stack is None:
        pytest.skip("no C++ decoder stack on this machine")
    ids = [11, 5, 40]
    batch = FlatBatch(BLOCK)
    for i, t in enumerate(ids):  # three sequences of one token: a decode-sized step
        batch.add([t], 0, [i])
    model.aux_layers = (0, 2, 5)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model.aux_hidden = None
        with torch.inference_mode():
            h = model(torch.tensor(ids), torch.tensor(batch.positions), batch.metadata(torch.device("cpu")))
        return h, model.aux_hidden

    assert model.stack.takes(torch.zeros(len(ids), model.args.hidden_size, dtype=getattr(torch, dtype)))
    stacked, aux = run()
    monkeypatch.setattr(DecoderStack, "takes", lambda self, x: False)
    layered, want = run()
    model.aux_layers = ()
    assert torch.equal(stacked, layered) and torch.equal(aux, want)
    assert torch.equal(aux[:, :model.args.hidden_size], model.embed_tokens(torch.tensor(ids)))  # layer 0 reads these


TREE = "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]"  # k = 6 nodes, 3 deep; (0,) (0, 0) (0, 0, 0) is the chain


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_incremental_drafts_equal_drafts_from_the_whole_history(tiny6, head6, default_gguf, tree):
    """Record every proposal the engine makes (chunked prefill, several sequences, k = 3), then recompute
    each from scratch: one catch-up over the whole history and one chain (or tree). Any stale or misplaced
    draft KV, state or position makes them differ. A tree's first branch (the head's top first token, then its
    chain) is the chain itself: any key its mask let through from another branch would change it."""
    llm = LLM(tiny6, tokenizer=default_gguf, dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              speculative_config={"method": "eagle3", "model": head6, "num_speculative_tokens": 6 if tree else 3,
                                  "adaptive": False, "speculative_token_tree": tree})
    spec = llm.engine.speculator
    proposer: HeadProposer = spec.drafter
    seen = record_proposals(proposer)
    prompts = [[5, 6, 7, 8] * 5, list(range(10, 33)), [1, 2, 3]]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 6
    runner = llm.engine.runner
    fresh = HeadProposer(proposer.head, 64, BLOCK, runner.args.vocab_size)
    for i, (tokens, k, drafts) in enumerate(seen):
        aux, _ = runner.hidden_states(tokens, proposer.head.config.aux_layers)
        n = len(tokens)
        seq = SimpleNamespace(seq_id=1000 + i, token_ids=tokens, num_tokens=n, num_computed_tokens=0,
                              finished=False, request=SimpleNamespace(params=SimpleNamespace(greedy=True)))
        sched = SimpleNamespace(seqs=[seq], num_scheduled=[n - 1])
        seq.num_computed_tokens = n - 1
        fresh.record(sched, {}, aux)
        shape = spec.tree
        want, _, _ = fresh.propose([seq], [k], [shape])
        assert drafts == want[0], f"proposal {i} at length {n}"
        if shape is not None:
            fresh.record(sched, {}, aux)
            chain, _, _ = fresh.propose([seq], [k])
            first_branch = [d for p, d in zip(shape.cut(k).paths, drafts) if set(p) == {0}]
            assert first_branch == chain[0], f"proposal {i}: the first branch is not the chain"
        fresh.release_except(set())


def test_a_bad_head_is_one_line_naming_its_file(tiny6, head6, default_gguf, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((Path(head6) / "config.json").read_text())
    tensors = load_file(Path(head6) / "model.safetensors")
    del tensors["fc.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    cfg = {"method": "eagle3", "model": str(bad), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"model\.safetensors: missing 1 weight.*fc\.weight"):
        LLM(tiny6, tokenizer=default_gguf, dtype="float32", speculative_config=cfg)
    cfg_json = json.loads((Path(head6) / "config.json").read_text())
    cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (bad / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ValueError, match=r"config\.json: .*three layers of the target's 6"):
        LLM(tiny6, tokenizer=default_gguf, dtype="float32", speculative_config=cfg)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_bf16_with_the_kernels_is_plain_decoding(tiny6, head6, default_gguf, tree):
    """bf16 runs the C++ decoder stack in segments around the captured layers (a tree's mask through it), and the
    head on the kernels."""
    prompts = [[5, 6, 7, 8] * 5, list(range(10, 33)), [1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny6, tokenizer=default_gguf, dtype="bfloat16", block_size=BLOCK)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(tiny6, tokenizer=default_gguf, dtype="bfloat16", block_size=BLOCK,
               speculative_config={"method": "eagle3", "model": head6, "num_speculative_tokens": 6 if tree else 3,
                                   "adaptive": False, "speculative_token_tree": tree})
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    assert [o.outputs[0].token_ids for o in outs] == want
    assert spec.engine.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_quantized_head_drafts_as_the_float_one_and_leaves_output_unchanged(tiny6, head6, default_gguf, method):
    """speculative_config.quantization: every linear of the head runs quantized (the one over the draft vocabulary
    int8 under int4), its logits stay close to the float head's, and greedy output is plain decoding's."""
    from pagoda.layers.linear import Linear

    prompts = [[5, 6, 7, 8] * 5, list(range(10, 33)), [1, 2, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny6, tokenizer=default_gguf, dtype="float32", block_size=BLOCK)
            .generate(prompts, params, use_tqdm=False)]
    heads = {}
    for q in (None, method):
        cfg = {"method": "eagle3", "model": head6, "num_speculative_tokens": 3, "adaptive": False, "quantization": q}
        spec = LLM(tiny6, tokenizer=default_gguf, dtype="float32", block_size=BLOCK, speculative_config=cfg)
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
        assert spec.engine.speculator.stats.num_draft_tokens > 0
        heads[q] = spec.engine.speculator.drafter.head
    formats = {name: m.qweight.format for name, m in heads[method].named_modules() if isinstance(m, Linear)}
    assert formats == {"fc": method, "self_attn.qkv_proj": method, "self_attn.o_proj": method,
                       "mlp.gate_up_proj": method, "mlp.down_proj": method,
                       "lm_head": "int8" if method == "int4" else method}
    states = torch.randn(64, 3 * heads[None].hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact, got = (h.logits(h.fc(states)) for h in heads.values())
    assert torch.nn.functional.cosine_similarity(exact, got, dim=-1).min() > (0.95 if method == "int4" else 0.99)


def test_a_quantized_head_is_refused_where_no_head_drafts():
    from pagoda.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculative_config.quantization applies to methods eagle3, mtp"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                     "quantization": "int8"})
    with pytest.raises(ValueError, match="speculative_config.quantization: 'gguf'; choose one of int8, int4, fp8"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "m", "num_speculative_tokens": 2,
                                     "quantization": "gguf"})


def test_pending_states_past_the_cap_keep_the_newest(monkeypatch):
    """A sequence that does not draft keeps at most MAX_PENDING positions' states; the head then starts over
    after the dropped ones, and the kept rows are the newest, in order."""
    import pagoda.spec_decode.head_proposer as e3

    monkeypatch.setattr(e3, "MAX_PENDING", 8)
    head = SimpleNamespace(allocate_kv=lambda *a: None, to_target=lambda ids: ids,
                           draft_vocab_size=4)
    proposer = HeadProposer(head, 4, BLOCK, 64)  # type: ignore[arg-type]
    seq = SimpleNamespace(seq_id=7, num_computed_tokens=0, finished=False)
    computed = 0
    for n in (5, 3, 1, 4):  # steps of 5, 3, 1 and 4 positions; rows hold their position
        aux = torch.arange(computed, computed + n, dtype=torch.float32)[:, None]
        sched = SimpleNamespace(seqs=[seq], num_scheduled=[n])
        seq.num_computed_tokens = computed = computed + n
        proposer.record(sched, {}, aux)
    st = proposer.seqs[7]
    assert (st.base, st.computed, st.num_pending, st.end) == (5, 5, 8, 13)
    rows = torch.cat([aux[off:off + n] for aux, off, n in st.pending])
    assert rows[:, 0].tolist() == list(range(5, 13))
