"""gpu_layers.attention (paged GQA decode and prefill) against gpu_layers.reference.paged_attention in float64.

The caches are NaN everywhere a sequence does not own (slots past its end, unused pages), so a kernel that reads
or weighs one key too many fails; outputs start as NaN, so an unwritten element fails too."""

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import attention, reference

MIXED_LENS = [1, 15, 16, 17, 33, 100]


def make_paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, seed=0, v_head_dim=None):
    """K/V caches [pages, P, Hkv, D] (V [.., v_head_dim], default D) holding each sequence's random entries on
    scattered pages, NaN elsewhere, and block tables [B, pages + 1] (a padding column of page 0)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen)
    shape = (num_pages, page_size, num_kv_heads)
    k_cache = torch.full((*shape, head_dim), float("nan"), dtype=torch.float64)
    v_cache = torch.full((*shape, v_head_dim or head_dim), float("nan"), dtype=torch.float64)
    tables = torch.zeros(len(seq_lens), max(pages_per_seq) + 1, dtype=torch.int32)
    start = 0
    for b, (seq_len, num) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        tables[b, :num] = order[start:start + num].int()
        start += num
        for cache in (k_cache, v_cache):
            dim = cache.shape[-1]
            flat = cache[tables[b, :num].long()].view(-1, num_kv_heads, dim)
            flat[:seq_len] = torch.randn(seq_len, num_kv_heads, dim, generator=gen, dtype=torch.float64)
            cache[tables[b, :num].long()] = flat.view(num, page_size, num_kv_heads, dim)
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), tables.to(DEVICE)


def expected(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window=None):
    """The float64 reference on the same (rounded) inputs."""
    return reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, query_lens,
                                     scale, window)


def check(out, ref, dtype):
    assert not out.isnan().any(), "unwritten or NaN output"
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    else:  # bf16/fp16 operands and probabilities: about 3e-3 relative
        error = (out.double() - ref).norm() / ref.norm()
        assert error < 1e-2, f"relative error {error:.2e}"
        torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def run_decode(seq_lens, group, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, window=None,
               num_splits=None, seed=0):
    k_cache, v_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), group * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, num_splits,
                                           out=poisoned(*q.shape, dtype=dtype))
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, [1] * len(seq_lens), scale, window), dtype)


def run_prefill(seq_lens, query_lens, group, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32,
                window=None, seed=0):
    k_cache, v_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, page_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), group * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, max(query_lens), scale,
                                            window, out=poisoned(*q.shape, dtype=dtype))
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window), dtype)


# ------------------------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_mixed_lengths(page_size, group, head_dim):
    run_decode(MIXED_LENS, group, head_dim=head_dim, page_size=page_size, num_splits=3)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 5, 16])
def test_decode_num_splits(num_splits):
    """16 splits is more partitions than most of these sequences have pages: the empty ones must not count."""
    run_decode([1, 17, 100], group=4, num_splits=num_splits)


def test_decode_more_splits_than_one_reduce_step():
    """24 one-tile partials of the 600-token sequence: the reduce combines them over two steps of SPLIT_BLOCK."""
    assert attention.SPLIT_BLOCK < 24
    run_decode([1, 100, 600], group=2, num_splits=24)


def test_decode_reduce_rescales_across_steps():
    """Partials whose maxima rise from step to step of the reduce (so earlier steps must be rescaled), with empty
    partials (max -inf, sum 0) among them."""
    num_seqs, num_heads, num_splits, head_dim = 2, 3, 37, 64
    gen = torch.Generator().manual_seed(3)
    part_max = torch.arange(num_splits, dtype=torch.float32).repeat(num_seqs, num_heads, 1) * 0.7
    part_max[:, :, 5::4] = float("-inf")
    part_sum = torch.rand(num_seqs, num_heads, num_splits, generator=gen) + 0.5
    part_acc = torch.randn(num_seqs, num_heads, num_splits, head_dim, generator=gen)
    part_sum[part_max.isinf()] = 0.0
    part_acc[part_max.isinf()] = 0.0
    weight = torch.exp2(part_max - part_max.amax(-1, keepdim=True))
    want = (weight[..., None] * part_acc).sum(2) / (weight * part_sum).sum(2)[..., None]
    out = poisoned(num_seqs, num_heads, head_dim)
    attention.paged_decode_reduce_kernel[(num_seqs, num_heads)](
        part_acc.to(DEVICE), part_max.to(DEVICE), part_sum.to(DEVICE), part_max.to(DEVICE), out, num_splits,
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, D_PAD=head_dim, SPLIT_BLOCK=attention.SPLIT_BLOCK,
        HAS_SINKS=False)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 8, 20])
def test_decode_sliding_window(window):
    run_decode(MIXED_LENS, group=4, window=window, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype):
    run_decode(MIXED_LENS, group=8, head_dim=128, dtype=dtype, num_splits=2)


def test_decode_odd_group_padded_head_dim_and_small_pages():
    """A group of 3 (rows 3..15 of the dot are padding), head dim 96 (padded to 128), pages of 8."""
    run_decode([5, 9, 40], group=3, head_dim=96, page_size=8, num_splits=2)


def test_decode_strided_q_and_out():
    """q as the leading heads of a fused QKV projection; out as a view into a wider buffer."""
    seq_lens, num_kv_heads, group, head_dim = [7, 30], 2, 2, 64
    k_cache, v_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, 16, torch.float32)
    qkv = torch.randn(2, (group + 2) * num_kv_heads * head_dim, device=DEVICE)
    q = qkv[:, : group * num_kv_heads * head_dim].view(2, group * num_kv_heads, head_dim)
    wide = poisoned(2, group * num_kv_heads + 1, head_dim)
    out = wide[:, 1:]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, out=out)
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, [1, 1], 0.125), torch.float32)
    assert wide[:, 0].isnan().all(), "wrote outside out"


def test_decode_empty_sequence_gives_zeros():
    """A padding slot of a CUDA-graph batch (seq_len 0) must come out finite (zeros), not NaN."""
    k_cache, v_cache, tables = make_paged_kv([9, 1], 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64, device=DEVICE)
    lens = torch.tensor([9, 0], dtype=torch.int32, device=DEVICE)
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=2)
    assert (out[1] == 0).all()
    check(out[:1], expected(q[:1], k_cache, v_cache, tables, [9], [1], 0.125), torch.float32)


def test_choose_num_splits():
    # One sequence on a 132-SM part: many partitions (a power of two), but never fewer than 2 tiles each.
    assert attention.choose_num_splits(1, 4, 32768, 64, 132) == 64
    assert attention.choose_num_splits(1, 4, 256, 64, 132) == 2
    assert attention.choose_num_splits(1, 4, 64, 64, 132) == 1
    # A full batch already fills the part: no split.
    assert attention.choose_num_splits(256, 8, 32768, 64, 132) == 1
    assert 1 <= attention.choose_num_splits(3, 4, 10**7, 16, 10**4) <= attention.MAX_SPLITS


# ----------------------------------------------------------------------------------------------------- prefill

# (seq_len, query_len): no prefix, one new token, a long prefix with a short chunk, page edges, longer chunks.
MIXED_PREFILL = [(15, 15), (16, 1), (17, 17), (100, 3), (33, 33), (70, 40), (1, 1)]


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_mixed_batch(page_size, group, head_dim):
    seq_lens, query_lens = zip(*MIXED_PREFILL, strict=True)
    run_prefill(list(seq_lens), list(query_lens), group, head_dim=head_dim, page_size=page_size)


def test_prefill_no_prefix():
    run_prefill([37], [37], group=4)


def test_prefill_sequence_without_new_tokens():
    """A sequence with no new tokens in the middle of the batch: nothing of it is computed or written."""
    run_prefill([12, 30, 7], [12, 0, 4], group=2)


def test_prefill_single_token_queries():
    run_prefill([1, 16, 50], [1, 1, 1], group=8)


def test_prefill_long_prefix_short_chunk():
    run_prefill([200, 130], [5, 2], group=4, page_size=32)


@pytest.mark.parametrize("window", [1, 8, 20])
def test_prefill_sliding_window(window):
    run_prefill([40, 100, 9], [40, 12, 3], group=4, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(dtype):
    seq_lens, query_lens = zip(*MIXED_PREFILL, strict=True)
    run_prefill(list(seq_lens), list(query_lens), group=8, head_dim=128, dtype=dtype)


def test_prefill_odd_group_padded_head_dim():
    """A group of 3 leaves rows of each BLOCK_M tile unused; head dim 96 is padded to 128."""
    run_prefill([20, 45], [20, 9], group=3, head_dim=96, page_size=8)


# --------------------------------------------------------------------------------------------- argument checks


def test_launchers_reject_bad_arguments():
    k_cache, v_cache, tables = make_paged_kv([5, 9], 2, 64, 16, torch.float32)
    q = torch.randn(2, 4, 64, device=DEVICE)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    decode = attention.paged_decode_attention
    with pytest.raises(ValueError, match="block_tables"):
        decode(q, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        decode(q, k_cache, v_cache, tables, lens[:1], 0.1)
    with pytest.raises(ValueError, match="k_cache dtype"):
        decode(q, k_cache.bfloat16(), v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim 80"):
        decode(torch.zeros(2, 4, 80, device=DEVICE), torch.zeros(4, 16, 2, 80, device=DEVICE),
               torch.zeros(4, 16, 2, 80, device=DEVICE), tables, lens, 0.1)
    with pytest.raises(ValueError, match="GQA group"):
        decode(torch.randn(2, 64, 64, device=DEVICE), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="block size 12"):
        decode(q, k_cache[:, :12], v_cache[:, :12], tables, lens, 0.1)
    with pytest.raises(ValueError, match="q strides"):
        decode(torch.randn(2, 4, 72, device=DEVICE)[..., :64], k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="out must have shape"):
        decode(q, k_cache, v_cache, tables, lens, 0.1, out=torch.empty(2, 4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="sliding_window"):
        decode(q, k_cache, v_cache, tables, lens, 0.1, sliding_window=0)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    prefill = attention.paged_prefill_attention
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill(q, k_cache, v_cache, tables, lens, starts[:2], 1, 0.1)
    with pytest.raises(ValueError, match="max_query_len"):
        prefill(q, k_cache, v_cache, tables, lens, starts, 0, 0.1)


# ------------------------------------------------------------------------------------ full size, on a GPU only


def random_batch(seq_lens, query_lens, num_q_heads, num_kv_heads, head_dim, page_size=16, seed=0):
    """Full-size bf16 inputs (random caches, no NaN: too large to build page by page)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 16
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    order = torch.randperm(num_pages, generator=gen, device=DEVICE)
    tables = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, num in enumerate(pages_per_seq):
        tables[b, :num] = order[start:start + num].int()
        start += num
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen, device=DEVICE).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, lens


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim", "window"),
                         [(32, 4, 128, None), (64, 8, 128, 4096), (16, 8, 256, None), (64, 4, 64, None)])
def test_decode_full_size(num_q_heads, num_kv_heads, head_dim, window):
    """Qwen3-30B-A3B heads (32/4 x 128), a Llama-70B-like group of 8 with a Mistral-like window, D 256 and 64."""
    seq_lens = [1, 17, 1000, 4097, 8192, 32768, 129, 2048]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, [1] * len(seq_lens), num_q_heads, num_kv_heads,
                                                     head_dim)
    scale = head_dim**-0.5
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window)
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, [1] * len(seq_lens), scale, window), torch.bfloat16)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize(("head_dim", "window"), [(128, None), (128, 1000), (256, None), (64, None)])
def test_prefill_full_size(head_dim, window):
    """A 2048-token prompt, a chunk over a long prefix, and decode-like single tokens in one batch (32/4 heads)."""
    seq_lens, query_lens = [2048, 9000, 77, 4000, 513], [2048, 512, 1, 1, 513]
    q, k_cache, v_cache, tables, lens = random_batch(seq_lens, query_lens, 32, 4, head_dim)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, max(query_lens), scale,
                                            window)
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window), torch.bfloat16)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_decode_cuda_graph_replay():
    """Captured once, replayed with other lengths and pages: the launch reads nothing from the host."""
    q, k_cache, v_cache, tables, lens = random_batch([8000] * 4, [1] * 4, 32, 4, 128)
    lens.copy_(torch.tensor([3000, 12, 700, 5000], dtype=torch.int32))
    out = torch.empty_like(q)
    run = lambda: attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, out=out, max_seq_len=8192)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    new_lens = [8000, 1, 64, 4999]
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    check(out, expected(q, k_cache, v_cache, tables, new_lens, [1] * 4, 0.1), torch.bfloat16)
