"""Quantized weight formats for the CPU experts (shared with `convert`).

All formats are symmetric, per output row, with one float32 scale per group of `group_size` consecutive input
columns (group_size = K: one scale per row, i.e. per-channel). A row of K inputs is zero-padded to a whole number
of groups before quantizing; the padding is not stored.

- INT8: q int8 [N, K] in [-127, 127]; w ~= q * scale.
- INT4: q in [-8, 7] stored as q + 8 in a nibble, two per byte along K (even column in the low nibble):
  packed uint8 [N, ceil(K / 2)]; w ~= (nibble - 8) * scale. The quantizer here uses [-7, 7] (symmetric around
  zero); INT4 copied from a checkpoint (compressed-tensors, whose quantizer rounds the group's most negative
  value to -8) uses the -8 code too, and every kernel takes it.

Dequantization here is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_MAX = 7


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """[N, K] -> [N, G, group_size] float32 (zero-padded), and K."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    padded = -(-cols // group_size) * group_size
    w = torch.nn.functional.pad(w.float(), (0, padded - cols))
    return w.view(rows, padded // group_size, group_size), cols


def _symmetric(w: torch.Tensor, group_size: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    groups, cols = _grouped(w, group_size)
    scales = groups.abs().amax(dim=-1) / qmax  # [N, G]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero groups quantize to 0
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    return q.flatten(1)[:, :cols].to(torch.int8), scales, cols


def _expand_scales(scales: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    return scales.float().repeat_interleave(group_size, dim=1)[:, :cols]  # bfloat16 scales widen exactly


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales float32 [N, ceil(K / group_size)]); group_size None: per channel."""
    q, scales, _ = _symmetric(w, group_size or w.shape[1], INT8_MAX)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    return q.float() * _expand_scales(scales, group_size or q.shape[1], q.shape[1])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [N, K] -> uint8 [N, ceil(K / 2)], even columns in the low nibble."""
    nibbles = (q.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.shape[1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=8)  # pad with the code for zero
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> int8 values in [-8, 7], [N, K]."""
    low, high = packed & 0x0F, packed >> 4
    nibbles = torch.stack((low, high), dim=-1).flatten(1)[:, :cols]  # interleave back to column order
    return nibbles.to(torch.int8) - 8


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed uint8 [N, ceil(K / 2)], scales float32 [N, ceil(K / group_size)])."""
    q, scales, _ = _symmetric(w, group_size, INT4_MAX)
    return pack_int4(q), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    return unpack_int4(packed, cols).float() * _expand_scales(scales, group_size, cols)


# ---- float formats as published (FP8 e4m3 blocks, MXFP4, NVFP4) -------------------------------------------------
# Stored bits, not values: weights and the 8-bit scales are uint8 arrays holding the format's bit patterns, so every
# reader, file and kernel sees the same bytes.
# - FP8: e4m3fn codes [N, K], one float32 scale per row and group of `group_size` columns (a checkpoint's 128 x 128
#   block scale is repeated over its block's rows: the same values, one layout for every format).
# - MXFP4: two e2m1 codes a byte [N, ceil(K / 2)] (even column in the low nibble), one E8M0 scale per 32 columns
#   (2^(s - 127); 255 is NaN and never stored).
# - NVFP4: the same codes, one e4m3 scale per 16 columns, times one float32 scale per projection (`tensor_scale`).

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
E8M0_NAN = 255


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns -> float32 values (exact)."""
    return bits.contiguous().view(torch.float8_e4m3fn).float()


def float_to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e4m3fn bits, rounded to nearest even (values must lie within +-448)."""
    return values.float().to(torch.float8_e4m3fn).view(torch.uint8)


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 2^(bits - 127) (exact; 0 is the subnormal 2^-127); 255 (NaN) is refused."""
    if bool((bits == E8M0_NAN).any()):
        raise ValueError("E8M0 scale 255 (NaN) present")
    return torch.pow(2.0, bits.double() - 127).float()


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """int e2m1 codes 0..15 (bit 3 the sign) -> float32 values."""
    return E2M1_VALUES[codes.long()]


def unpack_fp4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> e2m1 codes uint8 [N, K] (even column in the low nibble)."""
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(1)[:, :cols]
    return nibbles


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 [N, K] -> uint8 [N, ceil(K / 2)] (an odd K padded with the code of +0)."""
    codes = codes.to(torch.uint8)
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> the e2m1 code of the nearest value (within +-6; a tie goes to the even code, as the spec's RNE)."""
    magnitudes = E2M1_VALUES[:8]
    distance = (x.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - magnitudes).abs()  # [..., 8]
    # among equal distances the first (smaller) magnitude wins; make ties pick the even code instead
    best = distance.argmin(dim=-1)
    ties = (distance == distance.min(dim=-1, keepdim=True).values).sum(-1) > 1
    best = torch.where(ties & (best % 2 == 1), best + 1, best)
    return (best | ((x < 0).long() << 3)).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 bits uint8 [N, K], scales float32 [N, ceil(K / group_size)])."""
    groups, cols = _grouped(w, group_size)
    scales = groups.abs().amax(dim=-1) / E4M3_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = float_to_e4m3((groups / safe.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX))
    return q.flatten(1)[:, :cols].contiguous(), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    return e4m3_to_float(q) * _expand_scales(scales, group_size, q.shape[1])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed e2m1 uint8 [N, ceil(K / 2)], E8M0 scales uint8 [N, ceil(K / 32)]): the OCP MX rule,
    shared exponent floor(log2(amax)) - 2 (e2m1's largest exponent), codes rounded to nearest."""
    groups, cols = _grouped(w, 32)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.double())) - 2, torch.full_like(amax, -127,
                                                                                                 dtype=torch.double))
    bits = (exponent + 127).clamp(0, 254).to(torch.uint8)
    codes = _nearest_e2m1(groups / e8m0_to_float(bits).unsqueeze(-1))
    return pack_fp4(codes.flatten(1)[:, :cols]), bits


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    return e2m1_to_float(unpack_fp4(packed, cols)) * _expand_scales(e8m0_to_float(scales), 32, cols)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed e2m1 uint8 [N, ceil(K / 2)], e4m3 scales uint8 [N, ceil(K / 16)], tensor scale
    float32 []): NVIDIA's recipe, tensor scale amax / (448 * 6), block scales amax_block / 6 in its units."""
    groups, cols = _grouped(w, 16)
    amax = groups.abs().amax()
    tensor_scale = (amax / (E4M3_MAX * E2M1_MAX)).float() if amax > 0 else torch.tensor(1.0)
    block = float_to_e4m3((groups.abs().amax(dim=-1) / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX))
    effective = e4m3_to_float(block) * tensor_scale
    safe = torch.where(effective > 0, effective, torch.ones_like(effective))
    codes = _nearest_e2m1(groups / safe.unsqueeze(-1))
    return pack_fp4(codes.flatten(1)[:, :cols]), block, tensor_scale


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                     cols: int) -> torch.Tensor:
    """e2m1 x e4m3 block scale, then x the tensor scale (the kernels' order: the block product is exact)."""
    values = e2m1_to_float(unpack_fp4(packed, cols)) * _expand_scales(e4m3_to_float(scales), 16, cols)
    return values * tensor_scale.float()
