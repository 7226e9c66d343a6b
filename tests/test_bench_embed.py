"""`pagoda bench embed`: its sentences fit the asked token range, a tiny run prints both sides and the
ratios, and --compare vllm drives vLLM's pooling runner through its peer script (the real benchmark's figures
live in docs/benchmarks.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pagoda.bench import embed, vllm_embed_peer, vllm_peer


@pytest.fixture(scope="module")
def minilm_folder() -> str:
    from pagoda.model.default_model import default_embedding_model_path

    try:
        return default_embedding_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_sentences_are_corpus_windows_within_the_token_range(minilm_folder: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{minilm_folder}/tokenizer.json")
    tok.no_truncation()
    tok.no_padding()
    texts = embed.sentences(tok, 50, 8, 64, seed=0, corpus_path=str(embed.CORPUS_PATH))
    lengths = [len(tok.encode(t).ids) for t in texts]
    # Decoding and encoding again may merge or split a word piece at the window's edges.
    assert min(lengths) >= 7 and max(lengths) <= 66 and len(set(lengths)) > 10


@pytest.mark.slow
def test_a_tiny_run_reports_both_sides_and_the_ratios(minilm_folder: str, tmp_path, capsys) -> None:
    pytest.importorskip("sentence_transformers")
    p = argparse.ArgumentParser()
    embed.add_arguments(p)
    out = tmp_path / "r.json"
    args = p.parse_args(["--num-sentences", "8", "--max-tokens", "48", "--batch-size", "4", "--rounds", "1",
                         "--latency-samples", "2", "--threads", "1", "--output-json", str(out)])
    assert embed.main(args) == 0
    printed = capsys.readouterr().out
    assert "throughput at batch 4: Pagoda" in printed and "sentence-transformers" in printed
    report = json.loads(out.read_text())
    assert report["min_cosine"] > 0.9999 and report["throughput_ratio"] > 0 and report["latency_ratio"] > 0
    assert [len(s["latency_ms"]) for s in report["sides"]] == [2, 2]


# ---- --compare vllm: vLLM's pooling runner as a third side ------------------------------------------
# The fast tests need no vLLM: a stand-in `vllm` package (below) plays the peer, so the pipe to
# peer_scripts/vllm_embed.py runs in pagoda's own venv. The real vLLM runs only in the slow test.

FAKE_VLLM = {
    "vllm/__init__.py": textwrap.dedent('''
        import os
        import sys

        __version__ = "0.0-fake"

        class _Pooled:
            def __init__(self, text):
                self.embedding = [float(len(text))] + [1.0] * 383  # all-MiniLM-L6-v2's width

        class _Output:
            def __init__(self, text):
                self.outputs = _Pooled(text)

        class LLM:
            def __init__(self, model, runner, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, seed=0):
                assert os.path.isdir(model) and runner == "pooling", (model, runner)
                assert max_num_batched_tokens == max_num_seqs * max_model_len
                print("vllm logs to stdout", flush=True)  # the script must keep this off its answers
                if os.environ.get("FAKE_VLLM_FAIL"):
                    print("(EngineCore pid=7) ERROR 12-06 04:22:54 [core.py:1510] ValueError: "
                          + os.environ["FAKE_VLLM_FAIL"], file=sys.stderr, flush=True)
                    raise RuntimeError("Engine core initialization failed. See root cause above.")
                self.max_len = max_model_len

            def embed(self, texts, use_tqdm=True, tokenization_kwargs=None):
                assert tokenization_kwargs == {"truncate_prompt_tokens": self.max_len}
                return [_Output(t) for t in texts]
        '''),
}


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "fake_vllm"
    for rel, text in FAKE_VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setattr(vllm_embed_peer, "IDLE_S", 0.0)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a failed run keeps vLLM's log
    return root


def _peer(tmp_path: Path, texts: list[str], python: str = sys.executable) -> vllm_embed_peer.VllmEmbedPeer:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return vllm_embed_peer.VllmEmbedPeer(python, str(model), texts, batch_size=2, max_model_len=16,
                                         dtype="float32", cores=[0], log_path=str(tmp_path / "vllm.log"),
                                         job_path=str(tmp_path / "job.json"))


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    embed.add_arguments(p)
    return p.parse_args(argv)


def test_compare_vllm_and_its_python_parse() -> None:
    assert _parse([]).compare == [] and _parse([]).vllm_python is None
    args = _parse(["--compare", "vllm", "--vllm-python", "/x/bin/python"])
    assert args.compare == ["vllm"] and args.vllm_python == "/x/bin/python"
    with pytest.raises(SystemExit):
        _parse(["--compare", "llama-cpp"])


def test_compare_vllm_without_the_venv_fails_first_with_the_recipe(tmp_path: Path, capsys) -> None:
    from pagoda.entrypoints.cli import main

    missing = tmp_path / "missing-python"
    rc = main(["bench", "embed", "--model", str(tmp_path / "no-such-model"), "--compare", "vllm",
               "--vllm-python", str(missing)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "vLLM peer not found" in err and str(missing) in err and "install-peers.sh vllm" in err


def test_the_peer_hands_back_embeddings_and_timings_through_the_pipe(fake_vllm: Path, tmp_path: Path) -> None:
    texts = ["a", "bb", "ccc"]
    with _peer(tmp_path, texts) as peer:
        ready = peer.start(timeout_s=120)
        assert ready["version"] == "0.0-fake" and ready["startup_s"] >= 0
        assert [e[0] for e in ready["embeddings"]] == [1.0, 2.0]  # the first batch_size texts
        assert peer.throughput(timeout_s=60) > 0 and peer.latency(2, timeout_s=60) > 0
        proc = peer.proc
    assert proc is not None and proc.returncode == 0  # close() ended it
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["texts"] == texts and job["batch_size"] == 2 and job["max_model_len"] == 16
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and peer.env["OMP_NUM_THREADS"] == "1"
    assert peer.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert "vllm logs to stdout" in (tmp_path / "vllm.log").read_text()  # in the log, not among the answers


def test_a_peer_that_cannot_load_the_model_says_why_in_one_line(fake_vllm: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", "encoder-only attention is not supported")
    with _peer(tmp_path, ["a"]) as peer, pytest.raises(vllm_peer.PeerFailed) as e:
        peer.start(timeout_s=120)
    assert str(e.value) == "ValueError: encoder-only attention is not supported"


def test_failure_reason_takes_the_root_cause_over_vllms_wrappers() -> None:
    log = textwrap.dedent("""\
        (EngineCore pid=7) INFO 12-06 04:21:03 [core.py:133] Initializing a V1 LLM engine
        (EngineCore pid=7) ERROR 12-06 04:22:54 [core.py:1510] Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
        (Worker pid=8) ERROR 12-06 04:22:54 [worker.py:1] NotImplementedError: Encoder self-attention is not implemented
        Traceback (most recent call last):
          File "x.py", line 1, in <module>
            raise RuntimeError(
        RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
        """)  # noqa: E501
    assert (vllm_embed_peer.failure_reason(log)
            == "NotImplementedError: Encoder self-attention is not implemented")
    wrappers_only = "\n".join(line for line in log.splitlines() if "NotImplementedError" not in line)
    assert vllm_embed_peer.failure_reason(wrappers_only).startswith("RuntimeError: Engine core initialization")
    assert vllm_embed_peer.failure_reason("killed\n") == "killed"


def test_the_peer_script_stands_alone() -> None:
    import ast
    import importlib.util

    text = vllm_embed_peer.SCRIPT.read_text()
    assert vllm_embed_peer.SCRIPT.parent.name == "peer_scripts" and 'if __name__ == "__main__":' in text
    for node in ast.walk(ast.parse(text)):  # the peer's venv has no pagoda
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert not any(n.split(".")[0] == "pagoda" for n in names)
    spec = importlib.util.spec_from_file_location("vllm_embed_under_test", vllm_embed_peer.SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # vllm is imported only once the engine is built
    assert script.RESULT_PREFIX == vllm_peer.RESULT_PREFIX and script.DEFAULT_ENV == vllm_peer.VLLM_ENV


@pytest.mark.slow
def test_a_tiny_run_with_a_stand_in_vllm_prints_its_ratios(minilm_folder: str, fake_vllm: Path, tmp_path: Path,
                                                           capsys) -> None:
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "r.json"
    args = _parse(["--num-sentences", "8", "--max-tokens", "48", "--batch-size", "4", "--rounds", "1",
                   "--latency-samples", "2", "--threads", "1", "--compare", "vllm", "--vllm-python", sys.executable,
                   "--output-json", str(out)])
    assert embed.main(args) == 0
    printed = capsys.readouterr().out
    assert "x sentence-transformers, " in printed and "x vLLM;" in printed and "x vLLM's;" in printed
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["sides"]] == ["pagoda", "sentence-transformers", "vllm"]
    assert [len(s["latency_ms"]) for s in report["sides"]] == [2, 2, 2]
    assert report["vllm"]["version"] == "0.0-fake" and report["vllm"]["error"] is None
    assert report["vllm"]["throughput_ratio"] > 0 and report["vllm"]["latency_ratio"] > 0


@pytest.mark.slow
def test_a_stand_in_vllm_that_fails_leaves_the_other_sides_and_one_line(minilm_folder: str, fake_vllm: Path,
                                                                        tmp_path: Path, capsys,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sentence_transformers")
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no encoder attention on CPU")
    args = _parse(["--num-sentences", "8", "--max-tokens", "48", "--batch-size", "4", "--rounds", "1",
                   "--latency-samples", "2", "--threads", "1", "--compare", "vllm", "--vllm-python", sys.executable])
    assert embed.main(args) == 1
    printed = capsys.readouterr().out
    assert "throughput at batch 4: Pagoda" in printed and "vLLM" not in printed.split("vllm: failed")[0]
    assert "vllm: failed: ValueError: no encoder attention on CPU (its log: " in printed


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(vllm_peer.DEFAULT_VLLM_PYTHON), reason="vLLM peer venv not installed")
def test_real_vllm_embeds_like_sentence_transformers(minilm_folder: str, tmp_path: Path, capsys) -> None:
    """vLLM's CPU build serves this BERT model (runner="pooling"); engine start-up takes a minute or more."""
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "r.json"
    args = _parse(["--num-sentences", "8", "--max-tokens", "48", "--batch-size", "4", "--rounds", "1",
                   "--latency-samples", "2", "--compare", "vllm", "--output-json", str(out)])
    assert embed.main(args) == 0
    report = json.loads(out.read_text())
    assert report["vllm"]["min_cosine"] > 0.999 and report["vllm"]["version"]
