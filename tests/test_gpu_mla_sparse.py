"""gpu_layers.mla_sparse against reference.mla_paged_attention with `selected` and against dense mla_decode: every
position selected equals dense attention (decode rows, and prefill rows with their causal prefix); random
selections (distinct, unsorted, -1 anywhere, a row of one token and a row of none) over shuffled pages of 16 and
32 tokens, ragged prefill rows of several sequences in shuffled row order, in float32 and bfloat16, at small, odd,
DeepSeek and GLM dims, with several split counts; the launcher's checks and gate cases; full DeepSeek-V3.2 and GLM-5
sizes and a CUDA-graph replay on the GPU."""

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED, poisoned
from test_gpu_mla import DECODE_LENS, GLM, ODD, REAL, SMALL, assert_matches, expected, make_problem

from gpu_layers import mla, mla_sparse, reference
from gpu_layers.capability import CAPABILITIES, select

# (cached prefix, new tokens) of prefill rows from several sequences: a one-token prompt, chunks after a prefix
# that cross pages, and rows that see more positions than K.
SPARSE_SEQS = [(0, 1), (20, 5), (47, 3), (5, 9)]


def row_positions(p) -> list[tuple[int, int]]:
    """(sequence, position) of every query row, in the problem's token order."""
    lens = zip(p["seq_lens_cpu"], p["query_lens_cpu"], strict=True)
    return [(b, seq_len - new + i) for b, (seq_len, new) in enumerate(lens) for i in range(new)]


def pad_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32, device=DEVICE)


def causal_selection(p, width: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """Every row selects its whole causal prefix (shuffled when gen is given), -1 padded to width."""
    rows = []
    for _, pos in row_positions(p):
        order = torch.randperm(pos + 1, generator=gen) if gen is not None else torch.arange(pos + 1)
        rows.append(order.tolist())
    return pad_rows(rows, width)


def random_selection(p, width: int, seed: int) -> torch.Tensor:
    """Distinct random visible positions per row, -1 padded and the whole row shuffled (-1 anywhere); row 0
    selects one token, row 1 none, and row 2's first 20 entries are -1 (a whole tile of them before any token)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, (_, pos) in enumerate(row_positions(p)):
        count = int(torch.randint(1, min(width, pos + 1) + 1, (), generator=gen))
        count = {0: 1, 1: 0}.get(n, count)
        chosen = torch.randperm(pos + 1, generator=gen)[:count].tolist()
        if n == 2:
            rows.append([-1] * 20 + chosen[: width - 20])
        else:
            row = chosen + [-1] * (width - count)
            rows.append([row[i] for i in torch.randperm(width, generator=gen).tolist()])
    return pad_rows(rows, width)


def row_seq_of(p) -> torch.Tensor:
    return torch.tensor([b for b, _ in row_positions(p)], dtype=torch.int32, device=DEVICE)


def run_sparse(p, row_seq, selected, num_splits=None, rows=None):
    """mla_sparse over the problem's rows, or over them in the order `rows` (the output then in that order)."""
    q_nope, q_rope = p["q_nope"], p["q_rope"]
    if rows is not None:
        q_nope, q_rope, row_seq, selected = q_nope[rows], q_rope[rows], row_seq[rows], selected[rows]
    num_rows, num_heads = q_nope.shape[:2]
    out = poisoned(num_rows, num_heads, p["v_head_dim"], dtype=q_nope.dtype)
    result = mla_sparse.mla_sparse(q_nope, q_rope, p["latent_cache"], p["w_kv_b"], p["block_tables"], row_seq,
                                   selected, p["scale"], p["v_head_dim"], num_splits=num_splits, out=out)
    assert result is out
    return out


def expected_sparse(p, selected):
    f = {k: p[k].float() for k in ("q_nope", "q_rope", "latent_cache", "w_kv_b")}
    return reference.mla_paged_attention(f["q_nope"], f["q_rope"], f["latent_cache"], f["w_kv_b"], p["block_tables"],
                                         p["seq_lens_cpu"], p["query_lens_cpu"], p["scale"], p["v_head_dim"],
                                         selected=selected)


def check_random(p, selected, dtype, num_splits=None, seed=0):
    """Runs the rows in a shuffled order; rows that select nothing must be zeros, the rest match the oracle."""
    rows = torch.randperm(selected.shape[0], generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    shuffled = run_sparse(p, row_seq_of(p), selected, num_splits, rows)
    out = torch.empty_like(shuffled)
    out[rows] = shuffled
    is_empty = (selected < 0).all(1)
    assert torch.equal(out[is_empty], torch.zeros_like(out[is_empty])), "a row that selects nothing is not zeros"
    assert_matches(out[~is_empty], expected_sparse(p, selected)[~is_empty], dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_every_position_selected_equals_dense_decode(num_splits):
    p = make_problem([(n - 1, 1) for n in DECODE_LENS], 16, SMALL, torch.float32, seed=60)
    width = max(DECODE_LENS) + 3  # not a power of two, the tail all -1
    selected = causal_selection(p, width, torch.Generator().manual_seed(61))
    out = run_sparse(p, row_seq_of(p), selected, num_splits)
    dense = mla.mla_decode(p["q_nope"], p["q_rope"], p["latent_cache"], p["w_kv_b"], p["block_tables"],
                           p["seq_lens"], p["scale"], p["v_head_dim"])
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    assert_matches(out, expected(p), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_prefix_selected_equals_dense_prefill(dtype):
    # pages of 16: the prefixes span pages and the chunk after 47 crosses one
    p = make_problem(SPARSE_SEQS, 16, SMALL, dtype, seed=62)
    selected = causal_selection(p, max(p["seq_lens_cpu"]))
    assert_matches(run_sparse(p, row_seq_of(p), selected), expected(p), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_random_selection(dtype, page_size, num_splits):
    seed = 70 + page_size + (num_splits or 0)
    p = make_problem(SPARSE_SEQS, page_size, SMALL, dtype, seed=seed)
    check_random(p, random_selection(p, 37, seed), dtype, num_splits, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_dims(dtype):
    p = make_problem(SPARSE_SEQS, 16, ODD, dtype, seed=80)
    check_random(p, random_selection(p, 29, 80), dtype, num_splits=3, seed=80)


@pytest.mark.parametrize("dims", [REAL, GLM], ids=["deepseek", "glm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dims(dims, dtype):
    """R = 512, Dr = 64 with DeepSeek-V3.2's Dn = Dv = 128 and GLM-5's Dn = 192, Dv = 256 (3 heads: part of a
    head block)."""
    p = make_problem([(0, 2), (40, 2), (16, 1)], 16, dims, dtype, seed=81)
    check_random(p, random_selection(p, 24, 81), dtype, num_splits=2, seed=81)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_padded_slots_give_zeros(num_splits):
    """Rows that select nothing (a captured graph's padded slots) yield zeros, never NaN, whatever the split; a
    selection of width 0 too."""
    p = make_problem([(6, 1), (16, 1)], 16, SMALL, torch.float32, seed=82)
    out = run_sparse(p, row_seq_of(p), pad_rows([[], []], 40), num_splits)
    assert torch.equal(out, torch.zeros_like(out))
    out = run_sparse(p, row_seq_of(p), pad_rows([[], []], 0))
    assert torch.equal(out, torch.zeros_like(out))


def test_default_num_splits():
    # A prefill's rows already cover the GPU: no splits.
    assert mla_sparse.default_num_splits(4096, 2, 2048, 32, 132) == 1
    assert mla_sparse.default_num_splits(132, 1, 2048, 16, 132) == 1
    # Batch 1 about fills the GPU with its two head blocks (DeepSeek-V3.2) or one (GLM-5): splits of two tiles, up
    # to the cap.
    assert mla_sparse.default_num_splits(1, 2, 2048, 32, 132) == 32
    assert mla_sparse.default_num_splits(1, 1, 2048, 16, 188) == mla.MAX_SPLITS
    assert mla_sparse.default_num_splits(8, 2, 2048, 32, 132) == 8
    assert mla_sparse.default_num_splits(8, 1, 2048, 32, 132) == 16
    # A short selection is not split past two tiles a split.
    assert mla_sparse.default_num_splits(1, 2, 40, 16, 132) == 2


def test_launcher_errors():
    p = make_problem([(3, 1), (7, 1)], 16, SMALL, torch.float32)
    row_seq, selected = row_seq_of(p), causal_selection(p, 8)
    names = ("q_nope", "q_rope", "latent_cache", "w_kv_b", "block_tables")

    def call(**changes):
        args = {k: p[k] for k in names} | dict(row_seq=row_seq, selected=selected) | changes
        return mla_sparse.mla_sparse(**args, scale=0.1, v_head_dim=32)

    with pytest.raises(ValueError, match="row_seq must be \\[2\\] int32"):
        call(row_seq=row_seq.long())
    with pytest.raises(ValueError, match="row_seq must be \\[2\\] int32"):
        call(row_seq=row_seq[:1])
    with pytest.raises(ValueError, match="selected must be \\[2, K\\] int32"):
        call(selected=selected[:, 0])
    with pytest.raises(ValueError, match="selected must be \\[2, K\\] int32"):
        call(selected=selected.long())
    with pytest.raises(ValueError, match="selected must be contiguous"):
        call(selected=selected.t().contiguous().t())
    with pytest.raises(ValueError, match="block_tables"):
        call(block_tables=p["block_tables"].long())
    with pytest.raises(ValueError, match="w_kv_b"):
        call(w_kv_b=p["w_kv_b"][:-1])
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=mla.MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(2, 4, 16, device=DEVICE))


def test_gate_cases_cover_every_config_and_dtype():
    cases = mla_sparse.gate_cases()
    kernels = {mla_sparse.mla_sparse_kernel, mla.mla_decode_reduce_kernel}
    assert {(c.kernel, c.capability) for c in cases} == {(k, cc) for k in kernels for cc in CAPABILITIES}
    # one R and Dr for both models: the kernel and its reduce per capability and dtype
    assert len({c.label + str(c.capability) for c in cases}) == len(cases) == 2 * 3 * len(CAPABILITIES)
    for case in cases:
        if case.kernel is mla_sparse.mla_sparse_kernel:
            cfg = select(mla_sparse.SPARSE_CONFIGS, case.capability)[2 if "fp32" not in case.label else 4]
            assert (case.constexprs["BLOCK_H"], case.constexprs["BLOCK_N"]) == (cfg.block_h, cfg.block_n)
            assert (case.num_warps, case.num_stages) == (cfg.num_warps, cfg.num_stages)
        assert set(case.signature) == set(case.kernel.arg_names), case.label
        assert {k for k, v in case.signature.items() if v == "constexpr"} == set(case.constexprs), case.label


# ---------------------------------------------------------------------------------------------- full size, GPU


def full_problem(dims, seed):
    """Decode rows at 1, 100, 3000 and 5000 tokens and prefill rows after an 4000-token prefix, K = 2048."""
    p = make_problem([(0, 1), (99, 1), (2999, 1), (4000, 60), (4999, 1)], 64, dims, torch.bfloat16, seed=seed)
    return p, random_selection(p, mla_sparse.INDEX_TOPK, seed)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("model", list(mla_sparse.GATED_MODELS))
def test_full_size(model):
    p, selected = full_problem(mla_sparse.GATED_MODELS[model], 90)
    for num_splits in (None, 1, 7):
        check_random(p, selected, torch.bfloat16, num_splits)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_replays_in_a_cuda_graph():
    """Captured with other selections and queries, replayed after they change in place: nothing is baked in."""
    p, selected = full_problem(mla_sparse.DEEPSEEK_V3_2, 91)
    p["q_nope"], p["q_rope"] = p["q_nope"][-1:], p["q_rope"][-1:]  # one decode row: the split path
    selected, row_seq = selected[-1:].clone(), torch.tensor([4], dtype=torch.int32, device=DEVICE)
    captured_selected, q_nope = selected.clone(), p["q_nope"].clone()
    selected[:, 1:] = -1
    p["q_nope"].normal_()
    out = torch.empty(1, 128, 128, dtype=torch.bfloat16, device=DEVICE)

    def step():
        mla_sparse.mla_sparse(p["q_nope"], p["q_rope"], p["latent_cache"], p["w_kv_b"], p["block_tables"], row_seq,
                              selected, p["scale"], p["v_head_dim"], out=out)

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    selected.copy_(captured_selected)
    p["q_nope"].copy_(q_nope)
    graph.replay()
    p["seq_lens_cpu"], p["query_lens_cpu"] = [5000], [1]
    p["block_tables"] = p["block_tables"][4:]
    assert_matches(out, expected_sparse(p, selected), torch.bfloat16)
