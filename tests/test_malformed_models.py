"""Malformed model files fail fast, in bounded memory, with one line naming the file and the problem.

The corpus is built here from a tiny random-weight Llama: its safetensors folder, and a GGUF of the
same weights written with gguf-py's GGUFWriter, each then truncated, corrupted or contradicted."""
from __future__ import annotations

import json
import logging
import pickle
import resource
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import finish_gguf, gguf_tensor_name

from pagoda.model.errors import ModelFileError
from pagoda.model.loader import resolve_model_files

# Tiny-model numbers (tests/tiny_models.py): vocab 512, hidden 64, 4 heads, 2 KV heads, 2 layers.
HEADS, KV_HEADS = 4, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of a Q/K projection (pagoda undoes it at load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, tensors: dict[str, torch.Tensor], head_count: int = HEADS,
                    extra: Callable[..., None] | None = None) -> Path:
    """The tiny Llama's weights as an F32 GGUF, with the metadata llama.cpp's converter writes."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(head_count)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(512)
    if extra is not None:
        extra(w)
    for hf, t in tensors.items():
        arr = t.float().numpy()
        if ".q_proj." in hf:
            arr = _permute(arr, HEADS)
        elif ".k_proj." in hf:
            arr = _permute(arr, KV_HEADS)
        w.add_tensor(gguf_tensor_name(hf), np.ascontiguousarray(arr))
    finish_gguf(w)
    return path


@pytest.fixture(scope="module")
def tiny_weights(tiny_llama: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(tiny_llama) / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_weights, tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_weights)


def _copy_folder(tiny_llama: str, tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(tiny_llama, dest)
    return dest


def _edit_config(folder: Path, **changes) -> Path:
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    return folder


def _load(path: Path) -> None:
    """The whole load path short of building the model: locate, check, stream every weight."""
    files = resolve_model_files(str(path))
    for _ in files.iter_weights(torch.float32):
        pass


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def assert_clean_failure(path: Path, file_name: str, words: tuple[str, ...] = ()) -> ModelFileError:
    """Loading `path` raises ModelFileError: one line naming `file_name` and a word of `words`, fast and small."""
    rss0, t0 = _peak_rss_mib(), time.perf_counter()
    with pytest.raises(ModelFileError) as info:
        _load(path)
    elapsed, grown = time.perf_counter() - t0, _peak_rss_mib() - rss0
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert file_name in msg, msg
    assert not words or any(w in msg.lower() for w in words), msg
    assert elapsed < 10, f"took {elapsed:.1f}s: {msg}"
    assert grown < 256, f"peak RSS grew {grown:.0f} MiB: {msg}"
    return info.value


# ---- good files: the corpus starts from models that load -------------------------------------------
def test_tiny_gguf_loads_the_same_weights_as_its_safetensors(tiny_llama, tiny_gguf, tiny_weights) -> None:
    hf_files = resolve_model_files(tiny_llama)
    gguf_files = resolve_model_files(str(tiny_gguf))
    ours = dict(gguf_files.iter_weights(torch.float32))
    assert set(ours) == set(dict(hf_files.iter_weights(torch.float32)))
    for name, t in ours.items():
        assert torch.equal(t, tiny_weights[name]), name


def test_model_file_error_is_a_value_error_that_pickles() -> None:
    e = ModelFileError("/m/model.safetensors", "corrupt header:\n  line two")
    assert isinstance(e, ValueError)
    assert str(e) == "/m/model.safetensors: corrupt header: line two"
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), str(back), back.path) == (ModelFileError, str(e), e.path)


# ---- safetensors ---------------------------------------------------------------------------------------
def test_truncated_safetensors_is_named_truncated(tiny_llama, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_clean_failure(folder, "model.safetensors", ("truncated",))


@pytest.mark.parametrize("keep", [0, 5])
def test_safetensors_shorter_than_its_header_length_is_truncated(tiny_llama, tmp_path, keep: int) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:keep])
    assert_clean_failure(folder, "model.safetensors", ("truncated",))


def test_safetensors_header_with_bad_json_is_a_corrupt_header(tiny_llama, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    st = folder / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8] = ord("x")  # the header's opening brace
    st.write_bytes(bytes(data))
    assert_clean_failure(folder, "model.safetensors", ("header",))


@pytest.mark.parametrize("length", [2**40, 2**64 - 1])
def test_safetensors_giant_header_length_is_a_corrupt_header(tiny_llama, tmp_path, length: int) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(struct.pack("<Q", length) + st.read_bytes()[8:])
    assert_clean_failure(folder, "model.safetensors", ("header",))


def _rewrite_header(st: Path, edit: Callable[[dict], None]) -> None:
    data = st.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_safetensors_offsets_past_the_end_are_truncated(tiny_llama, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    _rewrite_header(folder / "model.safetensors",
                    lambda h: h["model.norm.weight"].update(data_offsets=[0, 10**12]))
    assert_clean_failure(folder, "model.safetensors", ("truncated",))


def test_safetensors_offsets_that_disagree_with_the_shape_are_corrupt(tiny_llama, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    _rewrite_header(folder / "model.safetensors", lambda h: h["model.norm.weight"].update(data_offsets=[0, 4]))
    assert_clean_failure(folder, "model.safetensors", ("corrupt",))


def test_integer_weights_are_an_unsupported_tensor_type(tiny_llama, tiny_weights, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    weights = dict(tiny_weights, **{"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_clean_failure(folder, "model.safetensors", ("unsupported tensor type",))


def test_missing_tensor_is_named(tiny_llama, tiny_weights, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    weights = {k: v for k, v in tiny_weights.items() if k != "model.layers.1.mlp.down_proj.weight"}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    err = assert_clean_failure(folder, "model", ("missing",))
    assert "layers.1.mlp.down_proj.weight" in str(err)


# ---- config.json against the checkpoint -----------------------------------------------------------
@pytest.mark.parametrize("changes,words", [
    ({"hidden_size": 50_000}, ("hidden_size=50000", "shape")),   # would allocate ~200 GB
    ({"vocab_size": 1000}, ("vocab_size=1000", "shape")),
    ({"intermediate_size": 4096}, ("intermediate_size=4096", "shape")),
    ({"num_key_value_heads": 4}, ("num_key_value_heads=4", "shape")),
    ({"head_dim": 32}, ("head_dim=32", "shape")),
    ({"num_hidden_layers": 30}, ("missing",)),
    ({"num_hidden_layers": 1}, ("unexpected tensor",)),
])
def test_config_that_contradicts_the_checkpoint_fails_before_allocating(tiny_llama, tmp_path, changes,
                                                                          words) -> None:
    folder = _edit_config(_copy_folder(tiny_llama, tmp_path), **changes)
    name = "model" if "missing" in words else "model.safetensors"
    err = assert_clean_failure(folder, name, words)
    assert all(w in str(err) for w in words), err


@pytest.mark.parametrize("changes,words", [
    ({"num_attention_heads": 0}, ("num_attention_heads = 0",)),
    ({"num_key_value_heads": 0}, ("num_key_value_heads = 0",)),
    ({"num_attention_heads": 3}, ("num_attention_heads (3)",)),   # 3 % 2 KV heads
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": None}, ("hidden_size (64) is not divisible",)),
    ({"hidden_size": 10**12}, ("hidden_size = 1000000000000",)),
    ({"hidden_size": -64}, ("hidden_size = -64",)),
    ({"hidden_size": "64"}, ("hidden_size = '64'",)),
    ({"hidden_size": None}, ("hidden_size = None",)),
    ({"num_hidden_layers": 10**9}, ("num_hidden_layers",)),
    ({"vocab_size": 2**40}, ("vocab_size",)),
    ({"max_position_embeddings": 10**9}, ("max_position_embeddings",)),
    ({"head_dim": 15}, ("head_dim 15 is odd",)),
    ({"rope_theta": [1]}, ("bad config value",)),
    ({"rope_scaling": {"rope_type": "llama3"}}, ("rope_scaling lacks 'factor'",)),
    ({"rope_scaling": {"rope_type": "yarn2", "factor": 2.0}}, ("rope_scaling",)),
])
def test_bad_config_value_is_named_before_anything_is_allocated(tiny_llama, tmp_path, changes, words) -> None:
    folder = _edit_config(_copy_folder(tiny_llama, tmp_path), **changes)
    err = assert_clean_failure(folder, "config.json", ("bad config value",))
    assert all(w in str(err) for w in words), err


def test_config_json_that_is_not_json_names_the_file(tiny_llama, tmp_path) -> None:
    folder = _copy_folder(tiny_llama, tmp_path)
    (folder / "config.json").write_text('{"hidden_size": 64,\n')
    assert_clean_failure(folder, "config.json", ("invalid json",))


# ---- GGUF ---------------------------------------------------------------------------------------------------
def _corrupt_gguf(src: Path, tmp_path: Path, offset: int, fmt: str, value: int) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    dest = tmp_path / "bad.gguf"
    dest.write_bytes(bytes(data))
    return dest


@pytest.mark.parametrize("fraction", [0.5, 0.999])
def test_truncated_gguf_is_named_truncated(tiny_gguf, tmp_path, fraction: float) -> None:
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: int(len(data) * fraction)])
    assert_clean_failure(bad, "bad.gguf", ("truncated",))


@pytest.mark.parametrize("keep", [10, 100, 700])
def test_gguf_cut_inside_its_header_is_truncated(tiny_gguf, tmp_path, keep: int) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:keep])
    assert_clean_failure(bad, "bad.gguf", ("truncated",))


@pytest.mark.parametrize("offset,what", [(8, "tensor count"), (16, "kv count")])
@pytest.mark.parametrize("value", [2**63 + 5, 2**40, 10**6])
def test_gguf_with_a_huge_count_is_a_corrupt_header(tiny_gguf, tmp_path, offset: int, what: str, value: int) -> None:
    bad = _corrupt_gguf(tiny_gguf, tmp_path, offset, "<Q", value)
    assert_clean_failure(bad, "bad.gguf", ("corrupt",))


@pytest.mark.parametrize("offset", [8, 16])
def test_gguf_with_a_count_off_by_one_fails_cleanly(tiny_gguf, tmp_path, offset: int) -> None:
    (count,) = struct.unpack_from("<Q", tiny_gguf.read_bytes(), offset)
    assert_clean_failure(_corrupt_gguf(tiny_gguf, tmp_path, offset, "<Q", count + 1), "bad.gguf")


@pytest.mark.parametrize("length", [2**62, 2**64 - 1, 10**6])
def test_gguf_string_length_past_the_end_is_named(tiny_gguf, tmp_path, length: int) -> None:
    bad = _corrupt_gguf(tiny_gguf, tmp_path, 24, "<Q", length)  # the first key's length
    assert_clean_failure(bad, "bad.gguf", ("string of length",))


def test_gguf_tensor_offset_past_the_end_is_truncated(tiny_gguf, tmp_path) -> None:
    from pagoda.model.gguf_loader import GGUFFile

    g = GGUFFile(str(tiny_gguf))
    data = tiny_gguf.read_bytes()
    # The last tensor entry ends with its u64 offset relative to the data section, just before alignment.
    last = next(reversed(g.tensors.values()))
    rel = last.offset - min(t.offset for t in g.tensors.values())
    pos = data.index(struct.pack("<IQ", last.qtype, rel))
    bad = _corrupt_gguf(tiny_gguf, tmp_path, pos + 4, "<Q", 2**50)
    assert_clean_failure(bad, "bad.gguf", ("truncated",))


def test_gguf_unknown_tensor_type_is_unsupported(tiny_gguf, tmp_path) -> None:
    data = tiny_gguf.read_bytes()
    pos = data.index(b"output_norm.weight") + len(b"output_norm.weight")
    (n_dims,) = struct.unpack_from("<I", data, pos)
    bad = _corrupt_gguf(tiny_gguf, tmp_path, pos + 4 + 8 * n_dims, "<I", 1000)
    assert_clean_failure(bad, "bad.gguf", ("unsupported tensor type",))


def test_gguf_with_zero_heads_names_the_head_count(tiny_weights, tmp_path) -> None:
    bad = write_tiny_gguf(tmp_path / "bad.gguf", tiny_weights, head_count=0)
    err = assert_clean_failure(bad, "bad.gguf", ("bad config value",))
    assert "num_attention_heads = 0" in str(err)


def test_gguf_with_a_list_for_a_size_names_the_key(tiny_weights, tmp_path) -> None:
    bad = write_tiny_gguf(tmp_path / "bad.gguf", tiny_weights,
                          extra=lambda w: w.add_array("llama.context_length", [1, 2]))
    assert_clean_failure(bad, "bad.gguf", ("llama.context_length",))


def test_gguf_whose_metadata_contradicts_its_tensors_fails_before_allocating(tiny_weights, tmp_path) -> None:
    weights = dict(tiny_weights, **{"model.embed_tokens.weight": tiny_weights["model.embed_tokens.weight"][:500]})
    bad = write_tiny_gguf(tmp_path / "bad.gguf", weights)
    err = assert_clean_failure(bad, "bad.gguf", ("shape",))
    assert "vocab_size=512" in str(err)


def test_gguf_with_any_header_byte_corrupted_loads_or_fails_cleanly(tiny_gguf, tmp_path) -> None:
    """Every byte of the header set to 0xFF in turn: never an exception other than ModelFileError."""
    from pagoda.model.gguf_loader import GGUFFile

    data = tiny_gguf.read_bytes()
    header_end = min(t.offset for t in GGUFFile(str(tiny_gguf)).tensors.values())
    bad = tmp_path / "bad.gguf"
    t0 = time.perf_counter()
    failures = 0
    for i in range(4, header_end, 2):
        corrupted = bytearray(data)
        corrupted[i] = 0xFF
        bad.write_bytes(bytes(corrupted))
        try:
            _load(bad)
        except ModelFileError as e:
            assert "\n" not in str(e) and "bad.gguf" in str(e), (i, str(e))
            failures += 1
    assert failures > 0
    assert time.perf_counter() - t0 < 60


# ---- non-finite weights: a warning, and the model still loads -----------------------------------------------
def test_nan_weights_warn_naming_the_tensor_and_still_load(tiny_llama_byte_tokenizer, caplog) -> None:
    from pagoda import LLM, SamplingParams

    st = tiny_llama_byte_tokenizer / "model.safetensors"
    weights = load_file(str(st))
    weights["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, str(st), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="pagoda.model.errors"):
        llm = LLM(model=str(tiny_llama_byte_tokenizer), dtype="float32", kv_cache_memory="16MiB")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("model.layers.0.mlp.up_proj.weight" in m and "model.safetensors" in m and "1 non-finite" in m
               for m in warnings), warnings
    assert any("model.norm.weight" in m for m in warnings), warnings
    assert len(warnings) == 2, warnings
    llm.generate(["ab"], SamplingParams(max_tokens=2), use_tqdm=False)  # runs (to garbage), no exception


def test_nan_weights_in_a_gguf_warn_naming_the_tensor(tiny_weights, tmp_path, caplog) -> None:
    weights = dict(tiny_weights)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.embed_tokens.weight"][7, 7] = float("nan")
    path = write_tiny_gguf(tmp_path / "nan.gguf", weights)
    with caplog.at_level(logging.WARNING, logger="pagoda.model.errors"):
        loaded = dict(resolve_model_files(str(path)).iter_weights(torch.float32))
    assert torch.isnan(loaded["model.embed_tokens.weight"][7, 7])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "token_embd.weight" in warnings[0] and "nan.gguf" in warnings[0], warnings


def test_nan_weights_warn_on_the_native_gguf_path_too(tiny_weights, tmp_path, caplog) -> None:
    from pagoda.config import EngineConfig
    from pagoda.executor.model_runner import ModelRunner
    from pagoda.kernels.policy import KernelPolicy
    from pagoda.model.args import ModelArgs

    weights = dict(tiny_weights)
    weights["model.norm.weight"] = weights["model.norm.weight"].clone()
    weights["model.norm.weight"][3] = float("inf")
    path = write_tiny_gguf(tmp_path / "inf.gguf", weights)
    files = resolve_model_files(str(path))
    with caplog.at_level(logging.WARNING, logger="pagoda.model.errors"):
        ModelRunner(EngineConfig.from_kwargs(str(path), quantization="gguf"), files,
                    ModelArgs.from_hf_config(files.hf_config), torch.float32, KernelPolicy.resolve())
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and "non-finite" in r.getMessage()]
    assert any("model.norm.weight" in w and "inf.gguf" in w for w in warnings), warnings


def test_finite_weights_do_not_warn(tiny_llama, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pagoda.model.errors"):
        _load(Path(tiny_llama))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- the CLI -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("corrupt", ["gguf_count", "config_hidden"])
def test_cli_generate_with_a_malformed_model_prints_one_error_line(tiny_llama, tiny_gguf, tmp_path, capsys,
                                                                     corrupt: str) -> None:
    from pagoda.entrypoints.cli import main

    if corrupt == "gguf_count":
        bad = _corrupt_gguf(tiny_gguf, tmp_path, 8, "<Q", 2**62)
    else:
        bad = _edit_config(_copy_folder(tiny_llama, tmp_path), hidden_size=50_000)
    t0 = time.perf_counter()
    rc = main(["generate", "hello", "--model", str(bad), "--max-tokens", "1"])
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert str(bad) in lines[0] and "Traceback" not in err
