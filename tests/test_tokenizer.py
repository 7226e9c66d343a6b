"""Tokenizer: parity with transformers (encode, decode, chat template), streaming, caching."""
from __future__ import annotations

import os
import time

import pytest

from pagoda.model.default_model import default_model_path
from pagoda.model.loader import resolve_model_files
from pagoda.model.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, Ærøskøbing, Größe",
    "日本語のテキストと中文文本，还有한국어。",
    "emoji: 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ok",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\t# tab\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "   leading spaces and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A private cache dir for this module, so the cold path is exercised deterministically."""
    root = str(tmp_path_factory.mktemp("pagoda-cache"))
    old = os.environ.get("PAGODA_CACHE_DIR")
    os.environ["PAGODA_CACHE_DIR"] = root
    yield root
    if old is None:
        os.environ.pop("PAGODA_CACHE_DIR", None)
    else:
        os.environ["PAGODA_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def tok(cache_root) -> Tokenizer:
    return load_tokenizer(resolve_model_files(None))


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_metadata(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_id == hf_tok.eos_token_id
    assert tok.eos_token_id in tok.stop_token_ids
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") in tok.stop_token_ids
    assert tok.chat_template == hf_tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_parity(tok: Tokenizer, hf_tok, text: str) -> None:
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_tok.encode(text, add_special_tokens=special)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for skip in (True, False):
        stream = tok.decode_stream(skip_special_tokens=skip)
        pieces = [stream.step(i) for i in ids]
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_decode_stream_holds_partial_chars(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    stream = tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_id_to_token_text(tok: Tokenizer, hf_tok) -> None:
    for i in tok.encode("Hello world 日本"):
        assert tok.id_to_token_text(i) == hf_tok.decode([i])


def test_chat_template_parity(tok: Tokenizer, hf_tok) -> None:
    convs = [
        [{"role": "user", "content": "Hi there! 🎉"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 日本?"}],
    ]
    for msgs in convs:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_chat_template_sandboxed(tok: Tokenizer) -> None:
    import jinja2

    evil = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    helpers = Tokenizer(tok.backend, eos_token_id=tok.eos_token_id,
                        chat_template="{{ eos_token }}{{ strftime_now('%Y') | length }}{{ {'a': 'é'} | tojson }}"
                                      "{% if messages | length > 5 %}{{ raise_exception('too long') }}{% endif %}")
    assert helpers.apply_chat_template([]) == '<|im_end|>4{"a": "é"}'
    with pytest.raises(jinja2.exceptions.TemplateError, match="too long"):
        helpers.apply_chat_template([{"role": "user", "content": "x"}] * 6)


def test_no_chat_template(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "x"}])


def test_second_load_uses_cache(tok: Tokenizer, cache_root: str) -> None:
    entries = os.listdir(os.path.join(cache_root, "tokenizers"))
    assert len([e for e in entries if not e.startswith(".")]) == 1
    assert not [e for e in entries if e.startswith(".tmp-")]
    t0 = time.perf_counter()
    again = load_tokenizer(default_model_path())
    assert time.perf_counter() - t0 < 2.0  # ms in practice; loose for shared CI machines
    assert again.encode(TEXTS[3]) == tok.encode(TEXTS[3])


def test_hf_folder(tmp_path, tok: Tokenizer, hf_tok) -> None:
    hf_tok.save_pretrained(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    assert ours.eos_token_id == hf_tok.eos_token_id and ours.bos_token_id == hf_tok.bos_token_id
    for text in TEXTS:
        assert ours.encode(text) == hf_tok.encode(text)
    msgs = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False,
                                                                       add_generation_prompt=True)
