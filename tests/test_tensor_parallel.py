"""Tensor parallelism: each rank's shard, and a TP engine's outputs against the single-process engine's.

Two levels: the sharding math of every model family and weight format runs N ranks as threads of this process
(a thread communicator: the same shards, wrappers and collectives' sums, no process start-up), compared with
one runner on the same batch; the engine runs as it ships, with worker processes and shared-memory collectives,
through the offline API, the server and a killed rank.

Logits of a TP=N fp32 run differ from TP=1 by rounding only (partial sums of o_proj and down_proj add in another
order): within 1e-4 relative to the logits' scale, far below what a wrong shard gives (O(1)). Greedy tokens may
then differ only at a near-tie, which these prompts avoid (checked below with the TP=1 margins).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_tiny_model, build_tiny_moe

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig, resolve_dtype
from pagoda.distributed.errors import WorkerDiedError
from pagoda.distributed.tensor_parallel import Shard
from pagoda.executor.model_runner import ModelRunner, rows_input
from pagoda.model.args import ModelArgs
from pagoda.model.loader import resolve_model_files
from pagoda.outputs import RequestOutput

ROWS = [([5, 9, 17, 33, 100, 200, 7, 1, 44, 90, 3, 250, 61, 18, 77, 12, 6, 301, 8], 0, [0, 1]),
        ([3, 4, 5], 0, [2]), ([400, 11, 28, 91, 40], 0, [3])]


class ThreadCommunicator:
    """N ranks as threads of one process: each collective exchanges the ranks' tensors through a shared list and
    sums them in rank order in fp32, as the shared-memory communicator does."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared = rank, shared
        self.world_size = len(shared["slots"])

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.shared["slots"][self.rank] = t.clone()
        self.shared["barrier"].wait()
        parts = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> None:
        parts = self._exchange(t)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        t.copy_(acc.to(t.dtype))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(t))

    def broadcast_object(self, obj: object | None) -> object:
        raise NotImplementedError

    def close(self) -> None:
        pass


def run_sharded(model: str, world: int, rows=ROWS, **kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of `rows` from one runner, and from each of `world` ranks (threads) holding their shards."""
    cfg = EngineConfig.from_kwargs(model, kv_cache_memory="16MiB", **kw)
    files = resolve_model_files(cfg.model)
    args = ModelArgs.from_hf_config(files.hf_config)
    dtype, policy = resolve_dtype(cfg.dtype), cfg.kernel_policy()
    single = ModelRunner(cfg, files, args, dtype, policy)
    single.allocate_kv_cache(8)
    want = single.run(rows_input(rows, cfg.cache.block_size, None)).sample_logits
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=120)}
    outs: list[torch.Tensor | BaseException | None] = [None] * world

    def rank(r: int) -> None:
        try:
            runner = ModelRunner(cfg, files, args, dtype, policy, Shard.of(args, r, world),
                                 ThreadCommunicator(r, shared))  # type: ignore[arg-type]
            runner.allocate_kv_cache(8)
            outs[r] = runner.run(rows_input(rows, cfg.cache.block_size, None)).sample_logits
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            shared["barrier"].abort()
            outs[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in outs if isinstance(o, BaseException)]
    if errors:  # the rank that failed first, not the ones its abort woke
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return want, outs  # type: ignore[return-value]


def assert_matches_single(want: torch.Tensor, outs: list[torch.Tensor], rtol: float = 1e-4) -> None:
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), "ranks disagree: their hidden states must be identical"
    scale = want.abs().max().item()
    err = (outs[0] - want).abs().max().item()
    assert err <= rtol * scale, f"TP logits differ from one process by {err:.3g} (scale {scale:.3g})"
    assert torch.equal(outs[0].argmax(-1), want.argmax(-1))


# ---- shards ------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(kv=st.integers(1, 12), group=st.integers(1, 6), world=st.integers(1, 16), vocab=st.integers(256, 5000))
def test_shards_cover_every_head_column_and_token_once(kv: int, group: int, world: int, vocab: int) -> None:
    a = ModelArgs("LlamaForCausalLM", vocab, 64, 384, 2, kv * group, kv, 16)
    try:
        shards = [Shard.of(a, r, world) for r in range(world)]
    except ValueError as e:
        assert world > kv and (world % kv or (kv * group) % world), e
        return
    q = [h for s in shards for h in s.q_heads]
    assert q == list(range(kv * group))  # every query head on exactly one rank, in order
    for s in shards:  # a rank's query heads read only the KV heads it holds
        assert {h // group for h in s.q_heads} <= set(s.kv_heads) and len(s.q_heads) > 0
    kvs = [h for s in shards for h in s.kv_heads]
    assert sorted(set(kvs)) == list(range(kv)) and (world <= kv) == (len(kvs) == kv)
    assert [t for s in shards for t in s.vocab] == list(range(vocab))
    assert [c for s in shards for c in s.intermediate] == list(range(384))
    assert shards[0].local_args(a).num_kv_heads == max(len(s.kv_heads) for s in shards)  # rank 0 sizes the pool


def test_sizes_that_cannot_split_fail_clearly() -> None:
    a = ModelArgs("LlamaForCausalLM", 512, 64, 128, 2, 6, 3, 16)
    with pytest.raises(ValueError, match="cannot split 6 attention heads over 3 KV heads"):
        Shard.of(a, 0, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig.from_kwargs(None, tensor_parallel_size=0)


# ---- every family and format, ranks as threads ---------------------------------------------------------
@pytest.fixture(scope="module")
def uneven_llama(tmp_path_factory) -> str:
    """6 query heads over 3 KV heads: two ranks hold 2 and 1 KV groups (SmolLM2's 9/3 split the same way)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("uneven"), "llama", hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=3, intermediate_size=192))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_families_fp32(arch: str, tmp_path: Path) -> None:
    model = str(build_tiny_model(tmp_path, arch, attention_bias=True) if arch == "llama"
                else build_tiny_model(tmp_path, arch))  # llama with biases: o_proj's is added once
    assert_matches_single(*run_sharded(model, 2, dtype="float32"))


def test_uneven_heads_and_replicated_kv_heads(uneven_llama: str, tiny_llama: str) -> None:
    assert_matches_single(*run_sharded(uneven_llama, 2, dtype="float32"))
    assert_matches_single(*run_sharded(tiny_llama, 4, dtype="float32"))  # 2 KV heads, each on 2 ranks


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "glm4_moe"])  # glm4_moe: shared experts split too
def test_mixture_of_experts(arch: str, tmp_path: Path) -> None:
    assert_matches_single(*run_sharded(str(build_tiny_moe(tmp_path, arch)), 2, dtype="float32"))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma(arch: str, tmp_path: Path) -> None:
    from test_gemma import build_gemma

    assert_matches_single(*run_sharded(build_gemma(tmp_path, arch), 2, dtype="float32"))


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_weights_shard_on_their_groups(tiny_llama: str, quantization: str) -> None:
    """Quantized before sharding: each rank holds exactly the single process's codes and scales."""
    assert_matches_single(*run_sharded(tiny_llama, 2, dtype="float32", quantization=quantization,
                                       quantization_group_size=32))


def test_a_split_inside_a_quantization_group_is_refused(tmp_path: Path) -> None:
    """3 ranks split an MLP of 256 as 128 + 64 + 64 columns: rank 2's starts inside a group of 128."""
    model = str(build_tiny_model(tmp_path, "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                 intermediate_size=256))
    with pytest.raises(ValueError, match=r"down_proj.weight splits at input column 1[29][28] .*groups of 128"):
        run_sharded(model, 3, dtype="float32", quantization="int4", quantization_group_size=128)


@pytest.mark.long
def test_bfloat16_stays_as_close_to_fp32_as_one_process(default_gguf: str) -> None:
    """bf16 rounds each rank's partial sums: TP=2's distance to the fp32 logits is the single process's, give or
    take rounding noise, on the real embedded model (9 heads over 2 ranks: 6 and 3)."""
    fp32, _ = run_sharded(default_gguf, 1, dtype="float32")
    want, outs = run_sharded(default_gguf, 2, dtype="bfloat16")
    assert all(torch.equal(o, outs[0]) for o in outs)
    single_err = (want - fp32).abs().mean().item()
    tp_err = (outs[0] - fp32).abs().mean().item()
    assert tp_err < 1.5 * single_err, (tp_err, single_err)


@pytest.mark.parametrize("quantization", ["gguf", "int4"])
def test_gguf_blocks_shard_as_stored(default_gguf: str, quantization: str) -> None:
    """The embedded GGUF's Q8_0/Q4 blocks (groups of 32) split by rows and on whole blocks; fp32 activations."""
    assert_matches_single(*run_sharded(default_gguf, 2, dtype="float32", quantization=quantization), rtol=2e-4)


# ---- the engine as it ships: worker processes, shared-memory collectives ------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "The capital of France is Paris. The capital of Italy is", "1, 2, 3, 4,"]


def greedy(llm: LLM, max_tokens: int = 24, prompt_logprobs: int | None = None) -> list[RequestOutput]:
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
                        use_tqdm=False)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def engines():
    """Engines made in a test, closed after it (their worker ranks stopped)."""
    made: list[LLM] = []

    def make(model: str, **kw) -> LLM:
        made.append(LLM(model, **kw))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


def test_tp2_engine_equals_one_process(default_gguf: str, engines) -> None:
    """fp32, the embedded model split 6 + 3 heads: greedy tokens and prompt logprobs as one process gives them, with
    chunked prefill (budget 16), prefix hits (prompts 1 and 4 share a prefix; the second pass hits every prompt)
    and preemption (a pool too small for all five at once)."""
    kw = dict(dtype="float32", max_num_batched_tokens=16, block_size=4, kv_cache_memory="3MiB")
    one = engines(default_gguf, **kw)
    want = greedy(one, prompt_logprobs=1)
    tp = engines(default_gguf, tensor_parallel_size=2, **kw)
    workers = tp.engine.runner.workers
    assert len(workers) == 1 and workers[0].is_alive() and os.sched_getaffinity(workers[0].pid).isdisjoint(
        os.sched_getaffinity(0)) == (os.cpu_count() >= 2)
    got = greedy(tp, prompt_logprobs=1)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):  # each prompt token's logprob
        for tok, lg, lw in zip(w.prompt_token_ids[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-3
    assert tp.engine.stats.num_scheduled_tokens > 0 and tp.engine.scheduler.num_preemptions > 0
    again = greedy(tp)  # every prompt now a prefix-cache hit
    assert tokens(again) == tokens(want)


@pytest.mark.long
@pytest.mark.parametrize("kw", [dict(dtype="bfloat16", quantization="gguf"),
                                dict(dtype="float32", quantization="int4",
                                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["bf16-gguf", "int4-ngram"])
def test_tp2_engine_quantized_and_speculative(default_gguf: str, engines, kw: dict) -> None:
    """Quantized weights shard on their blocks; n-gram speculation verifies through the TP forward. fp32 is
    compared token for token; bf16 rounds differently per rank count, so where a continuation first parts from
    one rank's, the token two ranks chose must have been a near tie there (the continuations differ after it):
    bf16 logits of this model's size are 0.125 apart, and the rounding of 30 layers moves them a few steps."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    want = [o.outputs[0] for o in engines(default_gguf, **kw).generate(PROMPTS, params, use_tqdm=False)]
    got = tokens(greedy(engines(default_gguf, tensor_parallel_size=2, **kw), max_tokens=16))
    if kw["dtype"] == "float32":
        assert got == [w.token_ids for w in want]
        return
    for g, w in zip(got, want):
        split = next((i for i, (a, b) in enumerate(zip(g, w.token_ids)) if a != b), None)
        if split is None:
            continue
        top = w.logprobs[split]
        assert g[split] in top, (g, w.token_ids)
        assert top[w.token_ids[split]].logprob - top[g[split]].logprob <= 0.5, (split, top)


@pytest.mark.long
def test_a_killed_rank_ends_the_engine_with_a_clear_error(default_gguf: str, engines) -> None:
    llm = engines(default_gguf, tensor_parallel_size=2, dtype="float32")
    assert tokens(greedy(llm, max_tokens=2))
    os.kill(llm.engine.runner.workers[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1"):
        greedy(llm, max_tokens=4)
    assert time.monotonic() - t0 < 10


# ---- start-up: a rank that cannot start fails the caller, a script from stdin starts ---------------------------
_TP_SCRIPT = """
import sys, time
from pagoda import LLM, SamplingParams
from pagoda.distributed.errors import WorkerDiedError
t0 = time.monotonic()
try:
    llm = LLM(sys.argv[1] if len(sys.argv) > 1 else {model!r}, tensor_parallel_size=2, dtype="float32",
              kv_cache_memory="8MiB", max_model_len=256)
except WorkerDiedError as e:
    print(f"WorkerDiedError after {{time.monotonic() - t0:.1f}} s: {{e}}")
    sys.exit(3)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print("generated:", len(out[0].outputs[0].token_ids))
llm.close()
"""
# In a spawned rank only (it is unpickling its Process object): importing the worker function's module fails.
_BREAK_RANK_IMPORT = """
import multiprocessing, sys
class _Break:
    def find_spec(self, name, path=None, target=None):
        if name == "pagoda.executor.multiproc" and getattr(multiprocessing.current_process(), "_inheriting", 0):
            raise ImportError("injected: this rank cannot import pagoda.executor.multiproc")
        return None
sys.meta_path.insert(0, _Break())
"""


def _run_tp_script(model: str, tmp_path: Path, *, stdin: bool, hook: str | None = None) -> tuple[str, float]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    path = [repo]
    if hook is not None:
        (tmp_path / "sitecustomize.py").write_text(hook)
        path.insert(0, str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")])
    script = _TP_SCRIPT.format(model=model)
    t0 = time.monotonic()
    if stdin:  # `python - < script.py`: spawn cannot re-run a main script that has no file
        out = subprocess.run([sys.executable, "-"], input=script, env=env, capture_output=True, text=True,
                             timeout=240)
    else:
        (tmp_path / "tp_script.py").write_text(script)  # no `if __name__ == "__main__":` guard
        out = subprocess.run([sys.executable, str(tmp_path / "tp_script.py")], env=env, capture_output=True,
                             text=True, timeout=240)
    return out.stdout + out.stderr, time.monotonic() - t0


@pytest.mark.long
def test_a_rank_that_cannot_import_fails_the_caller_within_seconds(default_gguf: str, tmp_path: Path) -> None:
    out, seconds = _run_tp_script(default_gguf, tmp_path, stdin=False, hook=_BREAK_RANK_IMPORT)
    assert "WorkerDiedError after" in out, out
    assert "tensor-parallel rank 1 exited during start-up" in out
    assert "injected: this rank cannot import" in out.split("WorkerDiedError after", 1)[1]  # the rank's own words
    assert seconds < 60


@pytest.mark.long
@pytest.mark.parametrize("stdin", [True, False], ids=["script-from-stdin", "script-without-main-guard"])
def test_tp_starts_from_any_main_script(default_gguf: str, tmp_path: Path, stdin: bool) -> None:
    out, _ = _run_tp_script(default_gguf, tmp_path, stdin=stdin)
    assert "generated: 4" in out, out
