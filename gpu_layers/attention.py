"""Paged GQA attention kernels: split-K decode and causal prefill/extend over a paged KV cache.

Data flow (the new tokens' K/V are already written to the cache, so everything is read from it):
  k_cache, v_cache [num_blocks, P, Hkv, D]   pages of P slots (P a power of two), bf16 / fp16 / fp32
  block_tables [B, max_blocks] int32          sequence b's position n lives in page block_tables[b, n // P]
  seq_lens [B] int32                          context length of each sequence, new tokens included
  decode:  q [B, Hq, D]  -> out [B, Hq, Dv]   one new token per sequence (position seq_lens[b] - 1)
  prefill: q [T, Hq, D]  -> out [T, Hq, Dv]   sequence b owns tokens query_start_loc[b]:query_start_loc[b + 1],
                                              its last query_len positions, attending causally to all its context
Hq = G * Hkv with a GQA group G of 1..16. A sliding window W keeps keys k with p - W < k <= p for query position p.
V may be narrower than K (v_cache [.., Dv]; MiMo-V2-Flash's 192/128). Optional sinks [Hq] float32 (gpt-oss, MiMo)
add one logit s_h per head to each softmax's denominator, its probability dropped; an optional value scale
multiplies V (MiMo), applied to the output since attention is linear in V.

Why it is built this way:
- GQA packing: one program serves all G query heads of one KV head (G rows of the M side of the dot, padded to
  16), so each K/V tile is loaded once per group; decode then reads every KV byte exactly once and is bound by
  HBM bandwidth alone.
- Split-K decode ("flash decoding"): batch * Hkv programs cannot fill a GPU at small batch, so each sequence's
  context is cut into `num_splits` partitions of whole BLOCK_N tiles, each program writes a partial
  (max, sum, unnormalised acc) in fp32, and a small kernel combines them. The host picks `num_splits` from the
  shapes and the declared maximum context only, never from seq_lens, so launches are CUDA-graph safe;
  partitions past a sequence's end simply write an empty partial (max -inf, sum 0) that the combine ignores.
- Keys are gathered one row at a time through the block table (page = n >> page_shift), so any power-of-two page
  size works with any BLOCK_N; each row is a contiguous D-vector, so loads stay 16-byte wide.
- Softmax runs in base 2 (scale * log2 e folded into the scores); fully masked rows are guarded so that they give
  zeros, not NaN. fp32 caches use exact ("ieee") dots so they can serve as a precise test path.
- Head dims 64/96/128/192/256: non-powers of two are padded to the next power of two and masked. The q/k and v
  widths are separate constexprs, so an asymmetric pair pads each on its own and takes the wider one's tiles.
- Sinks: the sink is a key whose value is zero, so it only seeds the running (max, sum) with (s_h, 1). Prefill seeds
  each row with it; split-K decode seeds the reduce with it, never a split, so the sum counts it once whatever
  num_splits is. HAS_SINKS is a constexpr: models without sinks run the kernels unchanged.
- GQA group, page size and sliding window are run-time ints, so one compiled kernel serves them all and the gate
  cases (one per kernel, dtype, head dims and sinks on/off, per capability; gpu_layers.attention_cases) cover
  everything the launchers can select.
- Configs were chosen on an H200 (decode at batch 8-64 and 8K-32K contexts runs at 86-99% of the copy bandwidth)
  and, for 89/120, by compiling offline: 64-key tiles keep two programs per SM inside 99 KiB of shared memory.
The kernels are in gpu_layers.attention_kernels; the plain-PyTorch oracle and CPU path is
gpu_layers.reference.paged_attention.
"""

from __future__ import annotations

import torch
import triton

from gpu_layers.attention_kernels import (
    LOG2E,
    paged_decode_kernel,
    paged_decode_reduce_kernel,
    paged_prefill_kernel,
)
from gpu_layers.capability import capability_of, num_sms, select

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MAX_GROUP = 16
SPLIT_BLOCK = 16  # partials combined per step of the reduce kernel
MAX_SPLITS = 256
PROGRAMS_PER_SM = 2  # decode programs wanted per multiprocessor over the whole grid
MIN_TILES_PER_SPLIT = 2  # below this a partition costs more in partials and combining than it saves
# (q/k head dim, v head dim) pairs besides the equal ones: MiMo-V2-Flash's 192/128.
ASYMMETRIC_HEAD_DIMS = ((192, 128),)

# Configs are keyed by (head dim padded to a power of two, bytes per element). fp32 is the exact test and
# debugging path: its "ieee" dots run on the FMA units with operands in registers, so it takes small tiles and one
# stage (the warp counts are whatever ptxas compiles without a spill on each target; the windowed prefill's load
# bound, which keeps released pages unread, took sm_90's D=256 and sm_120's D=128 fp32 tiles from 4 to 8 warps).
# Decode: (BLOCK_N, num_warps, num_stages). K and V tiles are gathered with 16-byte cp.async into shared memory.
_DECODE_FP32 = {(64, 4): (32, 4, 1), (128, 4): (16, 4, 1), (256, 4): (16, 4, 1)}
DECODE_CONFIGS = {
    89: {(64, 2): (64, 4, 3), (128, 2): (64, 4, 3), (256, 2): (32, 4, 3), **_DECODE_FP32},
    90: {(64, 2): (128, 4, 3), (128, 2): (128, 4, 3), (256, 2): (64, 8, 3), **_DECODE_FP32},
    120: {(64, 2): (64, 4, 3), (128, 2): (64, 4, 3), (256, 2): (32, 4, 3), **_DECODE_FP32},
}
# Prefill: (BLOCK_M, BLOCK_N, num_warps, num_stages). 99 KiB parts (89, 120) keep D=256 at 64 x 32 tiles.
PREFILL_CONFIGS = {
    89: {(64, 2): (128, 64, 8, 2), (128, 2): (128, 64, 8, 2), (256, 2): (64, 32, 8, 2),
         (64, 4): (32, 16, 4, 1), (128, 4): (16, 16, 8, 1), (256, 4): (16, 16, 8, 1)},
    90: {(64, 2): (128, 128, 8, 2), (128, 2): (128, 128, 8, 2), (256, 2): (64, 64, 8, 3),
         (64, 4): (32, 16, 4, 1), (128, 4): (16, 16, 8, 1), (256, 4): (16, 16, 8, 1)},
    120: {(64, 2): (128, 64, 8, 2), (128, 2): (128, 64, 8, 2), (256, 2): (64, 32, 8, 2),
          (64, 4): (32, 16, 4, 1), (128, 4): (16, 16, 8, 1), (256, 4): (16, 16, 8, 1)},
}
REDUCE_CONFIG = (4, 1)  # (num_warps, num_stages): a tiny memory-bound combine, the same everywhere


# ----------------------------------------------------------------------------------------------- host side


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _padded(head_dim: int) -> int:
    return triton.next_power_of_2(head_dim)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 operands read it: exact fp32 dots


def _config_key(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    # Unequal dims take the wider one's tiles: K and V tiles then need no more shared memory or registers than a
    # symmetric head of that width, which the tables were chosen for.
    return max(_padded(head_dim), _padded(v_head_dim)), dtype.itemsize


def supports_head_dims(head_dim: int, v_head_dim: int) -> bool:
    """Whether the kernels serve q/k head dim `head_dim` with v head dim `v_head_dim`."""
    if head_dim == v_head_dim:
        return head_dim in SUPPORTED_HEAD_DIMS
    return (head_dim, v_head_dim) in ASYMMETRIC_HEAD_DIMS


def head_dim_pairs() -> tuple[tuple[int, int], ...]:
    """Every supported (q/k head dim, v head dim)."""
    return tuple((d, d) for d in SUPPORTED_HEAD_DIMS) + ASYMMETRIC_HEAD_DIMS


def decode_config(capability: int, head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None
                  ) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel."""
    return select(DECODE_CONFIGS, capability)[_config_key(head_dim, v_head_dim or head_dim, dtype)]


def prefill_config(capability: int, head_dim: int, dtype: torch.dtype, v_head_dim: int | None = None
                   ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel."""
    return select(PREFILL_CONFIGS, capability)[_config_key(head_dim, v_head_dim or head_dim, dtype)]


def _dims(head_dim: int, v_head_dim: int) -> dict[str, int]:
    """The kernels' head-dim constexprs: non-powers of two are padded in registers and masked, not in memory."""
    return {"QK_DIM": head_dim, "QK_PAD": _padded(head_dim), "V_DIM": v_head_dim, "V_PAD": _padded(v_head_dim)}


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Partitions per sequence: the power of two that brings the grid nearest to, not over, PROGRAMS_PER_SM
    programs per multiprocessor, with at least MIN_TILES_PER_SPLIT tiles of the longest context each. (Measured on
    an H200: a grid just past a whole wave costs a tail, and more splits than that only add per-program start-up.)"""
    num_tiles = triton.cdiv(max(max_seq_len, 1), block_n)
    wanted = max(1, PROGRAMS_PER_SM * num_sms // (num_seqs * num_kv_heads))
    wanted = min(wanted, triton.cdiv(num_tiles, MIN_TILES_PER_SPLIT), MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1)


def _check_rows(name: str, t: torch.Tensor) -> None:
    # The kernels tell the compiler that row offsets are multiples of 16 elements (16-byte vector loads).
    _check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    _check(all(s % 16 == 0 for s in t.stride()[:-1]), f"{name} strides {t.stride()} are not multiples of 16")


def _check_paged(q, k_cache, v_cache, block_tables, seq_lens, num_seqs: int) -> tuple[int, int]:
    """Checks what both kernels read from the paged cache; returns (GQA group, log2 of the page size)."""
    _check(q.dim() == 3, f"q must be 3-D [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    _check(q.dtype in SUPPORTED_DTYPES, f"q must be bf16, fp16 or fp32, got {q.dtype}")
    _check_rows("q", q)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(cache.dim() == 4, f"{name} must be 4-D [num_blocks, block_size, kv_heads, head_dim]")
        _check(cache.dtype == q.dtype, f"{name} dtype {cache.dtype} differs from q's {q.dtype}")
        _check(cache.device == q.device, f"{name} is on {cache.device}, q on {q.device}")
        _check_rows(name, cache)
    _check(v_cache.shape[:3] == k_cache.shape[:3],
           f"v_cache shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)} before the head dim")
    num_q_heads, head_dim, v_head_dim = q.shape[1], q.shape[2], v_cache.shape[3]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    _check(k_cache.shape[3] == head_dim, f"k_cache head dim {k_cache.shape[3]} differs from q's {head_dim}")
    _check(supports_head_dims(head_dim, v_head_dim),
           f"head_dim {head_dim} with v head dim {v_head_dim} is not supported: equal dims of {SUPPORTED_HEAD_DIMS} "
           f"or (q/k, v) of {ASYMMETRIC_HEAD_DIMS}")
    _check(page_size & (page_size - 1) == 0, f"k_cache block size {page_size} is not a power of two")
    _check(num_q_heads % num_kv_heads == 0, f"q heads {num_q_heads} are not a multiple of kv heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    _check(group <= MAX_GROUP, f"GQA group {group} is larger than {MAX_GROUP}")
    _check(block_tables.dtype == torch.int32 and block_tables.dim() == 2, "block_tables must be int32 [B, blocks]")
    _check(block_tables.shape[0] == num_seqs, f"block_tables has {block_tables.shape[0]} rows for {num_seqs} seqs")
    _check(block_tables.stride(1) == 1, "block_tables must be contiguous in its last dim")
    _check(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), f"seq_lens must be int32 [{num_seqs}]")
    _check(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
    return group, page_size.bit_length() - 1


def _output(out, shape: tuple[int, ...], q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return q.new_empty(shape)
    _check(tuple(out.shape) == shape, f"out must have shape {shape}, got {tuple(out.shape)}")
    _check(out.dtype == q.dtype, f"out dtype {out.dtype} differs from q's {q.dtype}")
    _check(out.device == q.device, f"out is on {out.device}, q on {q.device}")
    _check_rows("out", out)
    return out


def _check_window(sliding_window) -> int:
    _check(sliding_window is None or sliding_window > 0, f"sliding_window must be None or > 0: {sliding_window}")
    return sliding_window or 0


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The sinks to pass to the kernels: with none, an empty float32 tensor stands in (unread), so the launch
    keeps the pointer type the gate compiles."""
    if sinks is None:
        return torch.empty(0, dtype=torch.float32, device=q.device)
    num_q_heads = q.shape[1]
    _check(sinks.dtype == torch.float32, f"sinks must be float32, got {sinks.dtype}")
    _check(tuple(sinks.shape) == (num_q_heads,), f"sinks must have shape ({num_q_heads},), got {tuple(sinks.shape)}")
    _check(sinks.device == q.device, f"sinks is on {sinks.device}, q on {q.device}")
    _check(sinks.is_contiguous(), "sinks must be contiguous")
    return sinks


def _apply_value_scale(out: torch.Tensor, value_scale: float) -> torch.Tensor:
    # Attention is linear in V, so scaling the output equals scaling V before it is cached (MiMo's v_scale), at
    # the cost of one pass over the (small) output instead of a kernel variant.
    if value_scale != 1.0:
        out.mul_(value_scale)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    sinks: torch.Tensor | None = None,
    value_scale: float = 1.0,
) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] over its paged context (K [.., D], V [.., Dv]) -> [B, Hq, Dv].
    Reference: gpu_layers.reference.paged_attention with query_lens all 1. `max_seq_len` bounds the contexts
    (default: what the block table can hold); with `num_splits` None the split count comes from it and the batch
    shape. `sinks` [Hq] float32: one more logit per head in each softmax denominator (gpt-oss); `value_scale`
    multiplies V (MiMo)."""
    num_seqs = q.shape[0]
    group, page_shift = _check_paged(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    window = _check_window(sliding_window)
    sinks_arg = _check_sinks(sinks, q)
    num_q_heads, head_dim, v_head_dim = q.shape[1], q.shape[2], v_cache.shape[3]
    num_kv_heads = k_cache.shape[2]
    out = _output(out, (num_seqs, num_q_heads, v_head_dim), q)
    if num_seqs == 0:
        return out

    block_n, num_warps, num_stages = decode_config(capability_of(q.device), head_dim, q.dtype, v_head_dim)
    if num_splits is None:
        max_seq_len = max_seq_len or block_tables.shape[1] << page_shift
        if window:
            max_seq_len = min(max_seq_len, window + block_n)  # a window spans at most this many tile keys
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, block_n, num_sms(q.device))
    _check(1 <= num_splits <= 65535, f"num_splits must be in 1..65535, got {num_splits}")

    partial_acc = torch.empty((num_seqs, num_q_heads, num_splits, v_head_dim), dtype=torch.float32,
                              device=q.device)
    partial_max = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    partial_sum = torch.empty_like(partial_max)
    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, partial_acc, partial_max, partial_sum,
        scale * LOG2E, window, group, num_splits, page_shift,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        **_dims(head_dim, v_head_dim), BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    reduce_warps, reduce_stages = REDUCE_CONFIG
    paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
        partial_acc, partial_max, partial_sum, sinks_arg, out, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=v_head_dim, D_PAD=_padded(v_head_dim), SPLIT_BLOCK=SPLIT_BLOCK, HAS_SINKS=sinks is not None,
        num_warps=reduce_warps, num_stages=reduce_stages,
    )
    return _apply_value_scale(out, value_scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    value_scale: float = 1.0,
) -> torch.Tensor:
    """Each sequence's new tokens q [T, Hq, D] (its last query_len positions) attend causally over its paged
    context (K [.., D], V [.., Dv]) -> [T, Hq, Dv]. Reference: gpu_layers.reference.paged_attention.
    `max_query_len` (a host int, at least the longest query) sizes the grid. `sinks` and `value_scale` as in
    paged_decode_attention."""
    _check(seq_lens.dim() == 1, f"seq_lens must be 1-D [B], got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    group, page_shift = _check_paged(q, k_cache, v_cache, block_tables, seq_lens, num_seqs)
    _check(query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,),
           f"query_start_loc must be int32 [{num_seqs + 1}]")
    _check(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    _check(query_start_loc.device == q.device, f"query_start_loc is on {query_start_loc.device}, q on {q.device}")
    _check(max_query_len >= 1, f"max_query_len must be >= 1, got {max_query_len}")
    window = _check_window(sliding_window)
    sinks_arg = _check_sinks(sinks, q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_cache.shape[2], v_cache.shape[3]
    out = _output(out, (num_tokens, num_q_heads, v_head_dim), q)
    if num_seqs == 0 or num_tokens == 0:
        return out

    block_m, block_n, num_warps, num_stages = prefill_config(capability_of(q.device), head_dim, q.dtype,
                                                             v_head_dim)
    grid = (triton.cdiv(max_query_len, block_m // group), num_seqs, num_kv_heads)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, sinks_arg,
        scale * LOG2E, window, group, page_shift,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        **_dims(head_dim, v_head_dim), BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=_dot_precision(q.dtype),
        HAS_SINKS=sinks is not None, num_warps=num_warps, num_stages=num_stages,
    )
    return _apply_value_scale(out, value_scale)


# ----------------------------------------------------------------------------------------------- bench


def bench_cases() -> list[tuple]:
    """Decode and prefill at Qwen3-30B-A3B-like heads, with the SDPA baseline (gpu_layers.attention_cases)."""
    from gpu_layers import attention_cases

    return attention_cases.bench()
