"""train-eagle: the dense training module against the paged inference head, the published format, and training
(with resume) on a tiny random target."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model, save_byte_tokenizer

from pagoda.spec_decode.eagle3_head import WEIGHTS_FILE, Eagle3Config, load_head, save_head

DRAFT_VOCAB = 300  # below the tiny target's 512: d2t maps draft ids to other target ids


@pytest.fixture
def target(tiny_llama_byte_tokenizer: Path):
    from pagoda import LLM

    return LLM(str(tiny_llama_byte_tokenizer), dtype="float32", kernels="torch", kv_cache_memory="8MiB")


def _random_head(runner, seed: int = 0):
    from pagoda.spec_decode.eagle3_train import new_head

    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(runner.args.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values - torch.arange(DRAFT_VOCAB)
    head = new_head(runner, Eagle3Config.for_target(runner.args, DRAFT_VOCAB), d2t, seed)
    with torch.no_grad():  # norms away from one and a larger scale, so that every term shows in the outputs
        for name, p in head.named_parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=g))
    return head


def test_dense_unrolled_steps_equal_the_paged_head_drafting_a_chain(target, tmp_path: Path) -> None:
    """Step 0 over a sequence, then steps 1 and 2 of the chain from anchor 9, through Eagle3Head over paged KV,
    equal the dense training module's steps at the same anchors (TTT attention is what a chain sees)."""
    from pagoda.executor.model_runner import FlatBatch
    from pagoda.kernels.policy import KernelPolicy

    runner = target.engine.runner
    dense = _random_head(runner)
    config = dense.config
    torch.manual_seed(1)
    ids = torch.randint(3, 256, (13,))
    aux = runner.hidden_states(ids.tolist(), config.aux_layers)[0].clone()
    states, logits = dense.unroll(aux[None], ids[None], 3)

    save_head(tmp_path / "head", config, dense.tensors(runner.args.vocab_size))
    head = load_head(tmp_path / "head", runner.args, runner.model.embed_tokens, torch.float32,
                     KernelPolicy.resolve("torch"))
    head.allocate_kv(4, 4)
    table = [0, 1, 2, 3]
    anchor = 9
    batch = FlatBatch(4)
    batch.add(ids[1:anchor + 2].tolist(), 0, table)
    with torch.no_grad():
        state = head(ids[1:anchor + 2], aux[:anchor + 1], torch.arange(anchor + 1), batch.metadata(torch.device("cpu")),
                     from_target=True)
        torch.testing.assert_close(state, states[0][0, :anchor + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.logits(state), logits[0][0, :anchor + 1], atol=1e-5, rtol=1e-5)
        state = state[anchor:]
        for j in (1, 2):
            batch = FlatBatch(4)
            batch.add([int(ids[anchor + 1 + j])], anchor + j, table)
            state = head(ids[anchor + 1 + j:anchor + 2 + j], state, torch.tensor([anchor + j]),
                         batch.metadata(torch.device("cpu")), from_target=False)
            torch.testing.assert_close(state[0], states[j][0, anchor], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(head.logits(state)[0], logits[j][0, anchor], atol=1e-5, rtol=1e-5)
    draft = torch.arange(DRAFT_VOCAB)
    assert torch.equal(head.to_target(draft), dense.to_target(draft))


def test_saved_head_loads_back_and_a_broken_file_is_a_one_line_error(target, tmp_path: Path) -> None:
    from pagoda.kernels.policy import KernelPolicy

    runner = target.engine.runner
    dense = _random_head(runner)
    tensors = dense.tensors(runner.args.vocab_size)
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{m}.weight" for m in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert int(tensors["t2d"].sum()) == DRAFT_VOCAB
    folder = tmp_path / "head"
    save_head(folder, dense.config, tensors)

    def load():
        return load_head(folder, runner.args, runner.model.embed_tokens, torch.float32, KernelPolicy.resolve("torch"))

    head = load()
    attn = dense.midlayer.self_attn
    assert torch.equal(head.self_attn.qkv_proj.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(head.lm_head.weight, dense.lm_head.weight) and torch.equal(head.d2t, dense.d2t)
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == DRAFT_VOCAB

    weights = folder / WEIGHTS_FILE
    for broken in ({k: v for k, v in tensors.items() if k != "fc.weight"},
                   {**tensors, "midlayer.mlp.up_proj.weight": tensors["midlayer.mlp.up_proj.weight"][:-1]}):
        save_file(broken, str(weights))
        with pytest.raises(ValueError) as e:
            load()
        assert str(weights) in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def looping_target(tmp_path_factory) -> Path:
    """A tiny random Llama whose small weights make its greedy text fall into short loops: structure a head can
    learn from some lines and find again on others."""
    folder = build_tiny_model(tmp_path_factory.mktemp("looping"), "llama", initializer_range=0.05)
    save_byte_tokenizer(folder)
    return folder


def _corpus(path: Path, lines: int) -> Path:
    """Distinct prompts (no held-out line repeats a training one), every fourth as a JSON line."""
    words = ["abc", "hello world", "one two three", "xyz xyz", "the cat sat"]
    text = [f"{words[i % 5]} {words[(i * 3 + i // 5) % 5]} {i}" for i in range(lines)]
    path.write_text("\n".join(json.dumps({"text": t}) if i % 4 == 0 else t for i, t in enumerate(text)) + "\n")
    return path


def _options(model: Path, corpus: Path, out: Path, **kw):
    from pagoda.spec_decode.eagle3_train import TrainOptions

    return TrainOptions(corpus=str(corpus), output=str(out), model=str(model), data="self", gen_tokens=24,
                        seq_len=48, holdout=0.2, batch_size=4, eval_k=4, progress=False,
                        engine={"dtype": "float32", "kernels": "torch", "kv_cache_memory": "8MiB"}, **kw)


def test_training_writes_the_head_and_resumes_from_its_last_checkpoint(looping_target: Path, tmp_path: Path) -> None:
    from pagoda import LLM
    from pagoda.kernels.policy import KernelPolicy
    from pagoda.model.args import ModelArgs
    from pagoda.spec_decode.eagle3_train import checkpoint_state, train

    corpus, out = _corpus(tmp_path / "corpus.txt", 20), tmp_path / "out"
    first = train(_options(looping_target, corpus, out, max_steps=5, checkpoint_every=2), LLM)
    assert first["steps"] == 5 and first["resumed_from_step"] == 0
    assert first["holdout_sequences"] == 4 and first["acceptance"]["steps"] > 0
    for name in ("config.json", WEIGHTS_FILE, "train_report.json", "checkpoint/head.safetensors",
                 "checkpoint/optimizer.safetensors", "checkpoint/state.json", "data/self.jsonl"):
        assert (out / name).is_file(), name
    assert checkpoint_state(out / "checkpoint")["step"] == 5
    generated = (out / "data" / "self.jsonl").read_text()

    second = train(_options(looping_target, corpus, out, max_steps=8, checkpoint_every=2), LLM)
    assert second["resumed_from_step"] >= 4 and second["steps"] == 8
    assert (out / "data" / "self.jsonl").read_text() == generated  # the generations were reused, not redone
    moments = load_file(str(out / "checkpoint" / "optimizer.safetensors"))
    assert "fc.weight.exp_avg" in moments and checkpoint_state(out / "checkpoint")["adam_step"] == 8

    args = ModelArgs.from_hf_config(json.loads((looping_target / "config.json").read_text()))
    load_head(out, args, torch.nn.Embedding(args.vocab_size, args.hidden_size), torch.float32,
              KernelPolicy.resolve("torch"))
    with pytest.raises(ValueError, match="lr 0.001 -> 0.01"):
        train(_options(looping_target, corpus, out, max_steps=9, lr=1e-2), LLM)


def test_kept_teacher_outputs_train_the_same_head_without_the_target(looping_target: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Epochs after the first read the target's outputs kept from it: the head is bit for bit the one trained
    with the target run again for every batch (--teacher-cache-gib 0), and the target runs once per sequence.
    Both runs keep their thread count (no governor): torch's sums, and so the head's bits, may follow it."""
    from pagoda import LLM
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.spec_decode.eagle3_train import lr_share, train

    forwards: list[int] = []
    real = ModelRunner.hidden_states
    monkeypatch.setattr(ModelRunner, "hidden_states", lambda self, ids, layers: (forwards.append(len(ids)),
                                                                                 real(self, ids, layers))[1])
    corpus = _corpus(tmp_path / "corpus.txt", 20)  # 16 training lines: 4 batches an epoch
    heads, calls, engines = [], [], []

    def llm_class(*args, **kw):
        llm = LLM(*args, **kw)
        engines.append(llm.engine)
        return llm

    for gib in (0.0, 4.0):
        forwards.clear()
        report = train(_options(looping_target, corpus, tmp_path / f"out{gib}", max_steps=10, teacher_cache_gib=gib),
                       llm_class)
        assert report["epochs"] == 2.5
        heads.append(load_file(str(tmp_path / f"out{gib}" / WEIGHTS_FILE)))
        calls.append(len(forwards))
    assert heads[0].keys() == heads[1].keys()
    for name in heads[0]:
        assert torch.equal(heads[0][name], heads[1][name]), name
    assert calls[0] - calls[1] == 10 * 4 - 16  # the held-out report runs the target alike in both
    assert [e.thread_governor for e in engines] == [None, None]
    assert lr_share(0) == 1 and lr_share(1) == pytest.approx(0.05) and lr_share(0.5) == pytest.approx(0.525)


@pytest.mark.long
def test_self_distilled_head_reaches_the_acceptance_bar(looping_target: Path, tmp_path: Path) -> None:
    """The issue's bar: a mean acceptance length above 1.5 on held-out prompts' greedy continuations (an
    untrained head's is 1.0: the smoke test's 5 steps leave it there)."""
    from pagoda import LLM
    from pagoda.spec_decode.eagle3_train import train

    corpus = _corpus(tmp_path / "corpus.txt", 240)
    report = train(_options(looping_target, corpus, tmp_path / "out", max_steps=300, lr=3e-3), LLM)
    print(report["acceptance"])
    assert report["acceptance"]["mean_acceptance_length"] > 1.5


@pytest.mark.parametrize("flags,lines,message", [
    (["--ttt-steps", "0"], 10, "ttt_steps must be at least 1"),
    (["--teacher-cache-gib", "-1"], 10, "teacher_cache_gib must be at least 0"),
    (["--data", "self", "--seq-len", "64", "--gen-tokens", "64"], 10, "seq_len 64 must exceed gen_tokens 64"),
    (["--holdout", "1"], 10, "holdout"),
    ([], 1, "at least 2 are needed"),
])
def test_train_eagle_refuses_bad_arguments_before_the_model_loads(monkeypatch, capsys, tmp_path, flags, lines,
                                                                   message) -> None:
    from pagoda.entrypoints import cli

    monkeypatch.setattr("pagoda.entrypoints.llm.LLMEngine", lambda *a, **k: pytest.fail("engine built"))
    corpus = _corpus(tmp_path / "corpus.txt", lines)
    assert cli.main(["train-eagle", "--corpus", str(corpus), "--output", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def _hits(accepted: list[int], k: int) -> torch.Tensor:
    """chain_acceptance's form: per anchor, the first `accepted[a]` drafts accepted."""
    return torch.tensor([[j < n for j in range(k)] for n in accepted])


def test_the_acceptance_report_counts_the_chains_decoding_verifies(monkeypatch) -> None:
    """After a chain accepts n drafts, decoding's next chain starts n + 1 positions on; the anchors it skips do not
    count, and an anchor after a rejection (often a hard one) does. The report's length is over those chains."""
    from types import SimpleNamespace

    from pagoda.spec_decode import eagle3_train
    from pagoda.spec_decode.eagle3_train import Sample, evaluate
    from pagoda.spec_decode.eagle3_ttt import decoding_steps

    accepted = [2, 3, 3, 0, 1, 3, 3, 3, 0, 2]  # anchors 0, 3, 4 and 6 are verified: 2, 0, 1 and 3 accepted
    hits = _hits(accepted, 3)
    assert torch.equal(decoding_steps(hits), _hits([2, 0, 1, 3], 3))
    teacher = SimpleNamespace(batch=lambda samples: SimpleNamespace(
        ids=torch.zeros(1, 15, dtype=torch.int64), aux=torch.zeros(1, 15, 4), greedy=torch.zeros(1, 15)))
    monkeypatch.setattr(eagle3_train, "chain_acceptance", lambda *args: hits)
    report = evaluate(teacher, None, [Sample(list(range(15)), 1)], 3)  # type: ignore[arg-type]
    assert report["steps"] == 4 and report["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert report["acceptance_per_position"] == [0.75, 0.5, 0.25]
    assert report["per_anchor"] == {"anchors": 10, "mean_acceptance_length": pytest.approx(1 + 20 / 10),
                                    "acceptance_per_position": [0.8, 0.7, 0.5]}
