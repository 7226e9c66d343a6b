"""What the engine reports about itself: the snapshot the server's metrics and admission read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """A snapshot of the engine (LLMEngine.engine_stats), published by the async worker after every step and
    read from other threads without locks."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # running totals, in tokens
    prefix_cache_hits: int = 0
    spec_decode_num_drafts: int = 0            # speculative decoding running totals (0 when it is off)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_emitted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [j]: proposals accepted at position j
    num_steps: int = 0             # steps that ran the model so far; the last one's figures follow
    step_tokens: int = 0           # tokens it computed (prompt chunks, decodes, proposals)
    step_seconds: float = 0.0      # its wall time, scheduling to outputs
    step_forward_seconds: float = 0.0  # of which the model's forward
