"""Attention sinks, asymmetric q/k and v head dims and the value scale in gpu_layers.attention, against
gpu_layers.reference.paged_attention and against transformers' own gpt-oss / MiMo-V2-Flash eager attention."""

import types

import pytest
import torch
from gpu_support import DEVICE, poisoned
from test_gpu_attention import check, make_paged_kv
from transformers.models.gpt_oss import modeling_gpt_oss

from gpu_layers import attention, attention_kernels, reference


def random_sinks(num_q_heads, seed=5):
    """Sinks on the scale of the scores (some above, some below them), so they change the result visibly."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_q_heads, generator=gen) * 2.0).to(DEVICE)


def expected(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window, sinks, value_scale=1.0):
    return reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, query_lens,
                                     scale, window, None if sinks is None else sinks.double(), value_scale)


def decode_case(seq_lens, group, head_dim=64, v_head_dim=None, window=None, page_size=16, dtype=torch.float32,
                seed=0):
    """Inputs of one decode batch (two KV heads) with random sinks."""
    k_cache, v_cache, tables = make_paged_kv(seq_lens, 2, head_dim, page_size, dtype, seed, v_head_dim)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(seq_lens), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, lens, random_sinks(2 * group, seed)


def run_decode(seq_lens, group, num_splits, window=None, value_scale=1.0, **kwargs):
    q, k_cache, v_cache, tables, lens, sinks = decode_case(seq_lens, group, window=window, **kwargs)
    scale = q.shape[-1] ** -0.5
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, window, num_splits,
                                           out=poisoned(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype),
                                           sinks=sinks, value_scale=value_scale)
    want = expected(q, k_cache, v_cache, tables, seq_lens, [1] * len(seq_lens), scale, window, sinks, value_scale)
    check(out, want, q.dtype)
    return out


def run_prefill(seq_lens, query_lens, group, window=None, value_scale=1.0, head_dim=64, v_head_dim=None,
                page_size=16, dtype=torch.float32, seed=0):
    k_cache, v_cache, tables = make_paged_kv(seq_lens, 2, head_dim, page_size, dtype, seed, v_head_dim)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(query_lens), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    sinks = random_sinks(2 * group, seed)
    scale = head_dim**-0.5
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, max(query_lens), scale,
                                            window, out=poisoned(*q.shape[:2], v_cache.shape[-1], dtype=dtype),
                                            sinks=sinks, value_scale=value_scale)
    check(out, expected(q, k_cache, v_cache, tables, seq_lens, query_lens, scale, window, sinks, value_scale), dtype)


# ------------------------------------------------------------------------------------------------------ decode

# Page edges (15/16/17 with pages of 16), a single key, and contexts longer than the windows below.
DECODE_LENS = [1, 15, 16, 17, 33, 70]


@pytest.mark.parametrize("window", [None, 8, 20])
def test_decode_sinks_do_not_depend_on_num_splits(window):
    """The sink enters the denominator once: one split, several, and more splits than tiles agree."""
    outs = [run_decode(DECODE_LENS, group=4, num_splits=n, window=window) for n in (1, 3, 8)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)


def test_decode_sinks_empty_sequence_gives_zeros():
    """A padding slot (seq_len 0) sees only the sink, whose value is zero."""
    q, k_cache, v_cache, tables, _, sinks = decode_case([9, 1], group=2)
    lens = torch.tensor([9, 0], dtype=torch.int32, device=DEVICE)
    out = attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, num_splits=2, sinks=sinks)
    assert (out[1] == 0).all()


def test_decode_asymmetric_head_dims_sinks_and_value_scale():
    """MiMo-V2-Flash's SWA layers: q/k 192 (padded to 256 in registers), v 128, sinks, a window, v_scale 0.707."""
    run_decode([5, 17, 40], group=2, num_splits=2, head_dim=192, v_head_dim=128, window=16, value_scale=0.707)


def test_decode_sinks_half_precision():
    run_decode(DECODE_LENS, group=8, num_splits=2, dtype=torch.bfloat16, window=20)


# ----------------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("window", [None, 8])
def test_prefill_sinks(window):
    """1, 7 and 33 new tokens, over prefixes that cross page edges and exceed the window."""
    run_prefill([1, 23, 40], [1, 7, 33], group=4, window=window)


def test_prefill_asymmetric_head_dims_sinks_and_value_scale():
    run_prefill([20, 35], [7, 33], group=2, head_dim=192, v_head_dim=128, window=16, value_scale=0.707)


def test_prefill_asymmetric_head_dims_without_sinks():
    """Dqk != Dv alone (MiMo's full-attention layers): no sinks, no window."""
    k_cache, v_cache, tables = make_paged_kv([12, 30], 2, 192, 16, torch.float32, v_head_dim=128)
    q = torch.randn(12 + 4, 4, 192).to(DEVICE)
    lens = torch.tensor([12, 30], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 12, 16], dtype=torch.int32, device=DEVICE)
    out = attention.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 12, 0.1)
    check(out, expected(q, k_cache, v_cache, tables, [12, 30], [12, 4], 0.1, None, None), torch.float32)


# ------------------------------------------------------------------------------------------------ transformers


def sliding_causal_mask(length, window):
    """transformers' additive mask [1, 1, L, L]: 0 where visible, -inf elsewhere."""
    pos = torch.arange(length)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    return torch.zeros(length, length).masked_fill(~visible, float("-inf"))[None, None]


@pytest.mark.parametrize("window", [None, 6])
def test_matches_transformers_gpt_oss_eager_attention(window):
    """gpt-oss's eager_attention_forward (sinks concatenated as a logit column, then dropped) on a 21-token
    sequence: prefill of all tokens, and decode of the last one, both from the paged cache."""
    length, num_kv_heads, group, head_dim, page_size = 21, 2, 4, 64, 8
    k_cache, v_cache, tables = make_paged_kv([length], num_kv_heads, head_dim, page_size, torch.float32, seed=3)
    k = reference.gather_context(k_cache.cpu(), tables[0].cpu(), length)  # [L, Hkv, D]
    v = reference.gather_context(v_cache.cpu(), tables[0].cpu(), length)
    q = torch.randn(length, num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(4))
    sinks = random_sinks(num_kv_heads * group).cpu()
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=group, training=False)
    want, _ = modeling_gpt_oss.eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        sliding_causal_mask(length, window), scaling=head_dim**-0.5)
    want = want[0].double()  # [L, Hq, D]

    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, length], dtype=torch.int32, device=DEVICE)
    prefill = attention.paged_prefill_attention(q.to(DEVICE), k_cache, v_cache, tables, lens, starts, length,
                                                head_dim**-0.5, window, sinks=sinks.to(DEVICE))
    torch.testing.assert_close(prefill.cpu().double(), want, atol=2e-5, rtol=2e-5)
    decode = attention.paged_decode_attention(q[-1:].to(DEVICE), k_cache, v_cache, tables, lens, head_dim**-0.5,
                                              window, num_splits=2, sinks=sinks.to(DEVICE))
    torch.testing.assert_close(decode.cpu().double(), want[-1:], atol=2e-5, rtol=2e-5)


def test_reference_matches_transformers_mimo_eager_attention():
    """MiMo-V2-Flash's SWA attention: q/k 192, v 128 scaled by v_scale before caching, sinks, a window."""
    mimo = pytest.importorskip("transformers.models.mimo_v2_flash.modeling_mimo_v2_flash")
    length, num_kv_heads, group, window, value_scale = 13, 2, 2, 5, 0.707
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(length, num_kv_heads * group, 192, generator=gen, dtype=torch.float64)
    k = torch.randn(length, num_kv_heads, 192, generator=gen, dtype=torch.float64)
    v = torch.randn(length, num_kv_heads, 128, generator=gen, dtype=torch.float64)
    sinks = random_sinks(num_kv_heads * group).cpu().double()
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=group, training=False)
    want, _ = mimo.eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], (v * value_scale).transpose(0, 1)[None],
        sliding_causal_mask(length, window).double(), scaling=192**-0.5)
    # One sequence in pages of one slot (page i holds position i).
    k_cache, v_cache = k.view(-1, 1, num_kv_heads, 192), v.view(-1, 1, num_kv_heads, 128)
    tables = torch.arange(length, dtype=torch.int32)[None]
    got = reference.paged_attention(q, k_cache, v_cache, tables, [length], [length], 192**-0.5, window, sinks,
                                    value_scale)
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)  # both take the softmax in float32


# --------------------------------------------------------------------------------------------- argument checks


def test_launchers_reject_bad_sinks_and_head_dims():
    q, k_cache, v_cache, tables, lens, sinks = decode_case([5, 9], group=2)
    decode = attention.paged_decode_attention
    with pytest.raises(ValueError, match="sinks must be float32"):
        decode(q, k_cache, v_cache, tables, lens, 0.1, sinks=sinks.double())
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        decode(q, k_cache, v_cache, tables, lens, 0.1, sinks=sinks[:2])
    with pytest.raises(ValueError, match="v head dim 32 is not supported"):
        decode(q, k_cache, v_cache[..., :32].contiguous(), tables, lens, 0.1)
    with pytest.raises(ValueError, match="v_cache shape"):
        decode(q, k_cache, v_cache[:, :8], tables, lens, 0.1)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4, 128\)"):
        decode(torch.zeros(2, 4, 192, device=DEVICE), torch.zeros(4, 16, 2, 192, device=DEVICE),
               torch.zeros(4, 16, 2, 128, device=DEVICE), tables, lens, 0.1, out=torch.empty(2, 4, 192))
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="sinks must be float32"):
        attention.paged_prefill_attention(q, k_cache, v_cache, tables, lens, starts, 1, 0.1, sinks=sinks.half())


def test_supported_head_dims_and_gate_cover_them():
    assert attention.supports_head_dims(192, 128) and attention.supports_head_dims(64, 64)
    assert not attention.supports_head_dims(128, 192)
    labels = {case.label for case in attention_kernels.gate_cases() if case.capability == 120}
    for dtype in ("bf16", "fp16", "fp32"):
        assert any(label.startswith(f"paged_decode {dtype} Dqk=192 Dv=128") for label in labels)
        assert any(label.startswith(f"paged_prefill {dtype} Dqk=192 Dv=128") and label.endswith("sinks")
                   for label in labels)
        assert f"paged_decode_reduce {dtype} Dv=64 sinks" in labels
