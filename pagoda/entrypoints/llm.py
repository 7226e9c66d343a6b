"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from pagoda.config import EngineConfig
from pagoda.engine.engine import LLMEngine
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batched generation.

    `model` is a Hugging Face folder (config.json + *.safetensors + tokenizer files) or a .gguf file;
    None uses the embedded SmolLM2-135M-Instruct. Keyword arguments take vLLM's names: dtype,
    max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory, max_model_len, seed,
    enable_prefix_caching, kv_cache_dtype (auto | int8 | fp8_e4m3 | fp8_e5m2: 8-bit KV with per-token scales),
    enable_lora, max_loras, max_lora_rank (PEFT adapters chosen per prompt by generate's lora_request).

    `task="embed"` or `"score"` loads a pooling model instead (an encoder folder, or a causal LM pooled at its
    last token; None: the embedded all-MiniLM-L6-v2) for embed(), score() and rerank() (entrypoints/pooling.py);
    no KV outlives a forward. A causal LM scores pairs as a reranker with `classifier_from_token=["no", "yes"]`.
    """

    def __init__(self, model: str | None = None, task: str = "generate", **engine_kwargs: Any) -> None:
        self.task = task
        if task != "generate":
            from pagoda.config import PoolingConfig
            from pagoda.entrypoints.pooling import POOLING_TASKS, OfflinePooling

            if task not in POOLING_TASKS:
                raise ValueError(f"task must be generate, {' or '.join(POOLING_TASKS)}; got {task!r}")
            self.pooling = OfflinePooling(PoolingConfig.from_kwargs(model, **engine_kwargs), task)
            return
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_kwargs))

    def embed(self, prompts: Any, truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[Any]:
        """One EmbeddingRequestOutput per prompt (text or token ids); needs task="embed"."""
        return self._pooling().embed(prompts, truncate_prompt_tokens, dimensions)

    def score(self, text_1: str | list[str], text_2: str | list[str],
              truncate_prompt_tokens: int | None = None) -> list[Any]:
        """One ScoringRequestOutput per pair (one text_1 against each text_2, or pairwise)."""
        return self._pooling().score(text_1, text_2, truncate_prompt_tokens)

    def rerank(self, query: str, documents: list[str], top_n: int | None = None,
               truncate_prompt_tokens: int | None = None) -> list[dict[str, Any]]:
        """The documents by relevance to the query, best first: index, relevance_score, document."""
        return self._pooling().rerank(query, documents, top_n, truncate_prompt_tokens)

    def _pooling(self) -> Any:
        if self.task == "generate":
            raise ValueError('embed, score and rerank need a pooling model: LLM(model, task="embed" or "score")')
        return self.pooling

    def get_tokenizer(self):  # noqa: ANN201 - pagoda.model.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids or {"prompt_token_ids": [...]}) in one batch run.
        `priority`, one per prompt, orders them under the priority scheduling policy (lower first).
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError("priority must give one value per prompt")
        loras = list(lora_request) if isinstance(lora_request, Seq) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        for p in {id(p): p for p in params}.values():  # a constraint that cannot compile is a ValueError
            self.engine.input_processor.compile_structured(p)
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompt_list, params, priorities, loras):
                salt = None
                if isinstance(prompt, dict):  # {"prompt" | "prompt_token_ids": ..., "cache_salt": ...}
                    salt = prompt.get("cache_salt")
                    prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
                ids.append(self.engine.add_request(prompt, p, cache_salt=salt, priority=rank,
                                                   lora_request=lora).request_id)
        except Exception:
            for rid in ids:  # leave the engine as we found it
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (they also stop when this process exits)."""
        self.engine.close()

    def reset_prefix_cache(self) -> None:
        """Drop all cached prefixes (for benchmarks that compare cold and warm runs)."""
        self.engine.reset_prefix_cache()

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.input_processor.tokenize_chat(c, add_generation_prompt) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in request_ids]
