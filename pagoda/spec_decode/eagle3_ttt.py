"""An EAGLE-3 head as a dense, differentiable module, unrolled over several draft steps (training-time test).

The parameters carry the published format's names (eagle3_head.py's docstring, which also has the one step's
math), so `tensors()` is what save_head writes. Eagle3Head runs the same step over paged KV at inference;
tests/test_eagle3_train.py pins the two together.

Training-time test (EAGLE-3, as SpecForge trains it): step 0 at position t takes fc of the target's captured
states at t and the token at t + 1, and predicts the token at t + 2. Step j > 0 at t takes step j - 1's output at
t and the token at t + 1 + j, at RoPE position t + j, and predicts the token at t + 2 + j. Its query sees step 0's
keys at positions <= t and the keys of steps 1..j at t alone: what a chain drafted from anchor t sees at depth j
(the true context's keys up to the anchor, then its own).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.spec_decode.eagle3_head import Eagle3Config

# SpecForge's weight of step j's loss: 0.8 ** j (later steps start from the head's own, noisier states).
STEP_DECAY = 0.8


def _norm(dim: int, eps: float) -> RMSNorm:
    """The engine's RMSNorm on its torch path (differentiable; the C++ op is not)."""
    norm = RMSNorm(dim, eps)
    norm.bind_ops(False)
    return norm


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        a = c.args
        self.heads, self.kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_proj = _linear(2 * a.hidden_size, a.num_heads * a.head_dim)
        self.k_proj = _linear(2 * a.hidden_size, a.num_kv_heads * a.head_dim)
        self.v_proj = _linear(2 * a.hidden_size, a.num_kv_heads * a.head_dim)
        self.o_proj = _linear(a.num_heads * a.head_dim, a.hidden_size)
        # The inference head's tables (its cos/sin by position), read here by index.
        self.rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope_theta, a.rope_scaling)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D] rotated (rotate-half layout) at `positions` [T]."""
        cos, sin = self.rope.cos[positions], self.rope.sin[positions]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """One step's attention; appends its keys and values (the chain's) to `keys` and `values`."""
        b, t, _ = x.shape
        q = self._rope(self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2), positions)
        keys.append(self._rope(self.k_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2), positions))
        values.append(self.v_proj(x).view(b, t, self.kv_heads, -1).transpose(1, 2))
        group = self.heads // self.kv_heads
        ks = [k.repeat_interleave(group, dim=1) for k in keys]
        vs = [v.repeat_interleave(group, dim=1) for v in values]
        # Step 0's keys under the causal mask, then one score per later step: its key at the query's own position.
        scores = [(q @ ks[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * k).sum(-1, keepdim=True) for k in ks[1:]]
        p = torch.softmax(torch.cat(scores, dim=-1) * self.head_dim ** -0.5, dim=-1)
        out = p[..., :t] @ vs[0]
        for i, v in enumerate(vs[1:]):
            out = out + p[..., t + i:t + i + 1] * v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h, inter = c.args.hidden_size, c.args.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, inter), _linear(h, inter), _linear(inter, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h, eps = c.args.hidden_size, c.args.rms_norm_eps
        self.input_layernorm, self.hidden_norm = _norm(h, eps), _norm(h, eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _norm(h, eps)
        self.mlp = _MLP(c)

    def forward(self, emb: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, causal: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(state)], dim=-1)
        h = state + self.self_attn(x, positions, causal, keys, values)
        return h + self.mlp(self.post_attention_layernorm(h))


class DenseEagle3(nn.Module):
    """The head, trainable. `embed`: the target's token embedding (frozen: neither trained nor saved)."""

    def __init__(self, c: Eagle3Config, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        a = c.args
        self.config = c
        self.fc = _linear(len(c.aux_layers) * c.target_hidden_size, a.hidden_size)
        self.midlayer = _Midlayer(c)
        self.norm = _norm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = _linear(a.hidden_size, c.draft_vocab_size)
        # In a tuple: assigned bare, a target's embedding module would become this head's own (trained, saved).
        self._embed = (embed,)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64), persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._embed[0](ids).float()

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(state))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def unroll(self, aux: torch.Tensor, ids: torch.Tensor, steps: int,
               greedy: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """aux [B, L, 3 * H_target] and ids [B, L] of sequences (padded at the end) -> each step's states
        [B, L - 1, H] and logits [B, L - 1, draft_vocab] at anchors t = 0..L-2. Step j > 0 reads the token at
        t + 1 + j (`greedy`: the head's own step j - 1 draft instead, as a chain drafts at inference)."""
        t = ids.shape[1] - 1
        positions = torch.arange(t, device=ids.device)
        causal = positions[:, None] >= positions[None, :]
        state = self.fc(aux[:, :t])
        tokens = ids[:, 1:]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        states, logits = [], []
        for j in range(steps):
            if j:
                tokens = self.to_target(logits[-1].argmax(-1)) if greedy else F.pad(ids[:, 1 + j:], (0, j))
            state = self.midlayer(self.embed(tokens), state, positions + j, causal, keys, values)
            states.append(state)
            logits.append(self.logits(state))
        return states, logits

    def tensors(self, vocab_size: int) -> dict[str, torch.Tensor]:
        """The published format's tensors: the weights, d2t, and t2d over the target's `vocab_size`."""
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[self.to_target(torch.arange(self.config.draft_vocab_size))] = True
        return {**{k: v.detach().float() for k, v in self.state_dict().items()}, "d2t": self.d2t.clone(), "t2d": t2d}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of tensors(): the weights and d2t (t2d follows from d2t)."""
        self.load_state_dict({k: tensors[k] for k in self.state_dict()})
        self.d2t = tensors["d2t"].long()


def ttt_loss(logits: list[torch.Tensor], target_p: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy of each step against the target's distribution over the draft vocabulary at the
    predicted position, weighted STEP_DECAY ** j. target_p [B, L, draft_vocab]: softmax of the target's logits at
    each position (which predict the next token); valid [B, L]: positions with a target there."""
    t = target_p.shape[1] - 1
    total = logits[0].new_zeros(())
    for j, lg in enumerate(logits):
        # Step j at anchor t predicts the token at t + 2 + j: the target's distribution at t + 1 + j.
        p = F.pad(target_p[:, 1 + j:], (0, 0, 0, j))[:, :t]
        mask = F.pad(valid[:, 1 + j:], (0, j))[:, :t].float()
        ce = -(p * torch.log_softmax(lg, dim=-1)).sum(-1)
        total = total + STEP_DECAY ** j * (ce * mask).sum() / mask.sum().clamp(min=1)
    return total


def chain_acceptance(head: DenseEagle3, aux: torch.Tensor, ids: torch.Tensor, greedy_next: torch.Tensor,
                     anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Chains of k greedy drafts from each anchor of one sequence (aux [L, 3 * H_target], ids [L]); the token at
    position p + 1 the target would pick greedily is greedy_next[p]. Returns [A, k]: whether each anchor's
    draft j and all before it were accepted. An anchor t must leave room: t + 1 + k < L."""
    with torch.no_grad():
        _, logits = head.unroll(aux[None], ids[None], k, greedy=True)
    drafts = torch.stack([head.to_target(lg[0].argmax(-1)) for lg in logits], dim=1)   # [L - 1, k]
    want = torch.stack([greedy_next[1 + j:][:ids.shape[0] - 1 - k] for j in range(k)], dim=1)
    hits = drafts[:ids.shape[0] - 1 - k] == want
    return hits[anchors].long().cumprod(dim=1).bool()


def decoding_steps(hits: torch.Tensor) -> torch.Tensor:
    """The rows of `hits` (chain_acceptance over consecutive anchors, the first where decoding starts) that
    decoding verifies: each verification emits its accepted drafts and the target's own token, so the next chain
    starts that many positions on. Every anchor alone overstates what decoding gets: the anchor after a rejection
    sits where the head just failed, and is harder than the average position."""
    rows, a = [], 0
    while a < len(hits):
        rows.append(a)
        a += int(hits[a].sum()) + 1
    return hits[rows]
