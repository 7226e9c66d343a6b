"""EAGLE-3 against no speculation on open chat: `python -m benchmarks.eagle corpus FILE` writes the training
prompts, `python -m benchmarks.eagle run --head DIR` measures.

`python -m benchmarks.eagle train-step DIR` times train-eagle's optimizer step after the first epoch, the target's
outputs kept against the target run for every batch, over a run's self-distilled data.

`python -m benchmarks.eagle profile --head DIR` splits a batch-1 decode step's time, with and without the head:
the target's forward, the head's passes and logits, and the rest.

`python -m benchmarks.eagle tree-moves --head DIR` times a draft tree's KV moves, one C++ call against the
torch twin's indexed copies, in one engine at batch 1.

`python -m benchmarks.eagle report --head DIR` prints train-eagle's acceptance report over the prompts `run`
measures.

`python -m benchmarks.eagle untrained DIR` writes a head with train-eagle's initial weights (a random layer, the
target's LM-head rows) over a random draft vocabulary, which accepts almost nothing: `run` over it measures what
a bad head costs, the case the adaptive controller must keep at no speculation's speed.

Prompts are open questions (templates x topics, with the chat template); the training prompts and the
measured ones share no topic. `run` answers the held-out prompts greedily (up to --output-len tokens, stopping
at end of turn as a chat would) with the same engine settings with and without the head:
  batch 1     one request at a time (--prompts of them), alternated --rounds times: output tok/s of each;
  concurrent  --concurrency requests at a time (max_num_seqs), twice as many prompts, alternated too;
with one EAGLE-3 engine per --trees ('chain', or a speculative_token_tree in vLLM's form), per
--head-quantization (the head's linears as stored, or quantized as they load) and per --adaptive (the
controller choosing k, or k every step), and checks that
every answer is the same tokens either way. Prints the ratios (of the medians, and the median of the rounds'
paired ratios), the mean acceptance length and the acceptance
per draft depth (the share of verifications that accepted a proposal at depth j).
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time

TEMPLATES = [
    "Explain {t} to a beginner.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short story that involves {t}.",
    "Give me three practical tips about {t}.",
    "How would you describe {t} to a ten-year-old?",
    "What is the history of {t}, in a few sentences?",
    "Write a short poem about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something similar and explain the difference.",
    "Why do people care about {t}?",
    "Write a friendly email to a colleague about {t}.",
    "What questions should I ask before learning about {t}?",
]

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system", "climate change",
    "electric cars", "solar panels", "wind energy", "recycling", "honey bees", "coral reefs", "the moon landing",
    "the printing press", "the Roman Empire", "ancient Egypt", "the Renaissance", "democracy", "inflation",
    "compound interest", "budgeting", "saving for retirement", "credit cards", "learning a new language",
    "playing the guitar", "jazz music", "classical music", "painting with watercolors", "photography",
    "baking bread", "making pasta", "coffee", "green tea", "vegetarian cooking", "running a marathon", "yoga",
    "sleep", "meditation", "friendship", "remote work", "job interviews", "public speaking", "time management",
    "writing a resume", "starting a small business", "social media", "online privacy", "passwords",
    "computer viruses", "the internet", "smartphones", "artificial intelligence", "robots", "video games",
    "chess", "soccer", "basketball", "the Olympic Games", "mountain climbing", "camping", "gardening",
    "houseplants", "composting", "dogs", "cats", "birds", "whales", "dinosaurs", "evolution", "DNA",
    "vaccines", "antibiotics", "the human brain", "memory", "dreams", "the solar system", "Mars", "telescopes",
    "the speed of light", "gravity", "magnets", "electricity", "batteries", "airplanes", "trains", "bicycles",
    "city planning", "public libraries", "museums", "theater", "poetry", "novels", "fairy tales", "mythology",
    "volunteering", "recycling plastic", "clean water", "deserts", "rainforests", "the ocean", "earthquakes",
    "hurricanes", "snow", "the seasons", "maps", "the compass", "clocks", "calendars", "bridges",
    "skyscrapers", "castles", "pyramids", "lighthouses", "farming", "rice", "chocolate", "cheese", "spices",
    "tea ceremonies", "origami", "knitting",
]
HELD_OUT = 24  # the last topics: measured, never trained on


def prompts(split: str, seed: int = 0) -> list[str]:
    topics = TOPICS[-HELD_OUT:] if split == "heldout" else TOPICS[:-HELD_OUT]
    out = [t.format(t=topic) for topic, t in itertools.product(topics, TEMPLATES)]
    random.Random(seed).shuffle(out)
    return out


def vocabulary_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` more training prompts, each a random template over a word drawn from the embedded model's
    vocabulary (whole-word tokens, lowercase ASCII, six letters or more), none inside a held-out topic: topics
    the fixed list lacks, so the head meets more kinds of text than 97 topics give."""
    from pagoda.model.default_model import default_model_path
    from pagoda.model.tokenizer import load_tokenizer

    held = " ".join(TOPICS[-HELD_OUT:])
    vocab = load_tokenizer(default_model_path()).backend.get_vocab()
    spaced = (t[1:] for t in vocab if t.startswith("\u0120"))  # a word token, after its leading space
    words = sorted(w for w in spaced if len(w) >= 6 and w.isascii() and w.isalpha() and w.islower() and w not in held)
    rng = random.Random(seed)
    return [rng.choice(TEMPLATES).format(t=w) for w in rng.sample(words, min(count, len(words)))]


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _timed(llm, convs, params) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, tokens)) / dt, tokens


def _one_at_a_time(llm, convs, params) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    """Batch 1: each conversation alone, in turn; output tokens per second over all of them."""
    t0, toks = time.perf_counter(), []
    for c in convs:
        toks += _timed(llm, [c], params)[1]
    return sum(map(len, toks)) / (time.perf_counter() - t0), toks


def _spec(head: str, k: int, tree: str, quantization: str, adaptive: bool) -> dict:
    """The speculative_config of an EAGLE-3 engine: a chain k deep, or `tree` (a speculative_token_tree, which
    sets num_speculative_tokens to its nodes); `quantization` "none" keeps the head's linears as stored."""
    from pagoda.core.draft_tree import TokenTree

    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k,
            "quantization": None if quantization == "none" else quantization, "adaptive": adaptive}
    if tree != "chain":
        spec.update(speculative_token_tree=tree, num_speculative_tokens=len(TokenTree.parse(tree).paths))
    return spec


def run(args: argparse.Namespace) -> int:
    from pagoda import LLM, SamplingParams

    held = prompts("heldout")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    common = dict(dtype=args.dtype, quantization=args.quantization, kv_cache_memory="2GiB")
    rows = []
    for conc in [1, *args.concurrency]:
        n = args.prompts if conc == 1 else 2 * conc
        convs = [_messages(t) for t in held[:n]]
        llms = {"plain": LLM(args.model, max_num_seqs=conc, **common)}
        # chains and draft trees, with the head as stored or quantized, each beside the same plain engine
        for tree, quant, adaptive in itertools.product(args.trees, args.head_quantization, args.adaptive):
            spec = _spec(args.head, args.k, tree, quant, adaptive == "on")
            name = ", ".join([tree] + [f"head {quant}"] * (len(args.head_quantization) > 1)
                             + [f"adaptive {adaptive}"] * (len(args.adaptive) > 1))
            llms[name] = LLM(args.model, max_num_seqs=conc, speculative_config=spec, **common)
        rates: dict[str, list[float]] = {name: [] for name in llms}
        answers: dict[str, list[list[int]]] = {}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                rate, toks = _one_at_a_time(llm, convs, params) if conc == 1 else _timed(llm, convs, params)
                rates[name].append(rate)
                answers[name] = toks
        p = statistics.median(rates["plain"])
        for name, llm in list(llms.items())[1:]:
            same = answers["plain"] == answers[name]
            st = llm.engine.speculator.stats
            per_pos = [a / st.num_drafts for a in st.accepted_per_pos] if st.num_drafts else []
            e = statistics.median(rates[name])
            spread = [a / b for a, b in zip(rates[name], rates["plain"])]  # each round's ratio
            # The rounds alternate the engines, so a round's ratio pairs runs a few seconds apart: its median
            # holds while the machine drifts, where the ratio of medians pairs runs minutes apart.
            paired = statistics.median(spread)
            rows.append((conc, name, e, p, e / p, paired, st.mean_acceptance_length, per_pos, same))
            c = llm.engine.speculator.policy.cost  # measured as the engine started, beside the other engines
            print(f"  {name}: cost model at start-up: target {1e3 * c.c0:.2f} ms + {1e3 * c.c1:.2f} ms a token, "
                  f"draft pass {1e3 * c.d0:.2f} ms + {1e3 * c.d1:.2f} ms a row", flush=True)
            print(f"concurrency {conc}, {name}: eagle3 {e:.1f} tok/s vs plain {p:.1f} ({e / p:.2f}x; rounds "
                  f"{min(spread):.2f}-{max(spread):.2f}x, median {paired:.2f}x), acceptance "
                  f"length {st.mean_acceptance_length:.2f}, per position {' '.join(f'{x:.2f}' for x in per_pos)}, "
                  f"identical tokens: {same}", flush=True)
        del llms
    print("\n| concurrency | drafts | EAGLE-3 (out tok/s) | no speculation | ratio | ratio per round (median) | "
          "mean acceptance length | accepted at depth 1..k | tokens identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for conc, name, e, p, r, rr, al, per_pos, same in rows:
        print(f"| {conc} | {name} | {e:.1f} | {p:.1f} | {r:.2f}x | **{rr:.2f}x** | {al:.2f} | "
              f"{' / '.join(f'{x:.2f}' for x in per_pos)} | {'yes' if same else 'NO'} |")
    return 0 if all(r[-1] for r in rows) else 1


def report(args: argparse.Namespace) -> int:
    """train-eagle's acceptance report (eagle3_train.evaluate) over the held-out prompts `run` measures: the head
    on the target's greedy continuations of them, counted as decoding verifies chains and over every anchor."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from pagoda import LLM
    from pagoda.spec_decode.eagle3_head import WEIGHTS_FILE, Eagle3Config
    from pagoda.spec_decode.eagle3_train import Teacher, TrainOptions, evaluate, self_samples
    from pagoda.spec_decode.eagle3_ttt import DenseEagle3

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=16, kv_cache_memory="1GiB")
    runner = llm.engine.runner
    folder = Path(args.head)
    config = Eagle3Config.from_hf(json.loads((folder / "config.json").read_text()), runner.args)
    head = DenseEagle3(config, runner.model.embed_tokens)
    head.load_tensors(load_file(str(folder / WEIGHTS_FILE)))
    held = prompts("heldout")[:args.prompts]
    opts = TrainOptions(corpus="", output="", gen_tokens=args.output_len, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        samples = self_samples(llm, held, list(range(len(held))), opts, Path(tmp) / "self.jsonl", None)
    print(json.dumps(evaluate(Teacher(runner, config.aux_layers, head.d2t, 0), head, samples, args.k), indent=2))
    return 0


def untrained(args: argparse.Namespace) -> int:
    import torch

    from pagoda import LLM
    from pagoda.spec_decode.eagle3_head import Eagle3Config, save_head
    from pagoda.spec_decode.eagle3_train import new_head

    runner = LLM(args.model, dtype="float32", kv_cache_memory="64MiB").engine.runner
    vocab, draft = runner.args.vocab_size, args.draft_vocab_size
    g = torch.Generator().manual_seed(0)
    d2t = torch.randperm(vocab, generator=g)[:draft].sort().values - torch.arange(draft)
    head = new_head(runner, Eagle3Config.for_target(runner.args, draft), d2t, seed=0)
    save_head(args.folder, head.config, head.tensors(vocab))
    print(f"an untrained EAGLE-3 head in {args.folder}")
    return 0


def train_step(args: argparse.Namespace) -> int:
    """train-eagle's optimizer step after the first epoch, the target's outputs kept (Teacher with a cache)
    against the target run again for every batch, alternated over the same batches of a run's data/self.jsonl."""
    from pathlib import Path

    import torch

    from pagoda import LLM
    from pagoda.spec_decode.eagle3_head import Eagle3Config
    from pagoda.spec_decode.eagle3_train import Teacher, draft_vocab, new_head, read_generated, train_step

    samples = list(read_generated(Path(args.folder) / "data" / "self.jsonl").values())[:args.batches * 4]
    if not samples:
        raise SystemExit(f"{args.folder}/data/self.jsonl holds no generated lines (train-eagle --data self writes it)")
    runner = LLM(args.model, dtype=args.dtype, kv_cache_memory="256MiB").engine.runner
    config = Eagle3Config.for_target(runner.args, args.draft_vocab_size)
    head = new_head(runner, config, draft_vocab(samples, runner.args.vocab_size, args.draft_vocab_size, set()), 0)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3)
    teachers = {"target every batch": Teacher(runner, config.aux_layers, head.d2t, 0),
                "kept outputs": Teacher(runner, config.aux_layers, head.d2t, 1 << 40)}
    batches = [list(range(i, min(i + 4, len(samples)))) for i in range(0, len(samples), 4)]
    for index in batches:  # the first epoch, which fills the cache
        teachers["kept outputs"].batch([samples[i] for i in index], index)
    times: dict[str, list[float]] = {name: [] for name in teachers}
    for _ in range(args.rounds):
        for index in batches:
            for name, teacher in teachers.items():
                t0 = time.perf_counter()
                train_step(head, opt, teacher.batch([samples[i] for i in index], index), 4)
                times[name].append(time.perf_counter() - t0)
    every, kept = (statistics.median(v) for v in times.values())
    print(f"seconds per step (median of {len(times['kept outputs'])}): target every batch {every:.2f}, kept "
          f"outputs {kept:.2f}: {every / kept:.2f}x")
    return 0


class _Clock:
    """Seconds and calls of wrapped callables (instance attributes, so other engines are untouched), per engine
    step: a step whose target forward runs more than `max_tokens` tokens (a prompt's prefill) is not counted."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.tokens = 0  # emitted by the counted steps
        self._step: dict[str, tuple[float, int]] = {}
        self._prefill = False

    def wrap(self, owner: object, attr: str, name: str, key=None) -> None:  # noqa: ANN001
        inner = getattr(owner, attr)

        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = inner(*a, **k)
            n = name if key is None else key(a, k)
            sec, calls = self._step.get(n, (0.0, 0))
            self._step[n] = (sec + time.perf_counter() - t0, calls + 1)
            return out

        setattr(owner, attr, timed)

    def wrap_step(self, engine: object, runner: object) -> None:
        """The engine's step (outermost: it commits or drops what the step's wrapped calls measured) and the
        runner's forward (which tells a prefill)."""
        execute = runner.execute

        def forward(sched, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            self._prefill |= sched.total_tokens > self.max_tokens
            return execute(sched, *a, **k)

        runner.execute = forward
        self.wrap(runner, "execute", "target forward and LM head")
        inner = engine._step

        def step():  # noqa: ANN202
            self._step, self._prefill = {}, False
            emitted = engine.stats.num_generated_tokens
            t0 = time.perf_counter()
            out = inner()
            self._step["step"] = (time.perf_counter() - t0, 1)
            if not self._prefill:
                self.tokens += engine.stats.num_generated_tokens - emitted
                for n, (sec, calls) in self._step.items():
                    self.seconds[n] = self.seconds.get(n, 0.0) + sec
                    self.calls[n] = self.calls.get(n, 0) + calls
            return out

        engine._step = step


def profile(args: argparse.Namespace) -> int:
    """Where a batch-1 decode step's time goes, without speculation and with a head (--tree: 'chain' or a
    speculative_token_tree), over the measured prompts: milliseconds per decode step (prefills left out) of the
    engine's step, the target's forward with its LM head, drafting and its parts. Each engine runs the prompts
    once unmeasured first."""
    from pagoda import LLM, SamplingParams
    from pagoda.spec_decode.head_proposer import HeadProposer

    spec = _spec(args.head, args.k, args.tree, args.head_quantization, adaptive=False)
    convs = [_messages(t) for t in prompts("heldout")[:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    rows: list[tuple[str, dict[str, float], float]] = []
    for name, cfg in (("no speculation", None), (f"EAGLE-3 {args.tree}, head {args.head_quantization}", spec)):
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=1, speculative_config=cfg)
        engine = llm.engine
        for c in convs:  # unmeasured: every path warm
            llm.chat([c], params, use_tqdm=False)
        clock = _Clock(1 + (cfg["num_speculative_tokens"] if cfg else 0))
        clock.wrap_step(engine, engine.runner)
        if engine.speculator is not None:
            clock.wrap(engine.speculator, "propose", "drafting")
            drafter = engine.speculator.drafter
            assert isinstance(drafter, HeadProposer)
            clock.wrap(drafter, "_run", "", key=lambda a, k: "catch-up passes" if k.get("from_target", a[3:4] == [True])
                       else "further passes")
            clock.wrap(drafter.head, "logits", "head's logits")
        for c in convs:
            llm.chat([c], params, use_tqdm=False)
        steps = clock.calls["step"]
        per = {n: 1e3 * sec / steps for n, sec in clock.seconds.items()}
        if "drafting" in per:
            per["the rest of drafting"] = per["drafting"] - sum(per.get(n, 0.0) for n in (
                "catch-up passes", "further passes", "head's logits"))
        per["the rest of the step"] = per["step"] - per["target forward and LM head"] - per.get("drafting", 0.0)
        rows.append((name, per, clock.tokens / steps))
        print(f"{name}: {steps} decode steps, {clock.tokens / steps:.2f} tokens a step; passes a step: "
              f"{clock.calls.get('further passes', 0) / steps:.2f} further, "
              f"{clock.calls.get('catch-up passes', 0) / steps:.2f} catch-up", flush=True)
        del llm, engine
    order = ["step", "target forward and LM head", "drafting", "catch-up passes", "further passes",
             "head's logits", "the rest of drafting", "the rest of the step"]
    print(f"\n| ms per step | {' | '.join(name for name, _, _ in rows)} |")
    print("|---|" + "---|" * len(rows))
    for n in order:
        print(f"| {n} | " + " | ".join(f"{per[n]:.2f}" if n in per else "" for _, per, _ in rows) + " |")
    print("| tokens per step | " + " | ".join(f"{t:.2f}" for _, _, t in rows) + " |")
    return 0


def tree_moves(args: argparse.Namespace) -> int:
    """A draft tree's accepted nodes move to their positions' KV slots in every layer (ModelRunner.move_slots):
    one C++ call over every cache against the torch twin's indexed copies, swapped into the same engine and
    alternated round by round, batch 1 over the measured prompts. Prints one move's time and the decode rate."""
    from pagoda import LLM, SamplingParams
    from pagoda.executor import model_runner
    from pagoda.kernels import fused_ops

    spec = _spec(args.head, 0, args.tree, args.head_quantization, adaptive=False)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=1, speculative_config=spec)
    runner = llm.engine.runner
    ways = {"one call": fused_ops.move_kv_slots, "indexed copies": fused_ops.move_kv_slots_torch}
    moves = [(runner.block_size + 3, 2), (runner.block_size + 5, 3)]  # two accepted nodes, one block apart
    for name, move in ways.items():
        model_runner.move_kv_slots = move
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            runner.move_slots(moves)
            times.append(time.perf_counter() - t0)
        print(f"{name}: {1e3 * statistics.median(times):.3f} ms to move 2 slots in "
              f"{len(runner.kv_caches)} layers' K and V", flush=True)
    convs = [_messages(t) for t in prompts("heldout")[:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    answers: dict[str, list[list[int]]] = {}
    _one_at_a_time(llm, convs, params)  # unmeasured: the engine's first answers pay for warming it
    for _ in range(args.rounds):
        for name, move in ways.items():
            model_runner.move_kv_slots = move
            rate, answers[name] = _one_at_a_time(llm, convs, params)
            rates[name].append(rate)
    model_runner.move_kv_slots = fused_ops.move_kv_slots
    paired = [a / b for a, b in zip(*rates.values())]
    print(f"batch 1, {args.tree}: one call {statistics.median(rates['one call']):.1f} tok/s, indexed copies "
          f"{statistics.median(rates['indexed copies']):.1f}; paired median {statistics.median(paired):.3f}x "
          f"(rounds {min(paired):.3f}-{max(paired):.3f}x); tokens identical: "
          f"{answers['one call'] == answers['indexed copies']}")
    return 0


HEAD_QUANTIZATION = ["none", "int8", "int4", "fp8"]  # speculative_config.quantization; none: as stored


def _measuring(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments every subcommand that measures a head over the held-out prompts takes."""
    p.add_argument("--head", required=True, help="the EAGLE-3 head folder (pagoda train-eagle --output)")
    p.add_argument("--model", default=None, help="the target (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts (at batch 1)")
    p.add_argument("--output-len", type=int, default=128)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus", help="write the training prompts, one per line")
    c.add_argument("file")
    c.add_argument("--vocabulary-topics", type=int, default=0,
                   help="add this many prompts over words of the model's vocabulary (vocabulary_prompts)")
    u = sub.add_parser("untrained", help="write an untrained head (what a bad head costs)")
    u.add_argument("folder")
    u.add_argument("--model", default=None, help="the target (default: the embedded model)")
    u.add_argument("--draft-vocab-size", type=int, default=8192)
    r = _measuring(sub.add_parser("run", help="measure a head against no speculation"))
    r.add_argument("--quantization", default=None, help="the target's weights (int8, int4, gguf, ...), as LLM takes")
    r.add_argument("--head-quantization", nargs="+", default=["none"], choices=HEAD_QUANTIZATION,
                   help="the head's linears (speculative_config.quantization), one engine each")
    r.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    r.add_argument("--adaptive", nargs="+", default=["on"], choices=["on", "off"],
                   help="speculative_config.adaptive, one engine each: off drafts k (or the whole tree) every step")
    r.add_argument("--trees", nargs="+", default=["chain"],
                   help="one EAGLE-3 engine each, measured beside the plain one: 'chain' (k deep), or a "
                        "speculative_token_tree such as '[(0,), (1,), (2,), (0, 0)]'")
    r.add_argument("--concurrency", type=int, nargs="*", default=[8, 32])
    r.add_argument("--rounds", type=int, default=4)
    a = _measuring(sub.add_parser("report", help="train-eagle's acceptance report over the prompts run measures"))
    a.add_argument("--k", type=int, default=4)
    t = sub.add_parser("train-step", help="train-eagle's step with the target's outputs kept against without")
    t.add_argument("folder", help="a train-eagle --output folder with data/self.jsonl")
    t.add_argument("--model", default=None, help="the target (default: the embedded model)")
    t.add_argument("--dtype", default="float32")
    t.add_argument("--draft-vocab-size", type=int, default=8192)
    t.add_argument("--batches", type=int, default=6, help="batches of 4 sequences")
    t.add_argument("--rounds", type=int, default=2)
    f = _measuring(sub.add_parser("profile", help="where a batch-1 step's time goes, with and without a head"))
    f.add_argument("--head-quantization", default="int8", choices=HEAD_QUANTIZATION)
    f.add_argument("--tree", default="chain", help="'chain' (--k deep) or a speculative_token_tree")
    f.add_argument("--k", type=int, default=4)
    m = _measuring(sub.add_parser("tree-moves", help="a draft tree's KV moves: one C++ call against indexed copies"))
    m.add_argument("--head-quantization", default="int8", choices=HEAD_QUANTIZATION)
    m.add_argument("--tree", default="[(0,), (1,), (2,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]")
    m.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    if args.cmd == "corpus":
        with open(args.file, "w") as f:
            f.write("\n".join(prompts("train") + vocabulary_prompts(args.vocabulary_topics)) + "\n")
        return 0
    return {"untrained": untrained, "run": run, "report": report, "train-step": train_step,
            "tree-moves": tree_moves, "profile": profile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
