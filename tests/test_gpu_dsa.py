"""gpu_layers.dsa (the DSA lightning indexer) against gpu_layers.dsa_reference: the scores over shuffled pages of
16 and 32 tokens, prefill-like and decode-like rows of several sequences, in float32 (tight) and bfloat16, at
V3.2's head dim and a small one, few and odd head counts; the top-k selection exactly as the reference's (fewer,
exactly and more than k visible, k = 1 and k not a power of two, ties away from and at the boundary, all equal,
mostly exact zeros, keys that differ in the last radix digit, small tiles); index_topk end to end with its row
chunking and on zero-tied scores; the launchers' checks; a CUDA-graph replay on the GPU."""

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


def hide(scores, row_limit, value=float("-inf")):
    hidden = torch.arange(scores.shape[1], device=scores.device)[None, :] >= row_limit[:, None]
    return scores.masked_fill(hidden, value)


def run_select(scores, limits, k):
    """select_topk against the reference, exactly: positions in order, boundary ties to the lowest. The kernel
    sees +inf past each row's limit (never to be read), the reference -inf (its only notion of a limit)."""
    row_limit = torch.tensor(limits, dtype=torch.int32, device=DEVICE)
    scores = scores.to(DEVICE)
    out = torch.full((len(limits), k), -7, dtype=torch.int32, device=DEVICE)
    assert dsa.select_topk(hide(scores, row_limit, float("inf")), row_limit, k, out=out) is out
    expected = dsa_reference.select_topk(hide(scores, row_limit), row_limit, k)
    for n in range(len(limits)):
        assert torch.equal(out[n].cpu(), expected[n].cpu()), f"row {n} (limit {limits[n]}) differs"
    return out.cpu()


def test_reference_select_contract():
    """The oracle itself: the k best in position order, the first of the tied ones, -1 padded; ±0 are equal."""
    scores = torch.tensor([[3.0, 0.0, -0.0, 1.0, 0.0, 5.0, -2.0], [1.0, 2.0, *[float("-inf")] * 5]])
    out = dsa_reference.select_topk(scores, torch.tensor([7, 2]), 5)
    assert out.tolist() == [[0, 1, 2, 3, 5], [0, 1, -1, -1, -1]]


@pytest.mark.parametrize("k", [1, 37, 64, 300])
def test_select_fewer_exact_and_more_than_k(k):
    """Rows with 0, 1, k - 1, k, k + 1 and many visible; negative and positive scores over several tiles."""
    limits = [0, 1, max(k - 1, 1), k, k + 1, 5000, 2049]
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(len(limits), 5000, generator=gen) * torch.logspace(-3, 3, 5000)[torch.randperm(5000)]
    run_select(scores, limits, k)


def test_select_row_without_tokens_is_all_padding():
    out = run_select(torch.randn(2, 40), [0, 40], 50)
    assert (out[0] == -1).all() and out[1][:40].tolist() == list(range(40)) and (out[1][40:] == -1).all()


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
    """The k-th largest is one of many equal scores spread over every tile: the first of them fill the last
    slots, every higher one is taken; zeros of both signs; greater scores after the equal ones."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.where(torch.rand(4, 4000, generator=gen) < 0.5, 2.0, torch.rand(4, 4000, generator=gen))
    scores[1] = torch.where(scores[1] == 2.0, 0.0, -scores[1])
    scores[1, ::3] = -0.0
    scores[2, :100] = 5.0
    scores[3] = torch.where(torch.rand(4000, generator=gen) < 0.75, 1.0, torch.rand(4000, generator=gen) * 0.5)
    scores[3, -200:] = 1.01
    out = run_select(scores, [4000, 3999, 4000, 4000], 1000)
    assert set(range(100)) <= set(out[2].tolist()) and set(range(3800, 4000)) <= set(out[3].tolist())


def test_select_all_equal():
    """Every visible score equal (one bucket in every pass): the first k positions."""
    out = run_select(torch.full((3, 3000), 0.75), [3000, 2048, 1500], 1100)
    assert out[0].tolist() == list(range(1100)) and out[2].tolist() == list(range(1100))


def test_select_mostly_zeros():
    """ReLU-weighted sums: a few positive scores, a few negative (negative head weights), and exact zeros of
    both signs everywhere else; the k-th largest is a zero (most rows) or a positive (the last)."""
    gen = torch.Generator().manual_seed(11)
    draw = torch.rand(4, 6000, generator=gen)
    scores = torch.where(draw < 0.02, torch.rand(4, 6000, generator=gen), torch.where(draw < 0.03, -1.0, 0.0))
    scores = torch.where(torch.rand(4, 6000, generator=gen) < 0.3, -scores, scores)
    scores[:, 1::5] = torch.where(scores[:, 1::5] == 0, -0.0, scores[:, 1::5])
    scores[3] = torch.where(draw[3] < 0.5, torch.rand(6000, generator=gen) + 0.1, 0.0)
    run_select(scores, [6000, 5999, 2100, 6000], 2048)


def test_select_keys_differ_in_the_last_digit():
    """Scores whose bit patterns share their top 24 bits (1.0 and the next 255 floats; negated; both): every
    pass narrows, the last one decides; duplicates among them."""
    gen = torch.Generator().manual_seed(12)
    bits = 0x3F800000 + torch.randint(0, 256, (3, 4000), generator=gen, dtype=torch.int32)
    scores = bits.view(torch.float32).clone()
    scores[1] = -scores[1]
    scores[2, ::2] = -scores[2, ::2]
    run_select(scores, [4000, 4000, 3333], 1500)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_select_wide_range():
    """Magnitudes past float16's range and below it, of both signs."""
    gen = torch.Generator().manual_seed(6)
    magnitude = 10.0 ** (torch.rand(2, 3000, generator=gen) * 20 - 10)
    scores = magnitude * torch.where(torch.rand(2, 3000, generator=gen) < 0.3, -1.0, 1.0)
    run_select(scores, [3000, 1500], 513)


def test_select_small_tiles(monkeypatch):
    """Tiles of 64 and offsets summed 4 tiles a step: the gather's loop over earlier tiles runs many times;
    ties split across tiles; k larger than L."""
    for capability in dsa.SELECT_CONFIGS:
        monkeypatch.setitem(dsa.SELECT_CONFIGS, capability, dsa.SelectConfig(64, 4, 4))
    gen = torch.Generator().manual_seed(13)
    scores = torch.randint(0, 6, (3, 1000), generator=gen).float()
    run_select(scores, [1000, 900, 700], 555)
    run_select(scores[:, :700], [700, 650, 1], 1000)


def test_index_topk_in_chunks():
    """End to end against the reference select of the kernels' own scores (bitwise the fused kernel's), with one
    chunk and with chunks of 2 rows (a partial last one); ragged rows with fewer and more than k visible, pages
    of 16 (positions cross page boundaries)."""
    p = make_problem([(300, 3), (200, 1), (40, 2), (150, 1)], 16, 8, 64, torch.float32, seed=8, max_context=320)
    k = 50
    expected = dsa_reference.select_topk(dsa.index_scores(**p).cpu(), p["row_limit"].cpu(), k)
    row_bytes = dsa.workspace_bytes_per_row(p["max_context"], dsa.SELECT_CONFIGS[120].block_g)
    budgets = {"one chunk": dsa.SCORE_BUDGET_BYTES, "2 rows": 2 * row_bytes + 7}
    assert dsa.rows_per_chunk(7, row_bytes, budgets["2 rows"]) == 2
    for budget in budgets.values():
        out = torch.full((7, k), -7, dtype=torch.int32, device=DEVICE)
        assert dsa.index_topk(**p, k=k, out=out, budget_bytes=budget) is out
        assert torch.equal(out.cpu(), expected)


def test_index_topk_matches_reference_scores():
    """Against the reference scores themselves (their top k is clear of rounding), in bfloat16 at V3.2's dims."""
    p = make_problem([(700, 2), (90, 1)], 32, dsa.MAX_HEADS, 128, torch.bfloat16, seed=9)
    expected = dsa_reference.select_topk(reference_scores(p), p["row_limit"], 64)
    assert torch.equal(dsa.index_topk(**p, k=64).cpu(), expected.cpu())


def test_index_topk_zero_ties():
    """Keys shifted along u and every query -u (positive head weights): all but a few scores are exact zeros in
    kernel and reference alike, so the selection is the positive ones, then the first zeros by position."""
    p = make_problem([(900, 3), (130, 1), (600, 2)], 16, 4, 32, torch.float32, seed=14)
    gen = torch.Generator().manual_seed(14)
    u = torch.nn.functional.normalize(torch.randn(32, generator=gen), dim=0).to(DEVICE)
    p["index_cache"] = p["index_cache"] + 2 * u
    p["q"] = (-u).expand_as(p["q"]).contiguous()
    p["weights"] = p["weights"].abs()
    ref = reference_scores(p)
    num_positive = (ref > 0).sum(-1)
    assert (num_positive > 0).all() and (num_positive < 128).all() and (p["row_limit"] > 128).all()
    expected = dsa_reference.select_topk(ref, p["row_limit"], 128)
    assert torch.equal(dsa.index_topk(**p, k=128).cpu(), expected.cpu())


def test_rows_per_chunk():
    row_bytes = dsa.workspace_bytes_per_row(131072, 1024)
    assert row_bytes == 4 * (131072 + 128 * dsa.TILE_STRIDE + dsa.ROW_STRIDE)
    assert dsa.rows_per_chunk(8192, row_bytes, dsa.SCORE_BUDGET_BYTES) == 405
    assert dsa.rows_per_chunk(4, row_bytes, dsa.SCORE_BUDGET_BYTES) == 4
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
        assert torch.equal(out, dsa.index_topk(**p, k=2048))
