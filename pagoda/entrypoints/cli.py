"""The `pagoda` command: generate, chat, serve, bench, train-eagle."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import pagoda
from pagoda.entrypoints.engine_args import add_engine_args, check_model, engine_kwargs


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help text already says it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _show_defaults(p: argparse.ArgumentParser) -> None:
    """argparse prints nothing, not even the default, for a flag without help text: give each one a help
    (plugin modules add flags this file does not see)."""
    for action in p._actions:
        if action.help is None and action.default is not argparse.SUPPRESS and not action.required:
            action.help = "(default: %(default)s)"


# Sampling flags: name -> (type, default of `generate`). `chat` leaves them unset (None) so that the
# model's generation_config.json, or CHAT_SAMPLING, fills what the user did not give.
_SAMPLING_FLAGS: dict[str, tuple[type, float]] = {
    "temperature": (float, 0.0), "top_p": (float, 1.0), "top_k": (int, -1), "repetition_penalty": (float, 1.0)}
# Greedy decoding of a small chat model loops; a little temperature and a repetition penalty do not.
CHAT_SAMPLING: dict[str, float] = {"temperature": 0.7, "repetition_penalty": 1.1}


def add_sampling_args(p: argparse.ArgumentParser, chat: bool = False) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    for name, (kind, default) in _SAMPLING_FLAGS.items():
        if chat:
            fallback = CHAT_SAMPLING.get(name, default)
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                           help=f"(default: the model's generation_config.json, else {fallback:g})")
        else:
            p.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                           help="0 = greedy" if name == "temperature" else "1 = off" if kind is float else "-1 = off")


def model_sampling_defaults(model: str | None) -> dict[str, Any]:
    """The sampling values of a model folder's generation_config.json ({} if it has none, as a GGUF).
    do_sample is ignored, as vLLM does: the values are what the model's authors tuned sampling to."""
    if model is None or not os.path.isdir(model):
        return {}
    try:
        with open(os.path.join(model, "generation_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: cfg[k] for k, (kind, _) in _SAMPLING_FLAGS.items()
            if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}


def _sampling(args: argparse.Namespace, defaults: dict[str, Any] | None = None):  # noqa: ANN202
    """SamplingParams from the flags; a flag left unset (None) takes `defaults`, then SamplingParams'."""
    from pagoda import SamplingParams

    values = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **{**(defaults or {}), **values})


def _note_speed(tokens: int, seconds: float) -> None:
    """'[42 tokens, 55.1 tok/s]' on stderr (dim on a terminal), so stdout keeps only the text."""
    line = f"[{tokens} tokens, {tokens / max(seconds, 1e-9):.1f} tok/s]"
    if sys.stderr.isatty():
        line = f"\033[2m{line}\033[0m"
    print(line, file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # bad flags fail before the model loads
    check_model(args.model)
    from pagoda import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    t0 = time.perf_counter()
    outs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(args.prompt, outs):
        print(f"{prompt}{out.outputs[0].text}")
        if len(args.prompt) > 1:
            print("-" * 40)
    _note_speed(sum(len(o.outputs[0].token_ids) for o in outs), elapsed)
    return 0


class _StopOnInterrupt:
    """SIGINT handler for one reply. The first Ctrl-C asks the stream loop to stop between engine steps
    (a step cut in half could leave the engine inconsistent); a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@dataclass
class Reply:
    text: str = ""                    # what was shown
    tokens: int = 0                   # tokens generated
    stopped: bool = False             # by Ctrl-C
    finish_reason: str | None = None  # "length": cut at --max-tokens


def stream_reply(engine: Any, prompt_ids: list[int], params: Any) -> Reply:
    """Stream one reply to stdout. Ctrl-C stops it: the request is aborted and the engine stays usable."""
    req = engine.add_request(prompt_ids, params)
    stop = _StopOnInterrupt()
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGINT, stop) if main_thread else None
    reply = Reply()
    try:
        while not stop.requested and engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == req.request_id:
                    c = out.outputs[0]
                    sys.stdout.write(c.text[len(reply.text):])
                    sys.stdout.flush()
                    reply.text, reply.tokens, reply.finish_reason = c.text, len(c.token_ids), c.finish_reason
    except KeyboardInterrupt:
        stop.requested = True
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
        if stop.requested:
            engine.abort_request(req.request_id)
    reply.stopped = stop.requested
    return reply


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat that streams tokens as the engine makes them."""
    params = _sampling(args, model_sampling_defaults(args.model) or CHAT_SAMPLING)
    check_model(args.model)
    from pagoda import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("pagoda chat: type a message; /reset starts over, /quit (or Ctrl-D) quits, Ctrl-C stops a reply.")
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if user.strip() in ("/quit", "/exit"):
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            print("[conversation reset" + (", system prompt kept]" if args.system else "]"), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        try:
            ids = engine.input_processor.tokenize_chat(messages)
            reply = stream_reply(engine, ids, params)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, keep chatting
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        if reply.finish_reason == "length":
            print(f"[reply cut at {reply.tokens} tokens: --max-tokens N allows more]", file=sys.stderr)
        _note_speed(reply.tokens, time.perf_counter() - t0)
        if reply.text or not reply.stopped:
            messages.append({"role": "assistant", "content": reply.text})  # what was shown, as the user saw it
        else:
            messages.pop()  # stopped before any output: as if never asked


def add_train_eagle_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", required=True,
                   help="text file: one document or prompt a line, or JSON lines with a \"text\" field")
    p.add_argument("--output", required=True,
                   help="folder for the head (published EAGLE-3 format), checkpoint/, data/ and train_report.json; "
                        "rerun with the same arguments to resume")
    p.add_argument("--data", default="self", choices=["self", "corpus"],
                   help="self: train on the target's own greedy continuations of each line (self-distillation); "
                        "corpus: on the text itself")
    p.add_argument("--max-minutes", type=float, default=30.0,
                   help="time budget over all runs into --output, generation included")
    p.add_argument("--epochs", type=int, default=1000, help="passes over the data at most (the budget decides first)")
    p.add_argument("--ttt-steps", type=int, default=4, help="draft steps unrolled in training (training-time test)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="tokens the head can draft: the data's most frequent (default: min(vocab, 32000))")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per training sequence (self: the prompt text is cut to seq-len - gen-tokens)")
    p.add_argument("--gen-tokens", type=int, default=128, help="self: tokens generated per line")
    p.add_argument("--holdout", type=float, default=0.05, help="share of the lines held out for the acceptance report")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--checkpoint-every", type=int, default=200, help="optimizer steps between checkpoints")
    p.add_argument("--eval-k", type=int, default=5, help="draft tokens per chain in the acceptance report")
    p.add_argument("--teacher-cache-gib", type=float, default=4.0,
                   help="memory for the target's outputs kept between epochs (about 16 bytes per hidden unit "
                        "per token); sequences beyond it run the target again each epoch")
    add_engine_args(p, decoding=False)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    """Train an EAGLE-3 head (spec_decode/eagle3_train.py) and print its held-out acceptance."""
    check_model(args.model)
    from pagoda.spec_decode.eagle3_train import TrainOptions, summary, train

    opts = TrainOptions(corpus=args.corpus, output=args.output, model=args.model, data=args.data,
                        max_minutes=args.max_minutes, epochs=args.epochs, ttt_steps=args.ttt_steps,
                        draft_vocab_size=args.draft_vocab_size, seq_len=args.seq_len, gen_tokens=args.gen_tokens,
                        holdout=args.holdout, batch_size=args.batch_size, lr=args.lr,
                        checkpoint_every=args.checkpoint_every, eval_k=args.eval_k, seed=args.seed or 0,
                        teacher_cache_gib=args.teacher_cache_gib,
                        engine=engine_kwargs(args))
    from pagoda.entrypoints.llm import LLM

    report = train(opts, LLM)
    print(summary(report))
    print(f"wrote {args.output} (train_report.json beside the head)")
    return 0


# Subcommands living in their own modules: name -> (module, help). Each module has add_arguments(p), main(args).
_PLUGINS = {
    "serve": ("pagoda.entrypoints.server.cli", "start the OpenAI-compatible HTTP server"),
    "quantize": ("pagoda.quantization.cli", "write an INT4 (RTN/GPTQ/AWQ) checkpoint, or a GGUF (--gguf TYPE)"),
    "kernels": ("pagoda.kernels.cli", "build the C++ CPU kernels by hand (pip install does), or show which one loads"),
}
_BENCH = {
    "throughput": ("pagoda.bench.throughput", "offline throughput benchmark (vs HF, roofline)"),
    "serve": ("pagoda.bench.serve", "load generator for any OpenAI-compatible server"),
    "quant": ("pagoda.bench.quant_table", "weight formats side by side: bytes, perplexity, decode, throughput"),
    "structured": ("pagoda.bench.structured", "JSON-schema requests against the same work unconstrained"),
    "embed": ("pagoda.bench.embed", "an embedding model against sentence-transformers: throughput and latency"),
}
_EVAL = {
    "perplexity": ("pagoda.eval.perplexity", "sliding-window perplexity of a text file"),
}
_BATCH = {
    "run": ("pagoda.entrypoints.run_batch", "answer a JSONL of OpenAI batch requests offline (vLLM's run_batch)"),
}
# Commands in groups: `pagoda GROUP COMMAND`.
_GROUPS = {"bench": ("benchmarks", _BENCH), "eval": ("quality evaluations", _EVAL),
           "batch": ("batch jobs", _BATCH)}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `argv`, only the command it names gets its flags, so that `pagoda --help`,
    `--version` and the light commands never import the heavy ones' modules (torch among them)."""
    chosen = _chosen_command(argv) if argv is not None else None
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM inference engine",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagoda {pagoda.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=HelpFormatter)
    g.add_argument("prompt", nargs="+", help="prompt text(s), each generated for separately")
    g.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat, streaming", formatter_class=HelpFormatter)
    c.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    add_engine_args(c)
    add_sampling_args(c, chat=True)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("train-eagle", help="train an EAGLE-3 draft head for a model on this CPU",
                       formatter_class=HelpFormatter)
    add_train_eagle_args(t)
    t.set_defaults(func=cmd_train_eagle)

    for name, (module, help_text) in _PLUGINS.items():
        _add_plugin(sub, name, module, help_text, chosen in (None, (name,)))
    for group, (group_help, commands) in _GROUPS.items():
        gsub = sub.add_parser(group, help=group_help, formatter_class=HelpFormatter).add_subparsers(
            dest=group, required=True)
        for name, (module, help_text) in commands.items():
            _add_plugin(gsub, name, module, help_text, chosen in (None, (group, name)))
    for p in (g, c, t):
        _show_defaults(p)
    return parser


def _chosen_command(argv: list[str]) -> tuple[str, ...]:
    """The command `argv` names: (command,) or, in a group, (group, command); () for none."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return ()
    return tuple(words[:2]) if words[0] in _GROUPS else (words[0],)


def _add_plugin(sub: Any, name: str, module: str, help_text: str, load: bool = True) -> None:
    """A command whose flags and code live in `module`; imported only where `load` (the command being run)."""
    if not load:
        sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        return
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:  # a real import error inside the module must surface
            raise
        return
    p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
    mod.add_arguments(p)
    _show_defaults(p)
    p.set_defaults(func=mod.main)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
