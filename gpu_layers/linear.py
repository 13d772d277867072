"""Linear layers on quantized GPU weights: FP8 (per-channel or 128x128 block scales) and W4A16 (packed int4).

Data flow (T tokens, K input features, N output features):
- `fp8_linear(x [T, K], weight fp8 [N, K], weight_scale)`: the activations are quantized dynamically to e4m3 by
  `fp8_quantize_kernel` (one scale per token, or per token and 128-column group for block scales) into
  x_q fp8 [T, K] and x_scale fp32 [T, ceil(K / group)]; `fp8_gemm_kernel` multiplies fp8 x fp8 with float32
  accumulation. Per-channel weight_scale [N, 1] or [N] (compressed-tensors float-quantized): the scales are linear,
  so y = acc * x_scale[t] * w_scale[n] once in the epilogue. Block weight_scale [ceil(N / 128), ceil(K / 128)]
  (DeepSeek-V3's weight_scale_inv): every K block has its own scales, so each K tile's product is scaled inside
  the loop, acc += dot(x_q, w) * x_scale[t, kb] * w_scale[nb, kb] (BLOCK_K divides the 128-column block).
- `w4a16_linear(x [T, K], weight_packed int32 [N, ceil(K / 8)], weight_scale [N, ceil(K / group)])`
  (compressed-tensors pack-quantized): each tile of packed words is unpacked in registers, (nibble - 8) * scale
  is cast to the activation dtype and fed to tl.dot with float32 accumulation. A K tile takes one scale per row,
  so BLOCK_K divides the group (smaller for group 32), unless one group covers all of K.

Both GEMMs have two regimes, chosen by T: decode (T <= 16) is a matrix-vector product bound by reading the
weights once, so it uses BLOCK_M = 16 (the smallest tensor-core tile) and splits K over several programs when
the output alone has too few tiles to keep every SM streaming; the splits write float32 partials [S, T, N] that
`splitk_reduce_kernel` sums (deterministic, no atomics) before the bias and the cast. Prefill uses large tiles.
Configs are per capability: SM120 and Ada have 99 KiB of shared memory per block, so their pipelines are
shallower than Hopper's; every config the launchers can pick is listed by `gate_cases` and compiled by the gate.

Alignment: the launchers require K % 16 == 0 (FP8) and K % 32 == 0 with 16-byte x rows (W4A16), true of every
real model, and the kernels state it to the compiler; without it the tiles load element by element, are not
software-pipelined (cp.async needs 4+ byte pieces) and the 128-wide FP8 tiles spill registers.

The references (`fp8_linear_reference`, `w4a16_linear_reference`) dequantize exactly as the checkpoint readers
do (hybrid.checkpoint, hybrid.compressed_tensors) and quantize the activations as the kernel does, bit for bit
(the kernel rounds to e4m3 itself, so no target's conversion path can differ).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gpu_layers.capability import CAPABILITIES, GateCase, capability_of, num_sms, select

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_ABSMAX = 1e-12  # an all-zero group still gets a positive scale
MAX_DECODE_TOKENS = 16  # up to here the decode configs (BLOCK_M = 16, split-K) are used
MIN_TILES_PER_SPLIT = 2  # a split of K keeps at least this many K tiles, so its loads still pipeline
MIN_W4A16_BLOCK_K = 32  # smallest K tile a W4A16 group may force


def _config(block_m, block_n, block_k, num_warps, num_stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


# Shared memory is (num_stages - 1) buffered tiles (checked by compiling every config, see gate_cases).
# Decode: 16 x 128 activations and 64 x 128 weights a stage (fp8 10 KiB, bf16 + int4 8 KiB plus the 16 KiB
# dequantized tile), deep pipelines keep bytes in flight. FP8 prefill: 128 x 128 x 128 (32 KiB a stage, 64 KiB of
# SM120's 99 KiB at 3 stages); with block scales each K tile's product is a second float32 tile live beside the
# accumulator, so 64-row tiles (and 64-deep K off Hopper) keep it in registers. W4A16 prefill: 128 x 128 x 64
# (20 KiB a stage plus the dequantized tile, 56 KiB at 3 stages); Hopper has room for one stage more.
FP8_CONFIGS = {
    89: {"decode": _config(16, 64, 128, 4, 4), "prefill": _config(128, 128, 128, 8, 3),
         "prefill_block": _config(64, 128, 64, 8, 4)},
    90: {"decode": _config(16, 64, 128, 4, 5), "prefill": _config(128, 128, 128, 8, 4),
         "prefill_block": _config(64, 128, 128, 8, 4)},
    120: {"decode": _config(16, 64, 128, 4, 4), "prefill": _config(128, 128, 128, 8, 3),
          "prefill_block": _config(64, 128, 64, 8, 4)},
}
W4A16_CONFIGS = {
    89: {"decode": _config(16, 64, 128, 4, 4), "prefill": _config(128, 128, 64, 8, 3)},
    90: {"decode": _config(16, 64, 128, 4, 5), "prefill": _config(128, 128, 64, 8, 4)},
    120: {"decode": _config(16, 64, 128, 4, 4), "prefill": _config(128, 128, 64, 8, 3)},
}


# ----------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _round_to_e4m3(v):
    """float32 v, |v| <= 448 -> v rounded to the nearest e4m3 value (ties to even), still float32. Rounding here
    makes the final conversion exact, so the codes are the same whichever path a target's fp32 -> fp8 conversion
    takes (and under Triton's interpreter, whose own conversion drops the carry of a rounded-up mantissa)."""
    bits = v.to(tl.uint32, bitcast=True)
    # Normal e4m3 numbers keep 3 of float32's 23 mantissa bits; a carry moves into the exponent as it should.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2**-6 e4m3 is subnormal, spaced 2**-9: adding 1.5 * 2**14 (whose ulp is 2**-9) rounds to that grid.
    # Rounded on |v|, then v's sign bit put back, so tiny negative values become -0 as the conversion makes them.
    magnitude = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    subnormal = (magnitude | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def fp8_quantize_kernel(
    x_ptr, q_ptr, scale_ptr,
    K, x_row_stride, group_size, num_groups,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per token and GROUPS column groups: scale = absmax / 448, q = e4m3(x / scale) per group.
    A group's first BLOCK columns stay in registers between the two passes; the configs make BLOCK cover a whole
    row of the usual sizes (per-token scales) or put 16 groups of 128 in one program (block scales), so a
    program waits on one load, not on a loop of them."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    starts = groups * group_size
    ends = tl.minimum(starts + group_size, K)
    offs = starts[:, None] + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]: each group's first columns
    is_group = (groups < num_groups)[:, None]
    x_row = x_ptr + row * x_row_stride
    first = tl.load(x_row + offs, mask=is_group & (offs < ends[:, None]), other=0.0).to(tl.float32)
    absmax = tl.max(tl.abs(first), axis=1)
    for k in range(BLOCK, group_size, BLOCK):
        x = tl.load(x_row + k + offs, mask=is_group & (k + offs < ends[:, None]), other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.max(tl.abs(x), axis=1))
    # IEEE division (div_rn) in both places, so the scales and values match the PyTorch reference exactly.
    scale = tl.math.div_rn(tl.maximum(absmax, 1e-12), 448.0)[:, None]
    tl.store(scale_ptr + row * num_groups + groups[:, None], scale, mask=is_group)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(first, scale), -448.0, 448.0))
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=is_group & (offs < ends[:, None]))
    for k in range(BLOCK, group_size, BLOCK):
        mask = is_group & (k + offs < ends[:, None])
        x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0))
        tl.store(q_ptr + row * K + k + offs, q.to(tl.float8e4nv), mask=mask)


@triton.jit
def fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr,
    M, N, K, c_row_stride, c_split_stride, num_k_groups, scale_block_n, scale_block_k, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """c[s] = a_q [M, K] x b [N, K]^T over split s's K tiles, scaled; a_scale [M, num_k_groups], b_scale
    [N] (per channel) or [ceil(N / scale_block_n), num_k_groups] (blocks)."""
    # Equal to K (the launcher checks K % 16 == 0), written so the compiler knows every row starts 16-byte aligned
    # and loads the tiles as vectors, which the software pipeline needs (tl.multiple_of does not reach a scalar).
    K = K // 16 * 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * K
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * K
    a_scales = a_scale_ptr + offs_m * num_k_groups
    b_scales = b_scale_ptr + (offs_n // scale_block_n) * num_k_groups  # per channel: scale_block_n = 1
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile in range(first_tile, last_tile):
        k = tile * BLOCK_K + offs_k
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_rows + k[None, :], mask=mask_n[:, None] & (k[None, :] < K), other=0.0)
        if IS_BLOCK_SCALED:
            k_group = (tile * BLOCK_K) // scale_block_k
            a_scale = tl.load(a_scales + k_group, mask=mask_m, other=0.0)
            b_scale = tl.load(b_scales + k_group, mask=mask_n, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not IS_BLOCK_SCALED:
        a_scale = tl.load(a_scales, mask=mask_m, other=0.0)
        acc *= a_scale[:, None] * tl.load(b_scales, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + split * c_split_stride + offs_m[:, None].to(tl.int64) * c_row_stride + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def w4a16_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr,
    M, N, K, x_row_stride, c_row_stride, c_split_stride, group_size, num_groups, tiles_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """c[s] = x [M, K] x dequant(w_packed [N, ceil(K / 8)], scale [N, num_groups])^T over split s's K tiles."""
    # Unchanged values (the launcher checks K % 32 == 0 and x_row_stride % 8 == 0), written so the compiler knows
    # that rows of x and of packed words start 16-byte aligned and loads the tiles as vectors, as pipelining needs.
    K = K // 32 * 32
    x_row_stride = x_row_stride // 8 * 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_word = tl.arange(0, BLOCK_K // 8)
    shifts = (offs_k % 8) * 4  # column 8j + i sits in bits 4i..4i+3 of word j
    mask_m, mask_n = offs_m < M, offs_n < N
    num_words = K // 8
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * num_words
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile in range(first_tile, last_tile):
        k = tile * BLOCK_K + offs_k
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
        word = tile * (BLOCK_K // 8) + offs_word
        packed = tl.load(w_rows + word[None, :], mask=mask_n[:, None] & (word[None, :] < num_words), other=0)
        # Repeat every word 8 times along K ([BLOCK_N, BLOCK_K]), then each column takes its own nibble.
        packed = tl.interleave(packed, packed)
        packed = tl.interleave(packed, packed)
        packed = tl.interleave(packed, packed)
        nibbles = ((packed >> shifts[None, :]) & 0xF) - 8
        # The tile lies in one group (BLOCK_K divides the group), so one scale per row.
        scale = tl.load(scale_ptr + offs_n * num_groups + (tile * BLOCK_K) // group_size, mask=mask_n, other=0.0)
        w = (nibbles.to(tl.float32) * scale.to(tl.float32)[:, None]).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + split * c_split_stride + offs_m[:, None].to(tl.int64) * c_row_stride + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def splitk_reduce_kernel(
    partial_ptr, bias_ptr, c_ptr,
    M, N, c_row_stride, num_splits,
    HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """c [M, N] = sum over s of partial [S, M, N] (float32) + bias, cast to c's dtype. BLOCK_S splits are loaded
    at once (one load's latency for the usual split counts, not one per split)."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for split in range(0, num_splits, BLOCK_S):
        rows = (split + offs_s).to(tl.int64) * M + row
        tile = tl.load(partial_ptr + rows[:, None] * N + offs_n[None, :],
                       mask=(split + offs_s < num_splits)[:, None] & mask[None, :], other=0.0)
        acc += tl.sum(tile, axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + row * c_row_stride + offs_n, acc.to(c_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------------------------------- references


PACK_FACTOR = 8  # 4-bit values per int32 word (compressed-tensors pack-quantized)


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight float8 [N, K] * scale [ceil(N / bn), ceil(K / bk)] broadcast over its blocks -> float32 [N, K]."""
    rows, cols = weight.shape
    expanded = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * expanded


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [N, ceil(K / 8)], column 8j + i in bits 4i..4i+3 stored as value + 8 -> int8 values [N, K]. Written
    here, not imported from the engine's loader: kernels never import the engine, and the test oracle stays
    independent of the code that loads the weights."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int64, device=packed.device) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [N, K / 8, 8]
    return (nibbles.flatten(1)[:, :cols] - 8).to(torch.int8)


def fp8_quantize_reference(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8_e4m3fn [T, K], float32 scales [T, ceil(K / group)]), groups of `group_size` columns
    (None: the whole row); scale = max(absmax, 1e-12) / 448, q = e4m3(clamp(x / scale)), as the kernel does."""
    num_tokens, num_cols = x.shape
    group_size = group_size or num_cols
    num_groups = triton.cdiv(num_cols, group_size)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group_size - num_cols))
    groups = padded.view(num_tokens, num_groups, group_size)
    absmax = groups.abs().amax(dim=-1).clamp_min(MIN_ABSMAX)
    # A true division: on CUDA, dividing by a Python number multiplies by its rounded reciprocal instead.
    scale = absmax / torch.full_like(absmax, FP8_MAX)
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(num_tokens, -1)[:, :num_cols]
    return q.to(torch.float8_e4m3fn), scale


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    block_shape: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_linear` in PyTorch: the activations quantized as the kernel does, both sides dequantized, float32."""
    num_cols = x.shape[1]
    group_size = num_cols if block_shape is None else block_shape[1]
    q, scale = fp8_quantize_reference(x, group_size)
    x_dequant = q.float() * scale.repeat_interleave(group_size, dim=1)[:, :num_cols]
    if block_shape is None:
        w = weight.float() * weight_scale.float().reshape(-1, 1)
    else:
        w = dequantize_fp8_block(weight, weight_scale.float(), block_shape)
    y = x_dequant @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def w4a16_linear_reference(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`w4a16_linear` in PyTorch: w = ((nibble - 8) * scale) in x's dtype, then a float32 matmul."""
    num_cols = x.shape[1]
    group_size = group_size or num_cols
    values = unpack_int4(weight_packed, num_cols)
    scale = weight_scale.float().repeat_interleave(group_size, dim=1)[:, :num_cols]
    w = (values.float() * scale).to(x.dtype)
    y = x.float() @ w.float().T
    return (y if bias is None else y + bias.float()).to(x.dtype)


# --------------------------------------------------------------------------------------------------- launchers


# Memory-bound row kernels with no shared memory to speak of: the same entry for every target, keyed so that one
# can be tuned alone. fp8_quantize_kernel: BLOCK (the smallest covering the group, else the largest) -> config;
# each program quantizes about 2K-8K values.
QUANT_CONFIGS = {cc: {128: dict(GROUPS=16, num_warps=4), 2048: dict(GROUPS=1, num_warps=4),
                      8192: dict(GROUPS=1, num_warps=16)} for cc in CAPABILITIES}
REDUCE_CONFIGS = {cc: dict(BLOCK_S=8, BLOCK_N=256, num_warps=4) for cc in CAPABILITIES}


@functools.cache
def _regime(num_tokens: int) -> str:
    return "decode" if num_tokens <= MAX_DECODE_TOKENS else "prefill"


def _fp8_config_key(regime: str, is_block_scaled: bool) -> str:
    # Block scales keep a second 128 x 128 float32 tile live (each K tile's product before it is scaled), which
    # spills at 128 x 128 per block: prefill takes 64-row tiles with them.
    return "prefill_block" if regime == "prefill" and is_block_scaled else regime


def _tiles_per_split(num_out_tiles: int, num_k_tiles: int, device: torch.device, regime: str) -> int:
    """K tiles per program: all of K in prefill; in decode, K is split until there are ~2 programs per SM."""
    if regime != "decode":
        return num_k_tiles
    wanted = max(1, 2 * num_sms(device) // num_out_tiles)
    num_splits = max(1, min(wanted, num_k_tiles // MIN_TILES_PER_SPLIT))
    return triton.cdiv(num_k_tiles, num_splits)


def _check_x(x: torch.Tensor, k_multiple: int, row_stride_multiple: int = 1) -> None:
    """x [T, K] bf16/fp16 with contiguous rows; K and the row stride multiples of what the kernel assumes."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {list(DTYPES)}")
    if x.shape[1] == 0 or x.shape[1] % k_multiple:
        raise ValueError(f"x has K = {x.shape[1]} columns, must be a positive multiple of {k_multiple}")
    if x.stride(0) % row_stride_multiple:
        raise ValueError(f"x row stride {x.stride(0)} must be a multiple of {row_stride_multiple} (16-byte rows)")


def _check_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, x: torch.Tensor) -> None:
    """A weight-side tensor: exactly `shape` and `dtype`, contiguous, on x's device."""
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def _output(x: torch.Tensor, num_out: int, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """Checks bias [N] and out [T, N] (x's dtype, out rows contiguous), allocating out when not given."""
    if bias is not None:
        _check_tensor("bias", bias, (num_out,), x.dtype, x)
    if out is None:
        return torch.empty(x.shape[0], num_out, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (x.shape[0], num_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{x.shape[0]}, {num_out}] {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, x on {x.device}")
    return out


def _launch_gemm(launch, x: torch.Tensor, bias, out: torch.Tensor, config: dict, regime: str) -> torch.Tensor:
    """Runs `launch(grid, c, c_row_stride, c_split_stride, tiles_per_split, has_bias)` into out directly, or into
    float32 partials [S, T, N] that `splitk_reduce_kernel` sums into out with the bias."""
    (num_tokens, num_cols), num_out = x.shape, out.shape[1]
    num_n, num_m = triton.cdiv(num_out, config["BLOCK_N"]), triton.cdiv(num_tokens, config["BLOCK_M"])
    num_k_tiles = triton.cdiv(num_cols, config["BLOCK_K"])
    tiles_per_split = _tiles_per_split(num_n * num_m, num_k_tiles, x.device, regime)
    num_splits = triton.cdiv(num_k_tiles, tiles_per_split)
    if num_splits == 1:
        launch((num_n, num_m, 1), out, out.stride(0), 0, tiles_per_split, bias is not None)
        return out
    partial = torch.empty(num_splits, num_tokens, num_out, dtype=torch.float32, device=x.device)
    launch((num_n, num_m, num_splits), partial, num_out, num_tokens * num_out, tiles_per_split, False)
    reduce = select(REDUCE_CONFIGS, capability_of(x.device))
    grid = (num_tokens, triton.cdiv(num_out, reduce["BLOCK_N"]))
    splitk_reduce_kernel[grid](partial, x if bias is None else bias, out, num_tokens, num_out, out.stride(0),
                               num_splits, HAS_BIAS=bias is not None, **reduce)
    return out


def fp8_quantize(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] bf16/fp16 -> (float8_e4m3fn [T, K], float32 scales [T, ceil(K / group)]); group None: per token."""
    _check_x(x, k_multiple=1)
    num_tokens, num_cols = x.shape
    group_size = group_size or num_cols
    num_groups = triton.cdiv(num_cols, group_size)
    q = torch.empty(num_tokens, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_tokens, num_groups, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return q, scale
    configs = select(QUANT_CONFIGS, capability_of(x.device))
    block = next((b for b in sorted(configs) if b >= min(group_size, num_cols)), max(configs))
    config = configs[block]
    grid = (num_tokens, triton.cdiv(num_groups, config["GROUPS"]))
    fp8_quantize_kernel[grid](x, q, scale, num_cols, x.stride(0), group_size, num_groups, BLOCK=block, **config)
    return q, scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_shape: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] bf16/fp16 @ fp8 weight [N, K]^T -> [T, N] in x's dtype. weight_scale: [N, 1] or [N] per channel,
    or [ceil(N / bn), ceil(K / bk)] for block_shape (bn, bk); any float dtype (float32 saves a conversion).
    K must be a multiple of 16 (every real model's is): the kernel reads 16-byte-aligned fp8 rows."""
    _check_x(x, k_multiple=16)
    num_cols, num_out = x.shape[1], weight.shape[0]
    _check_tensor("weight", weight, (num_out, num_cols), torch.float8_e4m3fn, x)
    regime = _regime(x.shape[0])
    config = dict(select(FP8_CONFIGS, capability_of(x.device))[_fp8_config_key(regime, block_shape is not None)])
    if block_shape is None:
        scale_block_n, group_size = 1, num_cols
        weight_scale = weight_scale.reshape(-1) if weight_scale.shape == (num_out, 1) else weight_scale
        scale_shape = (num_out,)
    else:
        scale_block_n, group_size = (int(b) for b in block_shape)
        if scale_block_n <= 0 or group_size <= 0 or group_size % config["BLOCK_K"]:
            raise ValueError(f"block_shape {tuple(block_shape)} must be positive, columns a multiple of "
                             f"{config['BLOCK_K']}")
        scale_shape = (triton.cdiv(num_out, scale_block_n), triton.cdiv(num_cols, group_size))
    if not weight_scale.dtype.is_floating_point:
        raise ValueError(f"weight_scale must be a float tensor, got {weight_scale.dtype}")
    weight_scale = weight_scale.to(torch.float32)
    _check_tensor("weight_scale", weight_scale, scale_shape, torch.float32, x)
    out = _output(x, num_out, bias, out)
    if x.shape[0] == 0 or num_out == 0:
        return out
    q, x_scale = fp8_quantize(x, group_size)

    def launch(grid, c, c_row_stride, c_split_stride, tiles_per_split, has_bias):
        fp8_gemm_kernel[grid](q, x_scale, weight, weight_scale, x if bias is None else bias, c,
                              x.shape[0], num_out, num_cols, c_row_stride, c_split_stride, x_scale.shape[1],
                              scale_block_n, group_size, tiles_per_split,
                              IS_BLOCK_SCALED=block_shape is not None, HAS_BIAS=has_bias, **config)

    return _launch_gemm(launch, x, bias, out, config, regime)


def _w4a16_block_k(block_k: int, group_size: int, num_groups: int) -> int:
    """The config's BLOCK_K, shrunk to divide the group when K has several groups (a tile takes one scale)."""
    if num_groups == 1:
        return block_k
    block_k = min(block_k, group_size & -group_size)  # the largest power of two dividing the group
    if block_k < MIN_W4A16_BLOCK_K:
        raise ValueError(f"group_size {group_size} must be a multiple of {MIN_W4A16_BLOCK_K} (or cover all of K)")
    return block_k


def w4a16_linear(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
    bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] bf16/fp16 @ int4 weight^T -> [T, N] in x's dtype. weight_packed int32 [N, ceil(K / 8)] (column
    8j + i in bits 4i..4i+3 of word j, stored as value + 8), weight_scale [N, ceil(K / group)] in x's dtype;
    group_size None: one scale per row. K must be a multiple of 32 and x's row stride of 8 (16-byte rows)."""
    _check_x(x, k_multiple=32, row_stride_multiple=8)
    num_cols, num_out = x.shape[1], weight_packed.shape[0]
    group_size = group_size or num_cols
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    num_groups = triton.cdiv(num_cols, group_size)
    _check_tensor("weight_packed", weight_packed, (num_out, triton.cdiv(num_cols, PACK_FACTOR)), torch.int32, x)
    _check_tensor("weight_scale", weight_scale, (num_out, num_groups), x.dtype, x)
    regime = _regime(x.shape[0])
    config = dict(select(W4A16_CONFIGS, capability_of(x.device))[regime])
    config["BLOCK_K"] = _w4a16_block_k(config["BLOCK_K"], group_size, num_groups)
    out = _output(x, num_out, bias, out)
    if x.shape[0] == 0 or num_out == 0:
        return out

    def launch(grid, c, c_row_stride, c_split_stride, tiles_per_split, has_bias):
        w4a16_gemm_kernel[grid](x, weight_packed, weight_scale, x if bias is None else bias, c,
                                x.shape[0], num_out, num_cols, x.stride(0), c_row_stride, c_split_stride,
                                group_size, num_groups, tiles_per_split, HAS_BIAS=has_bias, **config)

    return _launch_gemm(launch, x, bias, out, config, regime)


# ------------------------------------------------------------------------------------------ gate and benchmarks


def gate_cases() -> list[GateCase]:
    """Every config the launchers can select (gpu_layers.linear_cases)."""
    from gpu_layers import linear_cases

    return linear_cases.gate()


def bench_cases() -> list[tuple]:
    """The module's benchmark cases (gpu_layers.linear_cases)."""
    from gpu_layers import linear_cases

    return linear_cases.bench()
