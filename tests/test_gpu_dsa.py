"""gpu_layers.dsa (the DSA lightning indexer) against gpu_layers.dsa_reference: the scores over shuffled pages of
16 and 32 tokens, prefill-like and decode-like rows of several sequences, in float32 (tight) and bfloat16, at
V3.2's head dim and a small one, few and odd head counts; the top-k selection as sets (fewer, exactly and more than
k visible, k = 1 and k not a power of two, ties away from and at the boundary, one coarse bin holding everything);
index_topk end to end with its row chunking; the launchers' checks; a CUDA-graph replay on the GPU."""

import math

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import dsa, dsa_reference

# (context length, rows): a prefill-like sequence has rows for its last `rows` positions (row_limit =
# position + 1), a decode-like one a single row seeing all of it. One row of 1 visible token.
SEQS = [(1, 1), (37, 1), (50, 12), (16, 3), (131, 1), (96, 5)]


def make_problem(seqs, page_size, num_heads, head_dim, dtype, seed=0, max_context=None):
    """Random index keys for each sequence in shuffled pages away from page 0 (tables are padded with 0, so a
    wrong page cannot pass by accident); rows interleaved across sequences. Returns the launchers' arguments."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [math.ceil(length / page_size) for length, _ in seqs]
    num_pages = sum(pages_needed) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    max_context = max_context or max(length for length, _ in seqs)
    width = max(max(pages_needed) + 2, math.ceil(max_context / page_size))  # tables span max_context
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, n in enumerate(pages_needed):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    rows = [(b, length - i) for b, (length, count) in enumerate(seqs) for i in range(count)]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    num_rows = len(rows)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(DEVICE)

    return dict(
        q=rand(num_rows, num_heads, head_dim),
        weights=(torch.randn(num_rows, num_heads, generator=gen) * num_heads**-0.5).to(DEVICE),
        index_cache=rand(num_pages, page_size, 1, head_dim),
        block_tables=tables.to(DEVICE),
        row_seq=torch.tensor([b for b, _ in rows], dtype=torch.int32, device=DEVICE),
        row_limit=torch.tensor([limit for _, limit in rows], dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
        max_context=max_context,
    )


def reference_scores(p):
    f = {name: p[name].float() for name in ("q", "index_cache")}
    return dsa_reference.index_scores(f["q"], p["weights"], f["index_cache"], p["block_tables"], p["row_seq"],
                                      p["row_limit"], p["scale"], p["max_context"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_heads,head_dim", [(4, 32), (32, 128), (3, 128)])
def test_scores(dtype, page_size, num_heads, head_dim):
    p = make_problem(SEQS, page_size, num_heads, head_dim, dtype, seed=page_size + num_heads,
                     max_context=200 if num_heads == 4 else None)
    out = poisoned(p["q"].shape[0], p["max_context"])
    assert dsa.index_scores(**p, out=out) is out
    ref = reference_scores(p)
    hidden = torch.arange(p["max_context"], device=DEVICE)[None, :] >= p["row_limit"][:, None]
    assert torch.equal(torch.isneginf(out), hidden)
    # bf16 inputs reach both as the same values, products are exact in float32: only the summation order differs.
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-4, atol=1e-5)


def test_scores_v32_heads():
    p = make_problem([(70, 2), (9, 1)], 16, dsa.MAX_HEADS, 128, torch.bfloat16, seed=7)
    torch.testing.assert_close(dsa.index_scores(**p), reference_scores(p), rtol=1e-4, atol=1e-5)


def assert_valid_topk(out, scores, row_limit, k):
    """The selection contract: per row, min(k, limit) distinct visible positions whose scores are all >= the
    k-th largest visible score, then -1; and the reference's very set where the boundary is not a tie."""
    expected = dsa_reference.select_topk(scores, row_limit, k)
    for n, limit in enumerate(row_limit.tolist()):
        taken = out[n][out[n] >= 0]
        assert taken.numel() == min(k, limit) and (out[n] < 0).sum() == k - taken.numel(), f"row {n}: count"
        assert taken.unique().numel() == taken.numel() and (taken < limit).all(), f"row {n}: positions"
        if limit <= k:
            continue
        ordered = scores[n, :limit].sort(descending=True).values
        assert (scores[n, taken.long()] >= ordered[k - 1]).all(), f"row {n}: not the top {k}"
        if ordered[k - 1] != ordered[k]:
            assert set(taken.tolist()) == set(expected[n].tolist()), f"row {n}: differs from the reference"


def hide(scores, row_limit):
    hidden = torch.arange(scores.shape[1], device=scores.device)[None, :] >= row_limit[:, None]
    return scores.masked_fill(hidden, float("-inf"))


def run_select(scores, limits, k):
    row_limit = torch.tensor(limits, dtype=torch.int32, device=DEVICE)
    scores = hide(scores.to(DEVICE), row_limit)
    out = torch.full((len(limits), k), -7, dtype=torch.int32, device=DEVICE)
    assert dsa.select_topk(scores, row_limit, k, out=out) is out
    assert_valid_topk(out.cpu(), scores.cpu(), row_limit.cpu(), k)
    return out.cpu()


@pytest.mark.parametrize("k", [1, 37, 64, 300])
def test_select_fewer_exact_and_more_than_k(k):
    """Rows with 0, 1, k - 1, k, k + 1 and many visible; negative and positive scores over several gather tiles."""
    limits = [0, 1, max(k - 1, 1), k, k + 1, 5000, 2049]
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(len(limits), 5000, generator=gen) * torch.logspace(-3, 3, 5000)[torch.randperm(5000)]
    run_select(scores, limits, k)


def test_select_row_without_tokens_is_all_padding():
    out = run_select(torch.randn(2, 40), [0, 40], 50)
    assert (out[0] == -1).all() and sorted(out[1][:40].tolist()) == list(range(40)) and (out[1][40:] == -1).all()


def test_select_many_equal_scores_away_from_the_boundary():
    """Most of the row shares one score below the top k, some above it share another."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.full((2, 3000), 0.25)
    scores[:, ::7] = 9.0  # 429 equal scores, all selected
    top = torch.randperm(3000, generator=gen)[:200]
    scores[0, top] = 1 + torch.rand(200, generator=gen)  # distinct, then the 9.0s: k = 629 ends on a gap
    scores[1, 1500:] = -scores[1, 1500:]
    run_select(scores, [3000, 2800], 629)


def test_select_ties_at_the_boundary():
    """The k-th largest is one of many equal scores: any of them may fill the last slots (checked by the
    contract), never a lower one, every higher one taken; also with zeros of both signs."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.where(torch.rand(4, 4000, generator=gen) < 0.5, 2.0, torch.rand(4, 4000, generator=gen))
    scores[1] = torch.where(scores[1] == 2.0, 0.0, -scores[1])
    scores[1, ::3] = -0.0
    scores[2, :100] = 5.0
    # Greater scores in the boundary's own coarse bin, after its equal ones in position order.
    scores[3] = torch.where(torch.rand(4000, generator=gen) < 0.75, 1.0, torch.rand(4000, generator=gen) * 0.5)
    scores[3, -200:] = 1.01
    out = run_select(scores, [4000, 3999, 4000, 4000], 1000)
    assert set(range(100)) <= set(out[2].tolist()) and set(range(3800, 4000)) <= set(out[3].tolist())


def test_select_one_coarse_bin_holds_everything():
    """Scores within a quarter octave: every visible position is a candidate, more than a refining block
    (BLOCK_R) holds, so the candidates are re-read in blocks; ties among them too."""
    gen = torch.Generator().manual_seed(5)
    scores = 1.0 + torch.rand(2, 9000, generator=gen) * 0.1
    scores[1, 4000:4500] = scores[1, 4000]
    assert dsa.SELECT_CONFIGS[120].block_r < 9000
    run_select(scores, [9000, 8999], 777)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's float16 rounding to inf
def test_select_wide_range():
    """Magnitudes past float16's range (coarse bins saturate) and below it (subnormal and flushed bins)."""
    gen = torch.Generator().manual_seed(6)
    magnitude = 10.0 ** (torch.rand(2, 3000, generator=gen) * 20 - 10)
    scores = magnitude * torch.where(torch.rand(2, 3000, generator=gen) < 0.3, -1.0, 1.0)
    run_select(scores, [3000, 1500], 513)


def test_index_topk_in_chunks():
    """End to end against select_topk of the kernels' own scores (bitwise the fused kernel's), with one chunk and
    with chunks of 2 rows (a partial last one); rows with fewer and more than k visible."""
    p = make_problem([(300, 3), (200, 1), (40, 2), (150, 1)], 16, 8, 64, torch.float32, seed=8, max_context=320)
    k = 50
    scores = dsa.index_scores(**p)
    budgets = {"one chunk": dsa.SCORE_BUDGET_BYTES, "2 rows": 8 * p["max_context"] * 2 + 7}
    assert dsa.rows_per_chunk(7, p["max_context"], budgets["2 rows"]) == 2
    for budget in budgets.values():
        out = torch.full((7, k), -7, dtype=torch.int32, device=DEVICE)
        assert dsa.index_topk(**p, k=k, out=out, budget_bytes=budget) is out
        assert_valid_topk(out.cpu(), scores.cpu(), p["row_limit"].cpu(), k)


def test_index_topk_matches_reference_scores():
    """Against the reference scores themselves (their top k is clear of rounding), in bfloat16 at V3.2's dims."""
    p = make_problem([(700, 2), (90, 1)], 32, dsa.MAX_HEADS, 128, torch.bfloat16, seed=9)
    ref = reference_scores(p)
    expected = dsa_reference.select_topk(ref, p["row_limit"], 64)
    out = dsa.index_topk(**p, k=64)
    for n in range(3):
        assert set(out[n].tolist()) == set(expected[n].tolist())


def test_rows_per_chunk():
    assert dsa.rows_per_chunk(8192, 131072, dsa.SCORE_BUDGET_BYTES) == 256
    assert dsa.rows_per_chunk(4, 131072, dsa.SCORE_BUDGET_BYTES) == 4
    assert dsa.rows_per_chunk(4, 1 << 30, dsa.SCORE_BUDGET_BYTES) == 1


def test_launcher_errors():
    p = make_problem([(20, 2)], 16, 4, 32, torch.float32)

    def scores(**changes):
        return dsa.index_scores(**(p | changes))

    with pytest.raises(ValueError, match="q must be bf16"):
        scores(q=p["q"].double())
    with pytest.raises(ValueError, match="65 heads"):
        scores(q=torch.zeros(2, 65, 32, device=DEVICE), weights=torch.zeros(2, 65, device=DEVICE))
    with pytest.raises(ValueError, match="heads of 256"):
        scores(q=torch.zeros(2, 4, 256, device=DEVICE))
    with pytest.raises(ValueError, match="weights"):
        scores(weights=p["weights"].half())
    with pytest.raises(ValueError, match="index_cache must be \\[num_blocks"):
        scores(index_cache=p["index_cache"][..., :16])
    with pytest.raises(ValueError, match="index_cache must be torch.float32"):
        scores(index_cache=p["index_cache"].half())
    with pytest.raises(ValueError, match="block_tables"):
        scores(block_tables=p["block_tables"].long())
    with pytest.raises(ValueError, match="row_seq"):
        scores(row_seq=p["row_seq"][:1])
    with pytest.raises(ValueError, match="row_limit"):
        scores(row_limit=p["row_limit"].long())
    capacity = p["block_tables"].shape[1] * 16
    with pytest.raises(ValueError, match=f"max_context must be 1..{capacity}"):
        scores(max_context=capacity + 1)
    with pytest.raises(ValueError, match="out must be"):
        scores(out=torch.empty(2, 19, device=DEVICE))
    with pytest.raises(ValueError, match="k must be >= 1"):
        dsa.index_topk(**p, k=0)
    with pytest.raises(ValueError, match="scores must be"):
        dsa.select_topk(torch.zeros(2, 8, dtype=torch.float16, device=DEVICE), p["row_limit"], 4)
    with pytest.raises(ValueError, match="out must be"):
        dsa.select_topk(torch.zeros(2, 8, device=DEVICE), p["row_limit"], 4, out=torch.empty(2, 5, device=DEVICE))


@pytest.mark.skipif(IS_INTERPRETED, reason="CUDA graphs need a GPU")
def test_index_topk_cuda_graph_replay():
    """Captured once at max_context, replayed with other limits: the same selection as an eager run."""
    p = make_problem([(3000, 2), (600, 1)], 64, dsa.MAX_HEADS, 128, torch.bfloat16, seed=10, max_context=4096)
    out = torch.empty(3, 2048, dtype=torch.int32, device=DEVICE)
    dsa.index_topk(**p, k=2048, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsa.index_topk(**p, k=2048, out=out)
    for limits in ([3000, 2999, 600], [2100, 17, 599]):
        p["row_limit"].copy_(torch.tensor(limits, dtype=torch.int32))
        graph.replay()
        expected = dsa.index_topk(**p, k=2048)
        for n in range(3):
            assert set(out[n].tolist()) == set(expected[n].tolist())
