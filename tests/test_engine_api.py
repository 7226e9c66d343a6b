"""The offline API as a user meets it: defaults, stop rules, chat, errors, and the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda import LLM, SamplingParams


def test_generate_and_chat_on_the_embedded_model(smollm_llm):
    outs = smollm_llm.generate(["The capital of France is", "def fib(n):"],
                               SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 16
    chat = smollm_llm.chat([{"role": "user", "content": "Name three colors."}],
                           SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.text.strip()
    assert "<|im_end|>" not in chat.text


def test_stop_string_ends_generation_and_is_not_in_the_text(smollm_llm):
    base = smollm_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16),
                               use_tqdm=False)[0].outputs[0].text
    assert "." in base
    out = smollm_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=16, stop="."),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "."
    assert out.text == base[: base.index(".")]
    kept = smollm_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=16, stop=["."], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == base[: base.index(".") + 1]


def test_prompt_longer_than_context_is_rejected_with_a_clear_error(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(100))], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([list(range(10))], SamplingParams(max_tokens=60), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    # The engine still serves after rejecting.
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_request_that_can_never_fit_the_pool_is_rejected_not_left_hanging(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", block_size=4, kv_cache_memory=8 * 2048)
    assert llm.engine.kv.pool.num_blocks == 8
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(20))], SamplingParams(max_tokens=20), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_model_path_and_malformed_config_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config"):
        LLM(str(tmp_path))


def test_unknown_engine_argument_is_a_type_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_a_renamed_engine_argument_still_works_with_a_warning():
    from pagoda.config import EngineConfig

    with pytest.warns(DeprecationWarning, match="quant_activations"):
        config = EngineConfig.from_kwargs(int4_activations="int8")
    assert config.quant_activations == "int8"
    with pytest.raises(TypeError, match="one setting"), pytest.warns(DeprecationWarning):
        EngineConfig.from_kwargs(int4_activations="int8", quant_activations="float")


def test_cli_generate_prints_the_completion():
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "generate", "The capital of France is",
                        "--max-tokens", "8", "--dtype", "float32", "--kv-cache-memory", "64MiB"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is") and "Paris" in r.stdout


def test_engine_stats_count_what_waits_runs_and_is_cached(tiny_llama, default_gguf):
    llm = LLM(tiny_llama, tokenizer=default_gguf, dtype="float32", kv_cache_memory="16MiB", block_size=4)
    eng = llm.engine
    idle = eng.engine_stats()
    assert (idle.num_running, idle.num_waiting, idle.kv_cache_usage) == (0, 0, 0.0)
    assert idle.num_free_blocks == eng.kv.pool.num_blocks
    prompt = list(range(1, 19))
    eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    assert eng.engine_stats().num_waiting == 1
    eng.step()
    busy = eng.engine_stats()
    assert (busy.num_running, busy.num_waiting) == (1, 0) and busy.kv_cache_usage > 0
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request(prompt, SamplingParams(max_tokens=1))
    eng.step()
    again = eng.engine_stats()
    assert again.prefix_cache_queries == 2 * len(prompt) and again.prefix_cache_hits >= 16  # 4 full blocks


def test_sent_choice_records_text_and_tokens_sent():
    from pagoda.entrypoints.server.serving import SentChoice

    s = SentChoice()
    assert s.advance("Hel", 2, False) == 0
    assert s.advance("Hello", 3, True) == 2 and (s.text, s.tokens, s.done) == (5, 3, True)


def test_a_request_arrives_when_its_input_is_processed_not_when_the_engine_takes_it(smollm_llm):
    """Queueing and time to first token count from the request's arrival (the input processor's stamp), so the
    wait for a step already running, between the route and the engine thread, is in them."""
    import time

    engine = smollm_llm.engine
    t0 = time.time()
    processed = engine.input_processor.process("Hello", SamplingParams(max_tokens=2, temperature=0))
    time.sleep(0.2)  # the engine thread is busy with a step
    req = engine.add_processed(processed, "arrival-check")
    assert t0 <= req.metrics.arrival_time <= t0 + 0.1
    while not req.finished:
        engine.step()
    assert req.metrics.first_token_time - req.metrics.arrival_time >= 0.2
