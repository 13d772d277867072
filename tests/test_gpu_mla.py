"""gpu_layers.mla against reference.mla_paged_attention: decode by weight absorption (several split counts, an
empty padded slot, a CUDA-graph replay on the GPU) and prefill with and without a cached prefix, in float32 and
bfloat16, over shuffled pages of 16 and 32 tokens and mixed lengths; dims that are not powers of two (padded inside
the kernels: GLM-4.7-Flash's nope 192 / v 256, and small odd ones below one dot block); the launchers' checks; full
DeepSeek-V3 and GLM-4.7-Flash sizes on the GPU."""

import math

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED, poisoned

from gpu_layers import mla, reference
from gpu_layers.capability import CAPABILITIES

SMALL = dict(num_heads=4, nope_dim=32, rope_dim=16, v_head_dim=32, rank=64)
REAL = dict(num_heads=3, nope_dim=128, rope_dim=64, v_head_dim=128, rank=512)  # DeepSeek-V3 dims, few heads
GLM = dict(num_heads=3, nope_dim=192, rope_dim=64, v_head_dim=256, rank=512)  # GLM-4.7-Flash dims, few heads
# No dim a power of two; rope 8 pads past itself to a 16-wide dot, the latent 48 to 64.
ODD = dict(num_heads=3, nope_dim=24, rope_dim=8, v_head_dim=40, rank=48)
DECODE_LENS = [1, 7, 16, 17, 40]
# (cached prefix, new tokens): prefill from scratch, after a prefix, across page boundaries, a single token; the
# last two span several query and key tiles of every config.
PREFILL_SEQS = [(0, 1), (0, 7), (0, 17), (9, 7), (16, 16), (23, 17), (1, 39), (0, 70), (60, 30)]


def make_problem(seqs, page_size, dims, dtype, seed=0):
    """Random latents for each sequence's whole context (prefix and new tokens, as after the cache write), in
    shuffled pages that start away from page 0 (tables are padded with 0, so a wrong row cannot pass by accident);
    queries for the new tokens. Returns a dict of the launchers' arguments plus host lengths for the reference."""
    gen = torch.Generator().manual_seed(seed)
    h, dn, dr, dv, r = (dims[k] for k in ("num_heads", "nope_dim", "rope_dim", "v_head_dim", "rank"))
    seq_lens = [prefix + new for prefix, new in seqs]
    pages_needed = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(pages_needed) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(seqs), max(pages_needed), dtype=torch.int32)
    for b, n in enumerate(pages_needed):
        tables[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    num_tokens = sum(new for _, new in seqs)
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(DEVICE)

    return dict(
        q_nope=rand(num_tokens, h, dn), q_rope=rand(num_tokens, h, dr),
        latent_cache=rand(num_pages, page_size, 1, r + dr), w_kv_b=rand(h * (dn + dv), r, std=r**-0.5),
        block_tables=tables.to(DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens_cpu=seq_lens, query_lens_cpu=[new for _, new in seqs], v_head_dim=dv,
        scale=1 / math.sqrt(dn + dr),
    )


def expected(p):
    """The oracle in float32 from the same (possibly bfloat16) inputs."""
    f = {k: p[k].float() for k in ("q_nope", "q_rope", "latent_cache", "w_kv_b")}
    return reference.mla_paged_attention(f["q_nope"], f["q_rope"], f["latent_cache"], f["w_kv_b"], p["block_tables"],
                                         p["seq_lens_cpu"], p["query_lens_cpu"], p["scale"], p["v_head_dim"])


def assert_matches(out, ref, dtype):
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    # bf16 rounds q_latent, p and o_latent; fp32 differs only by summation order. Dropping or adding one key of 40
    # moves the output by a few percent, so both limits catch a masking or paging error.
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), f"relative error {err:.2e}"


def run_decode(p, num_splits=None):
    num_seqs, num_heads = p["q_nope"].shape[:2]
    out = poisoned(num_seqs, num_heads, p["v_head_dim"], dtype=p["q_nope"].dtype)
    result = mla.mla_decode(p["q_nope"], p["q_rope"], p["latent_cache"], p["w_kv_b"], p["block_tables"],
                            p["seq_lens"], p["scale"], p["v_head_dim"], num_splits=num_splits, out=out)
    assert result is out
    return out


def run_prefill(p, pass_total=True):
    num_tokens, num_heads = p["q_nope"].shape[:2]
    out = poisoned(num_tokens, num_heads, p["v_head_dim"], dtype=p["q_nope"].dtype)
    total = sum(p["seq_lens_cpu"]) if pass_total else None
    return mla.mla_prefill(p["q_nope"], p["q_rope"], p["latent_cache"], p["w_kv_b"], p["block_tables"],
                           p["seq_lens"], p["query_start_loc"], max(p["query_lens_cpu"]), p["scale"],
                           p["v_head_dim"], out=out, num_context_tokens=total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8, 11])
def test_decode_mixed_lengths(dtype, page_size, num_splits):
    p = make_problem([(n - 1, 1) for n in DECODE_LENS], page_size, SMALL, dtype, seed=page_size + (num_splits or 0))
    assert_matches(run_decode(p, num_splits), expected(p), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_real_dims_and_odd_head_count(dtype):
    """R = 512, Dr = 64 as in DeepSeek-V3; 3 heads fill part of a head block."""
    p = make_problem([(0, 1), (32, 1), (70, 1)], 16, REAL, dtype, seed=3)
    assert_matches(run_decode(p, num_splits=2), expected(p), dtype)


def test_decode_empty_slot_gives_zeros():
    """A padded batch slot (seq_len 0, as in a captured graph's unused rows) yields zeros, never NaN."""
    p = make_problem([(6, 1), (16, 1)], 16, SMALL, torch.float32, seed=4)
    p["seq_lens"][1] = 0
    out = run_decode(p, num_splits=4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    p["seq_lens_cpu"], p["query_lens_cpu"] = p["seq_lens_cpu"][:1], [1]
    assert_matches(out[:1], expected(p)[:1], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_prefill_with_and_without_prefix(dtype, page_size):
    p = make_problem(PREFILL_SEQS, page_size, SMALL, dtype, seed=10 + page_size)
    assert_matches(run_prefill(p, pass_total=page_size == 16), expected(p), dtype)


def test_prefill_real_dims():
    p = make_problem([(5, 3), (0, 20)], 32, REAL, torch.bfloat16, seed=5)
    assert_matches(run_prefill(p), expected(p), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_odd_dims(dtype, num_splits):
    """Every dim padded in the kernel: 1-token contexts, contexts ending on, just past and just before a page."""
    p = make_problem([(n - 1, 1) for n in (1, 15, 16, 17, 33, 40)], 16, ODD, dtype, seed=30 + (num_splits or 0))
    assert_matches(run_decode(p, num_splits), expected(p), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 32])
def test_prefill_odd_dims(dtype, page_size):
    p = make_problem(PREFILL_SEQS, page_size, ODD, dtype, seed=40 + page_size)
    assert_matches(run_prefill(p), expected(p), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glm_dims(dtype):
    """GLM-4.7-Flash: nope 192 padded to 256 in prefill (v 256, rope 64 unpadded); decode sees R and Dr only. A
    one-token prompt, a prompt that fills a page exactly, one that crosses it, and a chunk after a prefix."""
    p = make_problem([(0, 1), (0, 16), (0, 17), (16, 9)], 16, GLM, dtype, seed=50)
    assert_matches(run_prefill(p), expected(p), dtype)
    p = make_problem([(0, 1), (15, 1), (16, 1), (40, 1)], 16, GLM, dtype, seed=51)
    assert_matches(run_decode(p, num_splits=2), expected(p), dtype)


def test_supported_dims():
    assert mla.supports_dims(128, 64, 128, 512) and mla.supports_dims(192, 64, 256, 512)
    assert mla.supports_dims(24, 8, 40, 48) and mla.supports_dims(1, 1, 1, 1)
    assert not mla.supports_dims(257, 64, 128, 512)  # pads to 512, past the gated 256
    assert not mla.supports_dims(128, 96, 128, 512)
    assert not mla.supports_dims(128, 64, 128, 576)
    assert not mla.supports_dims(128, 0, 128, 512)


def test_prefill_config_follows_the_padded_head_width():
    narrow, wide = mla.PREFILL_CONFIGS[120][(128, 2)], mla.PREFILL_CONFIGS[120][(256, 2)]
    assert mla.prefill_config(120, 128, 128, 2) == mla.prefill_config(120, 24, 40, 2) == narrow
    assert mla.prefill_config(120, 192, 256, 2) == mla.prefill_config(120, 192, 128, 2) == wide


def test_default_num_splits():
    # A full batch already covers the GPU: no splits.
    assert mla.default_num_splits(32, 4, 32768, 32, 132) == 1
    # One sequence: about one program per SM, up to the cap, but no split shorter than 4 tiles.
    assert mla.default_num_splits(1, 4, 32768, 32, 132) == 33
    assert mla.default_num_splits(1, 1, 32768, 32, 132) == mla.MAX_SPLITS
    assert mla.default_num_splits(1, 4, 1024, 32, 132) == 8
    assert mla.default_num_splits(1, 4, 16, 32, 132) == 1


def test_launcher_errors():
    p = make_problem([(3, 1), (7, 1)], 16, SMALL, torch.float32)
    names = ("q_nope", "q_rope", "latent_cache", "w_kv_b", "block_tables", "seq_lens")

    def decode(**changes):
        return mla.mla_decode(**({k: p[k] for k in names} | changes), scale=0.1, v_head_dim=32)

    with pytest.raises(ValueError, match="block_tables"):
        decode(block_tables=p["block_tables"].long())
    with pytest.raises(ValueError, match="q_rope"):
        decode(q_rope=p["q_rope"][:, :2])
    with pytest.raises(ValueError, match="latent_cache"):
        decode(latent_cache=p["latent_cache"].double())
    with pytest.raises(ValueError, match="w_kv_b"):
        decode(w_kv_b=p["w_kv_b"][:-1])
    with pytest.raises(ValueError, match="rope_dim must be 1..64"):  # 80 pads to 128, past the gated 64
        cache = p["latent_cache"]
        decode(q_rope=torch.zeros(2, 4, 80, device=DEVICE), latent_cache=cache.new_zeros(*cache.shape[:3], 64 + 80))
    with pytest.raises(ValueError, match="num_splits"):
        decode(num_splits=0)
    with pytest.raises(ValueError, match="out"):
        decode(out=torch.empty(2, 4, 16, device=DEVICE))
    with pytest.raises(ValueError, match="query_start_loc"):
        mla.mla_prefill(*(p[k] for k in names), p["query_start_loc"][:-1], 1, 0.1, 32)


def test_gate_cases_cover_every_kernel_config_and_dtype():
    cases = mla.gate_cases()
    kernels = {mla.mla_decode_kernel, mla.mla_decode_reduce_kernel, mla.mla_prefill_kernel}
    assert {(c.kernel, c.capability) for c in cases} == {(k, cc) for k in kernels for cc in CAPABILITIES}
    # decode and its reduce once (the models share R and Dr), prefill per model: DeepSeek-V3 and GLM-4.7-Flash
    assert len({c.label + str(c.capability) for c in cases}) == len(cases) == 4 * 3 * len(CAPABILITIES)
    glm = [c for c in cases if c.kernel is mla.mla_prefill_kernel and "glm-4.7-flash" in c.label]
    assert len(glm) == 3 * len(CAPABILITIES)
    assert all(c.constexprs["DN"] == 192 and c.constexprs["BLOCK_DN"] == 256 for c in glm)
    for case in cases:
        params = case.kernel.arg_names
        assert set(case.signature) == set(params), case.label
        assert {k for k, v in case.signature.items() if v == "constexpr"} == set(case.constexprs), case.label


# ---------------------------------------------------------------------------------------------- full size, GPU

FULL = dict(num_heads=128, nope_dim=128, rope_dim=64, v_head_dim=128, rank=512)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_deepseek_v3_size(page_size):
    p = make_problem([(n - 1, 1) for n in (1, 100, 1000, 4097)], page_size, FULL, torch.bfloat16, seed=20)
    ref = expected(p)
    for num_splits in (None, 1, 7):
        assert_matches(run_decode(p, num_splits), ref, torch.bfloat16)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_prefill_deepseek_v3_size():
    p = make_problem([(0, 300), (1000, 129), (64, 1)], 64, FULL, torch.bfloat16, seed=21)
    assert_matches(run_prefill(p), expected(p), torch.bfloat16)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_glm_4_7_flash_size():
    dims = dict(GLM, num_heads=20)
    p = make_problem([(0, 300), (1000, 129), (64, 1), (0, 1)], 64, dims, torch.bfloat16, seed=23)
    assert_matches(run_prefill(p), expected(p), torch.bfloat16)
    p = make_problem([(n - 1, 1) for n in (1, 64, 65, 4097)], 64, dims, torch.bfloat16, seed=24)
    ref = expected(p)
    for num_splits in (None, 1, 7):
        assert_matches(run_decode(p, num_splits), ref, torch.bfloat16)


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
def test_decode_replays_in_a_cuda_graph():
    """Captured with other lengths and queries, replayed after they change in place: nothing is baked in."""
    p = make_problem([(n - 1, 1) for n in (900, 2, 1300)], 16, FULL, torch.bfloat16, seed=22)
    seq_lens, q_nope = p["seq_lens"].clone(), p["q_nope"].clone()
    p["seq_lens"].copy_(torch.tensor([5, 1, 17]))
    p["q_nope"].normal_()
    out = torch.empty(3, FULL["num_heads"], FULL["v_head_dim"], dtype=torch.bfloat16, device=DEVICE)

    def step():
        mla.mla_decode(p["q_nope"], p["q_rope"], p["latent_cache"], p["w_kv_b"], p["block_tables"], p["seq_lens"],
                       p["scale"], p["v_head_dim"], out=out)

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    p["seq_lens"].copy_(seq_lens)
    p["q_nope"].copy_(q_nope)
    graph.replay()
    assert_matches(out, expected(p), torch.bfloat16)
