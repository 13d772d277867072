"""The CUDA-graph hand-off's row kernels (`gpu_layers.handoff`: stage_tokens, fetch_rows) against their references,
on the GPU or under Triton's interpreter: dtype conversions, ids of invalid rows, odd hidden sizes across the
programs' column chunks, one token and many."""

import pytest
import torch
from gpu_support import DEVICE

from gpu_layers import handoff


def _host_buffer(*shape, dtype):
    """The CPU side's staging buffers: page-locked host memory on a GPU machine, plain CPU tensors interpreted."""
    return torch.full(shape, 7, dtype=dtype, pin_memory=DEVICE.type == "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("num_tokens", "hidden_size", "top_k"), [(1, 2048, 8), (3, 1100, 4), (5, 64, 16)])
def test_stage_tokens_matches_the_masked_copies(dtype, id_dtype, num_tokens, hidden_size, top_k):
    torch.manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size + 3, device=DEVICE).to(dtype)[:, :hidden_size]  # strided rows
    ids = torch.randint(0, 128, (num_tokens, top_k), device=DEVICE, dtype=id_dtype)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    valid = (torch.arange(num_tokens, device=DEVICE) < max(num_tokens - 1, 1))[:, None]  # the last row padding
    got = [_host_buffer(num_tokens, hidden_size, dtype=torch.float32), _host_buffer(num_tokens, top_k,
           dtype=torch.int64), _host_buffer(num_tokens, top_k, dtype=torch.float32)]
    want = [b.clone() for b in got]
    handoff.stage_tokens(hidden, ids, weights, valid, *got)
    handoff.stage_tokens_reference(hidden.cpu(), ids.cpu(), weights.cpu(), valid.cpu(), *want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    if num_tokens > 1:
        assert (got[1][-1] == -1).all()


@pytest.mark.parametrize(("src_dtype", "dtype"), [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                  (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), [(1, 2048), (4, 1030)])
def test_fetch_rows_matches_a_cast_copy(src_dtype, dtype, num_tokens, hidden_size):
    src = _host_buffer(num_tokens, hidden_size, dtype=src_dtype)
    src.copy_(torch.randn(num_tokens, hidden_size))
    got = handoff.fetch_rows(src, dtype, DEVICE)
    assert got.device.type == DEVICE.type
    assert torch.equal(got.cpu(), handoff.fetch_rows_reference(src, dtype, torch.device("cpu")))


def test_stage_tokens_rejects_mismatched_buffers():
    hidden = torch.randn(2, 64, device=DEVICE)
    ids = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    weights = torch.zeros(2, 4, device=DEVICE)
    valid = torch.ones(2, 1, dtype=torch.bool, device=DEVICE)
    buffers = [_host_buffer(2, 64, dtype=torch.float32), _host_buffer(2, 4, dtype=torch.int64),
               _host_buffer(2, 4, dtype=torch.float32)]
    with pytest.raises(ValueError, match="ids_dst"):
        handoff.stage_tokens(hidden, ids, weights, valid, buffers[0], buffers[2], buffers[2])
    with pytest.raises(ValueError, match="topk_weights"):
        handoff.stage_tokens(hidden, ids, weights.double(), valid, *buffers)
