"""Plain-PyTorch references for DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): the lightning indexer's
scores and top-k selection. Importable without Triton: the test oracle of `gpu_layers.dsa` and the CPU path of the
runtime. The sparse attention itself is `reference.mla_paged_attention` with `selected`.

Rows are query tokens (a decode step: one per sequence; a prefill step: every new token). Row n belongs to
sequence row_seq[n] (its block table row) and may see that sequence's first row_limit[n] tokens (its position + 1:
the causal mask). For each visible token j, with the index-key cache holding k_j [Di] (the LayerNorm'd, rotated
indexer key) and the row's indexer queries q [Hi, Di] and head weights w [Hi] (weights_proj(x) * Hi^-0.5, float32):

    score[n, j] = sum_h w[h] * relu(scale * q[h] . k_j)          (float32 products and sums)

The selection is the top `k` visible tokens by score, in no particular order, padded with -1 where fewer than `k`
tokens are visible (then every visible token is selected). transformers computes the same scores in float32; the
references' FP8 scoring with a Hadamard rotation is a precision choice this runtime does not make.
"""

from __future__ import annotations

import torch

from gpu_layers.reference import gather_context


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_tables: torch.Tensor,
                 row_seq: torch.Tensor, row_limit: torch.Tensor, scale: float, max_context: int) -> torch.Tensor:
    """q [N, Hi, Di], weights [N, Hi] float32, index_cache [num_blocks, page_size, 1, Di], block_tables [B, pages]
    int32, row_seq / row_limit [N] int32 -> float32 scores [N, max_context], -inf from row_limit[n] on."""
    num_rows = q.shape[0]
    scores = torch.full((num_rows, max_context), float("-inf"), dtype=torch.float32, device=q.device)
    seqs, limits = row_seq.tolist(), row_limit.tolist()
    for b in sorted(set(seqs)):
        rows = [n for n in range(num_rows) if seqs[n] == b]
        length = max(limits[n] for n in rows)
        keys = gather_context(index_cache, block_tables[b], length)[:, 0].float()  # [L, Di]
        for n in rows:
            visible = keys[: limits[n]]
            per_head = torch.relu(torch.matmul(q[n].float(), visible.T) * scale)  # [Hi, L_n]
            scores[n, : limits[n]] = torch.matmul(weights[n].float()[None], per_head)[0]
    return scores


def select_topk(scores: torch.Tensor, row_limit: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, L] float32 (-inf where not visible), row_limit [N] -> int32 [N, k]: the positions of each row's
    k best visible scores (all visible positions where there are at most k), -1 padded. (row_limit is
    the kernel's; here the -inf scores say the same.)"""
    width = min(k, scores.shape[1])
    values, indices = scores.topk(width, dim=-1)
    # a row with fewer than k visible tokens gets -inf columns: every visible token is selected, the rest is -1
    indices = torch.where(values == float("-inf"), -1, indices)
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    out[:, :width] = indices.to(torch.int32)
    return out
