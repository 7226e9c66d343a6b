"""OutputProcessor: append sampled tokens, detokenize incrementally, apply stop rules, build outputs."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pagoda.core.request import Request, Sequence
from pagoda.layers.sampler import SamplerOutput
from pagoda.model.tokenizer import Tokenizer
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = tokenizer.id_to_token_text  # cached per token id by the tokenizer

    def stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            ids |= self.tokenizer.stop_token_ids
        return ids

    def append_tokens(self, seqs: list[Sequence], sampled: SamplerOutput,
                      on_error: Callable[[Sequence], None] | None = None) -> None:
        """Append each row's token. A failure in one row calls on_error(seq) from inside the except
        block and goes on with the next row (without on_error it raises)."""
        now = time.time()
        for i, (seq, tok) in enumerate(zip(seqs, sampled.token_ids)):
            if seq.finished:  # its request failed earlier in this step
                continue
            try:
                self._append(seq, tok, sampled, i, now)
            except Exception:
                if on_error is None:
                    raise
                on_error(seq)

    def _append(self, seq: Sequence, tok: int, sampled: SamplerOutput, i: int, now: float) -> None:
        req, p = seq.request, seq.request.params
        seq.token_ids.append(tok)
        m = req.metrics
        if m is not None:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        if seq.logprobs is not None and sampled.sampled_logprobs is not None:
            lp = sampled.sampled_logprobs[i]
            seq.cumulative_logprob += lp
            entry = {tok: Logprob(lp, sampled.sampled_ranks[i], self.token_text(tok))}  # type: ignore[index]
            k = p.logprobs or 0
            if k and sampled.topk_ids is not None and sampled.topk_logprobs is not None:
                for rank, (tid, tlp) in enumerate(zip(sampled.topk_ids[i][:k], sampled.topk_logprobs[i][:k]), 1):
                    if tid not in entry:
                        entry[tid] = Logprob(tlp, rank, self.token_text(tid))
            seq.logprobs.append(entry)
        self._check_stop(seq, tok, p)

    def _check_stop(self, seq: Sequence, tok: int, p: SamplingParams) -> None:
        is_stop_token = tok in seq.request.stop_ids  # the sampler bans these below min_tokens
        if not is_stop_token or p.include_stop_str_in_output:
            assert seq.decoder is not None
            new_text = seq.decoder.step(tok)
        else:
            new_text = ""
        if new_text:
            seq.text += new_text
            if p.stop_strings and seq.num_output_tokens >= p.min_tokens:
                # Only the tail can hold a new match: the new text plus a stop string's length back.
                window = max(len(s) for s in p.stop_strings) + len(new_text)
                tail_start = max(0, len(seq.text) - window)
                hits = [(idx, s) for s in p.stop_strings if (idx := seq.text.find(s, tail_start)) >= 0]
                if hits:
                    idx, s = min(hits)
                    seq.text = seq.text[: idx + len(s)] if p.include_stop_str_in_output else seq.text[:idx]
                    seq.finish_reason, seq.stop_reason = "stop", s
                    return
        if is_stop_token:
            seq.finish_reason = "stop"
            seq.stop_reason = tok if tok in p.stop_token_ids else None  # vLLM: None for EOS
        elif seq.num_output_tokens >= seq.request.max_tokens:
            seq.finish_reason = "length"

    def append_prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        """logits[j] predicts prompt token start+j+1; add one entry per such position."""
        assert req.prompt_logprobs is not None and req.params.prompt_logprobs is not None
        k = req.params.prompt_logprobs
        lps = logits.float().log_softmax(dim=-1)
        targets = torch.tensor(req.prompt_token_ids[start + 1: start + 1 + lps.shape[0]])
        chosen = lps.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = ((lps > chosen.unsqueeze(1)).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = lps.topk(k, dim=-1) if k > 0 else (None, None)
        for j, tok in enumerate(targets.tolist()):
            entry = {tok: Logprob(chosen[j].item(), ranks[j], self.token_text(tok))}
            if top_ids is not None and top_vals is not None:
                for rank, (tid, tlp) in enumerate(zip(top_ids[j].tolist(), top_vals[j].tolist()), 1):
                    if tid not in entry:
                        entry[tid] = Logprob(tlp, rank, self.token_text(tid))
            req.prompt_logprobs.append(entry)

    def make_output(self, req: Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=s.index, text=s.text, token_ids=s.output_token_ids,
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            )
            for s in req.seqs
        ]
        finished = req.finished
        if finished and req.metrics is not None and req.metrics.finished_time is None:
            req.metrics.finished_time = time.time()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             req.prompt_logprobs, req.metrics, num_cached_tokens=req.seqs[0].num_cached_tokens)
