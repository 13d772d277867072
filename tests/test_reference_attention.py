"""Paged attention references against a dense computation: mixed lengths, page boundaries, sliding window, MLA."""

import math

import pytest
import torch

from gpu_layers import reference
from hybrid.block_manager import PrefixCachingBlockManager, blocks_needed
from hybrid.forward_batch import ForwardBatch, SequenceSlice


def dense_attention(q, k, v, scale, window=None):
    """Textbook attention with explicit loops over query positions (independent of the reference code)."""
    n, num_heads, _ = q.shape
    length, num_kv = k.shape[:2]
    out = torch.empty(n, num_heads, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        pos = length - n + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            kv = h // (num_heads // num_kv)
            scores = (k[lo : pos + 1, kv].double() @ q[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[lo : pos + 1, kv].double()
    return out


def build_cache(seqs, block_size, num_kv, dim, num_blocks=128, seed=0):
    """Random K/V for each sequence's full context, scattered into shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    alloc = PrefixCachingBlockManager(num_blocks, block_size)
    alloc.allocate(3)  # start away from page 0 so a wrong table cannot pass by accident
    k_cache = torch.randn(num_blocks, block_size, num_kv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv, dim, generator=gen)
    slices, contexts = [], []
    for computed, new in seqs:
        table = alloc.allocate(blocks_needed(computed + new, block_size))[::-1]
        slices.append(SequenceSlice(computed, new, [table]))
        k = torch.randn(computed + new, num_kv, dim, generator=gen)
        v = torch.randn(computed + new, num_kv, dim, generator=gen)
        for pos in range(computed):
            page, off = table[pos // block_size], pos % block_size
            k_cache[page, off], v_cache[page, off] = k[pos], v[pos]
        contexts.append((k, v))
    return k_cache, v_cache, slices, contexts


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_mixed_batch(block_size, window):
    num_heads, num_kv, dim = 6, 2, 8
    seqs = [(0, 1), (0, 17), (16, 1), (15, 2), (31, 9), (4, 0 + 1)]
    k_cache, v_cache, slices, contexts = build_cache(seqs, block_size, num_kv, dim)
    batch = ForwardBatch.build(slices, block_size, "cpu")
    new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(contexts, seqs, strict=True)])
    new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(contexts, seqs, strict=True)])
    reference.write_kv_cache(k_cache, new_k, batch.slot_mapping)
    reference.write_kv_cache(v_cache, new_v, batch.slot_mapping)
    q = torch.randn(batch.num_tokens, num_heads, dim)
    scale = 1 / math.sqrt(dim)
    out = reference.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens_cpu,
                                    batch.query_lens_cpu, scale, window)
    start = 0
    for (k, v), (_, new) in zip(contexts, seqs, strict=True):
        expected = dense_attention(q[start : start + new], k, v, scale, window)
        torch.testing.assert_close(out[start : start + new].double(), expected, rtol=1e-5, atol=1e-5)
        start += new


def test_write_kv_cache_touches_only_given_slots():
    cache = torch.zeros(4, 4, 1, 2)
    values = torch.arange(6, dtype=torch.float32).view(3, 1, 2) + 1
    reference.write_kv_cache(cache, values, torch.tensor([5, 0, 15]))
    flat = cache.view(16, 1, 2)
    assert torch.equal(flat[[5, 0, 15]], values)
    assert flat.abs().sum() == values.sum()


def test_mla_reference_matches_expanded_attention():
    torch.manual_seed(1)
    num_heads, rank, nope, rope, v_dim, block_size = 3, 10, 6, 4, 5, 4
    seqs = [(0, 7), (9, 1)]
    latent_cache = torch.zeros(16, block_size, 1, rank + rope)
    w_kv_b = torch.randn(num_heads * (nope + v_dim), rank)
    alloc = PrefixCachingBlockManager(16, block_size)
    slices, latents = [], []
    for computed, new in seqs:
        table = alloc.allocate(blocks_needed(computed + new, block_size))
        slices.append(SequenceSlice(computed, new, [table]))
        lat = torch.randn(computed + new, rank + rope)
        for pos in range(computed):
            latent_cache[table[pos // block_size], pos % block_size, 0] = lat[pos]
        latents.append(lat)
    batch = ForwardBatch.build(slices, block_size, "cpu")
    new_lat = torch.cat([lat[c:] for lat, (c, _) in zip(latents, seqs, strict=True)])
    reference.write_kv_cache(latent_cache, new_lat.unsqueeze(1), batch.slot_mapping)
    q_nope, q_rope = torch.randn(batch.num_tokens, num_heads, nope), torch.randn(batch.num_tokens, num_heads, rope)
    out = reference.mla_paged_attention(q_nope, q_rope, latent_cache, w_kv_b, batch.block_tables,
                                        batch.seq_lens_cpu, batch.query_lens_cpu, 0.3, v_dim)
    start = 0
    for lat, (_, new) in zip(latents, seqs, strict=True):
        kv = (lat[:, :rank] @ w_kv_b.T).view(-1, num_heads, nope + v_dim)
        k = torch.cat([kv[..., :nope], lat[:, None, rank:].expand(-1, num_heads, -1)], -1)
        q = torch.cat([q_nope, q_rope], -1)[start : start + new]
        expected = dense_attention(q, k, kv[..., nope:], 0.3)
        torch.testing.assert_close(out[start : start + new].double(), expected, rtol=1e-5, atol=1e-5)
        start += new


def test_paged_attention_sinks_and_value_scale():
    """A sink adds exp(s_h) to each softmax's denominator (its value is dropped); the value scale multiplies V.
    Against the dense loops with the sink written out, q/k 12 and v 8, a window shorter than the context."""
    num_heads, num_kv, dim, v_dim, window, value_scale = 4, 2, 12, 8, 6, 0.5
    gen = torch.Generator().manual_seed(2)
    length = 11
    q, k = torch.randn(length, num_heads, dim, generator=gen), torch.randn(length, num_kv, dim, generator=gen)
    v = torch.randn(length, num_kv, v_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen) * 2
    k_cache, v_cache = k.view(length, 1, num_kv, dim), v.view(length, 1, num_kv, v_dim)
    tables = torch.arange(length, dtype=torch.int32)[None]
    out = reference.paged_attention(q, k_cache, v_cache, tables, [length], [length], 0.3, window, sinks, value_scale)
    for i in range(length):
        lo = max(0, i - window + 1)
        for h in range(num_heads):
            scores = (k[lo : i + 1, h // 2].double() @ q[i, h].double()) * 0.3
            weights = scores.exp() / (scores.exp().sum() + sinks[h].double().exp())
            want = weights @ (v[lo : i + 1, h // 2].double() * value_scale)
            torch.testing.assert_close(out[i, h].double(), want, rtol=1e-5, atol=1e-5)
