"""Peer runners of `pagoda bench throughput --compare` (vLLM) and the HF copy of a GGUF model.

The fast tests need no peer: a stand-in `vllm` package (a few lines, below) plays the peer, so the whole
subprocess path (workload file, script, result parsing) runs in pagoda's own venv. Tests that run the
real vLLM are marked slow and skip unless its venv exists.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from pagoda.bench import hf_copy, vllm_peer
from pagoda.bench.datasets import BenchRequest

REAL_VLLM_PYTHON = vllm_peer.DEFAULT_VLLM_PYTHON

# A stand-in for vllm: generate() returns max_tokens token ids per prompt (fewer with SHORT set).
FAKE_VLLM = {
    "vllm/__init__.py": textwrap.dedent('''
        import os
        __version__ = "0.0-fake"

        class SamplingParams:
            def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
                assert temperature == 0.0 and ignore_eos
                self.max_tokens = max_tokens

        class _Completion:
            def __init__(self, ids):
                self.token_ids = ids

        class _Output:
            def __init__(self, ids):
                self.outputs = [_Completion(ids)]

        class LLM:
            def __init__(self, model, dtype, max_model_len, seed=0, **kw):
                assert os.path.isdir(model), model
                assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
                self.max_model_len = max_model_len

            def generate(self, prompts, params, use_tqdm=True):
                short = int(os.environ.get("FAKE_VLLM_SHORT", "0"))
                out = []
                for p, sp in zip(prompts, params):
                    assert len(p["prompt_token_ids"]) + sp.max_tokens <= self.max_model_len
                    out.append(_Output([7] * max(1, sp.max_tokens - short)))
                return out
        '''),
    "vllm/inputs.py": "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': list(prompt_token_ids)}\n",
}


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "fake_vllm"
    for rel, text in FAKE_VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(root))
    return root


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    d = tmp_path / "hf_model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def _requests() -> list[BenchRequest]:
    return [BenchRequest([1, 2, 3, 4], 5), BenchRequest(list(range(10, 40)), 3), BenchRequest([9], 1)]


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_offline_under_test", vllm_peer.SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # must not import vllm at module level
    return mod


# ---- the runner without the peer ------------------------------------------------------------------

def test_missing_venv_gives_a_clear_error_with_the_recipe(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "bin" / "python")
    with pytest.raises(vllm_peer.PeerUnavailable) as e:
        vllm_peer.run_vllm_peer(_requests(), str(tmp_path), "bfloat16", python=missing)
    msg = str(e.value)
    assert missing in msg and "install-peers.sh vllm" in msg and "docs/benchmarks.md" in msg
    assert isinstance(e.value, FileNotFoundError)  # the CLI prints it as `error: ...`, exit 2


def test_peer_python_is_the_install_scripts_venv_in_the_cache_folder(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Found where scripts/install-peers.sh puts it, or through a flag: no environment variable of its own."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGODA_VLLM_PYTHON", str(tmp_path / "elsewhere"))  # the old override, now ignored
    assert vllm_peer.peer_python("vllm") == str(tmp_path / "peers" / "vllm" / "bin" / "python")


def test_bench_throughput_compare_vllm_fails_fast_without_the_venv(tmp_path: Path, capsys) -> None:
    from pagoda.entrypoints.cli import main

    rc = main(["bench", "throughput", "--model", str(tmp_path / "no-such-model"), "--compare", "hf", "vllm",
               "--vllm-python", str(tmp_path / "missing-python")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "vLLM peer not found" in err and "missing-python" in err


def test_peer_scripts_are_package_data() -> None:
    assert vllm_peer.SCRIPT.is_file()
    assert vllm_peer.SCRIPT.parent.name == "peer_scripts"
    import ast

    text = Path(vllm_peer.SCRIPT).read_text()
    assert 'if __name__ == "__main__":' in text
    # The peer's venv has no pagoda: the script must stand alone.
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert not any(n.split(".")[0] == "pagoda" for n in names)


def test_workload_json_round_trip(tmp_path: Path, model_dir: str) -> None:
    reqs = _requests()
    b1 = BenchRequest(list(range(32)), 128)
    path = tmp_path / "w.json"
    vllm_peer.write_workload(path, reqs, model_dir, "torch.bfloat16", batch1=b1, engine_kwargs={"enforce_eager": True})
    back, doc = vllm_peer.read_workload(path)
    assert back == reqs
    assert doc["dtype"] == "bfloat16" and doc["model"] == model_dir and doc["engine_kwargs"] == {"enforce_eager": True}
    assert doc["batch1"] == {"prompt_token_ids": list(range(32)), "output_len": 128}
    assert doc["max_model_len"] == 256  # longest is 32 + 128, rounded up to 256
    # The script in the peer's venv reads the same file and agrees.
    w = _load_script().load_workload(str(path))
    assert [BenchRequest(r["prompt_token_ids"], r["output_len"]) for r in w["requests"]] == reqs
    assert w["batch1"]["output_len"] == 128


def test_workload_rejects_bad_input(tmp_path: Path, model_dir: str) -> None:
    with pytest.raises(ValueError):
        vllm_peer.workload_dict([], model_dir, "bfloat16")
    with pytest.raises(ValueError):
        vllm_peer.workload_dict(_requests(), model_dir, "int8")
    script = _load_script()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": model_dir, "dtype": "float32",
                               "requests": [{"prompt_token_ids": [], "output_len": 3}]}))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        script.load_workload(str(bad))


def test_parse_result_takes_the_last_marked_line() -> None:
    out = "INFO some log\nPAGODA_PEER_RESULT {\"a\": 1}\nnoise\nPAGODA_PEER_RESULT {\"a\": 2}\nmore noise\n"
    assert vllm_peer.parse_result(out) == {"a": 2}
    assert vllm_peer.parse_result("no result here") is None


def test_runner_drives_the_script_end_to_end_with_a_stand_in_vllm(fake_vllm: Path, model_dir: str) -> None:
    reqs = _requests()
    res = vllm_peer.run_vllm_peer(reqs, model_dir, "float32", python=sys.executable, batch1=True,
                                  batch1_prompt=list(range(32)), timeout_s=120)
    assert res["version"] == "0.0-fake" and res["dtype"] == "float32"
    assert res["num_requests"] == 3 and res["useful_output_tokens"] == 9 == res["generated_tokens"]
    assert res["prompt_tokens"] == 4 + 30 + 1
    assert res["elapsed_s"] > 0 and res["output_tok_s"] > 0 and res["startup_s"] >= 0
    assert res["env"] == vllm_peer.VLLM_ENV
    b1 = res["batch1_decode"]
    assert b1["prompt_len"] == 32 and b1["output_tokens"] == 128 and b1["decode_tok_s"] > 0


def test_runner_reports_a_peer_that_produced_the_wrong_lengths(fake_vllm: Path, model_dir: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    with pytest.raises(vllm_peer.PeerFailed, match="other lengths than asked"):
        vllm_peer.run_vllm_peer(_requests(), model_dir, "bfloat16", python=sys.executable, timeout_s=120)


def test_bench_throughput_compare_vllm_with_a_stand_in(fake_vllm: Path, tmp_path: Path,
                                                       tiny_llama_byte_tokenizer: Path) -> None:
    from pagoda.entrypoints.cli import main

    model = tiny_llama_byte_tokenizer
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(model), "--num-prompts", "4", "--input-len-range", "8", "24",
               "--output-len-range", "4", "10", "--no-roofline", "--dtype", "float32", "--kv-cache-memory", "32MiB",
               "--compare", "vllm", "--vllm-python", sys.executable, "--batch1-decode", "--output-json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    ours, peer = report["pagoda"], report["peers"]["vllm"]
    assert peer["useful_output_tokens"] == ours["output_tokens"]
    assert peer["ratio"] == pytest.approx(ours["output_tok_s"] / peer["output_tok_s"])
    assert peer["batch1_decode"]["output_tokens"] == 128


# ---- the HF copy ---------------------------------------------------------------------------------

def test_hf_copy_is_reused_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(64))
    calls = []

    def fake_write(src: str, dest: str) -> None:
        calls.append(src)
        (Path(dest) / "config.json").write_text("{}")
        (Path(dest) / "model.safetensors").write_bytes(b"x")
        (Path(dest) / hf_copy._MARKER).write_text("{}")

    monkeypatch.setattr(hf_copy, "_write_copy", fake_write)
    first = hf_copy.ensure_hf_copy(str(gguf))
    assert Path(first).parent == tmp_path / "cache" / "hf_copies"
    assert hf_copy.ensure_hf_copy(str(gguf)) == first and len(calls) == 1
    assert sorted(os.listdir(Path(first).parent)) == [Path(first).name]  # no temporary folder left
    gguf.write_bytes(b"GGUF" + os.urandom(64))  # other contents: another copy
    assert hf_copy.ensure_hf_copy(str(gguf)) != first and len(calls) == 2


def test_hf_copy_failure_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def half_write(src: str, dest: str) -> None:
        (Path(dest) / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(hf_copy, "_write_copy", half_write)
    with pytest.raises(OSError, match="disk full"):
        hf_copy.ensure_hf_copy(str(gguf))
    assert os.listdir(tmp_path / "cache" / "hf_copies") == []


def test_hf_copy_passes_folders_through_and_rejects_other_files(tmp_path: Path) -> None:
    assert hf_copy.ensure_hf_copy(str(tmp_path)) == str(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError):
        hf_copy.ensure_hf_copy(str(tmp_path / "w.bin"))
    with pytest.raises(FileNotFoundError):
        hf_copy.ensure_hf_copy(str(tmp_path / "absent.gguf"))


@pytest.mark.slow
def test_hf_copy_of_the_default_gguf_matches_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                default_gguf: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    folder = hf_copy.ensure_hf_copy(default_gguf)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["rope_theta"] == 100000.0 and "quantization_config" not in cfg
    copy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    d, n = os.path.split(default_gguf)
    orig = AutoModelForCausalLM.from_pretrained(d, gguf_file=n, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template and tok.eos_token_id == 2
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        assert torch.equal(copy(ids).logits, orig(ids).logits)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(REAL_VLLM_PYTHON), reason="vLLM peer not installed")
def test_real_vllm_runs_a_small_workload(default_gguf: str) -> None:
    reqs = [BenchRequest(list(range(100, 116)), 8), BenchRequest(list(range(200, 240)), 4)]
    res = vllm_peer.run_vllm_peer(reqs, default_gguf, "bfloat16", python=REAL_VLLM_PYTHON)
    assert res["useful_output_tokens"] == 12 and res["output_tok_s"] > 0
