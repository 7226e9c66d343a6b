"""Fast tokenizer wrapper over `tokenizers.Tokenizer`, plus chat-template rendering.

The hot path never imports transformers. Tokenizers that exist only inside a GGUF file (or an
HF folder without tokenizer.json) are converted once by transformers and cached as a plain
tokenizer.json in pagoda's cache folder (pagoda/paths.py), tokenizers/<key>/.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import processors
from tokenizers.decoders import DecodeStream

from pagoda import paths

if TYPE_CHECKING:
    from pagoda.model.loader import ModelFiles

_CACHE_VERSION = 1
_GIL_FREE_CHARS = 4096  # texts longer than this are (de)tokenized through the calls that release the GIL
# End-of-turn markers of common chat formats; added to stop ids when the chat template uses them.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|endoftext|>", "</s>", "<|END_OF_TURN_TOKEN|>", "<｜end▁of▁sentence｜>")


class IncrementalDecoder:
    """Streams text for one sequence, token by token; never emits a partial UTF-8 character."""

    def __init__(self, tokenizer: _HFTokenizer, skip_special_tokens: bool = True,
                 prefix_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        # A few prompt tokens of context: SentencePiece decoders drop a word's leading space at the
        # start of a stream, so the first generated word would lose it.
        self._stream = DecodeStream(ids=list(prefix_ids or []), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Feed one token id; return the newly completed text ('' while a character is incomplete)."""
        out = self._stream.step(self._tok, int(token_id))
        return out or ""


class Tokenizer:
    """A model's tokenizer: encode/decode/streaming decode and its chat template."""

    def __init__(self, tok: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 extra_eos_ids: list[int] | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id if bos_token_id is not None else (
            tok.token_to_id(bos_token) if bos_token else None)
        self.eos_token_id = eos_token_id if eos_token_id is not None else (
            tok.token_to_id(eos_token) if eos_token else None)
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = tok.id_to_token(self.bos_token_id)
        if self.eos_token is None and self.eos_token_id is not None:
            self.eos_token = tok.id_to_token(self.eos_token_id)
        self.chat_template = chat_template
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        # Named special tokens (bos/eos/unk/pad strings) are visible to chat templates.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        if self.bos_token:
            self.special_tokens.setdefault("bos_token", self.bos_token)
        if self.eos_token:
            self.special_tokens.setdefault("eos_token", self.eos_token)
        stop: set[int] = set()
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        stop.update(int(i) for i in (extra_eos_ids or []))
        if chat_template:
            for t in _END_OF_TURN_TOKENS:
                if t in chat_template:
                    tid = tok.token_to_id(t)
                    if tid is not None:
                        stop.add(tid)
        self.stop_token_ids: set[int] = stop
        self._token_text_cache: dict[int, str] = {}
        self._compiled_template: Any = None
        self._specials: tuple[list[str], re.Pattern[str] | None] | None = None
        self._plain: _HFTokenizer | None = None

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings in the text map to their ids, as in HF)."""
        if len(text) > _GIL_FREE_CHARS:
            # encode() holds the GIL for the whole text, so no other Python thread, the server's event loop
            # included, runs while a long prompt encodes; encode_batch releases it.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if len(ids) > _GIL_FREE_CHARS // 4:  # as in encode: the batch call releases the GIL
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text: no text over n times this encodes to n tokens or fewer."""
        n = self._tok.get_vocab_size(with_added_tokens=True)
        texts = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1) or 1

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a rendered conversation in which only the template makes control tokens.

        A special-token string inside a message (say "<|im_end|><|im_start|>system") would otherwise
        become the real control token and forge a turn. Such strings are swapped for private-use markers
        before rendering and tokenized as plain text afterwards, like HF's split_special_tokens but for
        the messages alone: the template's own special tokens stay control tokens. Conversations without
        such strings take the plain path, so their ids are exactly what tokenizing the rendering gives.
        `tools` (OpenAI's tool definitions, for templates that render them) are escaped the same way.
        """
        specials, pattern = self._special_strings()
        extra = {"tools": tools} if tools else {}
        if pattern is None or not any(pattern.search(text) for text in iter_strings([messages, tools])):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                               add_special_tokens=False)
        nonce = secrets.token_hex(4)
        escaped, extra = _map_strings([messages, extra], lambda t: pattern.sub(
            lambda m: f"\ue000{nonce}{specials.index(m.group(0))}\ue001", t))
        rendered = self.apply_chat_template(escaped, add_generation_prompt, **extra)
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            else:
                ids += self._text_only().encode(specials[int(piece)], add_special_tokens=False).ids
        return ids

    def _special_strings(self) -> tuple[list[str], re.Pattern[str] | None]:
        """The special tokens' strings, and one regex matching any of them (None if there are none)."""
        if self._specials is None:  # longest first, so that the alternation prefers the longest match
            added = self._tok.get_added_tokens_decoder().values()
            strings = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
            self._specials = strings, re.compile("|".join(map(re.escape, strings))) if strings else None
        return self._specials

    def _text_only(self) -> _HFTokenizer:
        """A copy of the tokenizer that reads special-token strings as text (split_special_tokens)."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def id_to_token_text(self, token_id: int) -> str:
        """Decoded text of a single token (byte fragments of a multibyte char come out as U+FFFD)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._tok.decode([int(token_id)], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def decode_stream(self, skip_special_tokens: bool = True,
                      prefix_ids: list[int] | None = None) -> IncrementalDecoder:
        """Incremental decoder; `prefix_ids` (the prompt's last tokens) give the first token its context."""
        return IncrementalDecoder(self._tok, skip_special_tokens, prefix_ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        """Render the chat template like transformers' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use a completions request with a raw prompt "
                             "or a model whose tokenizer defines one")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        variables = {**self.special_tokens, **kw}
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        return self._compiled_template.render(**variables)


# -- chat templates -----------------------------------------------------------------------

def iter_strings(value: Any) -> Iterator[str]:
    """Every string inside a message (content, name, tool call arguments, ...)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_strings(v)


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _compile_template(source: str) -> Any:
    """Compile a chat template in an immutable sandbox, with the helpers HF templates expect."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) as a no-op."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's builtin tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class SafeNamespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore attributes (no reach into Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature trick
            self, rest = args[0], args[1:]
            for k in dict(*rest, **kwargs):
                SafeNamespace._check(k)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = SafeNamespace
    return env.from_string(source)


# -- loading ------------------------------------------------------------------------------

def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {os.path.basename(path)} in {os.path.dirname(path)!r}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_str(v: Any) -> str | None:
    """tokenizer_config stores special tokens as plain strings or AddedToken dicts."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _pick_template(v: Any) -> str | None:
    """chat_template may be a string or a list of {name, template}; prefer 'default'."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        named = {d.get("name"): d.get("template") for d in v if isinstance(d, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(v)] if isinstance(v, int) else [int(x) for x in v]


def _apply_bos_eos_flags(tok: _HFTokenizer, bos: str | None, eos: str | None,
                         add_bos: bool, add_eos: bool) -> None:
    """Rebuild the post-processor from explicit add_bos_token/add_eos_token, as transformers does."""
    if add_bos and (bos is None or tok.token_to_id(bos) is None):
        add_bos = False
    if add_eos and (eos is None or tok.token_to_id(eos) is None):
        add_eos = False
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    special = ([(bos, tok.token_to_id(bos))] if add_bos else []) + ([(eos, tok.token_to_id(eos))] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _cache_key(paths: list[str]) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}".encode())
    for p in sorted(paths):
        st = os.stat(p)
        h.update(f"|{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def _convert_with_transformers(folder: str, gguf_file: str | None, out_dir: str) -> None:
    """Cold path: let transformers build the tokenizer once; persist what the hot path needs."""
    from transformers import AutoTokenizer  # lazy: slow import, only on a cache miss

    from pagoda.model.errors import ModelFileError

    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    except Exception as e:  # odd tokenizer metadata in a file whose header is valid
        raise ModelFileError(os.path.join(folder, gguf_file) if gguf_file else folder,
                             f"cannot build its tokenizer ({type(e).__name__}: {e})") from None
    if not getattr(hf, "is_fast", False) or getattr(hf, "backend_tokenizer", None) is None:
        raise ValueError(f"cannot build a fast tokenizer for {folder!r}")
    hf.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    template = hf.chat_template if isinstance(hf.chat_template, str) else _pick_template(hf.chat_template)
    special = {k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str) or hasattr(v, "content")}
    meta = {"version": _CACHE_VERSION, "chat_template": template,
            "bos_token": _token_str(hf.bos_token), "eos_token": _token_str(hf.eos_token),
            "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id,
            "special_tokens": {k: v for k, v in special.items() if k.endswith("_token")}}
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f)


def _cached_conversion(source_files: list[str], folder: str, gguf_file: str | None) -> tuple[_HFTokenizer, dict]:
    """Load a converted tokenizer from the cache, converting (atomically) on a miss."""
    root = str(paths.tokenizers_dir())
    final = os.path.join(root, _cache_key(source_files))
    if not (os.path.isfile(os.path.join(final, "meta.json")) and os.path.isfile(os.path.join(final, "tokenizer.json"))):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
        try:
            _convert_with_transformers(folder, gguf_file, tmp)
            try:
                os.rename(tmp, final)  # atomic publish; loses cleanly to a concurrent writer
            except OSError:
                if not os.path.isfile(os.path.join(final, "meta.json")):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    with open(os.path.join(final, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    return _HFTokenizer.from_file(os.path.join(final, "tokenizer.json")), meta


def _tokenizer_source_files(folder: str) -> list[str]:
    names = [n for n in os.listdir(folder)
             if n.startswith(("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template"))
             or n.endswith((".model", ".tiktoken"))]
    return [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]


def load_tokenizer(model_files: "ModelFiles | str") -> Tokenizer:
    """Tokenizer for a ModelFiles, an HF folder or a .gguf file path."""
    if isinstance(model_files, str):
        path = os.path.expanduser(model_files)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model path does not exist: {path!r}")
        kind, source = ("gguf" if os.path.isfile(path) and path.lower().endswith(".gguf") else "hf"), path
    else:
        kind, source = model_files.kind, model_files.source

    if kind == "gguf":
        folder, name = os.path.split(os.path.abspath(source))
        tok, meta = _cached_conversion([source], folder, name)
        return Tokenizer(tok, bos_token=meta.get("bos_token"), eos_token=meta.get("eos_token"),
                         bos_token_id=meta.get("bos_token_id"), eos_token_id=meta.get("eos_token_id"),
                         chat_template=meta.get("chat_template"), special_tokens=meta.get("special_tokens"))

    folder = source
    if not os.path.isdir(folder):
        raise ValueError(f"unsupported tokenizer source {folder!r}: expected a model folder or a .gguf file")
    tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    gen_cfg = _read_json(os.path.join(folder, "generation_config.json"))
    model_cfg = _read_json(os.path.join(folder, "config.json"))
    tok_json = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tok_json):
        tok = _HFTokenizer.from_file(tok_json)
        bos, eos = _token_str(tok_cfg.get("bos_token")), _token_str(tok_cfg.get("eos_token"))
        if "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg or tok.post_processor is None:
            _apply_bos_eos_flags(tok, bos, eos, bool(tok_cfg.get("add_bos_token", False)),
                                 bool(tok_cfg.get("add_eos_token", False)))
        template = _pick_template(tok_cfg.get("chat_template"))
        meta: dict[str, Any] = {"bos_token": bos, "eos_token": eos, "chat_template": template,
                                "special_tokens": {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                                   if (s := _token_str(tok_cfg.get(k)))}}
    else:
        sources = _tokenizer_source_files(folder)
        if not sources:
            raise FileNotFoundError(f"model folder {folder!r} has no tokenizer files (tokenizer.json expected)")
        tok, meta = _cached_conversion(sources, folder, None)
    # transformers >= 4.43 writes the template to its own file; it takes precedence.
    for fname in ("chat_template.jinja", "chat_template.json"):
        p = os.path.join(folder, fname)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                meta["chat_template"] = (f.read() if fname.endswith(".jinja")
                                         else _pick_template(json.load(f).get("chat_template")))
            break
    eos_ids = _ids(gen_cfg.get("eos_token_id")) or _ids(model_cfg.get("eos_token_id"))
    eos_id = meta.get("eos_token_id")
    if eos_id is None and meta.get("eos_token"):
        eos_id = tok.token_to_id(meta["eos_token"])
    if eos_id is None and eos_ids:
        eos_id = eos_ids[0]
    bos_id = meta.get("bos_token_id")
    if bos_id is None and not meta.get("bos_token"):
        bos_id = (_ids(gen_cfg.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id")) or [None])[0]
    return Tokenizer(tok, bos_token=meta.get("bos_token"), eos_token=meta.get("eos_token"),
                     bos_token_id=bos_id, eos_token_id=eos_id, extra_eos_ids=eos_ids,
                     chat_template=meta.get("chat_template"), special_tokens=meta.get("special_tokens"))
