"""Paged attention: C++ kernel vs pure-torch reference vs dense causal SDPA."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from references import dense_sdpa

import pagoda.kernels.paged_attention as pa
from pagoda.kernels.fused_ops import write_kv_cache, write_kv_cache_torch


def make_batch(specs, hq, hkv, d, bs, dtype, seed=0, words=False, given=None):
    """Random paged batch; specs = [(q_len, seq_len)]. Cache holds NaN in unused slots
    so any read outside a sequence's valid keys poisons the output. words: K stored as words
    ([num_blocks, Hkv, D/2, bs, 2], pa.k_cache_shape). given: per spec, its (q, k, v) instead of random ones."""
    g = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(s / bs) for _, s in specs]
    num_blocks = sum(nblk) + 3
    v_cache = torch.full((num_blocks, hkv, bs, d), float("nan"), dtype=dtype)
    k_shape = (num_blocks, hkv, d // 2, bs, 2) if words else (num_blocks, hkv, bs, d)
    k_cache = torch.full(k_shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)  # shuffled, non-contiguous blocks
    block_tables = torch.zeros(len(specs), max(nblk), dtype=torch.int32)
    dense_k, dense_v, qs, used = [], [], [], 0
    for b, (q_len, seq_len) in enumerate(specs):
        blocks = perm[used:used + nblk[b]]
        used += nblk[b]
        block_tables[b, : nblk[b]] = blocks.int()
        k = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        v = torch.randn(seq_len, hkv, d, generator=g).to(dtype)
        qb = torch.randn(q_len, hq, d, generator=g).to(dtype)
        if given is not None:
            qb, k, v = given[b]
        slots = blocks.repeat_interleave(bs)[:seq_len] * bs + torch.arange(seq_len) % bs
        write_kv_cache(k, v, k_cache, v_cache, slots)
        dense_k.append(k)
        dense_v.append(v)
        qs.append(qb)
    qsl = torch.tensor([0] + [q for q, _ in specs], dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([s for _, s in specs], dtype=torch.int32)
    return torch.cat(qs), k_cache, v_cache, block_tables, qsl, seq_lens, dense_k, dense_v




# decode, prefill from scratch, chunked prefill with prior context, non-aligned lengths
MIXED = [(1, 1), (1, 37), (5, 5), (23, 23), (1, 64), (17, 50), (40, 131), (1, 16), (3, 3), (64, 64)]

needs_kernel = pytest.mark.skipif(not pa.kernel_available(), reason="C++ kernel did not build")
# bf16 caches: K as rows (the fp32-staging path) and as words (bf16 dot products), where this CPU has them
needs_words = pytest.mark.skipif(not pa.k_words_supported(torch.bfloat16, 16, 64),
                                 reason="K words need AVX512-BF16 and the C++ kernel")
K_LAYOUTS = [False, pytest.param(True, marks=needs_words)]


@needs_kernel
@pytest.mark.parametrize("hq,hkv", [(4, 2), (9, 3), (8, 8), (8, 1)])
@pytest.mark.parametrize("bs", [16, 4])
def test_kernel_matches_reference_and_sdpa_fp32(hq, hkv, bs):
    d = 64
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(MIXED, hq, hkv, d, bs, torch.float32, seed=hq * bs)
    scale = d ** -0.5
    want = dense_sdpa(q, dk, dv, qsl, scale)
    ref = pa.paged_attention_reference(q, kc, vc, bt, qsl, sl, scale)
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, scale)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pa.paged_attention(q, kc, vc, bt, qsl, sl, scale), got)


@needs_kernel
@pytest.mark.parametrize("words", K_LAYOUTS)
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 16), (64, 32)])
def test_kernel_bf16(d, bs, words):
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(MIXED, 9, 3, d, bs, torch.bfloat16, seed=d, words=words)
    scale = d ** -0.5
    want = dense_sdpa(q, dk, dv, qsl, scale)
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, scale)
    assert got.dtype == torch.bfloat16
    # inputs are exact bf16 in both paths; only the final rounding to bf16 differs
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    ref = pa.paged_attention_reference(q, kc, vc, bt, qsl, sl, scale)
    torch.testing.assert_close(ref.float(), want, atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("words", K_LAYOUTS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (9, 3), (8, 1), (8, 8)])
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_bf16_few_rows(hq, hkv, d, words):
    """Work items of at most 8 rows (a decode query's group of heads, or two queries of a small group):
    one key, partial and whole 32-key chunks (a second group of 16 keys absent, partial, whole), more
    than one block, and steps of 2 and 3 queries; the NaN-filled free slots catch any read past a sequence."""
    specs = [(1, 1), (1, 37), (2, 40), (1, 130), (3, 3), (1, 16), (1, 17), (2, 2), (1, 64), (1, 48)]
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(specs, hq, hkv, d, 16, torch.bfloat16, seed=hq + d, words=words)
    scale = d ** -0.5
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, scale)
    torch.testing.assert_close(got.float(), dense_sdpa(q, dk, dv, qsl, scale), atol=1e-2, rtol=1e-2)


@needs_kernel
def test_kernel_large_batch_and_long_prefill():
    specs = [(1, 1 + (7 * i) % 300) for i in range(200)] + [(300, 300), (129, 700)]
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(specs, 4, 2, 64, 16, torch.float32, seed=1)
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, 0.125)
    torch.testing.assert_close(got, dense_sdpa(q, dk, dv, qsl, 0.125), atol=2e-5, rtol=1e-5)
    if pa.k_words_supported(torch.bfloat16, 16, 64):  # the same batch over a bf16 cache with K words
        q, kc, vc, bt, qsl, sl, dk, dv = make_batch(specs, 4, 2, 64, 16, torch.bfloat16, seed=1, words=True)
        got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, 0.125)
        torch.testing.assert_close(got.float(), dense_sdpa(q, dk, dv, qsl, 0.125), atol=1e-2, rtol=1e-2)


@needs_kernel
def test_kernel_detects_wrong_causal_offset():
    """Off-by-one in the causal position (e.g. ignoring prior context) must be visible."""
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch([(8, 20), (1, 9)], 4, 2, 64, 4, torch.float32)
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, 0.125)
    shifted = dense_sdpa(q, [k[:-1] for k in dk], [v[:-1] for v in dv], qsl, 0.125)
    assert not torch.allclose(got, shifted, atol=1e-3)
    # a kernel that treated the last query as attending to one key fewer would differ too
    assert not torch.allclose(got[-1:], dense_sdpa(q[-1:], [dk[1][:8]], [dv[1][:8]],
                                                   torch.tensor([0, 1]), 0.125), atol=1e-3)


def dense_window_softcap(q, dense_k, dense_v, qsl, seq_lens, scale, window, softcap):
    """Ground truth with a sliding window (keys (p - window, p]) and soft-capped scores, written out."""
    outs = []
    for b in range(len(dense_k)):
        qb = q[qsl[b]:qsl[b + 1]].float().transpose(0, 1)  # [Hq, q_len, D]
        group = qb.shape[0] // dense_k[b].shape[1]
        k = dense_k[b].float().transpose(0, 1).repeat_interleave(group, 0)
        v = dense_v[b].float().transpose(0, 1).repeat_interleave(group, 0)
        q_len, s = qb.shape[1], k.shape[1]
        scores = qb @ k.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        pos, key = torch.arange(s - q_len, s)[:, None], torch.arange(s)[None, :]
        allowed = (key <= pos) & ((key > pos - window) if window else True)
        outs.append((scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def free_blocks_before_windows(bt, qsl, sl, bs, window, poison):
    """Point each sequence's blocks before its first visible key's block at `poison` (a NaN block), as
    KVCacheManager frees them: any read there poisons the output."""
    bt = bt.clone()
    for b in range(len(sl)):
        first = max(0, int(sl[b]) - int(qsl[b + 1] - qsl[b]) - window + 1) // bs
        bt[b, :first] = poison
    return bt


WINDOWED = [(1, 1), (1, 37), (5, 5), (23, 23), (1, 64), (17, 50), (40, 131), (1, 200), (3, 3), (64, 64), (2, 99)]


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("dtype,words", [(torch.float32, False), (torch.bfloat16, False),
                                         pytest.param(torch.bfloat16, True, marks=needs_words)])
@pytest.mark.parametrize("window,softcap", [(16, 0.0), (21, 0.0), (48, 0.0), (0, 5.0), (21, 5.0)])
def test_sliding_window_and_softcap_match_the_dense_reference(kernel, dtype, words, window, softcap):
    """Windowed layers read from the block of their first visible key only (earlier blocks may be freed: here
    they are NaN), mask the keys before the window in that block, and cap scores before the mask."""
    bs, d = 16, 64
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(WINDOWED, 8, 2, d, bs, dtype, seed=window, words=words)
    poison = min(set(range(kc.shape[0])) - set(bt.flatten().tolist()))  # make_batch leaves spare NaN blocks
    if window:
        bt = free_blocks_before_windows(bt, qsl, sl, bs, window, poison)
    scale = d ** -0.5
    want = dense_window_softcap(q, dk, dv, qsl, sl, scale, window, softcap)
    attend = pa.paged_attention if kernel else pa.paged_attention_reference
    got = attend(q, kc, vc, bt, qsl, sl, scale, window=window, softcap=softcap)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if window:  # the window is felt: without it the long rows differ
        assert not torch.allclose(got.float(), dense_window_softcap(q, dk, dv, qsl, sl, scale, 0, softcap), atol=1e-2)


def test_reference_matches_sdpa_without_kernel():
    """The torch twin (what kernels="torch" binds) is exact."""
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(MIXED, 9, 3, 64, 4, torch.float32, seed=3)
    got = pa.paged_attention_reference(q, kc, vc, bt, qsl, sl, 0.125)
    torch.testing.assert_close(got, dense_sdpa(q, dk, dv, qsl, 0.125), atol=1e-5, rtol=1e-5)


def test_write_kv_cache_follows_slots():
    bs, hkv, d = 4, 2, 8
    k_cache = torch.zeros(6, hkv, bs, d)
    v_cache = torch.zeros(6, hkv, bs, d)
    k = torch.randn(5, hkv, d)
    v = torch.randn(5, hkv, d)
    slots = torch.tensor([2 * bs + 3, 5 * bs + 0, 0 * bs + 1, 5 * bs + 2, 3 * bs + 3])
    write_kv_cache(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // bs, :, s % bs], k[t])
        assert torch.equal(v_cache[s // bs, :, s % bs], v[t])
    written = torch.zeros(6, bs, dtype=torch.bool)
    written.view(-1)[slots] = True
    assert (k_cache.abs().sum((1, 3)) != 0).eq(written).all()  # nothing else touched
    assert (v_cache.abs().sum((1, 3)) != 0).eq(written).all()


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)])
def test_write_kv_cache_k_words(kernel):
    """A K cache stored as words holds what the row layout holds, written by the C++ op or by indexing."""
    bs, hkv, d = 16, 2, 64
    rows = torch.zeros(5, hkv, bs, d, dtype=torch.bfloat16)
    words = pa.k_words(rows)
    assert words.shape == (5, hkv, d // 2, bs, 2) and torch.equal(pa.k_rows(words), rows)
    v1, v2 = torch.zeros_like(rows), torch.zeros_like(rows)
    k = torch.randn(7, hkv, d).bfloat16()
    v = torch.randn(7, hkv, d).bfloat16()
    slots = torch.tensor([0, 17, 31, 2 * bs + 5, 4 * bs + 15, 3 * bs, 1])
    write = write_kv_cache if kernel else write_kv_cache_torch
    write(k, v, rows, v1, slots)
    write(k, v, words, v2, slots)
    assert torch.equal(pa.k_rows(words), rows) and torch.equal(v1, v2)
    assert torch.equal(pa.k_words(rows), words)


def test_write_then_attend_decode_step():
    """End to end: write a new token's K/V, then attend with seq_lens including it."""
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch([(1, 10), (1, 5)], 4, 2, 64, 4, torch.float32)
    new_k, new_v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    slots = torch.tensor([int(bt[0, 10 // 4]) * 4 + 10 % 4, int(bt[1, 1]) * 4 + 1])  # positions 10 and 5
    write_kv_cache(new_k, new_v, kc, vc, slots)
    sl2 = sl + 1
    dk2 = [torch.cat([dk[i], new_k[i:i + 1]]) for i in range(2)]
    dv2 = [torch.cat([dv[i], new_v[i:i + 1]]) for i in range(2)]
    want = dense_sdpa(q, dk2, dv2, qsl, 0.125)
    torch.testing.assert_close(pa.paged_attention(q, kc, vc, bt, qsl, sl2, 0.125), want,
                               atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,kv_dtype,words",
                         [(torch.float32, None, False), (torch.bfloat16, None, False),
                          (torch.bfloat16, torch.int8, False),
                          pytest.param(torch.bfloat16, None, True, marks=needs_words)])
def test_fused_rope_cache_attention_equals_the_three_ops(dtype, kv_dtype, words):
    """rope_cache_attention (one call per layer) = rope_, then write_kv_, then paged_attention."""
    from pagoda.kernels.fused_ops import rope_
    from pagoda.layers.rotary import RotaryEmbedding

    hq, hkv, d, bs = 6, 2, 32, 16
    specs = [(1, 37), (5, 5), (17, 50)]  # decode, prefill, chunked prefill over earlier context
    _, k_cache, v_cache, tables, qsl, seq_lens, _, _ = make_batch(specs, hq, hkv, d, bs, dtype, words=words)
    scales = None
    if kv_dtype is not None:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
        scales = (torch.rand(k_cache.shape[:3]) + 0.5, torch.rand(k_cache.shape[:3]) + 0.5)
    T = int(qsl[-1])
    positions = torch.cat([torch.arange(s - q, s) for q, s in specs])
    slots = torch.cat([tables[b, p // bs].long() * bs + p % bs
                       for b, (q, s) in enumerate(specs) for p in [torch.arange(s - q, s)]])
    rope = RotaryEmbedding(d, 256, 10000.0, None)
    qkv = torch.randn(T, (hq + 2 * hkv) * d).to(dtype)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    s2 = None if scales is None else (scales[0].clone(), scales[1].clone())
    fused = torch.ops.pagoda.rope_cache_attention(
        qkv.clone(), positions, rope.cos, rope.sin, k_cache, v_cache, slots, tables, qsl, seq_lens, d ** -0.5,
        hq, hkv, *(scales or ()))
    ref_qkv = qkv.clone()
    rope_(ref_qkv, positions, rope.cos, rope.sin, hq, hkv, d)
    q, k, v = ref_qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    write_kv_cache(k.view(T, hkv, d), v.view(T, hkv, d), kc2, vc2, slots, *(s2 or ()))
    ref = pa.paged_attention(q.reshape(T, hq, d), kc2, vc2, tables, qsl, seq_lens, d ** -0.5, *(s2 or ()))
    exact = dict(atol=0, rtol=0, equal_nan=True)  # unused cache slots hold NaN on purpose
    torch.testing.assert_close(k_cache, kc2, **exact)
    torch.testing.assert_close(v_cache, vc2, **exact)
    torch.testing.assert_close(fused, ref.reshape(T, hq * d), atol=0, rtol=0)


@needs_kernel
def test_attention_bench_runs(capsys):
    """`python -m benchmarks.attention`: the step it times is the engine's kernel over the engine's layout."""
    from benchmarks.attention import main

    assert main(["--num-seqs", "4", "--layers", "2", "--rounds", "1", "--ctx-range", "10", "40"]) == 0
    out = capsys.readouterr().out
    assert "decode attention" in out and "4 sequences" in out and "pagoda" in out and "GB/s" in out
    assert main(["--prefill", "40,17", "--dtype", "float32", "--layers", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill attention" in out and "float32" in out and "2 sequences, 57 keys" in out


@pytest.mark.slow
@needs_kernel
def test_attention_bench_builds_another_source(capsys):
    """--compare-source builds a paged_attention.cpp under another namespace (the current one, here: K as rows
    takes its fp32-staging path, so the outputs agree to bf16 rounding)."""
    from benchmarks.attention import main

    src = Path(pa.__file__).parent / "cpu" / "paged_attention.cpp"
    assert main(["--num-seqs", "4", "--layers", "2", "--rounds", "1", "--compare-source", str(src)]) == 0
    diff = float(re.search(r"outputs differ by <= (\S+)\)", capsys.readouterr().out).group(1))
    assert diff < 1e-2


def _tree_words(parents: list[int], seq_len: int) -> list[int]:
    """Tree-mask words (pa.AttentionMetadata.tree_mask) for a tree of len(parents) nodes at the end of a sequence
    of seq_len keys, node i's parent at parents[i] (-1: none, the root); every key before the tree visible."""
    n = len(parents)
    base = seq_len - pa.TREE_SPAN  # the key bit 0 covers
    words = []
    for i in range(n):
        bits, j = 0, i
        while j >= 0:
            bits |= 1 << (seq_len - n + j - base)
            j = parents[j]
        for key in range(max(0, base), seq_len - n):  # the context
            bits |= 1 << (key - base)
        words.append(bits - (1 << 64) if bits >= 1 << 63 else bits)  # as int64
    return words


def _node_keys(trees: list[list[int]], ctx: list[int]):
    """Per node of each tree (parents, after ctx[b] context keys): (tree, node, the keys it sees: the context, then
    its ancestors and itself in depth order)."""
    for b, (t, c) in enumerate(zip(trees, ctx)):
        for i in range(len(t)):
            path, j = [], i
            while j >= 0:
                path.insert(0, c + j)
                j = t[j]
            yield b, i, list(range(c)) + path


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_mask_matches_dense_attention_over_each_nodes_path(kernel, dtype):
    """A draft tree verified in one pass: each node attends to the context and its own ancestors only, exactly
    as dense attention over that path would; rows without a tree beside it stay causal."""
    hq, hkv, d, bs = 9, 3, 64, 16
    trees = [[-1, 0, 0, 0, 1, 1, 2, 4, 4, 6], [-1, 0, 1, 2], [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    ctx = [40, 3, 70]  # context keys before each tree (a tree root is the sequence's last token)
    specs = [(len(t), c + len(t)) for t, c in zip(trees, ctx)] + [(17, 50), (1, 37)]
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(specs, hq, hkv, d, bs, dtype, seed=3)
    words = [w for t, (_, s) in zip(trees, specs) for w in _tree_words(t, s)] + [-1] * (17 + 1)
    mask = torch.tensor(words, dtype=torch.int64)
    scale = d ** -0.5
    attend = (lambda *a: torch.ops.pagoda.paged_attention(*a, None, None, 0, 0.0, mask)) if kernel else \
        (lambda *a: pa.paged_attention_reference(*a, tree_mask=mask))
    got = attend(q, kc, vc, bt, qsl, sl, scale).float()
    causal = dense_sdpa(q, dk, dv, qsl, scale).float()
    g = hq // hkv
    for b, i, keys in _node_keys(trees, ctx):
        k = dk[b][keys].float().repeat_interleave(g, dim=1)  # [n, Hq, D]
        v = dv[b][keys].float().repeat_interleave(g, dim=1)
        row = int(qsl[b]) + i
        probs = torch.einsum("hd,nhd->hn", q[row].float() * scale, k).softmax(-1)
        want = torch.einsum("hn,nhd->hd", probs, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[row], want, atol=tol, rtol=tol)
    rest = int(qsl[len(trees)])
    torch.testing.assert_close(got[rest:], causal[rest:], atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("dtype,words", [(torch.float32, False), (torch.bfloat16, False),
                                         pytest.param(torch.bfloat16, True, marks=needs_words)],
                         ids=["fp32", "bf16-rows", "bf16-words"])
def test_a_tree_node_attends_bit_for_bit_as_its_path_decoded_alone(dtype, words):
    """Greedy verification of a tree must give plain decoding's tokens: each node's attention is, to the bit, the
    attention of a query at the end of its path laid out as a sequence of its own (the keys at the same offsets,
    so the same lanes, bf16 key pairs and chunks), however the tree's nodes sit in the cache."""
    hq, hkv, d, bs = 9, 3, 64, 16
    trees = [[-1, 0, 0, 0, 1, 1, 2, 4, 4, 6], [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [-1, 0, 1, 0]]
    ctx = [29, 70, 3]  # a tree across a chunk's edge, one past the mask's first 64 keys, one in the first chunk
    specs = [(len(t), c + len(t)) for t, c in zip(trees, ctx)] + [(17, 50)]
    q, kc, vc, bt, qsl, sl, dk, dv = make_batch(specs, hq, hkv, d, bs, dtype, seed=5, words=words)
    mask = torch.tensor([w for t, (_, s) in zip(trees, specs) for w in _tree_words(t, s)] + [-1] * 17)
    got = torch.ops.pagoda.paged_attention(q, kc, vc, bt, qsl, sl, d ** -0.5, None, None, 0, 0.0, mask)
    alone, rows = [], []
    for b, i, keys in _node_keys(trees, ctx):
        rows.append(int(qsl[b]) + i)
        alone.append((q[rows[-1]:rows[-1] + 1], dk[b][keys], dv[b][keys]))
    q1, kc1, vc1, bt1, qsl1, sl1, _, _ = make_batch([(1, len(k)) for _, k, _ in alone], hq, hkv, d, bs, dtype,
                                                     words=words, given=alone)
    want = torch.ops.pagoda.paged_attention(q1, kc1, vc1, bt1, qsl1, sl1, d ** -0.5, None, None, 0, 0.0, None)
    assert torch.equal(got[rows], want)
