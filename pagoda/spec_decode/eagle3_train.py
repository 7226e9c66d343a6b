"""`pagoda train-eagle`: train an EAGLE-3 head for a target on a CPU, within a time budget.

The data is the target's own greedy continuations of the corpus lines (self-distillation, as SpecForge does) or
the corpus text itself. For each sequence the target's Pagoda runner gives the states the head reads at inference
(ModelRunner.hidden_states) and its logits, the teacher (Teacher, which keeps them for the later epochs); the head
(eagle3_ttt.py) learns them with training-time test, the learning rate decaying over the time budget. The output
folder holds the head in the published format, resumable checkpoints, and a report of the head's acceptance on
held-out lines. docs/eagle.md describes the command and its files.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pagoda.cpus import resolve as resolve_cpus
from pagoda.spec_decode.eagle3_head import Eagle3Config, save_head
from pagoda.spec_decode.eagle3_ttt import DenseEagle3, chain_acceptance, decoding_steps, ttt_loss

DATA_MODES = ("self", "corpus")
# Self-distillation generates at most within this share of the budget; training gets the rest.
GENERATION_SHARE = 0.5
GENERATION_CHUNK = 64  # prompts per generate call: each chunk is cached before the next starts
GRAD_CLIP = 0.5        # SpecForge's
MIN_LR_SHARE = 0.05    # of --lr, at the end of the budget


@dataclass
class TrainOptions:
    corpus: str                          # text lines, or JSON lines with a "text" field
    output: str                          # the head, checkpoint/, data/, train_report.json
    model: str | None = None             # None: the embedded SmolLM2-135M-Instruct
    data: str = "self"                   # self: the target's greedy continuations of each line; corpus: the text
    max_minutes: float = 30.0            # over all runs into `output`, resumed ones included
    epochs: int = 1000
    ttt_steps: int = 4
    draft_vocab_size: int | None = None  # None: min(vocab, 32000)
    seq_len: int = 256                   # tokens per sequence (self: prompt text cut to seq_len - gen_tokens)
    gen_tokens: int = 128
    holdout: float = 0.05                # share of the lines kept for the acceptance report (at least one)
    batch_size: int = 4                  # sequences per optimizer step
    lr: float = 1e-3
    checkpoint_every: int = 200
    eval_k: int = 5
    seed: int = 0
    engine: dict[str, Any] = field(default_factory=dict)  # the target's LLM(...) keyword arguments
    max_steps: int | None = None         # optimizer steps over all runs (tests)
    teacher_cache_gib: float = 4.0       # the target's outputs kept in memory for later epochs
    progress: bool = True

    def check(self) -> None:
        """ValueError naming the first option out of range."""
        if self.data not in DATA_MODES:
            raise ValueError(f"data must be one of {DATA_MODES}; got {self.data!r}")
        for name in ("epochs", "ttt_steps", "seq_len", "gen_tokens", "batch_size", "checkpoint_every", "eval_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1; got {getattr(self, name)}")
        if self.teacher_cache_gib < 0:
            raise ValueError(f"teacher_cache_gib must be at least 0; got {self.teacher_cache_gib}")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout must be a share between 0 and 1; got {self.holdout}")
        if self.data == "self" and self.seq_len <= self.gen_tokens:
            raise ValueError(f"seq_len {self.seq_len} must exceed gen_tokens {self.gen_tokens} (self data)")

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the run that wrote the folder (budgets and reporting may change);
        the corpus by its bytes, since data/ caches what was generated from each line."""
        keys = ("model", "data", "ttt_steps", "draft_vocab_size", "seq_len", "gen_tokens", "holdout", "batch_size",
                "lr", "seed")
        digest = hashlib.sha256(Path(self.corpus).read_bytes()).hexdigest()
        return {"corpus_sha256": digest, **{k: getattr(self, k) for k in keys},
                "dtype": self.engine.get("dtype", "auto"), "quantization": self.engine.get("quantization")}


@dataclass
class Sample:
    ids: list[int]
    generated_from: int | None  # where the target's greedy continuation starts (self data); None: corpus text


@dataclass
class Batch:
    aux: torch.Tensor       # [B, L, 3 * H_target] the target's captured states
    ids: torch.Tensor       # [B, L] padded with 0
    target_p: torch.Tensor  # [B, L, draft_vocab] the target's next-token distribution, within the draft vocabulary
    valid: torch.Tensor     # [B, L] in the sequence, and the target's top token is one the head can draft
    greedy: torch.Tensor    # [B, L] the target's top token over its whole vocabulary (corpus data's greedy labels)


@dataclass
class Taught:
    """One sequence's forward through the target: the states the head reads, the final states the teacher's
    logits come from (model.compute_logits of them), and its top token over the whole vocabulary."""
    aux: torch.Tensor     # [L, 3 * H_target]
    final: torch.Tensor   # [L, H_target]
    greedy: torch.Tensor  # [L]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.aux, self.final, self.greedy))


class Teacher:
    """The target's outputs for training sequences, one forward each. The first `cache_bytes` of them are kept
    for later epochs, which then run no target forward: the target's logits are recomputed from its final states
    (its LM head's rows of the draft vocabulary, not the whole model), so what is kept stays small."""

    def __init__(self, runner: Any, layers: tuple[int, ...], d2t: torch.Tensor, cache_bytes: int) -> None:
        self.runner, self.layers, self.cache_bytes = runner, layers, cache_bytes
        self.draft_ids = torch.arange(len(d2t)) + d2t
        self.t2d = torch.zeros(runner.args.vocab_size, dtype=torch.bool)
        self.t2d[self.draft_ids] = True
        with torch.no_grad():
            self.rows = _target_rows(runner.model, self.draft_ids)  # None: the whole LM head runs instead
        self.kept: dict[int, Taught] = {}
        self.kept_bytes = 0

    def forward(self, s: Sample, key: int | None) -> Taught:
        """`s` through the target, or what was kept under `key` (None: neither kept nor looked up)."""
        taught = self.kept.get(key) if key is not None else None
        if taught is None:
            aux, final = self.runner.hidden_states(s.ids, self.layers)
            # Copies: the runner's outputs are inference tensors in its scratch space.
            taught = Taught(aux.clone(), final.clone(), self._logits(final).argmax(-1))
            if key is not None and self.kept_bytes + taught.nbytes <= self.cache_bytes:
                self.kept[key] = taught
                self.kept_bytes += taught.nbytes
        return taught

    def batch(self, samples: list[Sample], keys: list[int] | None = None) -> Batch:
        """The target's states and distributions for a batch of sequences (keys: their indices, for keeping)."""
        b, length = len(samples), max(len(s.ids) for s in samples)
        batch = Batch(torch.zeros(b, length, len(self.layers) * self.runner.args.hidden_size),
                      torch.zeros(b, length, dtype=torch.int64), torch.zeros(b, length, len(self.draft_ids)),
                      torch.zeros(b, length, dtype=torch.bool), torch.zeros(b, length, dtype=torch.int64))
        for i, s in enumerate(samples):
            taught = self.forward(s, keys[i] if keys is not None else None)
            n = len(s.ids)
            batch.aux[i, :n] = taught.aux  # copies into tensors autograd may save
            batch.ids[i, :n] = torch.tensor(s.ids)
            with torch.no_grad():
                if self.rows is not None:
                    draft_logits = taught.final.float() @ self.rows.T
                else:
                    draft_logits = self._logits(taught.final)[:, self.draft_ids]
                batch.target_p[i, :n] = torch.softmax(draft_logits, dim=-1)
            batch.greedy[i, :n] = taught.greedy
            # A position whose top token is outside the draft vocabulary would teach a renormalized remainder.
            batch.valid[i, :n] = self.t2d[taught.greedy]
        return batch

    @torch.no_grad()
    def _logits(self, final: torch.Tensor) -> torch.Tensor:
        return self.runner.model.compute_logits(final)


def lr_share(progress: float) -> float:
    """The learning rate's share of --lr at `progress` (0..1) through the budget: a cosine from 1 down to
    MIN_LR_SHARE."""
    return MIN_LR_SHARE + (1 - MIN_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def read_corpus(path: str | Path) -> list[str]:
    """Non-empty lines; a line starting with `{` is JSON with a "text" field."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if line.startswith("{"):
                try:
                    line = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: a line starting with {{ must be JSON with a \"text\" field ({e})") \
                        from None
                if not isinstance(line, str):
                    raise ValueError(f"{path}:{n}: \"text\" is not a string")
            if line:
                lines.append(line)
    return lines


def split_holdout(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """Line indices for training and for the held-out report (a seeded draw of round(share * n), at least 1)."""
    if n < 2:
        raise ValueError(f"the corpus has {n} non-empty line(s); at least 2 are needed (one held out)")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = min(n - 1, max(1, round(share * n)))
    return sorted(order[held:]), sorted(order[:held])


def corpus_samples(tokenizer: Any, lines: list[str], seq_len: int) -> list[Sample]:
    """Each line's tokens in windows of seq_len (a window needs 3 tokens: a state, an input and a label)."""
    out = []
    for line in lines:
        ids = tokenizer.encode(line)
        out += [Sample(ids[i:i + seq_len], None) for i in range(0, len(ids), seq_len) if len(ids) - i >= 3]
    return out


def read_generated(cache: Path) -> dict[int, Sample]:
    """What self_samples cached in `cache` (data/self.jsonl), by corpus line; none where it does not exist."""
    done: dict[int, Sample] = {}
    if cache.exists():
        for text in cache.read_text().splitlines():
            try:
                row = json.loads(text)
            except json.JSONDecodeError:  # the torn last line of a killed run: that line is generated again
                continue
            done[row["line"]] = Sample(row["ids"], row["generated_from"])
    return done


def self_samples(llm: Any, lines: list[str], index: list[int], opts: TrainOptions, cache: Path,
                 deadline: float | None) -> list[Sample]:
    """The target's greedy continuation of each line as a user prompt (through the chat template where the tokenizer
    has one), cached in `cache` a chunk at a time; lines not generated by `deadline` (time.monotonic) are left out."""
    from pagoda.sampling_params import SamplingParams

    done = read_generated(cache)
    todo = [i for i in index if i not in done]
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=opts.gen_tokens)
    bar = tqdm(total=len(index), initial=len(index) - len(todo), desc="self-distill", unit="line", file=sys.stderr,
               disable=not opts.progress or not todo)
    for start in range(0, len(todo), GENERATION_CHUNK):
        if deadline is not None and time.monotonic() > deadline:
            tqdm.write(f"generation stopped at the budget's {GENERATION_SHARE:.0%}: {len(todo) - start} line(s) "
                       "left out", file=sys.stderr)
            break
        chunk = todo[start:start + GENERATION_CHUNK]
        prompts = [{"prompt_token_ids": _prompt(llm, tok, lines[i], opts.seq_len - opts.gen_tokens)} for i in chunk]
        outs = llm.generate(prompts, params, use_tqdm=False)
        with cache.open("a") as f:
            for i, out in zip(chunk, outs):
                done[i] = Sample(list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids))
                f.write(json.dumps({"line": i, "ids": done[i].ids, "generated_from": done[i].generated_from}) + "\n")
        bar.update(len(chunk))
    bar.close()
    return [done[i] for i in index if i in done]


def _prompt(llm: Any, tok: Any, text: str, max_tokens: int) -> list[int]:
    text = tok.decode(tok.encode(text, add_special_tokens=False)[:max_tokens])
    if tok.chat_template:
        return llm.engine.input_processor.tokenize_chat([{"role": "user", "content": text}])
    return tok.encode(text)


def draft_vocab(samples: list[Sample], vocab_size: int, size: int, keep: set[int]) -> torch.Tensor:
    """d2t of the `size` most frequent tokens of the samples (ties by id), `keep` (the stop tokens) always in:
    draft id i is target id i + d2t[i], the target ids ascending."""
    ids = torch.tensor([t for s in samples for t in s.ids if t < vocab_size], dtype=torch.int64)
    counts = torch.bincount(ids, minlength=vocab_size).double()
    counts[[t for t in keep if t < vocab_size]] = math.inf
    chosen = torch.argsort(-counts, stable=True)[:size].sort().values
    return chosen - torch.arange(size)


def new_head(runner: Any, config: Eagle3Config, d2t: torch.Tensor, seed: int) -> DenseEagle3:
    """Small random weights, norms of one, lm_head from the target's rows of the draft vocabulary."""
    model = runner.model
    head = DenseEagle3(config, model.embed_tokens)
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        head.d2t = d2t.clone()
        rows = _target_rows(model, torch.arange(len(d2t)) + d2t)
        if rows is not None:
            head.lm_head.weight.copy_(rows)
    return head


def _target_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """The target's lm_head rows `ids` as fp32, float or quantized (a GGUF table tied to the embedding)."""
    lm = getattr(model, "lm_head", None)
    if lm is None:
        return None
    if getattr(lm, "weight", None) is not None:
        return lm.weight[ids].float()
    if getattr(lm, "qweight", None) is not None:
        return lm.qweight.dequantize_rows(ids, torch.float32)
    return None


def save_checkpoint(folder: Path, head: DenseEagle3, opt: torch.optim.AdamW, vocab_size: int,
                    state: dict[str, Any]) -> None:
    """head.safetensors, optimizer.safetensors (AdamW's moments per parameter) and state.json, swapped in whole:
    a run killed while writing leaves the previous checkpoint."""
    from pagoda.quantization.checkpoint import save_tensors

    new, old = folder.with_name(folder.name + ".new"), folder.with_name(folder.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    save_tensors(head.tensors(vocab_size), str(new / "head.safetensors"))
    moments, adam_step = {}, 0.0
    for name, p in head.named_parameters():
        st = opt.state.get(p)
        if st:
            moments[f"{name}.exp_avg"], moments[f"{name}.exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
            adam_step = float(st["step"])
    save_tensors(moments, str(new / "optimizer.safetensors"))
    (new / "state.json").write_text(json.dumps({**state, "adam_step": adam_step}, indent=2) + "\n")
    if folder.exists():
        folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(folder: Path, head: DenseEagle3, opt: torch.optim.AdamW) -> dict[str, Any] | None:
    """Restore head and optimizer from save_checkpoint's folder (or the one it was replacing); its state.json,
    or None where there is none."""
    from safetensors.torch import load_file

    state = checkpoint_state(folder)
    if state is None:
        return None
    folder = _last_checkpoint(folder)
    head.load_tensors(load_file(str(folder / "head.safetensors")))
    moments = load_file(str(folder / "optimizer.safetensors"))
    for name, p in head.named_parameters():
        if f"{name}.exp_avg" in moments:
            opt.state[p] = {"step": torch.tensor(state["adam_step"]), "exp_avg": moments[f"{name}.exp_avg"],
                            "exp_avg_sq": moments[f"{name}.exp_avg_sq"]}
    return state


def _last_checkpoint(folder: Path) -> Path:
    """`folder`, or the one it was replacing where a run was killed between save_checkpoint's two renames."""
    old = folder.with_name(folder.name + ".old")
    return old if not (folder / "state.json").is_file() and (old / "state.json").is_file() else folder


def checkpoint_state(folder: Path) -> dict[str, Any] | None:
    """The last checkpoint's state.json (step, epoch, batch, tokens, elapsed_s), or None."""
    path = _last_checkpoint(folder) / "state.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _check_run(out: Path, opts: TrainOptions) -> None:
    """A folder holds one run: resuming with other arguments is refused, naming them."""
    path, want = out / "run.json", opts.fingerprint()
    if path.is_file():
        have = json.loads(path.read_text())
        diff = [f"{k} {have.get(k)!r} -> {v!r}" for k, v in want.items() if have.get(k) != v]
        if diff:
            raise ValueError(f"{out} holds a run made with other arguments ({'; '.join(diff)}): pass another "
                             "--output, or delete it to start over")
    else:
        path.write_text(json.dumps(want, indent=2) + "\n")


def evaluate(teacher: Teacher, head: DenseEagle3, samples: list[Sample], k: int) -> dict[str, Any]:
    """Acceptance of greedy k-token chains on the held-out samples: a draft counts while it and those before it
    equal the target's greedy tokens (self data: the continuation the target generated). The mean acceptance
    length and per-position shares are over the chains decoding verifies (decoding_steps), as the engine counts
    them; `per_anchor` has them over every anchor."""
    rows, steps = [], []
    for s in samples:
        # Self data: the first anchor drafts after the target's first own token, as after a prefill.
        first = 0 if s.generated_from is None else max(s.generated_from - 1, 0)
        if first >= len(s.ids) - 1 - k:  # no anchor leaves room for k drafts and their labels
            continue
        batch = teacher.batch([s])
        ids = batch.ids[0]
        # Corpus data: the target's argmax after each true prefix (teacher forcing); self data: its own text.
        greedy_next = batch.greedy[0] if s.generated_from is None else F.pad(ids[1:], (0, 1))
        anchors = torch.arange(first, len(s.ids) - 1 - k)
        rows.append(chain_acceptance(head, batch.aux[0], ids, greedy_next, anchors, k))
        steps.append(decoding_steps(rows[-1]))

    def rates(hits: list[torch.Tensor]) -> dict[str, Any]:
        h = torch.cat(hits) if hits else torch.zeros(0, k, dtype=torch.bool)
        return {"mean_acceptance_length": 1 + float(h.sum(1).float().mean()) if len(h) else 1.0,
                "acceptance_per_position": [round(float(x), 4) for x in h.float().mean(0)] if len(h) else []}

    return {"k": k, "steps": sum(map(len, steps)), **rates(steps),
            "per_anchor": {"anchors": sum(map(len, rows)), **rates(rows)},
            "labels": "the target's greedy continuations" if samples and samples[0].generated_from is not None
            else "the target's argmax on the held-out text under teacher forcing (an approximation of its own "
                 "greedy text)"}


def _samples(llm: Any, lines: list[str], opts: TrainOptions, out: Path,
             deadline: float) -> tuple[list[Sample], list[Sample]]:
    """The training and held-out sequences; self data generates (or reads from out/data) the held-out lines'
    continuations first, then the training lines' until `deadline`."""
    train_idx, held_idx = split_holdout(len(lines), opts.holdout, opts.seed)
    if opts.data == "corpus":
        tok = llm.get_tokenizer()
        return (corpus_samples(tok, [lines[i] for i in train_idx], opts.seq_len),
                corpus_samples(tok, [lines[i] for i in held_idx], opts.seq_len))
    (out / "data").mkdir(exist_ok=True)
    cache = out / "data" / "self.jsonl"
    held = self_samples(llm, lines, held_idx, opts, cache, None)
    train_set = self_samples(llm, lines, train_idx, opts, cache, deadline)
    llm.reset_prefix_cache()  # hidden_states writes the pool's first blocks: no cached prefix may point there
    return train_set, held


def train_step(head: DenseEagle3, opt: torch.optim.Optimizer, batch: Batch, ttt_steps: int) -> float:
    """One optimizer step on a batch; its loss."""
    _, logits = head.unroll(batch.aux, batch.ids, ttt_steps)
    loss = ttt_loss(logits, batch.target_p, batch.valid)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
    opt.step()
    return loss.item()


def train(opts: TrainOptions, llm_class: Callable[..., Any]) -> dict[str, Any]:
    """Train (or resume) a head into opts.output; returns the report also written to train_report.json.
    `llm_class` is the offline API's LLM (entrypoints/llm.py), passed in by the caller because speculation sits
    below the entrypoints; the target is `llm_class(opts.model, **opts.engine)`."""
    opts.check()
    from pagoda.executor.model_runner import ModelRunner

    t0 = time.monotonic()
    lines = read_corpus(opts.corpus)
    split_holdout(len(lines), opts.holdout, opts.seed)  # a corpus too small fails before the model loads
    out = Path(opts.output)
    out.mkdir(parents=True, exist_ok=True)
    _check_run(out, opts)
    # A fixed thread count: torch's kernels, which train the head, may split a sum by threads, so a thread governor
    # following other processes' load would make the trained head depend on that load.
    engine = {**opts.engine, "threads": opts.engine.get("threads") or resolve_cpus(opts.engine.get("cpus"), None)[1]}
    llm = llm_class(opts.model, **engine)
    runner = llm.engine.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError("train-eagle runs the target in one process (tensor_parallel_size 1)")
    prior = checkpoint_state(out / "checkpoint")
    carried = prior["elapsed_s"] if prior else 0.0
    budget = opts.max_minutes * 60

    def elapsed() -> float:
        return carried + time.monotonic() - t0

    train_set, held = _samples(llm, lines, opts, out, time.monotonic() + GENERATION_SHARE * budget - carried)
    args = runner.args
    size = opts.draft_vocab_size or min(args.vocab_size, 32000)
    if not 0 < size <= args.vocab_size:
        raise ValueError(f"draft_vocab_size {size} must be within 1..{args.vocab_size} (the target's vocabulary)")
    config = Eagle3Config.for_target(args, size)
    d2t = draft_vocab(train_set, args.vocab_size, size, llm.get_tokenizer().stop_token_ids)
    head = new_head(runner, config, d2t, opts.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=opts.lr)
    state = load_checkpoint(out / "checkpoint", head, opt) or {"step": 0, "epoch": 0, "batch": 0, "tokens": 0}
    teacher = Teacher(runner, config.aux_layers, head.d2t, int(opts.teacher_cache_gib * 2**30))
    resumed_from = state["step"]
    n_batches = -(-len(train_set) // opts.batch_size)
    loss_value: float | None = None
    bar = tqdm(total=round(budget), initial=min(round(elapsed()), round(budget)), unit="s", desc="train-eagle",
               file=sys.stderr, disable=not opts.progress)
    rate_t, rate_tokens = time.monotonic(), 0

    def done() -> bool:
        return elapsed() >= budget or (opts.max_steps is not None and state["step"] >= opts.max_steps)

    def progress() -> float:
        """How far through the run, for the learning rate: by steps where a step count bounds it (tests)."""
        return state["step"] / opts.max_steps if opts.max_steps else elapsed() / budget

    def checkpoint() -> None:
        save_checkpoint(out / "checkpoint", head, opt, args.vocab_size, {**state, "elapsed_s": elapsed()})

    while state["epoch"] < opts.epochs and not done():
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(opts.seed + state["epoch"]))
        while state["batch"] < n_batches and not done():
            b = state["batch"] * opts.batch_size
            index = order[b:b + opts.batch_size].tolist()
            batch = teacher.batch([train_set[i] for i in index], index)
            for group in opt.param_groups:
                group["lr"] = opts.lr * lr_share(progress())
            loss_value = train_step(head, opt, batch, opts.ttt_steps)
            tokens = int(batch.valid.sum())
            state["step"], state["batch"], state["tokens"] = state["step"] + 1, state["batch"] + 1, \
                state["tokens"] + tokens
            rate_tokens += tokens
            now = elapsed()
            bar.update(min(round(now), round(budget)) - bar.n)
            bar.set_postfix(step=state["step"], epoch=state["epoch"], loss=f"{loss_value:.3f}",
                            tok_s=f"{rate_tokens / max(time.monotonic() - rate_t, 1e-9):.0f}", refresh=False)
            if state["step"] % opts.checkpoint_every == 0:
                checkpoint()
        if state["batch"] >= n_batches:
            state["epoch"], state["batch"] = state["epoch"] + 1, 0
    bar.close()
    checkpoint()
    save_head(out, config, head.tensors(args.vocab_size))
    report = {"model": opts.model or "embedded SmolLM2-135M-Instruct", "data": opts.data, "steps": state["step"],
              "resumed_from_step": resumed_from, "epochs": state["epoch"] + state["batch"] / n_batches,
              "train_sequences": len(train_set), "holdout_sequences": len(held), "trained_tokens": state["tokens"],
              "last_loss": loss_value, "elapsed_s": round(elapsed(), 1), "draft_vocab_size": size,
              "aux_layers": list(config.aux_layers), "options": {k: v for k, v in asdict(opts).items()
                                                                 if k not in ("engine", "progress")},
              "acceptance": evaluate(teacher, head, held, opts.eval_k)}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def summary(report: dict[str, Any]) -> str:
    """The report in one line."""
    acc = report["acceptance"]
    per = " ".join(f"{x:.2f}" for x in acc["acceptance_per_position"])
    return (f"held-out acceptance length {acc['mean_acceptance_length']:.2f} (k={acc['k']}, {acc['steps']} "
            f"verifications as decoding makes them; accepted per position: {per}; over every anchor: "
            f"{acc['per_anchor']['mean_acceptance_length']:.2f}; labels: {acc['labels']}) after {report['steps']} "
            f"steps, {report['trained_tokens']} tokens")
