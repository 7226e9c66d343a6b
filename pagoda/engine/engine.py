"""LLMEngine: the step loop. Each step is schedule -> run the model -> sample (and verify proposals) -> update
requests -> draft the next step's proposals."""
from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from pagoda.config import EngineConfig, resolve_dtype
from pagoda.core import draft_tree
from pagoda.core.emitted import Emitted
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request, Sequence
from pagoda.core.scheduler import Scheduler, SchedulerOutput
from pagoda.cpus import ThreadGovernor, affinity
from pagoda.cpus import resolve as resolve_cpus
from pagoda.distributed.errors import WorkerDiedError
from pagoda.engine.input_processor import InputProcessor, ProcessedRequest
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.stats import EngineStats
from pagoda.executor.model_runner import ModelOutput, ModelRunner
from pagoda.executor.multiproc import TensorParallelRunner
from pagoda.layers.sampler import Sampler, SamplerOutput, SamplingBatch
from pagoda.lora.request import LoRARequest
from pagoda.model.args import ModelArgs
from pagoda.model.loader import resolve_model_files
from pagoda.model.tokenizer import load_tokenizer
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.speculator import Speculator, StepResult, Verified
from pagoda.structured.backend import Matcher
from pagoda.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
T = TypeVar("T")
class ConstraintError(Exception):
    """A request's grammar cannot go on: that request fails with a 400, the others run on."""


_DEAD_GRAMMAR = "structured_outputs: the constraint allows no next token of this model's vocabulary after {} tokens"


@dataclass
class StepStats:
    """Running totals since the engine started, and the last step that ran the model."""
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    last_tokens: int = 0
    last_seconds: float = 0.0
    last_forward_seconds: float = 0.0

    def add_step(self, tokens: int, generated: int, seconds: float, forward_seconds: float) -> None:
        self.num_scheduled_tokens += tokens
        self.num_generated_tokens += generated
        self.num_steps += 1
        self.last_tokens, self.last_seconds, self.last_forward_seconds = tokens, seconds, forward_seconds


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        cores, threads = resolve_cpus(config.cpus, config.threads)
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if threads is not None:
            torch.set_num_threads(threads)
        logger.info("compute threads: %d on cores %s", torch.get_num_threads(),
                    ",".join(map(str, cores or affinity())))
        # Threads chosen for this process's cores (not by the user, not shared by tensor-parallel ranks) give way
        # while other processes keep some of those cores busy.
        self.thread_governor = ThreadGovernor.for_this_process(torch.get_num_threads(), torch.set_num_threads) \
            if config.threads is None and threads is not None and config.tensor_parallel_size == 1 else None
        torch.manual_seed(config.seed)
        self.files = resolve_model_files(config.model)
        self.args = ModelArgs.from_hf_config(self.files.hf_config)
        self.tokenizer = load_tokenizer(self.files if config.tokenizer is None else config.tokenizer)
        self.dtype = resolve_dtype(config.dtype, config.device)
        sched_cfg = config.scheduler
        self.max_model_len = min(sched_cfg.max_model_len or self.args.max_position_embeddings,
                                 self.args.max_position_embeddings)
        if sched_cfg.max_model_len and sched_cfg.max_model_len > self.args.max_position_embeddings:
            raise ValueError(f"max_model_len {sched_cfg.max_model_len} exceeds the model's context "
                             f"{self.args.max_position_embeddings}")
        policy = config.kernel_policy()
        logger.info("CPU kernels: %s", policy.kernel_set)
        if config.tensor_parallel_size > 1:  # this process is rank 0: it spawns or joins the other ranks
            self.runner: ModelRunner | TensorParallelRunner = TensorParallelRunner.start(
                config, self.files, self.args, self.dtype, policy)
        else:
            self.runner = ModelRunner(config, self.files, self.args, self.dtype, policy)
        # Enough blocks for every sequence at full context, capped by free RAM (CacheConfig.pool_bytes).
        blocks_wanted = sched_cfg.max_num_seqs * -(-self.max_model_len // config.cache.block_size)
        num_blocks = config.cache.pool_bytes(self.runner.kv_bytes_per_block(), blocks_wanted) \
            // self.runner.kv_bytes_per_block()
        self.runner.allocate_kv_cache(num_blocks)
        # The prefix cache's hash root covers what changes the KV: the model file and the KV dtype.
        namespace = f"{self.files.source}|{self.dtype}|kv={config.cache.kv_cache_dtype}|q={config.quantization}"
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, namespace,
                                 sliding_window=self.args.kv_window)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        # Adapter slots (config.lora); requests whose adapter finds every slot pinned wait here for one.
        self.lora = self.runner.lora if isinstance(self.runner, ModelRunner) else None
        self._awaiting_lora: list[Request] = []
        self.sampler = Sampler()
        self.outputs = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.args.vocab_size, config.structured,
                                                  max_model_len=self.max_model_len)
        self.input_processor = InputProcessor(self.tokenizer, self.structured, self.args.vocab_size,
                                              self.max_model_len, sched_cfg.max_num_seqs)
        self._awaiting_grammar: list[Request] = []  # structured requests whose grammar still compiles
        self._step_seqs: list[Sequence] | None = None  # the running step's sequences, failed together if need be
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self.stats = StepStats()
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, self.runner, self.kv, self.tokenizer,
                                         self.max_model_len, sched_cfg.max_num_batched_tokens, self.files)
        logger.info("KV pool: %d blocks of %d tokens (%.0f MiB; %d wanted for %d seqs x %d tokens), dtype %s, "
                    "kv_cache_dtype %s", num_blocks, config.cache.block_size,
                    num_blocks * self.runner.kv_bytes_per_block() / 2**20, blocks_wanted, sched_cfg.max_num_seqs,
                    self.max_model_len, self.dtype, config.cache.kv_cache_dtype)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    client: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Validate (the input processor) and queue a request. Raises ValueError for anything that can never run."""
        return self.add_processed(self.input_processor.process(prompt, params), request_id, cache_salt, client,
                                  priority, lora_request)

    def add_processed(self, processed: ProcessedRequest, request_id: str | None = None,
                      cache_salt: str | None = None, client: str | None = None, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> Request:
        """Queue a request the input processor has checked. Raises ValueError where this engine's KV pool can
        never hold it or its id is in use. `client` names whose fair share of the seats it takes (the
        scheduler's rule); None makes it its own. `priority` orders it among others under the priority
        scheduling policy, lower first. `lora_request` runs it with that adapter (ValueError where it cannot
        be served); where every adapter slot is pinned by running requests it waits for one."""
        ids, params, max_tokens = processed.prompt_token_ids, processed.params, processed.max_tokens
        need = self.kv.max_blocks_held(len(ids) + max_tokens, self.config.scheduler.max_num_batched_tokens)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt ({len(ids)}) plus max_tokens ({max_tokens}) needs {need} KV blocks but the "
                             f"pool has only {self.kv.pool.num_blocks}: raise kv_cache_memory or lower max_tokens")
        rid = request_id if request_id is not None else str(next(self._req_ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if lora_request is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is off: start the "
                             "engine with enable_lora (--enable-lora)")
        req = Request(rid, processed.prompt, ids, params, max_tokens, cache_salt=cache_salt, client=client,
                      priority=priority, stop_ids=self.outputs.stop_ids(params), lora_request=lora_request,
                      arrival_time=processed.arrival_time)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self._new_sequence(req, list(ids))
        req.grammar = processed.grammar
        if lora_request is not None and not self._pin_lora(req):
            self._awaiting_lora.append(req)  # admitted once a slot frees (_admit_loras)
        else:
            self._enqueue(req)
        self.requests[rid] = req
        return req

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter and check it against the model (any thread: no slot is touched); ValueError naming
        it where it cannot be served."""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: LoRA is off (start with --enable-lora)")
        self.lora.check(lora_request)

    def _enqueue(self, req: Request) -> None:
        """Schedule a request, or hold it until its grammar is ready (_admit_grammars)."""
        if req.grammar is not None:
            self._awaiting_grammar.append(req)
        else:
            self.scheduler.add(req.seqs[0])

    def _pin_lora(self, req: Request) -> bool:
        """Pin req's adapter in a slot (loading it); False when every slot is pinned. ValueError: a bad adapter."""
        assert self.lora is not None and req.lora_request is not None
        slot = self.lora.acquire(req.lora_request)
        if slot is None:
            return False
        req.lora_slot, req.lora_key = slot, self.lora.key(slot)
        return True

    def _release_lora(self, req: Request) -> None:
        if self.lora is not None and req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1

    def _admit_loras(self) -> list[Request]:
        """Admit the requests waiting for an adapter slot, in order, while slots free; return those whose
        adapter failed to load."""
        failed = []
        for req in list(self._awaiting_lora):
            try:
                if not self._pin_lora(req):
                    break  # FIFO: a later request does not take the slot an earlier one waits for
            except ValueError as e:
                self._awaiting_lora.remove(req)
                self._fail_request(req, str(e), 400)
                failed.append(req)
                continue
            self._awaiting_lora.remove(req)
            self._enqueue(req)
        return failed

    def _admit_grammars(self) -> list[Request]:
        """Schedule the structured requests whose grammar is ready; return those whose grammar failed."""
        failed = []
        for req in [r for r in self._awaiting_grammar if r.grammar is not None and r.grammar.done()]:
            self._awaiting_grammar.remove(req)
            grammar = req.grammar
            assert grammar is not None
            error = "structured_outputs: the grammar compile was cancelled" if grammar.cancelled() \
                else grammar.exception()
            if error is not None:
                self._fail_request(req, str(error), 400)  # the client's own constraint: theirs to see
                failed.append(req)
                continue
            req.seqs[0].matcher = self.structured.matcher(req.grammar.result())  # type: ignore[union-attr]
            self.scheduler.add(req.seqs[0])
        return failed

    def _advance_grammar(self, seq: Sequence) -> None:
        """Move the matcher past the token just appended (what it forces next waits for _jump_if_forced)."""
        matcher = seq.matcher
        assert matcher is not None
        if not matcher.accept(seq.token_ids[-1]):  # the library's mask and matcher disagree, or it gave up
            raise ConstraintError(f"structured_outputs: the grammar library stopped matching after "
                                  f"{seq.num_output_tokens} tokens (it allowed token {seq.token_ids[-1]}, then "
                                  "refused it)")
        if seq.finish_reason is None and matcher.is_terminated():
            seq.finish_reason = "stop"  # the grammar is complete: nothing may follow

    def _jump_if_forced(self, seq: Sequence) -> None:
        if seq.finish_reason is None and seq.matcher is not None and self.config.structured.jump_forward \
                and seq.request.params.logprobs is None:  # jumped tokens have no logprobs of their own
            self._jump_forward(seq, seq.matcher)

    def _jump_forward(self, seq: Sequence, matcher: Matcher) -> None:
        """Append the text the grammar forces next as tokens now: the next step computes them all in one
        forward pass (SGLang's compressed FSM) instead of one step each.

        The tokens are the model tokenizer's own encoding of the forced text, taken only where that
        encoding does not merge with the token before it, and without its last token, which could merge
        with the free text that follows: so the output is tokenized as the model would have written it.
        """
        forced = matcher.forced_string()
        if len(forced) < 2:
            return
        tok = self.tokenizer
        ids = tok.encode(forced, add_special_tokens=False)
        prev = seq.token_ids[-1]
        if tok.encode(tok.decode([prev], skip_special_tokens=False) + forced, add_special_tokens=False) \
                != [prev, *ids]:
            return  # the forced text would re-tokenize the token before it: let the model go on
        room = seq.request.max_tokens - seq.num_output_tokens
        for t in ids[:-1][:room]:
            if not matcher.accept(t):
                break
            self.outputs.append_tokens([seq], SamplerOutput([t]))
            self.structured.stats.jump_forward_tokens += 1
            if seq.finish_reason is not None:
                break

    def _new_sequence(self, req: Request, token_ids: list[int]) -> Sequence:
        index = len(req.seqs)
        seq = Sequence(next(self._seq_ids), req, index, token_ids, len(req.prompt_token_ids))
        if req.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(req.params.seed + index)
        seq.decoder = self.tokenizer.decode_stream(req.params.skip_special_tokens, req.prompt_token_ids[-5:])
        if req.params.logprobs is not None:
            seq.logprobs = []
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.aborted = True
        if req in self._awaiting_grammar:
            self._awaiting_grammar.remove(req)
        if req in self._awaiting_lora:
            self._awaiting_lora.remove(req)
        self._release_lora(req)
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their KV but are no longer shared)."""
        self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a single-process engine holds nothing to stop)."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def engine_stats(self) -> EngineStats:
        """The scheduler's, KV pool's and speculator's figures now (cheap: counters and lengths)."""
        sched, pool = self.scheduler, self.kv.pool
        stats = EngineStats(
            num_running=len({s.request.request_id for s in sched.running}),
            num_waiting=len(sched.waiting),
            kv_cache_usage=float(pool.usage()),
            num_free_blocks=int(pool.num_free),
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_steps=self.stats.num_steps,
            step_tokens=self.stats.last_tokens,
            step_seconds=self.stats.last_seconds,
            step_forward_seconds=self.stats.last_forward_seconds,
        )
        if self.speculator is not None:
            spec = self.speculator.stats
            stats.spec_decode_num_drafts = spec.num_drafts
            stats.spec_decode_num_draft_tokens = spec.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_decode_num_emitted_tokens = spec.num_emitted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = tuple(spec.accepted_per_pos)
        return stats

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of every request that changed (finished ones last time).

        Never raises for a request's sake. A failure that belongs to one request (its prompt logprobs,
        sampling row or output processing) finishes that request alone with finish_reason "error"; one
        that cannot be attributed (scheduling, the forward pass) fails the requests of this step, and the
        engine goes on with the rest.
        """
        self._step_seqs = None
        if self.thread_governor is not None:
            self.thread_governor.tick()
        try:
            return self._step()
        except WorkerDiedError:  # not this step's fault, and no later step can run: the engine is dead
            raise
        except Exception:
            seqs = self._step_seqs
            if seqs is None:  # failed before scheduling: the running set, else the queue's head
                seqs = list(self.scheduler.running) or list(self.scheduler.waiting)[:1]
            reqs = {s.request.request_id: s.request for s in seqs}
            logger.exception("engine step failed; failing its %d request(s): %s", len(reqs), ", ".join(reqs))
            for req in reqs.values():
                self._fail_request(req)
            return [self._final_output(req) for req in reqs.values()]

    def _step(self) -> list[RequestOutput]:
        t_step = time.perf_counter()
        touched: dict[str, Request] = {r.request_id: r for r in self._admit_loras() + self._admit_grammars()}
        sched = self.scheduler.schedule()
        if not sched:
            return self._idle(touched)
        self._step_seqs = list(sched.seqs)
        self._mark_scheduled(sched)
        t_fwd = time.perf_counter()
        out = self.runner.execute(sched, self.kv.block_tables)
        t_fwd = time.perf_counter() - t_fwd
        self._record_prompt_logprobs(sched, out.prompt_logits, touched)
        emitted, verified = self._sample_and_verify(sched, out, touched)
        appended = self._append_emitted(emitted, touched)
        # What a verified row scheduled but did not append (rejected proposals, or tokens after a stop) has no valid
        # KV: the scheduler rolls it back.
        rejected = {r: sched.num_scheduled[r] - appended.get(sched.seqs[r], 0) for r in out.spec_logits}
        tree_paths = self._settle_trees(verified, appended)
        self.scheduler.update(sched, rejected)
        if self.speculator is not None:  # the next step's proposals, drafted from this step's outcome
            step = StepResult(sched, rejected, verified, appended, out.aux_hidden, t_fwd, time.perf_counter() - t_step,
                              tree_paths)
            self.scheduler.update_draft_token_ids(
                *self.speculator.propose(step, self.scheduler.running, self.scheduler.queued_prompt_tokens()))
        results = self._outputs(touched)
        self.stats.add_step(sched.total_tokens, sum(appended.values()), time.perf_counter() - t_step, t_fwd)
        return results

    def _settle_trees(self, verified: Verified | None, appended: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Before the scheduler keeps a verified draft tree's KV: the accepted nodes' KV moves from the slots of
        their place in the tree to those of their positions. Returns each tree row's accepted proposals."""
        if verified is None:
            return {}
        paths: dict[Sequence, list[int]] = {}
        moves: list[tuple[int, int]] = []
        bs = self.kv.block_size
        for seq, path in zip(verified.seqs, verified.paths):
            if not seq.spec_parents or seq.finished:
                continue
            paths[seq] = path
            table, root = self.kv.block_tables[seq.seq_id], seq.num_computed_tokens  # not yet updated
            keep = appended.get(seq, 0) - 1  # appended tokens with KV: the accepted proposals, not the last token
            for a, b in draft_tree.kv_moves(path, keep):
                src, dst = root + a, root + b
                moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
        if moves:  # only an EAGLE head drafts trees, and it runs in one process (a ModelRunner)
            self.runner.move_slots(moves)
        return paths

    def _idle(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """A step with nothing to schedule: the outputs of requests admission failed."""
        if self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("scheduler is stuck: a waiting request cannot get KV blocks")
        if self._awaiting_grammar and not touched:  # nothing else to do: wait a moment, don't spin
            futures.wait([r.grammar for r in self._awaiting_grammar if r.grammar is not None], 0.01,
                         futures.FIRST_COMPLETED)
        return [self._final_output(r) for r in touched.values()]

    @staticmethod
    def _mark_scheduled(sched: SchedulerOutput) -> None:
        now = time.time()
        for seq in sched.seqs:
            m = seq.request.metrics
            if m is not None and m.first_scheduled_time is None:
                m.first_scheduled_time = now

    def _sample_and_verify(self, sched: SchedulerOutput, out: ModelOutput,
                           touched: dict[str, Request]) -> tuple[list[Emitted], Verified | None]:
        """One token per sampling row (n > 1 forks siblings onto the same row), and the verified tokens of every
        speculative row: one ragged output, appended position by position."""
        emitted: list[Emitted] = []
        rows = [(s, r) for s, r in self._fork_parallel_samples(sched, out.sample_rows) if not s.finished]
        if rows:
            seqs = [s for s, _ in rows]
            row_ids = [r for _, r in rows]
            # Forked siblings reuse a row; otherwise rows are in order and the logits need no gather.
            logits = out.sample_logits if row_ids == list(range(len(out.sample_logits))) else \
                out.sample_logits[torch.tensor(row_ids)]
            emitted += [Emitted.sampled(group, sampled) for group, sampled in self._sample(seqs, logits, touched)]
        spec_rows = {r: v for r, v in out.spec_logits.items() if not sched.seqs[r].finished}
        if not spec_rows or self.speculator is None:
            return emitted, None
        verified = self.speculator.verify([sched.seqs[r] for r in spec_rows], list(spec_rows.values()),
                                          self.structured)
        for seq in verified.dead:
            self._fail_request(seq.request, _DEAD_GRAMMAR.format(seq.num_output_tokens), 400)
            touched[seq.request.request_id] = seq.request
        emitted.append(verified.as_emitted())
        return emitted, verified

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The step's output of every request it changed; finished requests leave."""
        results = []
        for req in touched.values():
            output = self._guarded(req, touched, self.outputs.make_output, req)
            results.append(output if output is not None else self._final_output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
                self._release_lora(req)
        return results

    def _append_emitted(self, emitted: list[Emitted], touched: dict[str, Request]) -> dict[Sequence, int]:
        """Append every sequence's emitted tokens, position by position across sequences, so that a stop
        truncates what follows it; each token advances its grammar, and once all are in, a grammar that forces
        text jumps forward over it. Returns how many tokens each sequence appended (after stops)."""
        on_error = functools.partial(self._request_failed, touched=touched)
        before = {seq: seq.num_tokens for group in emitted for seq in group.seqs}
        for group in emitted:
            for seq in group.seqs:
                touched[seq.request.request_id] = seq.request
            for j in range(max((len(t) for t in group.token_ids), default=0)):
                idx = [i for i, (seq, t) in enumerate(zip(group.seqs, group.token_ids))
                       if j < len(t) and seq.finish_reason is None and not seq.finished]
                if not idx:
                    break
                seqs = [group.seqs[i] for i in idx]
                self.outputs.append_tokens(seqs, group.output_at(idx, j), on_error=on_error)
                for seq in seqs:
                    if seq.matcher is not None and not seq.finished:
                        self._guarded(seq.request, touched, self._advance_grammar, seq)
        appended = {seq: seq.num_tokens - n for seq, n in before.items()}
        for seq in before:
            if seq.matcher is not None and not seq.finished:
                self._guarded(seq.request, touched, self._jump_if_forced, seq)
        return appended

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor,
                touched: dict[str, Request]) -> list[tuple[list[Sequence], SamplerOutput]]:
        """One batched sampler call; if it fails, each row alone, so that a bad row fails its request only.
        Returns (sequences, their tokens) groups: one group, or one per row that sampled."""
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:  # only those rows are touched: the others stay bit-identical
            matchers = [m for i in constrained if (m := seqs[i].matcher) is not None]
            dead = self.structured.mask_logits(logits, constrained, matchers)
            for i in dead:  # e.g. a character no token of this vocabulary spells
                seq = seqs[i]
                self._fail_request(seq.request, _DEAD_GRAMMAR.format(seq.num_output_tokens), 400)
                touched[seq.request.request_id] = seq.request
            if dead:
                keep = [i for i in range(len(seqs)) if not seqs[i].finished]
                seqs, logits = [seqs[i] for i in keep], logits[keep]
                if not seqs:
                    return []
        try:
            sampled = self.sampler(logits, self._sampling_batch(seqs))
        except Exception:
            logger.exception("batched sampling failed; sampling %d row(s) one by one", len(seqs))
        else:
            return [(seqs, sampled)]
        results = []
        for i, seq in enumerate(seqs):
            row = self._guarded(seq.request, touched, self.sampler, logits[i:i + 1], self._sampling_batch([seq]))
            if row is not None:
                results.append(([seq], row))
        return results

    def _guarded(self, req: Request, touched: dict[str, Request], fn: Callable[..., T],
                 *args: Any) -> T | None:
        """fn(*args) on behalf of one request: an exception fails that request (logged) and returns None."""
        if req.error is not None:  # failed earlier in this step
            return None
        try:
            return fn(*args)
        except ConstraintError as e:  # the request's own constraint: a 400 with its reason
            self._fail_request(req, str(e), 400)
            touched[req.request_id] = req
            return None
        except Exception:
            self._request_failed(req.seqs[0], touched)
            return None

    def _request_failed(self, seq: Sequence, touched: dict[str, Request]) -> None:
        """Called from an except block: log it and fail seq's request alone."""
        logger.exception("request %s failed in the engine step", seq.request.request_id)
        self._fail_request(seq.request)
        touched[seq.request.request_id] = seq.request

    def _fail_request(self, req: Request, error: str = "internal error while processing this request",
                      status: int = 500) -> None:
        """Finish every sequence of req with finish_reason "error" and free its KV blocks at once."""
        req.error, req.error_status = error, status
        req.aborted = True  # its n siblings may not all exist yet: finished means all that do
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
        self.requests.pop(req.request_id, None)
        if req in self._awaiting_lora:
            self._awaiting_lora.remove(req)
        self._release_lora(req)

    def _final_output(self, req: Request) -> RequestOutput:
        """The output of a failed request, built without the output processor (which may be what failed)."""
        outs = [CompletionOutput(index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                                 finish_reason=s.finish_reason or "error") for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True,
                             metrics=req.metrics, error=req.error, error_status=req.error_status)

    def _fork_parallel_samples(self, sched: SchedulerOutput, sample_rows: list[int]) -> list[tuple[Sequence, int]]:
        """(seq, logits row) pairs to sample. n > 1: once seq 0 has the prompt's KV, fork n-1 siblings
        that share its blocks and sample from the same logits row (copy-on-write on divergence)."""
        rows = []
        for logit_row, sched_row in enumerate(sample_rows):
            seq = sched.seqs[sched_row]
            if seq.finished:  # failed earlier in this step
                continue
            rows.append((seq, logit_row))
            req = seq.request
            if seq.index == 0 and len(req.seqs) < req.params.n and seq.num_output_tokens == 0:
                for _ in range(req.params.n - 1):
                    child = self._new_sequence(req, list(seq.token_ids))
                    child.matcher = seq.matcher.fork() if seq.matcher is not None else None
                    child.num_computed_tokens = seq.num_tokens  # the forward computed the whole prompt
                    self.kv.fork(seq.seq_id, child.seq_id)
                    self.scheduler.add_running(child)
                    rows.append((child, logit_row))
        return rows

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.request.params for s in seqs]
        # Below min_tokens stop ids are banned, except where a constraint is complete: its end wins (it
        # may allow nothing but the stop token).
        banned = [sorted(s.request.stop_ids) if s.num_output_tokens < p.min_tokens
                  and (s.matcher is None or not s.matcher.is_completed()) else [] for s, p in zip(seqs, params)]
        batch = SamplingBatch(params=params, generators=[s.generator for s in seqs],
                              output_token_ids=[], prompt_token_ids=[], banned_token_ids=banned)
        if batch.any_penalty:  # histories are only gathered when some row needs them
            batch.output_token_ids = [s.output_token_ids for s in seqs]
            batch.prompt_token_ids = [s.request.prompt_token_ids for s in seqs]
        return batch

    def _record_prompt_logprobs(self, sched: SchedulerOutput, prompt_logits: dict[int, torch.Tensor],
                                touched: dict[str, Request]) -> None:
        for row, logits in prompt_logits.items():
            req = sched.seqs[row].request
            assert req.prompt_logprobs is not None
            self._guarded(req, touched, self.outputs.append_prompt_logprobs, req, len(req.prompt_logprobs) - 1,
                          logits)
