"""The `pagoda` command as a newcomer meets it: help and defaults on a plain install, arguments checked
before the model loads, chat's Ctrl-C and sampling defaults, tok/s lines, the kernel build's cache and
notice, bench serve without a server, and the modes of written checkpoint files."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pagoda
from pagoda.entrypoints import cli

REPO = Path(__file__).resolve().parent.parent

# What a plain `pip install pagoda` lacks: the test extras. A command must not need them to start.
TEST_ONLY = ("pytest", "hypothesis", "openai", "anthropic", "matplotlib", "sentence_transformers", "schemathesis")
_BLOCK_TEST_ONLY = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {TEST_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, _Absent())
"""

COMMANDS = [["generate"], ["chat"], ["serve"], ["quantize"], ["bench"], ["bench", "throughput"],
            ["bench", "serve"], ["bench", "quant"], ["bench", "structured"], ["eval"], ["eval", "perplexity"],
            ["kernels"], ["batch"], ["batch", "run"], ["bench", "embed"], ["train-eagle"]]


def _run_cli(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`pagoda ARGV` in a fresh interpreter where the test-only packages cannot be imported."""
    code = _BLOCK_TEST_ONLY + "from pagoda.entrypoints.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _parsers(p: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                out += _parsers(sp, (*path, name))
    return out


def test_every_command_in_the_parser_is_covered():
    """COMMANDS below lists what build_parser offers: a new subcommand must get its --help run too."""
    found = {path for path, _ in _parsers(cli.build_parser()) if path}
    assert found == {tuple(c) for c in COMMANDS}


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_command_help_runs_without_test_only_packages(argv):
    r = _run_cli([*argv, "--help"])
    assert r.returncode == 0, r.stderr
    assert "usage: pagoda " + " ".join(argv) in r.stdout


def test_no_pagoda_module_imports_a_test_only_package():
    """Every module the commands may import (lazily included): importable with the test extras absent,
    and none of them pulls one in."""
    code = _BLOCK_TEST_ONLY + f"""
import importlib, pkgutil, pagoda
for m in pkgutil.walk_packages(pagoda.__path__, "pagoda."):
    # peer_scripts run inside the peers' own environments; prebuilt holds the C++ kernels' libraries, which
    # torch.ops.load_library loads, not import
    if ".peer_scripts." not in m.name and not m.name.startswith("pagoda.kernels.prebuilt."):
        importlib.import_module(m.name)
print(sorted(k for k in sys.modules if k.partition(".")[0] in {TEST_ONLY!r}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# Every command: its --help needs no torch (the heavy modules import it where they run, not at the top).
LIGHT = [[], ["generate"], ["chat"], ["serve"], ["kernels"], ["bench", "serve"], ["bench", "structured"],
         ["bench", "embed"], ["eval", "perplexity"], ["bench", "throughput"], ["bench", "quant"], ["quantize"],
         ["train-eagle"]]


@pytest.mark.parametrize("argv", [[*c, "--help"] for c in LIGHT] + [["--version"]], ids=" ".join)
def test_help_and_version_import_no_torch(argv):
    code = ("import sys\nfrom pagoda.entrypoints.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('imported torch:', 'torch' in sys.modules, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "imported torch: False" in r.stderr, r.stderr


def test_version_flag_prints_the_version():
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", "--version"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0
    assert r.stdout.strip() == f"pagoda {pagoda.__version__}"


def test_every_flag_help_shows_its_default():
    for path, p in _parsers(cli.build_parser()):
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            if action.required:
                continue  # nothing to default to
            assert action.help, f"pagoda {' '.join(path)} {action.dest}: no help, so argparse shows no default"
            text = formatter._get_help_string(action) or ""
            assert "default" in text.lower(), f"pagoda {' '.join(path)} {action.dest}: {text!r}"


# ---- arguments checked before the model loads -----------------------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything gets as far as building an engine."""
    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("the engine was built before the arguments were checked")
    monkeypatch.setattr("pagoda.entrypoints.llm.LLMEngine", refuse)


@pytest.mark.parametrize("cmd", ["generate", "chat"])
@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["--kv-cache-memory", "0"], "kv_cache_memory"),
    (["--quantization", "int3"], "quantization"),
    (["--max-model-len", "0"], "max_model_len"),
    (["--speculative-config", '{"method": "bogus", "num_speculative_tokens": 2}'], "speculative_config"),
])
def test_bad_arguments_fail_before_the_model_loads(no_model_load, capsys, cmd, flags, message):
    argv = [cmd, "hello", *flags] if cmd == "generate" else [cmd, *flags]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_model_path_fails_before_anything_loads(no_model_load, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("pagoda.entrypoints.llm.LLM", lambda *a, **k: pytest.fail("LLM built"))
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_engine_config_is_validated_before_the_engine_is_built(no_model_load):
    from pagoda import LLM
    for kw in [{"dtype": "float64"}, {"kv_cache_memory": "lots"}, {"quantization": "int3"},
               {"quantization_group_size": 100}, {"speculative_config": {"method": "bogus"}}]:
        with pytest.raises(ValueError):
            LLM(None, **kw)


# ---- float16 -----------------------------------------------------------------------------------------

def test_float16_is_accepted_and_computes_in_a_cpu_dtype(monkeypatch, caplog):
    import pagoda.config as config

    monkeypatch.setattr(config, "_warned_float16", False)
    assert cli.build_parser().parse_args(["generate", "x", "--dtype", "float16"]).dtype == "float16"
    with caplog.at_level("WARNING", logger="pagoda.config"):
        got = config.resolve_dtype("float16")
        assert config.resolve_dtype("float16") == got
    assert got == (torch.bfloat16 if config.has_native_bf16() else torch.float32)
    warnings = [r for r in caplog.records if "float16" in r.getMessage()]
    assert len(warnings) == 1  # once per process, on one line
    assert "\n" not in warnings[0].getMessage()
    assert config.resolve_dtype("float16", device="cuda") == torch.float16


# ---- chat and generate with a stand-in engine --------------------------------------------------------

class FakeEngine:
    """Streams WORDS one per step; SIGINTs itself after `interrupt_after` steps (None: never)."""
    WORDS = ["Hello", " there", ",", " friend", "!"]

    def __init__(self, interrupt_after: int | None = None, finish: str = "stop") -> None:
        self.interrupt_after, self.finish = interrupt_after, finish
        self.requests: dict[str, Any] = {}
        self.params: list[Any] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.input_processor = self  # the chat loop renders conversations through it

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> list[int]:
        json.dumps(messages)
        return [1, 2, 3]

    def add_request(self, ids: list[int], params: Any) -> Any:
        rid = str(len(self.params))
        self.params.append(params)
        self.requests[rid] = 0
        return SimpleNamespace(request_id=rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)
        self.requests.pop(rid, None)

    def step(self) -> list[Any]:
        self.steps += 1
        if self.interrupt_after is not None and self.steps == self.interrupt_after:
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, in the middle of a reply
        outs = []
        for rid in list(self.requests):
            n = self.requests[rid] = self.requests[rid] + 1
            done = n == len(self.WORDS)
            outs.append(SimpleNamespace(request_id=rid, finished=done, outputs=[SimpleNamespace(
                text="".join(self.WORDS[:n]), token_ids=list(range(n)),
                finish_reason=(self.finish if done else None))]))
            if done:
                del self.requests[rid]
        return outs


def _chat(monkeypatch, engine: FakeEngine, lines: list[str], argv: tuple[str, ...] = ()) -> int:
    monkeypatch.setattr("pagoda.entrypoints.llm.LLM", lambda *a, **k: SimpleNamespace(engine=engine))
    feed = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    args = cli.build_parser().parse_args(["chat", *argv])
    try:
        return cli.cmd_chat(args)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during a reply escaped the chat")


def test_chat_ctrl_c_stops_the_reply_and_returns_to_the_prompt(monkeypatch, capsys):
    engine = FakeEngine(interrupt_after=2)
    asked: list[str] = []
    lines = iter(["hi", "again", "/quit", "never read"])

    def record(prompt: str = "") -> str:
        line = next(lines)
        asked.append(line)
        return line
    monkeypatch.setattr("pagoda.entrypoints.llm.LLM", lambda *a, **k: SimpleNamespace(engine=engine))
    monkeypatch.setattr("builtins.input", record)
    previous = signal.getsignal(signal.SIGINT)
    try:
        rc = cli.cmd_chat(cli.build_parser().parse_args(["chat"]))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during a reply escaped the chat")
    assert rc == 0
    assert asked == ["hi", "again", "/quit"]  # back at the prompt after the stopped reply; /quit quits
    assert engine.aborted == ["0"]  # the first reply's request was aborted, the second ran to the end
    out = capsys.readouterr()
    assert "Hello there, friend!" in out.out
    assert signal.getsignal(signal.SIGINT) is previous  # Ctrl-C at the prompt behaves as before


@pytest.mark.parametrize("word", ["/quit", "/exit"])
def test_chat_quit_commands(monkeypatch, word):
    engine = FakeEngine()
    assert _chat(monkeypatch, engine, [word, "hi"]) == 0
    assert engine.params == []  # nothing after the quit was sent


def test_chat_prints_tokens_per_second_after_a_reply(monkeypatch, capsys):
    _chat(monkeypatch, FakeEngine(), ["hi"])
    err = capsys.readouterr().err
    assert "[5 tokens, " in err and " tok/s]" in err


def test_chat_says_when_a_reply_was_cut_and_confirms_reset(monkeypatch, capsys):
    _chat(monkeypatch, FakeEngine(finish="length"), ["hi", "/reset"])
    err = capsys.readouterr().err
    assert "[reply cut at 5 tokens: --max-tokens N allows more]" in err and "[conversation reset]" in err
    _chat(monkeypatch, FakeEngine(), ["hi"])
    assert "cut" not in capsys.readouterr().err


def test_chat_samples_with_defaults_that_do_not_loop(monkeypatch):
    engine = FakeEngine()
    _chat(monkeypatch, engine, ["hi"])
    p = engine.params[0]
    assert (p.temperature, p.repetition_penalty) == (0.7, 1.1)


def test_chat_takes_the_models_generation_config(monkeypatch, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "bos_token_id": 1}))
    engine = FakeEngine()
    _chat(monkeypatch, engine, ["hi", "/reset", "hi"], ("--model", str(tmp_path)))
    p = engine.params[0]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.0)
    engine = FakeEngine()
    _chat(monkeypatch, engine, ["hi"], ("--model", str(tmp_path), "--temperature", "0.2",
                                        "--repetition-penalty", "1.3"))
    p = engine.params[0]
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.2, 0.9, 1.3)  # a given flag wins


def test_generate_prints_tokens_per_second(monkeypatch, capsys):
    class FakeLLM:
        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def generate(self, prompts: list[str], params: Any, use_tqdm: bool = True) -> list[Any]:
            return [SimpleNamespace(outputs=[SimpleNamespace(text=" world", token_ids=[1, 2, 3])]) for _ in prompts]
    monkeypatch.setattr("pagoda.entrypoints.llm.LLM", FakeLLM)
    assert cli.main(["generate", "a", "b"]) == 0
    out = capsys.readouterr()
    assert "a world" in out.out and "tok/s" not in out.out  # stdout keeps only the text
    assert "[6 tokens, " in out.err and " tok/s]" in out.err


def test_ctrl_c_aborts_the_real_engines_request_and_the_engine_goes_on(smollm_llm, monkeypatch, capsys):
    from pagoda import SamplingParams

    engine = smollm_llm.engine
    real_step, steps = engine.step, []

    def step() -> list[Any]:
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step()
    monkeypatch.setattr(engine, "step", step)
    ids = engine.tokenizer.encode("Count to fifty:")
    reply = cli.stream_reply(engine, ids, SamplingParams(temperature=0, max_tokens=64))
    assert reply.stopped and 0 < reply.tokens < 64
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # its blocks went back to the pool
    monkeypatch.setattr(engine, "step", real_step)
    out = smollm_llm.generate("Count to fifty:", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


# ---- kernels: build directory and notice -----------------------------------------------------------

def test_kernel_build_dir_is_per_checkout_and_stable(tmp_path):
    from pagoda.kernels import cpu_extension

    src = Path(cpu_extension.__file__).parent / "cpu"
    a, b = tmp_path / "a" / "cpu", tmp_path / "b" / "cpu"
    shutil.copytree(src, a)
    shutil.copytree(src, b)
    da, db = cpu_extension.build_directory(a), cpu_extension.build_directory(b)
    assert da != db  # same sources, two checkouts: torch's build.ninja holds absolute paths
    assert cpu_extension.build_directory(a) == da  # and each checkout keeps its own
    assert da.name.split("-")[0] == db.name.split("-")[0]  # the content part agrees
    assert cpu_extension.build_directory(a, "avx2") != da  # each target its own library
    next(a.glob("*.cpp")).write_text("// changed\n", encoding="utf-8")
    assert cpu_extension.build_directory(a) != da


def test_kernel_build_says_so_only_when_it_compiles(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    from pagoda.kernels import cpu_extension

    calls = []

    def fake_load(**kw):
        calls.append(kw)
        (tmp_path / f"{kw['name']}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    build = cpu_extension.best_build()
    flags = cpu_extension.cflags(build)
    cpu_extension.jit_build("k", [], flags, tmp_path, label=f"{build} build")
    assert calls and cpu_extension.BUILDS[build] in calls[0]["extra_cflags"]
    err = capsys.readouterr().err
    assert f"pagoda: compiling the CPU kernels' {build} build (once, ~1 min)..." in err
    assert "pagoda: CPU kernels compiled in" in err
    cpu_extension.jit_build("k", [], flags, tmp_path, label=f"{build} build")  # built: loaded as it is
    assert len(calls) == 1 and "compiling" not in capsys.readouterr().err


# ---- bench serve without a server ----------------------------------------------------------------

def test_bench_serve_without_a_server_says_so_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    r = _run_cli(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}"])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot connect" in lines[0], r.stderr


def test_httpx_is_a_main_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("httpx") for d in project["dependencies"])


# ---- written checkpoint files ----------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_quantized_checkpoint_files_honor_the_umask(tiny_llama_byte_tokenizer, tmp_path, umask):
    from pagoda.quantization.checkpoint import export_dequantized, write_checkpoint
    from pagoda.quantization.int4_format import quantize_int4_rtn

    w = torch.randn(64, 64)
    q = quantize_int4_rtn(w, 32)
    cfg = json.loads((tiny_llama_byte_tokenizer / "config.json").read_text())
    old = os.umask(umask)
    try:
        out, plain = tmp_path / "q", tmp_path / "plain"
        write_checkpoint(str(out), str(tiny_llama_byte_tokenizer), cfg, {"a.weight": w, "n.weight": torch.ones(4)},
                         {"a": q}, "rtn", 32, False)
        export_dequantized(str(out), str(plain))
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for folder in (out, plain):
        for name in ("model.safetensors", "config.json"):
            assert (folder / name).stat().st_mode & 0o777 == want, f"{folder.name}/{name}"


@pytest.mark.parametrize("argv, first", [
    (["eval", "perplexity", "--text", "pagoda/bench/corpus/GPL-3", "--max-text-tokens", "300", "--max-length", "128",
      "--stride", "64"], "pagoda eval perplexity: 300 tokens in windows of 128 ..."),
    pytest.param(["bench", "structured", "--num-prompts", "4", "--concurrency", "4", "--max-tokens", "8",
                  "--jump-forward-rounds", "1"], "pagoda bench structured: concurrency 4, constrained, 4 requests ...",
                 marks=pytest.mark.long),
])
def test_long_commands_say_what_they_do_and_show_progress(argv, first):
    r = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli", *argv, "--dtype", "float32",
                        "--kv-cache-memory", "64MiB"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert first in r.stderr and "Generating" in r.stderr  # the progress bar, on stderr


def test_eval_perplexity_shows_only_the_flags_that_apply():
    p = dict(_parsers(cli.build_parser()))[("eval", "perplexity")]
    flags = {s for a in p._actions for s in a.option_strings}
    assert "--kv-cache-dtype" in flags and "--quantization" in flags
    assert not flags & {"--speculative-config", "--structured-outputs-backend", "--structured-outputs-jump-forward"}
