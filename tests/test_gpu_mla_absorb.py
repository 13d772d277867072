"""gpu_layers.mla_absorb against its PyTorch references (the bmm formulation in float32, rounded once): the query
and output absorptions for 1, 3 and 17 rows (one row block, and two of the larger ones), in float32, bfloat16 and
float16, at small odd dims (no dim a power of two or a multiple of a tile) and at DeepSeek-V3.2's and GLM-5's dims
with few heads; the weight as [H * (Dn + Dv), R] and as its [H, Dn + Dv, R] view; strided inputs, and outputs
that are views into larger NaN-poisoned buffers (the rest checked untouched); the launchers' checks and gate cases;
full-size heads on the GPU; mla_decode and mla_sparse keeping torch.bmm for a strided weight (the rest of those
two is tested in their own files)."""

import pytest
import torch
from gpu_support import DEVICE, IS_INTERPRETED
from test_gpu_mla import SMALL, assert_matches, expected, make_problem

from gpu_layers import mla, mla_absorb, mla_sparse
from gpu_layers.capability import CAPABILITIES, select

ODD = dict(num_heads=3, nope_dim=40, v_head_dim=24, rank=72)
DEEPSEEK = dict(num_heads=3, **mla_absorb.DEEPSEEK_V3_2)  # real dims, few heads (the interpreter is slow)
GLM = dict(num_heads=3, **mla_absorb.GLM_5)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_weight(dims, dtype, seed=0):
    """kv_b_proj.weight [H * (Dn + Dv), R], scaled so the products are of order 1."""
    gen = torch.Generator().manual_seed(seed)
    h, dn, dv, r = (dims[k] for k in ("num_heads", "nope_dim", "v_head_dim", "rank"))
    return (torch.randn(h * (dn + dv), r, generator=gen) * r**-0.5).to(dtype).to(DEVICE)


def rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def assert_close(out, ref):
    """Both sides sum in float32 and round once: they differ by summation order, at most an ulp of the dtype."""
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def check_query(dims, dtype, num_rows, seed=0, as_heads=False):
    w = make_weight(dims, dtype, seed)
    if as_heads:
        w = w.view(dims["num_heads"], -1, dims["rank"])
    q = rand(num_rows, dims["num_heads"], dims["nope_dim"], dtype=dtype, seed=seed + 1)
    got = mla_absorb.absorb_query(q, w, dims["nope_dim"])
    assert got.shape == (dims["num_heads"], num_rows, dims["rank"]) and got.dtype == dtype
    assert_close(got, mla_absorb.absorb_query_reference(q, w, dims["nope_dim"]))


def check_output(dims, dtype, num_rows, seed=0, as_heads=False):
    w = make_weight(dims, dtype, seed)
    if as_heads:
        w = w.view(dims["num_heads"], -1, dims["rank"])
    o = rand(dims["num_heads"], num_rows, dims["rank"], dtype=dtype, seed=seed + 2)
    out = torch.full((num_rows, dims["num_heads"], dims["v_head_dim"]), float("nan"), dtype=dtype, device=DEVICE)
    got = mla_absorb.absorb_output(o, w, dims["nope_dim"], dims["v_head_dim"], out=out)
    assert got is out
    assert_close(out, mla_absorb.absorb_output_reference(o, w, dims["nope_dim"], dims["v_head_dim"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_query_odd_dims(dtype, num_rows):
    check_query(ODD, dtype, num_rows, seed=num_rows, as_heads=num_rows == 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_output_odd_dims(dtype, num_rows):
    check_output(ODD, dtype, num_rows, seed=num_rows, as_heads=num_rows == 3)


@pytest.mark.parametrize("dims", [DEEPSEEK, GLM], ids=["deepseek-v3.2", "glm-5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_dims_one_row(dims, dtype):
    check_query(dims, dtype, 1, seed=5)
    check_output(dims, dtype, 1, seed=6)


def test_prefill_sized_rows():
    """More rows than one 64-row block, at the small dims: the row blocks tile the rows."""
    dims = dict(num_heads=2, nope_dim=16, v_head_dim=16, rank=32)
    check_query(dims, torch.bfloat16, 130, seed=7)
    check_output(dims, torch.bfloat16, 130, seed=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_and_outputs(dtype):
    """q_nope a column slice of [B, H, Dn + Dr], o_latent a transposed [B, H, R] buffer; outputs written into
    views of NaN-filled buffers with other row strides, the rest of each buffer left as it was."""
    h, dn, dv, r = (ODD[k] for k in ("num_heads", "nope_dim", "v_head_dim", "rank"))
    b = 5
    w = make_weight(ODD, dtype, 9)
    q = rand(b, h, dn + 16, dtype=dtype, seed=10)[:, :, :dn]
    q_buffer = torch.full((h + 1, b + 2, r + 8), float("nan"), dtype=dtype, device=DEVICE)
    q_latent = q_buffer[1:, 2:, 8:]
    assert mla_absorb.absorb_query(q, w, dn, out=q_latent) is q_latent
    assert_close(q_latent, mla_absorb.absorb_query_reference(q, w, dn))
    assert q_buffer[0].isnan().all() and q_buffer[:, :2].isnan().all() and q_buffer[..., :8].isnan().all()

    o = rand(b, h, r, dtype=dtype, seed=11).transpose(0, 1)  # [H, B, R], rows B strided by H * R
    out_buffer = torch.full((b, h + 2, dv + 8), float("nan"), dtype=dtype, device=DEVICE)
    out = out_buffer[:, 1:h + 1, 4:dv + 4]
    assert mla_absorb.absorb_output(o, w, dn, dv, out=out) is out
    assert_close(out, mla_absorb.absorb_output_reference(o, w, dn, dv))
    untouched = torch.ones_like(out_buffer, dtype=torch.bool)
    untouched[:, 1:h + 1, 4:dv + 4] = False
    assert out_buffer[untouched].isnan().all()


def test_no_rows_and_allocated_outputs():
    w = make_weight(ODD, torch.float32)
    q = rand(0, 3, 40, dtype=torch.float32, seed=0)
    assert mla_absorb.absorb_query(q, w, 40).shape == (3, 0, 72)
    assert mla_absorb.absorb_output(rand(3, 0, 72, dtype=torch.float32, seed=0), w, 40, 24).shape == (0, 3, 24)
    o = rand(3, 2, 72, dtype=torch.float32, seed=1)
    assert_close(mla_absorb.absorb_output(o, w, 40, 24), mla_absorb.absorb_output_reference(o, w, 40, 24))


def test_row_block():
    assert [mla_absorb.row_block(n) for n in (1, 16, 17, 64, 65, 10000)] == [16, 16, 64, 64, 64, 64]


def test_is_supported():
    w = make_weight(ODD, torch.bfloat16)
    q = rand(2, 3, 40, dtype=torch.bfloat16, seed=0)
    assert mla_absorb.is_supported(w, q)
    assert not mla_absorb.is_supported(w.t().contiguous().t(), q)  # a transposed weight
    assert not mla_absorb.is_supported(w, q.transpose(1, 2).contiguous().transpose(1, 2))
    assert not mla_absorb.is_supported(w.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn))


def test_launcher_errors():
    w = make_weight(ODD, torch.float32)
    q = rand(2, 3, 40, dtype=torch.float32, seed=0)
    o = rand(3, 2, 72, dtype=torch.float32, seed=1)
    cases = [
        (lambda: mla_absorb.absorb_query(q[0], w, 40), "q_nope must be \\[rows, heads, nope_dim\\]"),
        (lambda: mla_absorb.absorb_query(q.long(), w, 40), "q_nope must be bf16, fp16 or fp32"),
        (lambda: mla_absorb.absorb_query(q.transpose(1, 2).contiguous().transpose(1, 2), w, 40),
         "q_nope must be contiguous in its last dim"),
        (lambda: mla_absorb.absorb_query(q, w, 32), "nope_dim=32"),
        (lambda: mla_absorb.absorb_query(q, w.bfloat16(), 40), "w_kv_b must be torch.float32"),
        (lambda: mla_absorb.absorb_query(q, w[:-1], 40), "do not split into 3 heads"),
        (lambda: mla_absorb.absorb_query(q, w.t(), 40), "w_kv_b must be contiguous"),
        (lambda: mla_absorb.absorb_query(q, w.view(-1), 40), "w_kv_b must be \\[H \\* \\(Dn \\+ Dv\\), R\\]"),
        (lambda: mla_absorb.absorb_query(q, w[:3 * 40], 40), "more than nope_dim=40 rows a head"),
        (lambda: mla_absorb.absorb_query(q, w, 40, out=torch.empty(3, 2, 71, device=DEVICE)),
         "out must be \\[3, 2, 72\\]"),
        (lambda: mla_absorb.absorb_output(o[0], w, 40, 24), "o_latent must be \\[heads, rows, rank\\]"),
        (lambda: mla_absorb.absorb_output(o.half(), w, 40, 24), "w_kv_b must be torch.float16"),
        (lambda: mla_absorb.absorb_output(o, w, 40, 16), "v_head_dim=16"),
        (lambda: mla_absorb.absorb_output(o[..., :64], w, 40, 24), "o_latent's rank"),
        (lambda: mla_absorb.absorb_output(o, w, 40, 24, out=torch.empty(2, 3, 24, 2, device=DEVICE)[..., 0]),
         "out must be \\[2, 3, 24\\] .* with unit last stride"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="w_kv_b must be on"):
            mla_absorb.absorb_query(q, w.cpu(), 40)


def test_strided_weight_keeps_the_bmm_path():
    """mla_decode and mla_sparse with w_kv_b a column slice of a wider buffer (not contiguous: the kernels do not
    take it, torch.bmm does) and with its contiguous copy (the kernels) agree with the oracle alike."""
    p = make_problem([(6, 1), (20, 1)], 16, SMALL, torch.float32, seed=12)
    wide = torch.full((p["w_kv_b"].shape[0], p["w_kv_b"].shape[1] + 8), float("nan"), device=DEVICE)
    wide[:, :-8] = p["w_kv_b"]
    strided = wide[:, :-8]
    assert not mla_absorb.is_supported(strided, p["q_nope"]) and mla_absorb.is_supported(p["w_kv_b"], p["q_nope"])
    # every position selected: sparse attention is the dense oracle
    selected = torch.tensor([list(range(7)) + [-1] * 14, list(range(21))], dtype=torch.int32, device=DEVICE)
    row_seq = torch.arange(2, dtype=torch.int32, device=DEVICE)
    for w in (strided, p["w_kv_b"]):
        args = (p["q_nope"], p["q_rope"], p["latent_cache"], w, p["block_tables"])
        assert_matches(mla.mla_decode(*args, p["seq_lens"], p["scale"], p["v_head_dim"]), expected(p), torch.float32)
        sparse = mla_sparse.mla_sparse(*args, row_seq, selected, p["scale"], p["v_head_dim"])
        assert_matches(sparse, expected(p), torch.float32)


def test_gate_cases_cover_every_config_and_dtype():
    cases = mla_absorb.gate_cases()
    kernels = {mla_absorb.absorb_query_kernel, mla_absorb.absorb_output_kernel}
    assert {(c.kernel, c.capability) for c in cases} == {(k, cc) for k in kernels for cc in CAPABILITIES}
    # 2 kernels x 3 dtypes x 2 models x 2 row blocks per capability, each labelled apart
    assert len({c.label + str(c.capability) for c in cases}) == len(cases) == 24 * len(CAPABILITIES)
    for case in cases:
        table = mla_absorb.QUERY_CONFIGS if case.kernel is mla_absorb.absorb_query_kernel \
            else mla_absorb.OUTPUT_CONFIGS
        cfg = select(table, case.capability)[4 if "fp32" in case.label else 2]
        assert (case.constexprs["BLOCK_K"], case.constexprs["BLOCK_N"]) == (cfg.block_k, cfg.block_n)
        assert (case.num_warps, case.num_stages) == (cfg.num_warps, cfg.num_stages)
        assert case.constexprs["BLOCK_B"] in mla_absorb.ROW_BLOCKS
        assert set(case.signature) == set(case.kernel.arg_names), case.label
        assert {k for k, v in case.signature.items() if v == "constexpr"} == set(case.constexprs), case.label


@pytest.mark.skipif(IS_INTERPRETED, reason="needs a GPU")
@pytest.mark.parametrize("model", list(mla_absorb.GATED_MODELS))
@pytest.mark.parametrize("num_rows", [1, 8, 33, 300])
def test_full_size(model, num_rows):
    """All heads (DeepSeek-V3.2: 128, GLM-5: 64) in bf16, decode batches and a prefill-sized row count."""
    dims = dict(num_heads={"deepseek-v3.2": 128, "glm-5": 64}[model], **mla_absorb.GATED_MODELS[model])
    check_query(dims, torch.bfloat16, num_rows, seed=num_rows)
    check_output(dims, torch.bfloat16, num_rows, seed=num_rows)
