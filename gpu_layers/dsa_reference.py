"""Plain-PyTorch references for DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): the lightning indexer's
scores and top-k selection. Importable without Triton: the test oracle of `gpu_layers.dsa` and the CPU path of the
runtime. The sparse attention itself is `reference.mla_paged_attention` with `selected`.

Rows are query tokens (a decode step: one per sequence; a prefill step: every new token). Row n belongs to
sequence row_seq[n] (its block table row) and may see that sequence's first row_limit[n] tokens (its position + 1:
the causal mask). For each visible token j, with the index-key cache holding k_j [Di] (the LayerNorm'd, rotated
indexer key) and the row's indexer queries q [Hi, Di] and head weights w [Hi] (weights_proj(x) * Hi^-0.5, float32):

    score[n, j] = sum_h w[h] * relu(scale * q[h] . k_j)          (float32 products and sums)

The selection is the top `k` visible tokens by score in increasing position order (of the tokens tied at the k-th
best score, the first), padded with -1 where fewer than `k` tokens are visible (then every visible token is
selected). transformers computes the same scores in float32; the references' FP8 scoring with a Hadamard rotation
is a precision choice this runtime does not make.
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
    k best visible scores (all visible positions where there are at most k) in increasing order, -1 padded. Of
    the scores equal to the k-th best, the lowest positions are taken. (row_limit is the kernel's; here the -inf
    scores say the same.)"""
    num_rows, width = scores.shape
    if width == 0:
        return torch.full((num_rows, k), -1, dtype=torch.int32, device=scores.device)
    kth = scores.topk(min(k, width), dim=-1).values[:, -1:]  # -inf in a row with fewer than k visible
    is_above = scores > kth
    is_tie = (scores == kth) & (kth > float("-inf"))
    wanted = min(k, width) - is_above.sum(-1, keepdim=True)
    is_taken = is_above | (is_tie & (is_tie.cumsum(-1) <= wanted))
    rows, positions = is_taken.nonzero(as_tuple=True)  # row-major: positions increase within a row
    out = torch.full((num_rows, k), -1, dtype=torch.int32, device=scores.device)
    out[rows, is_taken.cumsum(-1)[rows, positions] - 1] = positions.to(torch.int32)
    return out
