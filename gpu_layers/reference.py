"""Plain-PyTorch references for the kernels: dense ops (RMSNorm, rotary, SiLU-and-mul), routers and paged attention
(GQA and MLA). Slow and simple on purpose: these are the test oracle for the kernels and the CPU path of the
runtime (`hybrid.layers.ops.TORCH_OPS`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, D] -> [N, D]: normalised in float32, cast back, times the weight (as the checkpoints were trained);
    with residual, the fused add first (residual updated in place)."""
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
    is_interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates the leading 2 * len(inv_freq) dims of q [T, Hq, D] and k [T, Hk, D] in place and returns them.
    Interleaved input pairs (2i, 2i+1) come out as halves (evens, then odds); q and k get the same permutation, so
    their dot products, and the attention, are unchanged."""
    freqs = positions[:, None].float() * inv_freq  # [T, R / 2]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    rotary_dim = 2 * inv_freq.shape[0]
    for x in (q, k):
        rot = x[..., :rotary_dim]
        cos_x, sin_x = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)  # [T, 1, R / 2]
        if is_interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        else:
            x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        rot.copy_(torch.cat((x1 * cos_x - x2 * sin_x, x2 * cos_x + x1 * sin_x), dim=-1))
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores values [T, heads, dim] into cache [num_blocks, block_size, heads, dim] at flat slots [T]."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, heads, dim]
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first_page: int = 0) -> torch.Tensor:
    """A sequence's cached entries from page `first_page` up to position seq_len [seq_len - first, heads, dim], in
    position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    pages = cache[block_table[first_page:num_blocks].long()]  # [num_blocks - first_page, block_size, heads, dim]
    return pages.reshape(-1, *cache.shape[2:])[:seq_len - first_page * block_size]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None,
    sinks: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] are the last n of L positions; k [L, Hkv, D], v [L, Hkv, Dv] -> [n, Hq, Dv]. `sinks` [Hq]: one
    more logit per head in the softmax, whose probability is dropped (gpt-oss's eager attention). `allowed` [n, L]
    bool: the keys each query may see besides the causal mask (a sparse-attention selection)."""
    n, num_q_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, Dv]
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [Hq, n, L]
    q_pos = torch.arange(length - n, length, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    masked = k_pos > q_pos
    if sliding_window is not None:
        masked |= k_pos <= q_pos - sliding_window
    if allowed is not None:
        masked = masked | ~allowed
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype)[:, None, None].expand(num_q_heads, n, 1)
        scores = torch.cat((scores, sink_column), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v).transpose(0, 1)  # [n, Hq, Dv]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    value_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each sequence's new tokens q [T, Hq, D] over its cached context -> [T, Hq, Dv]. `sinks` as in
    causal_attention; `value_scale` multiplies V (MiMo's v_scale, applied before caching there). With a window,
    pages before the first query's window are not read: a running sequence may have given them back."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    block_size = k_cache.shape[1]
    start = 0
    for b, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        # the keys stay the last ones of the context, so causal_attention's relative window mask still holds
        first_page = max(0, seq_len - query_len - sliding_window + 1) // block_size if sliding_window else 0
        k = gather_context(k_cache, block_tables[b], seq_len, first_page)
        v = gather_context(v_cache, block_tables[b], seq_len, first_page) * value_scale
        end = start + query_len
        out[start:end] = causal_attention(q[start:end], k, v, scale, sliding_window, sinks)
        start = end
    return out


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    v_head_dim: int,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head latent attention over a compressed cache, by expanding the latents (no weight absorption).

    q_nope [T, H, Dn], q_rope [T, H, Dr]; latent_cache [num_blocks, block_size, 1, R + Dr] holds the normalised
    kv latent (R) and the rotated shared key (Dr); w_kv_b [H * (Dn + Dv), R]. Returns [T, H, Dv]. `selected`
    [T, K] int32: sparse attention (DSA), token t attends only to the positions listed in its row (-1: none).
    """
    num_heads, nope_dim = q_nope.shape[1], q_nope.shape[2]
    rank = latent_cache.shape[-1] - q_rope.shape[-1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    out = q.new_empty(q.shape[0], num_heads, v_head_dim)
    start = 0
    for b, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        latent = gather_context(latent_cache, block_tables[b], seq_len)[:, 0]  # [L, R + Dr]
        kv = torch.nn.functional.linear(latent[:, :rank], w_kv_b).view(seq_len, num_heads, nope_dim + v_head_dim)
        k_nope, v = kv.split([nope_dim, v_head_dim], dim=-1)
        k_rope = latent[:, None, rank:].expand(seq_len, num_heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        end = start + query_len
        allowed = None
        if selected is not None:
            rows = selected[start:end].long()
            allowed = torch.zeros(query_len, seq_len + 1, dtype=torch.bool, device=q.device)
            allowed.scatter_(1, torch.where(rows < 0, seq_len, rows), True)  # -1 goes to a dropped column
            allowed = allowed[:, :seq_len]
        out[start:end] = causal_attention(q[start:end], k, v, scale, allowed=allowed)
        start = end
    return out


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen/Mixtral routing: softmax over experts, keep the top-k. Returns float32 weights [T, K], int64 ids."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_group: int,
    scoring: str,
    group_score: str,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek/GLM routing over float32 logits [T, E]: score (sigmoid or softmax), keep the best `topk_group` of
    `num_groups` groups, pick the top-k experts inside them by score + correction bias, weight them by the
    unbiased score, optionally renormalise, then scale. Returns float32 weights [T, K], int64 ids [T, K]."""
    scores = logits.sigmoid() if scoring == "sigmoid" else torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if correction_bias is None else scores + correction_bias
    if group_score != "none":
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E / G]
        if group_score == "top2_sum":
            per_group = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            per_group = grouped.max(dim=-1).values
        group_ids = torch.topk(per_group, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(per_group).scatter_(1, group_ids, 1).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # Sigmoid scores can be negative after the bias: excluded experts must lose to every allowed one.
        fill = float("-inf") if correction_bias is not None else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids
